"""Checks of plain Python values that every layer of jaxdp shares (the bottom of its imports)."""

from __future__ import annotations

import numbers
from typing import Any


def is_integer(value: Any) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
