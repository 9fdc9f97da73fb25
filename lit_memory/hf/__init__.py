"""Hugging Face models, tokenizers and data read offline: a model's parts (`anatomy`), a config loaded through the guard
(`config`), the tokenizer (`tokenizing`), the bundled model and data (`bundled`), a local file read through datasets
(`local_data`), a local data file checked before it is read (`data_file`), LoRA and QLoRA (`lora`, `qlora`), texts
encoded (`text_encoding`) and texts longer than the window (`windows`)."""
