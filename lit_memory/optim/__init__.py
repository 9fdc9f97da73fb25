"""Optimizers and their state: each library's optimizers (`optimizers`), what their state holds (`optimizer_state`),
bitsandbytes' 8-bit ones (`eightbit`, `eightbit_shards` under FSDP2), torchao's low-bit ones (`lowbit`) and the
precision a recipe's bf16 becomes on the device (`precision`)."""
