"""Models of the device a step runs on, as plain data and arithmetic: the GPU catalogue, a prediction's target
and a card's real limits (`gpus`), PyTorch's caching allocator and its settings (`allocator`), which attention
kernel runs and what it keeps (`kernels`), what one transformer layer keeps for backward (`layers`), a step's
allocations in the order the allocator sees them (`program`), the margin every "fits" keeps (`margin`), NCCL's
communicators and what they hold on each GPU (`nccl`), the training loops around a step (`loops`), and a run's
``memory`` settings parsed once (`budget`). Imports nothing of the training runtime: the runtime reads the
card and caps the allocator through them."""
