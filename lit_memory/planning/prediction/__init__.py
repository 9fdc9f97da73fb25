"""Predicting a training step's memory: the typed description of a step, built once from a run's settings
(`step`); the analytic model (`analytic`, assembling its sub-models: the activations of each layer
(`activation_model`) and what the optimizer step keeps beside them: sharding, buckets, the loss scaler
(`state_model`)); one step on fake tensors attributed by the tracker (`simulate`); and the one way into a
prediction for every caller (`predict`). Above the training runtime: it builds the configured module."""
