"""A training run's machinery around the model and data: recompute and offloading (`activation_checkpointing`),
exact resume (`resume`), the best checkpoint and early stopping (`best`), how long it trains (`training_length`),
regional compilation (`compiling`), known log noise (`noise`), the step profile (`step_profile`), the memory monitor
(`monitor`) and the callbacks beside it (`memory_callbacks`), the model card (`model_card`), settings a run cannot
train with (`checks`), the run-scoped environment (`environment`) and the predictions file (`predict_file`)."""
