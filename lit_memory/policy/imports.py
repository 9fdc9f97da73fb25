"""Imports: the class paths a sent recipe may name (`PACKAGES`, with the optimizers of the libraries lit_memory knows:
`lit_memory.optim.optimizers.IMPORTABLE`, added by `lit_memory.config.trust.ALLOWLIST`) and, inside them, those it may
not (`DENYLIST`). jsonargparse enforces both while it parses (`lit_memory.config.trust.import_policy`).
"""

# Lightning's own callbacks/loggers/strategies/plugins, this package and peft. An entry allows itself and everything
# under it.
PACKAGES = (
    "lightning",
    "lit_memory",
    "peft",
)
# Inside allowed packages: entry points that would parse a command line of their own (including the
# trust flag), and the guard's own machinery. The most specific entry decides.
DENYLIST = (
    "lightning.pytorch.cli",
    "lightning.fabric.cli",
    "lit_memory.cli", "lit_memory.config.arguments",
    "lit_memory.__main__",
    "lit_memory.config.trust",
    "lit_memory.config.shared_recipe.SaveRecipe",
    "lit_memory.fine_tune",
    "lit_memory.sandbox.guard", "lit_memory.sandbox.checkpoint_reading",
    "lit_memory.files",
    "lit_memory.tools",
    "lit_memory.policy",
)
