"""A sent recipe's run started in a child the kernel confines (`launch`, the parent's side; lit_memory.sandbox
holds the confinement), and what it names on the Hub fetched for it (`hub`)."""
