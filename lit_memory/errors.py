"""The one exception type for bad user input.

The CLI prints a `UserError` as a single ``error: ...`` line and exits with status 2, so every
check that can fail on a user's config or files raises it *before* training starts.
"""


class UserError(ValueError):
    """Bad input the user can fix (a missing file, a wrong column, an impossible setting)."""
