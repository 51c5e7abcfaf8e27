"""Per-batch seeds: derived from (seed, epoch, batch index), never from the worker.

A pool hands a batch to whichever worker is free, so a per-worker seed would make random
augmentations depend on scheduling. Deriving the seed from the batch's identity makes every
draw reproducible for any number of workers. Runs in workers and in the caller's process.
"""
from __future__ import annotations

import contextlib
import random
from typing import Any, Iterator

import numpy as np
import torch

__all__ = ["derive_batch_seed", "derive_epoch_seed", "derive_sample_seed", "draw_base_seed", "preserved_global_rng",
           "seed_global_rng"]

_SEED_MASK = (1 << 63) - 1


def draw_base_seed(generator: torch.Generator | None = None) -> int:
    """Draw a 63-bit seed from `generator`, or from torch's default generator (as torch's
    DataLoader draws its base seed), so that `torch.manual_seed(s)` reproduces a run."""
    value = torch.empty((), dtype=torch.int64).random_(generator=generator).item()
    return int(value) & _SEED_MASK


_MASK64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """SplitMix64's finalizer: a bijection on 64-bit ints that spreads every input bit."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK64
    return value ^ (value >> 31)


def derive_batch_seed(base_seed: int, epoch: int, batch_index: int) -> int:
    """Return the 63-bit seed of one batch; stable across processes and platforms.

    Computed per batch in the caller, so it is a few integer operations (SplitMix64 applied
    to each part in turn) rather than a SeedSequence (~16 us).
    """
    value = _mix64(base_seed & _MASK64)
    value = _mix64((value + (epoch & _MASK64) + 0x9E3779B97F4A7C15) & _MASK64)
    value = _mix64((value + (batch_index & _MASK64) + 0x9E3779B97F4A7C15) & _MASK64)
    return value & _SEED_MASK


def derive_epoch_seed(base_seed: int, epoch: int) -> int:
    """Return the seed of an epoch's global order: what its samples' seeds derive from when the
    sampler places them (`_wire.protocol.Placed`: a sample's seed comes from its place in the order,
    `derive_sample_seed(epoch seed, place)`, not from the batch it lands in)."""
    return derive_batch_seed(base_seed, epoch, _MASK64)  # a batch index no batch has


def derive_sample_seed(batch_seed: int, position: int) -> int:
    """Return the 63-bit seed of the sample at `position` in a batch (fetch_threads: each
    sample's `get_worker_info()` has its own, whichever thread fetches it)."""
    value = _mix64((batch_seed + 0x632BE59BD9B4E019 + (position & _MASK64)) & _MASK64)
    return value & _SEED_MASK


def seed_global_rng(seed: int) -> None:
    """Seed Python's `random`, numpy's legacy global generator and torch's CPU generator.

    Only the CPU generator: `torch.manual_seed` also walks every device's generators (96 us
    per batch here against 1 us), and loading never draws on a device (workers never touch
    CUDA; in-process loading saves and restores the CPU generator only).
    """
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    torch.default_generator.manual_seed(seed)


@contextlib.contextmanager
def preserved_global_rng() -> Iterator[None]:
    """Restore the global `random`, numpy and torch generators on exit.

    Used for in-process loading, so that seeding a batch does not disturb the caller's streams.
    """
    py_state: Any = random.getstate()
    np_state: Any = np.random.get_state()
    torch_state = torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
