"""Shared validation helpers for the config dataclasses.

Every user-facing check raises ``ValueError`` with the field, its value and the rule, e.g.
``moe.top_k (9) must be <= moe.num_experts (8)``.
"""

from __future__ import annotations

import math
from typing import Any


class InactiveFieldError(ValueError):
    """A field set away from its default while the feature it belongs to is off ("acts only with ...")."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def require(ok: bool, field: str, value: Any, rule: str) -> None:
    """Raise ``ValueError("<field> (<value>) <rule>")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{field} ({value!r}) {rule}")


def require_active(ok: bool, field: str, value: Any, rule: str) -> None:
    """``require`` for a field that acts only with another setting (``rule``: "acts only with ...";
    ``ok``: the field is at its default or its feature is on): an ``InactiveFieldError``."""
    if not ok:
        raise InactiveFieldError(field, f"{field} ({value!r}) {rule}")


def require_choice(field: str, value: Any, choices: tuple) -> None:
    require(value in choices, field, value, f"must be one of {', '.join(map(repr, choices))}")


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def require_positive(field: str, value: Any) -> None:
    """A finite number > 0 (inf would reach the optimizer or the init as inf or nan)."""
    require(_finite_number(value) and value > 0, field, value, "must be a finite number > 0")


def require_non_negative(field: str, value: Any) -> None:
    """A finite number >= 0."""
    require(_finite_number(value) and value >= 0, field, value, "must be a finite number >= 0")
