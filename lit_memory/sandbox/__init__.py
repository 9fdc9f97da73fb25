"""A sent recipe's run, confined by the kernel: one boundary for what the run reads, writes and reaches.

Without ``--trust-recipe``, ``python -m lit_memory fit|validate|test|predict`` judges the command in its own
process and runs it in a child that Linux Landlock confines (`launch`, the parent's side; `child`, the child's):

- `rules`: the confinement a run gets (read roots: Python and its packages, system libraries, a few files of
  ``/etc`` and ``/proc``, the GPU's devices, the Hub cache, the recipe's checked inputs; write roots: the run's
  folders and its private temporary folder and caches; no TCP but a distributed launch's own ports; process and
  file-size limits), and the values a recipe may not choose (run folders outside the working folder or that
  exist, format templates that walk Python's objects, free-form keyword dictionaries);
- `stage`: every file a recipe names, checked as a regular file beneath its folder with no link on the way
  (``openat2``), an index's shards included;
- `landlock`: the three system calls;
- `launch`: the parent: secrets scrubbed from the child's environment, what it names on the Hub fetched before
  confinement, and a watchdog bounding memory, disk and preparation time, each ending with one ``error:`` line.

What stays in Python (`lit_memory.trust`, `lit_memory.guard`, `lit_memory.bounds`) is what the kernel cannot judge:
the import allowlist, weights-only loading, remote-code refusals, value bounds. docs/sharing.md states the
guarantee per platform; where Landlock is missing an untrusted run does not start.
"""
