"""The policy for a sent recipe: every rule that judges what a recipe someone sent may make a run do, in one package.

A rule is data that returns refusals, tagged with the phase that runs it (`refusal`: `Refusal`, `Rule`, `Context`,
`register`); `phases` runs a phase's rules (`phases.refusals`). Each rule's module is one subject:

- `values`: settings a recipe may not have whatever they point at, and `values.BOUNDS`, the rows that bound the machine;
- `code`: Hugging Face settings that fetch or run code;
- `checkpoints`: the checkpoint a run loads, and how often and how many its callbacks save;
- `reads`: what a recipe may name to read (local files beneath its folder or the working folder);
- `writes`: where a recipe's run may write (the one list of run folders and write paths);
- `templates`: strings Python formats with a run's metrics, free-form keyword dictionaries;
- `imports`: the class paths a recipe may name;
- `typed`: what the user typed (theirs: exempt).

Who runs which phase: the parse check (`lit_memory.config.trust.Decision.refusals`: ``parse``), the confined launch
(`lit_memory.confine.launch`: ``launch``), the runtime guard (`lit_memory.sandbox.guard`: ``run``) and ``recipes
check`` (`lit_memory.tools.recipes`: all three, from the settings alone). The kernel's layers that enforce what is
decided here stay in `lit_memory.sandbox`. This package sits at the base: it imports nothing of lit_memory but
`lit_memory.errors` (and `lit_memory.settings` inside a function, once torch is loaded); what it needs of the layers
above (a checkpoint's restricted reader, a folder's walk) a rule gets through its `refusal.Context`. Importing it
loads neither torch nor Lightning.
"""
