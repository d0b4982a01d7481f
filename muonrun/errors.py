"""The one exception type for mistakes a user can fix (bad config, missing file, ...).

The CLI prints a `UserError` as a single paragraph and exits with code 2, without a traceback.
Programmer invariants use `assert` instead.
"""


class UserError(Exception):
    """A mistake in the user's input; the message names the key or path and says how to fix it."""
