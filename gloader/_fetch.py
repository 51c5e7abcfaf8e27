"""From sample keys (or a stream's next samples) to a batch; one code path for in-process
loading, thread workers and process workers.

What differs between them is only where the batch goes, which a `BatchWriter` decides:
`SharedMemoryWriter` (process workers) plans the batch and writes each byte once into a
shared-memory segment, returning a small handle; `DirectWriter` (threads, in-process) returns
the batch itself with numpy arrays turned into tensors. Runs wherever the batch is loaded;
never imports caller-side code. The flow is drawn in `_engine`.
"""
from __future__ import annotations

import itertools
import time
from typing import Any, Callable, Protocol

from ._protocol import Loaded, ShardEnd, StreamRequest, decode_keys
from ._rows import load_rows
from ._transport import SlotMaps, SlotSpace, pack_batch
from ._tree import arrays_to_tensors
from .batchify import build_planned, default_batchify_fn, plan_batch

__all__ = ["BatchWriter", "Cursor", "DirectWriter", "SharedMemoryWriter", "load_batch"]


# Slots a process worker keeps mapped; see SlotMaps. A cap well above the slots in
# circulation (window + spares + held batches with descriptors, prefetch + 6) for any
# num_workers up to ~100. Larger: fewer re-maps when many slots circulate; smaller: fewer
# mappings to check when pruning (only those mapped are checked).
_MAX_MAPPED_SLOTS = 256
# Batches between two prunes of a worker's mappings (a header read per mapped slot).
# Smaller: memory of retired slots returns sooner; larger: less per-batch cost.
_PRUNE_EVERY_BATCHES = 8


class BatchWriter(Protocol):
    """Turns samples into what the task returns for them."""

    def write(self, batchify_fn: Callable[[list[Any]], Any], samples: list[Any], space: SlotSpace | None) -> Any: ...


class DirectWriter:
    """Thread workers and in-process loading share the caller's memory: the batch itself."""

    def write(self, batchify_fn: Callable[[list[Any]], Any], samples: list[Any], space: SlotSpace | None) -> Any:
        return arrays_to_tensors(batchify_fn(samples))


class SharedMemoryWriter:
    """Process workers: plan the batch, write it into the task's lent slot, and return its handle.
    Keeps slots mapped across batches (see `SlotMaps`)."""

    def __init__(self) -> None:
        self.maps = SlotMaps(_MAX_MAPPED_SLOTS)
        self._written = 0

    def write(self, batchify_fn: Callable[[list[Any]], Any], samples: list[Any], space: SlotSpace | None) -> Any:
        self._count_batch()
        start = space.offset if space is not None else 0

        def pack(plan: Any) -> Any:
            if space is not None:
                space.offset = start  # planned again (see build_planned): written where the first try began
            return pack_batch(plan, space, self.maps)

        return build_planned(lambda: plan_batch(batchify_fn, samples), pack)

    def load_rows(self, load: Callable[[Any], Any], keys: list[Any], space: SlotSpace | None,
                  cursor: Cursor) -> tuple[Any, list[Any]]:
        """Fetch and write a batch row by row (see `_rows.load_rows`): its handle, or None
        and the samples taken so far (the first ones) for the usual batching."""
        handle, samples = load_rows(load, keys, space, self.maps, cursor.set)
        if handle is not None:
            self._count_batch()
        return handle, samples

    def _count_batch(self) -> None:
        self._written += 1
        if self._written % _PRUNE_EVERY_BATCHES == 0:
            self.maps.prune()  # give back the memory of slots the caller has retired


class Cursor:
    """The sample key being fetched, for the error report when `__getitem__` raises."""

    __slots__ = ("key",)

    def __init__(self) -> None:
        self.key: Any = None

    def set(self, key: Any) -> None:
        self.key = key


def _fetch_samples(dataset: Any, keys: list[Any], cursor: Cursor) -> list[Any]:
    getitems = getattr(dataset, "__getitems__", None)
    if getitems is not None:  # torch's batched protocol (HuggingFace datasets): one call per batch
        batch = list(getitems(keys))
        if len(batch) != len(keys):
            raise ValueError(f"{type(dataset).__name__}.__getitems__ returned {len(batch)} samples for "
                             f"{len(keys)} keys; it must return one sample per key, in order")
        return batch
    return _fetch_rest(dataset.__getitem__, keys, [], cursor)


def _fetch_rest(load: Callable[[Any], Any], keys: list[Any], samples: list[Any], cursor: Cursor) -> list[Any]:
    """Append to `samples` those of the keys after the first len(samples) ones."""
    try:
        samples.extend(map(load, keys[len(samples):] if samples else keys))  # ~1 us less per 100 keys than a loop
    except BaseException:
        cursor.key = keys[len(samples)]  # extend keeps the samples it took before the failure
        raise
    return samples


def _next_shard_samples(streams: dict[int, tuple[int, Any]], loader_id: int, epoch: int, dataset: Any,
                        batch_size: int) -> list[Any] | None:
    """The next samples of this worker's shard in `epoch`; None once it is exhausted.

    `streams` is the worker's own table: loader id -> (epoch, iterator, None when exhausted).
    """
    state = streams.get(loader_id)
    if state is None or state[0] != epoch:
        state = (epoch, iter(dataset))  # the dataset finds its shard through get_worker_info()
    stream = state[1]
    if stream is None:
        return None
    try:
        samples = list(itertools.islice(stream, batch_size))
    except BaseException:
        streams[loader_id] = (epoch, None)  # a generator that raised is finished
        raise
    streams[loader_id] = (epoch, stream if len(samples) == batch_size else None)
    return samples or None


def load_batch(registration: Any, loader_id: int, epoch: int, work: Any, space: SlotSpace | None, writer: BatchWriter,
               streams: dict[int, tuple[int, Any]], worker_id: int, cursor: Cursor) -> Loaded | ShardEnd:
    """Load one batch of a registered loader: its samples by key, or a stream's next ones.

    Raises whatever the dataset or the batchify function raises; `cursor.key` then names the
    sample being fetched (None when batchify failed).
    """
    started = time.monotonic()
    if isinstance(work, StreamRequest):
        samples = _next_shard_samples(streams, loader_id, epoch, registration.dataset, work.batch_size)
        if samples is None or (len(samples) < work.batch_size and not work.keep_last):
            return ShardEnd(worker_id)
    else:
        keys = decode_keys(work)
        dataset = registration.dataset
        if (registration.batchify_fn is default_batchify_fn and isinstance(writer, SharedMemoryWriter)
                and keys and getattr(dataset, "__getitems__", None) is None):
            # Large samples go straight into the slot as they come (see _rows); the fetch
            # time then includes their copies.
            handle, taken = writer.load_rows(dataset.__getitem__, keys, space, cursor)
            if handle is not None:
                finished = time.monotonic()
                return Loaded(handle, finished - started, 0.0, worker_id, started, finished, len(keys))
            samples = _fetch_rest(dataset.__getitem__, keys, taken, cursor)
        else:
            samples = _fetch_samples(dataset, keys, cursor)
    fetched = time.monotonic()
    batch = writer.write(registration.batchify_fn, samples, space)
    finished = time.monotonic()
    return Loaded(batch, fetched - started, finished - fetched, worker_id, started, finished, len(samples))
