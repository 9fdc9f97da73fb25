"""The shape of the policy: a `Refusal` (one value a sent recipe may not have, with its key and why), a `Rule` (a check
that returns refusals, tagged with the phase that runs it) and the registry (`register`; run by
`lit_memory.policy.phases`).

Phases, in the order a run meets them:

- ``parse``: the parsed settings of one subcommand, in the process that parsed them
  (`lit_memory.config.trust.Decision`);
- ``launch``: what only a confined run needs judged, in its parent before the child starts
  (`lit_memory.confine.launch`);
- ``run``: what only the running trainer shows (`lit_memory.sandbox.guard`); from the settings alone, ``recipes check``
  says what a run would refuse then (a rule's ``Context.trainer`` is None there).

``recipes check`` (`lit_memory.tools.recipes`) runs every phase's rules over a file, and prints every refusal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

# The flag that lifts the trust decision: every refusal names it (`lit_memory.sandbox` re-exports it).
TRUST_FLAG = "--trust-recipe"
PASS = f"pass {TRUST_FLAG} only if you trust its source"
HINT = f"check the file with `python -m lit_memory recipes check FILE`; {PASS}"
PHASES = ("parse", "launch", "run")
NOTHING = object()  # a refusal of a key whose value the line does not show


@dataclass(frozen=True)
class Refusal:
    """A value that would make us run or unpickle code from elsewhere, reach elsewhere, write outside the run, or
    overload the machine. ``head``: what the line says before the reason, where it is not ``key=value`` (repr)."""

    key: str
    value: Any
    reason: str
    safe: Any = None  # what a shared recipe.yaml writes instead (None: left as it is)
    hint: str = HINT
    head: Optional[str] = None  # what the line names before the reason ("": nothing), where not `key=value`

    def shown(self) -> str:
        """``key=value`` (or the rule's own ``head``): the refused setting as the line names it."""
        if self.head is not None:
            return self.head
        return self.key if self.value is NOTHING else f"{self.key}={self.value!r}"

    def line(self) -> str:
        """The refusal without its advice, as ``recipes check`` lists it."""
        return f"{self.shown()}: {self.reason}" if self.shown() else self.reason

    @classmethod
    def of_error(cls, key: str, text: str) -> "Refusal":
        """A refusal from the one line a lower layer's check raised (``refusing HEAD: REASON; ADVICE``)."""
        text = text.removeprefix("refusing ")
        head, _, rest = text.partition(": ")
        for advice in (f"; {PASS}", "; type --", "; check the file"):
            rest = rest.split(advice)[0]
        return cls(key, NOTHING, rest, head=head, hint=PASS)

    def __str__(self) -> str:
        return f"refusing {self.line()}; {self.hint}"


@dataclass
class Context:
    """What a rule judges. A rule reads what its phase gives and returns no refusal where that is missing.

    ``settings``: one subcommand's parsed settings (a jsonargparse Namespace or a dict); ``typed(key, value)``:
    whether the user typed that value (theirs, exempt from every rule that says so); ``work``: the working folder;
    ``folders``: where a recipe's own files may lie; ``roots``: the run's folders (None: the default ones, judged
    from the settings). The hooks are the lower machinery a rule asks without importing it (the sandbox is above this
    package): ``walk(path, key)`` judges a run folder's way from the working folder without following a link,
    ``checkpoint_problem(path)`` reads a checkpoint with the restricted readers, ``approved(path)`` says whether the
    user approved a file's content, ``model_folder_problems(path)`` what loading a model folder would refuse.
    ``trainer``/``exempt``/``config``: the running trainer, the callbacks that are the user's, a loaded model config."""

    settings: Any = None
    typed: Callable[[str, Any], bool] = lambda key, value: False
    work: str = ""
    folders: Sequence[str] = ()
    roots: Optional[Sequence[str]] = None
    walk: Optional[Callable[[str, str], Any]] = None
    checkpoint_problem: Callable[[Any], Optional[str]] = lambda path: None
    approved: Callable[[Any], bool] = lambda path: False
    model_folder_problems: Callable[[Any], list[str]] = lambda path: []
    trainer: Any = None
    exempt: Callable[[Any], bool] = lambda callback: False
    config: Any = None
    typed_keys: Sequence[str] = ()  # dotted keys the user typed (the guard's view of a loaded config)
    _leaves: Optional[list[tuple[str, Any]]] = field(default=None, repr=False)

    def leaves(self) -> list[tuple[str, Any]]:
        """(dotted key, value) of every leaf of the settings (`lit_memory.settings.dotted_leaves`: a list's items by
        index)."""
        if self._leaves is None:
            from lit_memory.settings import dotted_leaves  # torch: loaded by whoever has settings to judge

            self._leaves = [] if self.settings is None else list(dotted_leaves(self.settings))
        return self._leaves

    def chosen(self) -> dict[str, Any]:
        """The leaves the recipe chose: every one the user did not type."""
        return {k: v for k, v in self.leaves() if not self.typed(k, v)}

    def get(self, key: str, default: Any = None) -> Any:
        if self.settings is None:
            return default
        if isinstance(self.settings, dict):
            node: Any = self.settings
            for part in key.split("."):
                if not isinstance(node, dict) or part not in node:
                    return default
                node = node[part]
            return node
        return self.settings.get(key, default)


@dataclass(frozen=True)
class Rule:
    """One check of a sent recipe: ``check(context)`` returns its refusals. ``phase``: when it runs (`PHASES`).
    ``exempt_typed``: a refused value the user typed is theirs (the checkpoint rule says itself what is exempt).
    ``reads``: whether it reads what a value names (a file), not only the value (a shared recipe's values are
    sanitized by the others alone: `lit_memory.config.trust.sanitize`)."""

    name: str
    phase: str
    check: Callable[[Context], list[Refusal]]
    exempt_typed: bool = True
    reads: bool = False


RULES: list[Rule] = []


def register(phase: str, exempt_typed: bool = True, reads: bool = False) -> Callable[[Callable], Callable]:
    """Add the decorated function (``check(context) -> list[Refusal]``) to the policy as a rule of ``phase``, named
    by the function; it stays callable as it is."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}: one of {', '.join(PHASES)}")

    def add(check: Callable[[Context], list[Refusal]]) -> Callable[[Context], list[Refusal]]:
        name = f"{check.__module__.rsplit('.', 1)[-1]}.{check.__name__}"
        RULES[:] = [r for r in RULES if r.name != name]  # a module imported again replaces its rules
        RULES.append(Rule(name, phase, check, exempt_typed, reads))
        return check

    return add


def refuse_first(found: list[Refusal]) -> None:
    """Raise the first refusal as one ``error:`` line (`lit_memory.errors.UserError`)."""
    from lit_memory.errors import UserError

    if found:
        raise UserError(str(found[0]))
