"""Memory above the training runtime (it builds the configured model): predictions of a step's memory
(`prediction`), and decisions over them: which of two setups that fit is faster and the out-of-memory advice
(`choose`), FLOPs counted by torch with the per-layer checkpointing plan that fits a budget, ``gradient_checkpointing:
auto`` (`recompute`); what a run's memory callbacks
take from the models: its predictions, the advice when it runs out of memory, the timeline (`run_predictions`)."""
