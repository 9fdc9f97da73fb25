"""Memory accounting, over plain torch objects (nothing here imports the training runtime):

- `footprint`: the five categories, the phases of a training step, `Footprint`, byte units;
- `tracker`: torch's MemTracker attributing every live tensor, and the process's own peak;
- `analytic`: the analytic model of a training step's peak (bytes per parameter, an activation model);
- `simulate`: one training step on fake tensors, attributed by the tracker;
- `records`: the ``memory.json`` and ``bench.json`` files, read and written only here;
- `report`: the one table that shows footprints side by side.

The runtime's `lit_memory.monitor` measures with `tracker` and writes with `records`; the tools
(`lit_memory.tools`) build the configured model and ask `analytic` and `simulate` for predictions.
"""
