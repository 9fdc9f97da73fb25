"""Facts of the device a step runs on, as plain data and arithmetic: the GPU catalogue, a prediction's target and a
card's real limits (`gpus`), PyTorch's caching allocator and its settings (`allocator`), which attention kernel runs
on which card and what it keeps (`kernels`), NCCL's communicators and what they hold on each GPU (`nccl`). Imports
nothing of the training runtime: the runtime reads the card and caps the allocator through them; the memory model
over them is `lit_memory.memory.model`."""
