"""Memory accounting below the training runtime, in two sub-packages (plain torch objects; the runtime imports
them, they import none of it; predictions and plans over them are `lit_memory.planning`, above the runtime):

- `measure`: what a run measures: the categories and phases (`footprint`), torch's tensors attributed as they
  live (`tracker`), NVML's figure for this process (`nvml`), the ``memory.json``/``bench.json`` files
  (`records`), the memory picture (`picture`) and the one table that shows footprints side by side (`report`);
- `hardware`: models of the device: the GPU catalogue and the target a prediction is for (`gpus`), the caching
  allocator (`allocator`), the attention kernel (`kernels`), what one transformer layer keeps (`layers`), a step
  as the allocator sees it (`program`), collectives' buffers (`nccl`), the training loop around a step (`loops`),
  the margin every "fits" keeps (`margin`) and the memory settings of a run (`budget`).
"""
