"""Integer rounding used for batch counts, shard sizes, padding and segment sizes."""
from __future__ import annotations

__all__ = ["ceil_div", "round_up"]


def ceil_div(value: int, divisor: int) -> int:
    """`value / divisor` rounded up, in integers (exact for any size)."""
    return -(-value // divisor)


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= `value`."""
    return ceil_div(value, multiple) * multiple
