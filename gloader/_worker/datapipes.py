"""torch DataPipes (`torch.utils.data.IterDataPipe` graphs) as torch's DataLoader runs them.

A DataPipe graph is an IterableDataset whose `.shuffle()` and `.sharding_filter()` steps are
set by the loader: `shuffle=True` turns the shuffle steps on (at construction), and each shard
of each epoch seeds the graph's random steps from one seed of that epoch, the same in every
worker, so a shuffle placed before `sharding_filter()` splits one order between the workers,
whose filters then keep each its own share. Imports nothing of gloader's above `_worker.registry`.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import IterDataPipe

from .._wire.seed import derive_batch_seed
from .._worker.registry import get_worker_info

__all__ = ["begin_datapipe_epoch", "is_datapipe", "turn_on_datapipe_shuffle"]

# The epoch seed is derived as a batch seed at an index no batch has (batch indices are >= 0).
_EPOCH_SEED_INDEX = -1


def is_datapipe(dataset: Any) -> bool:
    """Whether `dataset` is a torch IterDataPipe graph."""
    return isinstance(dataset, IterDataPipe)


def turn_on_datapipe_shuffle(datapipe: Any) -> None:
    """Turn on the graph's shuffle steps (torch's DataLoader does it for shuffle=True)."""
    from torch.utils.data import graph_settings

    graph_settings.apply_shuffle_settings(datapipe, shuffle=True)


def begin_datapipe_epoch(datapipe: Any, base_seed: int, epoch: int) -> None:
    """Seed the graph's random steps for `epoch` (one seed for every worker) and set its
    sharding filters to this worker's share, before the shard's `iter()`."""
    from torch.utils.data import graph_settings

    info = get_worker_info()
    worker_id, workers = (0, 1) if info is None else (info.id, info.num_workers)
    rng = torch.Generator()
    rng.manual_seed(derive_batch_seed(base_seed, epoch, _EPOCH_SEED_INDEX))
    graph_settings.apply_random_seed(datapipe, rng)
    graph_settings.apply_sharding(datapipe, workers, worker_id)
