"""From sample keys (or a stream's next samples) to a batch; one code path for in-process
loading, thread workers and process workers.

What differs between them is only where the batch goes, which a `BatchWriter` decides:
`SharedMemoryWriter` (process workers) plans the batch and writes each byte once into a
shared-memory segment, returning a small handle; `DirectWriter` (threads, in-process) returns
the batch itself with numpy arrays turned into tensors. Runs wherever the batch is loaded;
never imports caller-side code. The flow is drawn in `_caller.engine`.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import time
from typing import Any, Callable, Protocol

from .._wire.plans import build_planned, plan_batch
from .._wire.protocol import Loaded, Placed, ShardEnd, StreamRequest, decode_keys
from .._wire.seed import derive_sample_seed
from .._wire.tree import arrays_to_tensors
from ..batchify import default_batchify_fn
from . import registry as _registry
from .datapipes import begin_datapipe_epoch, is_datapipe
from .rows import load_rows
from .slots import SlotMaps, SlotSpace, pack_batch

__all__ = ["BatchWriter", "Cursor", "DirectWriter", "Fetcher", "SharedMemoryWriter", "load_batch"]


# Slots a process worker keeps mapped; see SlotMaps. A cap well above the slots in
# circulation (window + spares + held batches with descriptors, prefetch + 6) for any
# num_workers up to ~100. Larger: fewer re-maps when many slots circulate; smaller: fewer
# mappings to check when pruning (only those mapped are checked).
_MAX_MAPPED_SLOTS = 256
# Batches between two prunes of a worker's mappings (a header read per mapped slot).
# Smaller: memory of retired slots returns sooner; larger: less per-batch cost.
_PRUNE_EVERY_BATCHES = 8
# fetch_threads='auto' (see _Climb): the most threads a worker fetches with; the batches each
# thread count is measured over; how much faster twice the threads must fetch to be kept (and
# how much slower half of them may be); and how many measurements a settled count is held for
# before the next try. Longer measurements and holds: steadier counts; shorter: quicker to follow.
_AUTO_MOST_THREADS = 64
_AUTO_MEASURE_BATCHES = 3
_AUTO_GAIN = 1.10
_AUTO_LOSS = 0.95
_AUTO_HOLD = 5


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
        """Fetch and write a batch row by row (see `_worker.rows.load_rows`): its handle, or None
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


