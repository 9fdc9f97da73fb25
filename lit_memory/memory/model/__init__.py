"""The memory model of a training step, over the device's facts (`lit_memory.memory.hardware`): what one
transformer layer keeps for backward (`layers`), a step's allocations in the order the allocator sees them
(`program`), the training loops around a step (`loops`), and the margin every "fits" keeps for the model's own
error (`margin`). Plain data and arithmetic; the assembled prediction is `lit_memory.planning.prediction`."""
