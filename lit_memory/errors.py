"""The one exception type for bad user input.

The CLI prints a `UserError` as a single ``error: ...`` line and exits with status 2, so every
check that can fail on a user's config or files raises it *before* training starts. Its text, a recipe's values
in it, is printed through `shown`: escape sequences a recipe carries are seen, never acted on by the terminal.
"""

import re


class UserError(ValueError):
    """Bad input the user can fix (a missing file, a wrong column, an impossible setting)."""


# What a terminal acts on instead of showing: C0 controls but tab, newline and return (ESC starts CSI, OSC 52's
# clipboard write, ``ESC[8m``'s hidden text), DEL, C1 controls (a CSI of its own), and the invisible format characters
# that reorder or hide text (bidirectional overrides and isolates, zero-width ones, line and paragraph separators).
CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")
BREAKS = re.compile("[\n\r]")


def shown(text: str) -> str:
    """``text`` as one line a terminal shows and never acts on: each control character (`CONTROL`, newline and return
    too) written as its escape, visible (``\\x1b``, ``\\u202e``). Every line the unconfined parent prints that can
    carry a recipe's value goes through it (an ``error:`` line, `lit_memory.tools.recipes`' verdicts, warnings)."""
    return BREAKS.sub(_escape, CONTROL.sub(_escape, text))


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