class _Climb:
    """fetch_threads='auto': the thread count that fetches fastest, found by trying.

    Each count is measured over _AUTO_MEASURE_BATCHES batches (samples per second of fetching;
    one batch while it first climbs, so that a loader's first epoch is not spent finding it).
    From one thread it doubles while twice the threads fetch at least _AUTO_GAIN times as fast
    (samples that wait gain, samples that compute or hold the GIL do not), then holds; after
    _AUTO_HOLD measurements it tries again, up and down in turn (half the threads are kept if
    they fetch at least _AUTO_LOSS as fast), so the count follows a dataset whose waiting changes.
    """

    def __init__(self, most: int) -> None:
        self.count = 1
        self._most = most
        self._samples = 0
        self._seconds = 0.0
        self._batches = 0
        self._base: tuple[int, float] | None = None  # (count, samples/s) the count under trial is compared with
        self._hold = 0  # measurements left before the next trial
        self._down = False  # the next trial halves the count
        self._climbing = True  # not settled yet

    def record(self, samples: int, seconds: float) -> None:
        self._samples += samples
        self._seconds += seconds
        self._batches += 1
        if self._batches < (1 if self._climbing else _AUTO_MEASURE_BATCHES):
            return
        rate = self._samples / max(self._seconds, 1e-9)
        self._samples, self._seconds, self._batches = 0, 0.0, 0
        base = self._base
        if base is None or self._hold > 0 or base[0] == self.count:  # measuring the settled count
            self._base = (self.count, rate)
            self._hold = max(0, self._hold - 1)
            if self._hold == 0:
                self._try(up=not self._down)
            return
        up = self.count > base[0]
        if rate >= base[1] * (_AUTO_GAIN if up else _AUTO_LOSS):  # kept: go on the same way
            self._base = (self.count, rate)
            self._try(up)
        else:  # back to the count before, for a while; after the first climb, try higher again
            self.count = base[0]  # (it came through the lower counts: they were slower)
            self._settle(down=up and not self._climbing)

    def _try(self, up: bool) -> None:
        trial = min(self._most, self.count * 2) if up else max(1, self.count // 2)
        if trial == self.count:
            self._settle(down=up)
        else:
            self.count = trial

    def _settle(self, down: bool) -> None:
        self._hold = _AUTO_HOLD
        self._down = down
        self._climbing = False


class Fetcher:
    """fetch_threads: a batch's samples fetched concurrently, `count` at a time, for datasets
    whose samples wait (object storage, a network file system, an HTTP service).

    Each sample gets its own seed (from the batch's seed and its position) in its
    `get_worker_info()`, so what a dataset draws from `get_worker_info().rng` is the same for
    any number of threads and workers; the process-wide generators, which the threads share,
    are seeded per batch and their draws interleave. With 'auto' the count is the one found to
    fetch fastest, and kept under trial (see _Climb).
    """

    def __init__(self, setting: int | str) -> None:
        self._climb = _Climb(_AUTO_MOST_THREADS) if setting == "auto" else None
        self._most = _AUTO_MOST_THREADS if self._climb is not None else int(setting)
        self.used = 0  # threads the latest batch was fetched with
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def count(self) -> int:
        return self._climb.count if self._climb is not None else self._most

    def fetch(self, load: Callable[[Any], Any], keys: list[Any], info: tuple[int, int, int, Any],
              cursor: Cursor, first_place: int = 0) -> list[Any]:
        """The samples of `keys`, in order; raises what the first failing sample raised
        (`cursor.key` names it), after every thread has finished. Sample `i`'s seed derives
        from `info`'s seed and `first_place + i`."""
        count = self.used = min(self.count, len(keys))
        started = time.monotonic()
        if count <= 1:
            results = [_fetch_group(load, keys, info, 0, 1, first_place)]
        else:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(self._most, "gloader-fetch")
            futures = [self._executor.submit(_fetch_group, load, keys, info, first, count, first_place)
                       for first in range(count)]
            results = [future.result() for future in futures]
        samples: list[Any] = [None] * len(keys)
        failed: tuple[int, BaseException] | None = None
        for first, (taken, error) in enumerate(results):
            for position, sample in zip(range(first, len(keys), count), taken):
                samples[position] = sample
            if error is not None and (failed is None or error[0] < failed[0]):
                failed = error
        _registry.set_current_info(info)  # the batch's own, for batchify
        if failed is not None:
            cursor.key = keys[failed[0]]
            raise failed[1]
        if self._climb is not None:
            self._climb.record(len(keys), time.monotonic() - started)
        return samples

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None


def _fetch_group(load: Callable[[Any], Any], keys: list[Any], info: tuple[int, int, int, Any], first: int,
                 step: int, first_place: int = 0) -> tuple[list[Any], tuple[int, BaseException] | None]:
    """Fetch keys[first::step] in turn, each with its own seed: (the samples, (position, error)
    of the first that raised, or None)."""
    worker_id, num_workers, seed, dataset = info
    taken: list[Any] = []
    try:
        for position in range(first, len(keys), step):
            _registry.set_current_info((worker_id, num_workers, derive_sample_seed(seed, first_place + position),
                                        dataset))
            try:
                taken.append(load(keys[position]))
            except BaseException as exc:
                return taken, (position, exc)
    finally:
        _registry.set_current_info(None)
    return taken, None


def _fetch_placed(registration: Any, work: Placed, info: tuple[int, int, int, Any],
                  reseed: Callable[[int], None] | None, cursor: Cursor) -> list[Any]:
    """The samples of a placed batch, each seeded from its place in the epoch's order: its
    `get_worker_info()` seed and rng, and (`reseed`) the process-wide generators. One
    `__getitem__` a sample (a batched `__getitems__` could not seed each)."""
    keys = decode_keys(work.keys)
    worker_id, num_workers, _, dataset = info
    if registration.fetch_threads is not None and keys:
        if registration.fetcher is None:
            registration.fetcher = Fetcher(registration.fetch_threads)
        fetched: list[Any] = registration.fetcher.fetch(dataset.__getitem__, keys,
                                                        (worker_id, num_workers, work.epoch_seed, dataset), cursor,
                                                        work.first)  # its threads share the process-wide generators
        return fetched
    samples: list[Any] = []
    try:
        for position, key in enumerate(keys, work.first):
            cursor.key = key
            seed = derive_sample_seed(work.epoch_seed, position)
            if reseed is not None:
                reseed(seed)
            _registry.set_current_info((worker_id, num_workers, seed, dataset))
            samples.append(dataset[key])
    finally:
        _registry.set_current_info(info)  # the batch's own, for batchify
    cursor.key = None
    return samples


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
                        batch_size: int, base_seed: int) -> tuple[list[Any] | None, bool]:
    """The next samples of this worker's shard in `epoch` (None once it is exhausted), and
    whether this call began the shard (a replacement for a dead worker begins it again).

    `streams` is the worker's own table: loader id -> (epoch, iterator, None when exhausted).
    """
    state = streams.get(loader_id)
    began = state is None or state[0] != epoch
    if state is None or began:
        if is_datapipe(dataset):
            begin_datapipe_epoch(dataset, base_seed, epoch)
        state = (epoch, iter(dataset))  # the dataset finds its shard through get_worker_info()
    stream = state[1]
    if stream is None:
        return None, began
    try:
        samples = list(itertools.islice(stream, batch_size))
    except BaseException:
        streams[loader_id] = (epoch, None)  # a generator that raised is finished
        raise
    streams[loader_id] = (epoch, stream if len(samples) == batch_size else None)
    return samples or None, began


