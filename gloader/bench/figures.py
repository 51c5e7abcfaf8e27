"""How the benchmark prints a figure: three significant digits, a median with its range."""
from __future__ import annotations

import math
import statistics

__all__ = ["summary", "three_digits"]


def three_digits(value: float) -> str:
    """`value` to three significant digits, without exponent: 675590.46 -> '676000', 43.83 -> '43.8',
    0.1234 -> '0.123'. Rounds of a noisy machine differ by more than the digits left out."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = 2 - math.floor(math.log10(abs(value)))
    rounded = round(value, decimals)
    return f"{rounded:.{max(decimals, 0)}f}"


def summary(values: list[float]) -> str:
    """'median (min-max)', each to three significant digits."""
    return f"{three_digits(statistics.median(values))} ({three_digits(min(values))}-{three_digits(max(values))})"
