"""Argument checks shared by the loader's config, the samplers and the worker pool.

Each returns the normalized value or raises a TypeError/ValueError that names the argument,
the value given and what is allowed. Imports nothing of gloader's.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

__all__ = ["LAST_BATCH_MODES", "START_METHODS", "check_callable", "check_flag", "check_last_batch",
           "check_non_negative_int", "check_positive_int", "check_seed", "check_start_method", "check_timeout", "is_int"]

LAST_BATCH_MODES = ("keep", "discard", "rollover")
START_METHODS = ("fork", "spawn", "forkserver")


def is_int(value: Any) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_flag(name: str, value: Any, *, none_means: bool | None = None) -> bool:
    """Return a yes/no argument as a bool: True, False, a numpy bool, or the integers 0 and 1
    (config files and torch code pass them); None means `none_means` where that is not None.
    Anything else is a TypeError: a string such as 'False' is truthy, and would say the opposite
    of what it reads."""
    if value is None and none_means is not None:
        return none_means
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if is_int(value) and value in (0, 1):
        return bool(value)
    allowed = "True or False" + (" (or None)" if none_means is not None else "")
    raise TypeError(f"{name} must be {allowed}, got {value!r} of type {type(value).__name__}")


def check_last_batch(last_batch: Any) -> str:
    """Return the last_batch mode, 'keep' for None; ValueError for anything else."""
    if last_batch is None:
        return "keep"
    if last_batch not in LAST_BATCH_MODES:
        raise ValueError(f"last_batch must be one of {LAST_BATCH_MODES} or None, got {last_batch!r}")
    return str(last_batch)


def _check_int_from(name: str, value: Any, lowest: int, kind: str) -> int:
    if not is_int(value):
        raise TypeError(f"{name} must be {kind}, got {value!r} of type {type(value).__name__}")
    if value < lowest:
        raise ValueError(f"{name} must be >= {lowest}, got {value}")
    return int(value)


def check_positive_int(name: str, value: Any) -> int:
    """Return `value` as int when it is an integer >= 1; TypeError/ValueError otherwise."""
    return _check_int_from(name, value, 1, "a positive integer")


def check_non_negative_int(name: str, value: Any) -> int:
    """Return `value` as int when it is an integer >= 0; TypeError/ValueError otherwise."""
    return _check_int_from(name, value, 0, "an integer >= 0")


def check_start_method(start_method: Any, name: str = "start_method") -> str | None:
    """Return `start_method` when it is one of START_METHODS or None; ValueError naming `name` otherwise."""
    if start_method is not None and start_method not in START_METHODS:
        raise ValueError(f"{name} must be one of {START_METHODS} or None, got {start_method!r}")
    return start_method  # type: ignore[no-any-return]


def check_callable(name: str, value: Any) -> Any:
    """A callable or None."""
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be callable or None, got {value!r}")
    return value


def check_timeout(timeout: Any) -> float:
    """timeout: seconds, > 0 and finite (every wait has a deadline)."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if not 0 < float(timeout) < math.inf:
        raise ValueError(f"timeout must be > 0 seconds and finite, got {timeout}: every wait for a batch has a "
                         "deadline (torch's timeout=0 waits forever); pass the most seconds one batch may take "
                         "(default 120)")
    return float(timeout)


def check_seed(seed: Any) -> int | None:
    """seed: an integer >= 0, or None."""
    if seed is None:
        return None
    if not is_int(seed):
        raise TypeError(f"seed must be an integer or None, got {seed!r}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    return int(seed)