def load_batch(registration: Any, loader_id: int, epoch: int, work: Any, space: SlotSpace | None, writer: BatchWriter,
               streams: dict[int, tuple[int, Any]], worker_id: int, cursor: Cursor,
               info: tuple[int, int, int, Any] | None = None,
               reseed: Callable[[int], None] | None = None) -> Loaded | ShardEnd:
    """Load one batch of a registered loader: its samples by key, or a stream's next ones.
    `info`: the batch's (worker id, num_workers, seed, dataset), for fetch_threads and placed
    batches; `reseed(seed)` seeds the process-wide generators before each sample of a placed
    batch (None where the worker does not own them: threads).

    Raises whatever the dataset or the batchify function raises; `cursor.key` then names the
    sample being fetched (None when batchify failed).
    """
    started = time.monotonic()
    if isinstance(work, StreamRequest):
        found, began = _next_shard_samples(streams, loader_id, epoch, registration.dataset, work.batch_size,
                                           registration.base_seed)
        if found is None or (len(found) < work.batch_size and not work.keep_last):
            return ShardEnd(worker_id)
        samples = found
    elif isinstance(work, Placed):
        samples = _fetch_placed(registration, work, info or (worker_id, 0, 0, registration.dataset), reseed, cursor)
    else:
        keys = decode_keys(work)
        dataset = registration.dataset
        if registration.fetch_threads is not None and info is not None and keys:
            if registration.fetcher is None:
                registration.fetcher = Fetcher(registration.fetch_threads)
            samples = registration.fetcher.fetch(dataset.__getitem__, keys, info, cursor)
        elif (registration.batchify_fn is default_batchify_fn and isinstance(writer, SharedMemoryWriter)
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
    threads = registration.fetcher.used if registration.fetcher is not None else 0
    return Loaded(batch, fetched - started, finished - fetched, worker_id, started, finished, len(samples), threads,
                  isinstance(work, StreamRequest) and began)
