"""Validation of DataLoader arguments into one frozen options object.

Every argument is checked once, when the loader is built, so that a bad value fails at the
line that wrote it instead of inside a worker minutes later. See `_dispatch` for the data flow.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable

import torch

__all__ = ["LAST_BATCH_MODES", "START_METHODS", "Options", "check_last_batch", "validate_options"]

LAST_BATCH_MODES = ("keep", "discard", "rollover")
START_METHODS = ("fork", "spawn", "forkserver")


@dataclasses.dataclass(frozen=True)
class Options:
    """The loader's validated settings; built by `validate_options` only."""

    num_workers: int
    prefetch: int
    thread_pool: bool
    timeout_s: float
    pin_memory: bool
    pin_device_id: int
    device: torch.device | None
    start_method: str | None
    worker_init_fn: Callable[[int], None] | None
    seed: int | None
    progress: bool


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_last_batch(last_batch: Any) -> str:
    """Return the last_batch mode, 'keep' for None; ValueError for anything else."""
    if last_batch is None:
        return "keep"
    if last_batch not in LAST_BATCH_MODES:
        raise ValueError(f"last_batch must be one of {LAST_BATCH_MODES} or None, got {last_batch!r}")
    return str(last_batch)


def check_positive_int(name: str, value: Any) -> int:
    """Return `value` as int when it is an integer >= 1; TypeError/ValueError otherwise."""
    if not _is_int(value):
        raise TypeError(f"{name} must be a positive integer, got {value!r} of type {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def _check_non_negative_int(name: str, value: Any) -> int:
    if not _is_int(value):
        raise TypeError(f"{name} must be an integer >= 0, got {value!r} of type {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def _check_device(device: Any) -> torch.device | None:
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be a torch.device or a string such as 'cuda:0', got {device!r}") from exc
    if dev.type == "cpu":
        return None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was requested but CUDA is not available on this machine; "
                         "use device=None (or 'cpu') to keep batches on the host")
    if dev.type != "cuda":
        raise ValueError(f"device must be a CUDA device or 'cpu', got {device!r}")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    _check_cuda_index("device", device, index)
    return torch.device("cuda", index)


def _check_cuda_index(name: str, value: Any, index: int) -> None:
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"{name}={value!r} names CUDA device {index}, but this machine has {count} "
                         f"(indices 0 to {count - 1})")


def validate_options(*, num_workers: Any, prefetch: Any, thread_pool: Any, timeout: Any,
                     pin_memory: Any, pin_device_id: Any, device: Any, start_method: Any,
                     worker_init_fn: Any, seed: Any, progress: Any) -> Options:
    """Check the loader's runtime arguments and return them frozen.

    Raises:
        TypeError, ValueError: naming the argument, the value given and what is allowed.
    """
    workers = _check_non_negative_int("num_workers", num_workers)
    depth = 2 * workers if prefetch is None else _check_non_negative_int("prefetch", prefetch)
    if workers > 0 and depth == 0:
        # A window of zero batches would dispatch nothing; one is the smallest that works.
        depth = 1
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if not float(timeout) > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    if start_method is not None and start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS} or None, got {start_method!r}")
    if worker_init_fn is not None and not callable(worker_init_fn):
        raise TypeError(f"worker_init_fn must be callable or None, got {worker_init_fn!r}")
    if seed is not None and not _is_int(seed):
        raise TypeError(f"seed must be an integer or None, got {seed!r}")
    if seed is not None and seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    pin_id = _check_non_negative_int("pin_device_id", pin_device_id)
    if pin_memory and torch.cuda.is_available():
        _check_cuda_index("pin_device_id", pin_device_id, pin_id)
    return Options(num_workers=workers, prefetch=depth, thread_pool=bool(thread_pool),
                   timeout_s=float(timeout), pin_memory=bool(pin_memory), pin_device_id=pin_id,
                   device=_check_device(device), start_method=start_method,
                   worker_init_fn=worker_init_fn, seed=None if seed is None else int(seed),
                   progress=bool(progress))
