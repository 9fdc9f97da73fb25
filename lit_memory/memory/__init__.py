"""Memory accounting, in four sub-packages on two layers of the package (`lit_memory.LAYERS`):

Below the training runtime (plain torch objects; the runtime imports them, they import none of it):

- `measure`: what a run measures: the categories and phases (`footprint`), torch's tensors attributed as they
  live (`tracker`), NVML's figure for this process (`nvml`), the ``memory.json``/``bench.json`` files
  (`records`) and the one table that shows footprints side by side (`report`);
- `hardware`: models of the device: the GPU catalogue and the target a prediction is for (`gpus`), the caching
  allocator (`allocator`), the attention kernel (`kernels`), what one transformer layer keeps (`layers`), a step
  as the allocator sees it (`program`), the margin every "fits" keeps (`margin`) and the memory settings of a
  run (`budget`).

Above the runtime (they build the configured model):

- `prediction`: the one typed description of a step (`step`), the analytic model (`analytic`, with its
  activation and optimizer-state sub-models), the simulation on fake tensors (`simulate`) and the one way in
  (`predict`);
- `planning`: choosing among setups (`choose`) and the per-layer checkpointing plan that fits a budget
  (`recompute`).
"""
