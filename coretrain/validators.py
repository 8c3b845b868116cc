"""attrs validators for config fields (the core's sections and every plugin's table).

Each raises :class:`FieldValueError`, which carries the field name, so the config loader
reports ``file:line: section.key: must be ...`` with the key path of the offending value.
Floats are checked finite by the loader itself (no NaN or inf is ever a setting).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs


class FieldValueError(ValueError):
    """A value of the right type but out of range; carries the field name for the key path."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def in_range(low: float | None = None, high: float | None = None, *, high_inclusive: bool = True) -> Validator:
    """``low <= value`` and ``value <= high`` (or ``< high``); None (unset) always passes."""

    bounds = []
    if low is not None:
        bounds.append(f">= {low}")
    if high is not None:
        bounds.append(f"<= {high}" if high_inclusive else f"< {high}")
    expected = " and ".join(bounds)

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        for item in _each(value):
            too_low = low is not None and item < low
            too_high = high is not None and (item > high if high_inclusive else item >= high)
            if too_low or too_high:
                raise FieldValueError(attribute.name, f"must be {expected}, got {value!r}")

    return check


def _each(value: Any) -> list[Any]:
    """The numbers to check: the value itself, or each item of a list (None = unset, skipped)."""
    return [v for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None]


def positive(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if any(v <= 0 for v in _each(value)):
        raise FieldValueError(attribute.name, f"must be > 0, got {value!r}")


def non_negative(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if any(v < 0 for v in _each(value)):
        raise FieldValueError(attribute.name, f"must be >= 0, got {value!r}")


fraction = in_range(0, 1, high_inclusive=False)
"""A share in [0, 1)."""
exit_code = in_range(1, 125)
"""A process exit status a shell can see: 1..125 (126+ mean 'not run' and signals)."""
