"""Range checks the config sections run in their `__post_init__` (a `UserError` naming the key)."""

from __future__ import annotations

from muonrun.errors import UserError


def at_least(minimum: float, **values: float) -> None:
    for key, value in values.items():
        if value < minimum:
            raise UserError(f"Config key '{key}' is {value}; it must be at least {minimum}.")


def not_negative(**values: float) -> None:
    for key, value in values.items():
        if value < 0:
            raise UserError(f"Config key '{key}' is {value}; it must not be negative.")
