"""Memory accounting below the training runtime (plain torch objects; the runtime imports them, they import none of
it; predictions and plans over them are `lit_memory.planning`, above the runtime):

- `settings`: the ``memory:`` block of a run's config, parsed once into `MemorySettings` and handed down;
- `margin`: the room every "fits" keeps for the memory model's own error, and the limit a prediction is fitted
  against (`Limit`, `Fit`);
- `measure`: what a run measures: the categories and phases (`footprint`), torch's tensors attributed as they
  live (`tracker`), NVML's figure for this process (`nvml`), the ``memory.json``/``bench.json`` files
  (`records`), the memory picture (`picture`) and the one table that shows footprints side by side (`report`);
- `hardware`: facts of the device: the GPU catalogue and the target a prediction is for (`gpus`), the caching
  allocator (`allocator`), which attention kernel runs and what it keeps (`kernels`), NCCL's buffers (`nccl`);
- `model`: the memory model over those facts: what one transformer layer keeps for backward (`layers`), a step
  as the allocator sees it (`program`) and the training loop around a step (`loops`).
"""
