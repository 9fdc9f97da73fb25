"""A sent recipe's run, confined by the kernel: nothing it ships runs before confinement, nothing the parent does for
it is unbounded, and the child is held by more than paths.

Without ``--trust-recipe``, ``python -m lit_memory fit|validate|test|predict`` judges the command in its own
process and runs it in a child that confines itself first thing (`lit_memory.confine.launch`, the parent's side, above
the runtime; `child`, the child's). This package is the base layer: the runtime imports it, it imports none of it.

- `rules`: the confinement a run gets (`rules.Spec`: read roots, write roots, TCP ports, bounds, the child's path
  and status pipe) and the child's environment without secrets; the values a recipe may not choose are the policy's
  (`lit_memory.policy`, the layer below this one);
- `roots`: the run's folders made beneath the working folder without following a link, logger names of one component;
- `stage`: every file a recipe names, checked as a regular file beneath its folder with no link on the way
  (``openat2``), an index's shards included;
- `cgroup`: the run's memory (tmpfs and memfd included) and processes bounded by the kernel, all killed at the end;
- `namespaces`: network (loopback only), IPC, process ids, and a mount namespace whose view holds only the run's
  roots, a fresh ``/proc`` and a private ``/dev/shm``;
- `landlock`: the three system calls; `privileges`: every capability dropped; `seccomp`: the system calls refused;
- `watchdog`: the parent's watch (output relayed, status over a pipe, memory, disk and preparation time bounded,
  nothing left running however it ends).

What stays in Python is what the kernel cannot judge: the decision (`lit_memory.config.trust`: the import allowlist,
value bounds) enforced where things load (`guard`: weights-only loading, remote-code refusals) and files read within
bounds (`bounds`); what a run names on the Hub is fetched for it by `lit_memory.confine.hub`. docs/sharing.md states the
guarantee: what is enforced by what, per platform, and what is not covered. Where Landlock is missing an untrusted run
does not start; each other missing layer is one warning line.
"""

# The flag that lifts the trust decision, here because every check that refuses names it (`guard`, `bounds`) and
# the light helps print it (`lit_memory.config.shipped`): this package's root imports only the policy's light base.
from lit_memory.policy.refusal import TRUST_FLAG  # noqa: E402, F401
