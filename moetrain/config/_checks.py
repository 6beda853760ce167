"""Validation helpers the section configs add to ``base``: integer and bool checks that reject
``True`` for an int and ``1.0`` for a count."""

from __future__ import annotations

from typing import Any

from moetrain.config.base import require


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def require_int(field: str, value: Any, *, min_value: int = 0, none_ok: bool = False, note: str = "") -> None:
    """``value`` is an int >= ``min_value`` (or None when ``none_ok``)."""
    if none_ok and value is None:
        return
    rule = f"must be {'None or ' if none_ok else ''}an int >= {min_value}{note}"
    require(is_int(value) and value >= min_value, field, value, rule)


def require_bool(field: str, value: Any) -> None:
    require(isinstance(value, bool), field, value, "must be true or false")
