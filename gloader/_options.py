"""Every DataLoader argument, checked once into one frozen config.

A bad value fails at the line that wrote it instead of inside a worker minutes later. This
is the only place that validates the loader's arguments and their combinations (sampler
against shuffle, batch_sampler against the rest, pool= against num_workers). Runs in the
caller's process; the flow is drawn in `_engine`.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable

import torch

from ._checks import check_last_batch, check_non_negative_int, check_positive_int, check_start_method, is_int
from ._pool import WorkerPool
from ._protocol import StreamRequest
from .batchify import default_batchify_fn
from .dataset import IterableDataset
from .sampler import BatchSampler, RandomSampler, SequentialSampler, dataset_length

__all__ = ["LoaderConfig"]


@dataclasses.dataclass(frozen=True)
class LoaderConfig:
    """The loader's validated settings; made by `LoaderConfig.build` only.

    `batch_sampler` decides a map-style epoch; `stream` is set instead for an IterableDataset.
    `lookahead`: whether the next epoch's first batches may be dispatched before the caller
    asks for them (see `build`).
    """

    dataset: Any
    batch_sampler: Any
    stream: StreamRequest | None
    batchify_fn: Callable[[list[Any]], Any]
    lookahead: bool
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
    pool: WorkerPool | None
    progress: bool

    @classmethod
    def build(cls, *, dataset: Any, batch_size: Any, shuffle: Any, sampler: Any, last_batch: Any,
              batch_sampler: Any, batchify_fn: Any, num_workers: Any, pin_memory: Any, pin_device_id: Any,
              prefetch: Any, thread_pool: Any, timeout: Any, device: Any, worker_init_fn: Any, seed: Any,
              start_method: Any, pool: Any, progress: Any) -> LoaderConfig:
        """Check every argument and their combinations.

        Raises:
            TypeError, ValueError: naming the argument, the value given and what is allowed.
        """
        if pool is not None:
            num_workers, thread_pool, start_method = _take_pool_settings(pool, num_workers, thread_pool,
                                                                         start_method)
        workers = check_non_negative_int("num_workers", num_workers)
        depth = _check_prefetch(prefetch, workers)
        timeout_s = _check_timeout(timeout)
        method = check_start_method(start_method)
        if worker_init_fn is not None and not callable(worker_init_fn):
            raise TypeError(f"worker_init_fn must be callable or None, got {worker_init_fn!r}")
        checked_seed = _check_seed(seed)
        pin = bool(pin_memory)
        pin_id = _check_pin_device(pin, pin_device_id)
        target = _check_device(device)
        if batchify_fn is not None and not callable(batchify_fn):
            raise TypeError(f"batchify_fn must be callable or None, got {batchify_fn!r}")
        is_stream = isinstance(dataset, IterableDataset)
        if not hasattr(dataset, "__getitem__") and not is_stream:
            raise TypeError(f"dataset must support __getitem__ and __len__ (or be a gloader.IterableDataset), "
                            f"got {type(dataset).__name__}")
        stream = _check_stream(batch_size, shuffle, sampler, last_batch, batch_sampler) if is_stream else None
        batches = None if is_stream else _build_batch_sampler(dataset, batch_size, shuffle, sampler, last_batch,
                                                              batch_sampler, checked_seed)
        thread = bool(thread_pool)
        # Dispatch the next epoch's first batches before the caller asks only when this loader
        # built the sampler (a user's may change between epochs: DistributedSampler.set_epoch)
        # and workers are processes: they hold their own copy of the dataset, whereas threads
        # would load the next epoch from a dataset the caller may still change between epochs.
        lookahead = sampler is None and batch_sampler is None and not is_stream and workers > 0 and not thread
        return cls(dataset=dataset, batch_sampler=batches, stream=stream,
                   batchify_fn=batchify_fn or default_batchify_fn, lookahead=lookahead, num_workers=workers,
                   prefetch=depth, thread_pool=thread, timeout_s=timeout_s, pin_memory=pin, pin_device_id=pin_id,
                   device=target, start_method=method, worker_init_fn=worker_init_fn, seed=checked_seed, pool=pool,
                   progress=bool(progress))


def _take_pool_settings(pool: Any, num_workers: Any, thread_pool: Any,
                        start_method: Any) -> tuple[int, bool, str | None]:
    if not isinstance(pool, WorkerPool):
        raise TypeError(f"pool must be a gloader.WorkerPool or None, got {type(pool).__name__}")
    if num_workers not in (0, pool.num_workers):
        raise ValueError(f"num_workers={num_workers} conflicts with pool= ({pool.num_workers} workers); "
                         "leave num_workers out when passing a pool")
    if thread_pool and not pool.thread_pool:
        raise ValueError("thread_pool=True conflicts with pool=, a process pool; leave thread_pool out")
    if start_method is not None and start_method != pool.start_method:
        raise ValueError(f"start_method={start_method!r} conflicts with pool= (start_method="
                         f"{pool.start_method!r}); leave start_method out when passing a pool")
    return pool.num_workers, pool.thread_pool, pool.start_method


def _check_stream(batch_size: Any, shuffle: Any, sampler: Any, last_batch: Any,
                  batch_sampler: Any) -> StreamRequest:
    if shuffle or sampler is not None or batch_sampler is not None:
        raise ValueError("an IterableDataset has no indices: shuffle, sampler and batch_sampler are not allowed")
    if batch_size is None:
        raise ValueError("batch_size must be given for an IterableDataset, got batch_size=None")
    size = check_positive_int("batch_size", batch_size)
    mode = check_last_batch(last_batch)
    if mode == "rollover":
        raise ValueError("last_batch='rollover' needs a map-style dataset; use 'keep' or 'discard'")
    return StreamRequest(size, mode == "keep")


def _build_batch_sampler(dataset: Any, batch_size: Any, shuffle: Any, sampler: Any, last_batch: Any,
                         batch_sampler: Any, seed: Any) -> Any:
    if batch_sampler is not None:
        given = {"batch_size": batch_size, "shuffle": shuffle or None, "sampler": sampler, "last_batch": last_batch}
        clashing = sorted(name for name, value in given.items() if value is not None)
        if clashing:
            raise ValueError(f"batch_sampler excludes {', '.join(clashing)}; pass either batch_sampler or "
                             "batch_size/shuffle/sampler/last_batch")
        if not hasattr(batch_sampler, "__iter__"):
            raise TypeError(f"batch_sampler must be iterable, got {type(batch_sampler).__name__}")
        return batch_sampler
    if batch_size is None:
        raise ValueError("batch_size must be given unless batch_sampler is given, got batch_size=None")
    mode = check_last_batch(last_batch)
    if sampler is None:
        length = dataset_length(dataset)
        sampler = RandomSampler(length, seed) if shuffle else SequentialSampler(length)
    elif shuffle:
        raise ValueError(f"shuffle=True excludes sampler={sampler!r}; shuffle inside the sampler instead")
    return BatchSampler(sampler, batch_size, mode)


def _check_prefetch(prefetch: Any, workers: int) -> int:
    depth = 2 * workers if prefetch is None else check_non_negative_int("prefetch", prefetch)
    # A window of zero batches would dispatch nothing; one is the smallest that works.
    return max(depth, 1)


def _check_timeout(timeout: Any) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if not float(timeout) > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    return float(timeout)


def _check_seed(seed: Any) -> int | None:
    if seed is None:
        return None
    if not is_int(seed):
        raise TypeError(f"seed must be an integer or None, got {seed!r}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    return int(seed)


def _check_pin_device(pin_memory: bool, pin_device_id: Any) -> int:
    index = check_non_negative_int("pin_device_id", pin_device_id)
    if pin_memory and torch.cuda.is_available():
        _check_cuda_index("pin_device_id", pin_device_id, index)
    return index


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
