"""The runner of each phase: every rule of the phase, from every module of the policy, in the order they register.

The parse check, the confined launch, the runtime guard and ``recipes check`` call `refusals` (or `refuse_first`);
none keeps a list of its own.
"""

from __future__ import annotations

from typing import Callable

from lit_memory.policy import checkpoints, code, reads, templates, values, writes  # noqa: F401  they register
from lit_memory.policy.refusal import NOTHING, RULES, Context, Refusal, Rule, refuse_first  # noqa: F401  (runners)

# The order a phase's refusals are listed in: by subject, then as each module registers its rules.
ORDER = ("code", "values", "checkpoints", "reads", "writes", "templates")


def rules_of(phase: str) -> list[Rule]:
    """The rules of ``phase``: by subject (`ORDER`), then in the order each module registers them."""
    chosen = [r for r in RULES if r.phase == phase]
    return sorted(chosen, key=lambda r: ORDER.index(r.name.split(".")[0]))


def refusals(phase: str, context: Context, only: Callable[[Rule], bool] = lambda rule: True) -> list[Refusal]:
    """Every refusal of ``phase``'s rules (those ``only`` keeps) for ``context``, a value the user typed left out
    where its rule exempts it."""
    found = []
    for rule in rules_of(phase):
        if not only(rule):
            continue
        for refusal in rule.check(context):
            if rule.exempt_typed and refusal.value is not NOTHING and context.typed(refusal.key, refusal.value):
                continue
            found.append(refusal)
    return found

