"""The memory model of a training step, over the device's facts (`lit_memory.memory.hardware`): what one
transformer layer keeps for backward (`layers`), a step's allocations in the order the allocator sees them
(`program`) and the training loops around a step (`loops`); what a prediction keeps free for its error is
`lit_memory.memory.margin`. Plain data and arithmetic; the assembled prediction is `lit_memory.planning.prediction`."""
