"""What runs inside a worker: the pool initializer, the batch task and the parent watchdog.

Entry points are module-level functions so that every start method can find them. They catch
`BaseException` around user code and return it as a message; the initializer never raises
(a failure is kept and reported by the first task), because a raising initializer makes the
pool respawn workers forever. Messages are small tuples; process workers return them as
bytes made by the stdlib pickler (see `_transport.dumps_handle`). Never imports caller-side
code. The whole flow is drawn in `_dispatch`.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import pickle
import signal
import threading
import time
import traceback
from typing import Any

import numpy as np

from . import _registry
from ._registry import Payload, WorkerInfo
from ._seed import seed_global_rng
from .batchify import plan_batch
from ._transport import SegmentCache, dumps_handle, pack_batch, unlink_prefix, unlink_segment

__all__ = ["PoolSpec", "STATUS_FIELDS", "STATUS_ROWS_PER_WORKER", "initialize_worker", "run_batch",
           "run_stream_batch"]

logger = logging.getLogger(__name__)

# How often a process worker checks that the caller is alive. Larger: less wake-up noise;
# smaller: orphaned workers exit (and free /dev/shm) sooner after the caller is killed.
_PARENT_POLL_S = 0.2
# Columns of the shared status table, one row per worker: what it is loading right now.
STATUS_FIELDS = 4  # pid, loader id, epoch, batch index (-1 when idle)
# Rows per worker slot in the status table: the pool starts a replacement when a worker
# dies, and the replacement must not overwrite the row that tells what the dead one did.
STATUS_ROWS_PER_WORKER = 4
# Segments a process worker keeps mapped; see SegmentCache.
_MAX_MAPPED_SEGMENTS = 32
# glibc malloc settings for process workers. By default glibc serves blocks over 128 KiB
# with a fresh mmap and gives freed heap tops back to the OS, so a dataset that builds one
# image (or a numpy temporary) per sample pays page faults for every sample: ~87 us per
# 150 KB image here against ~10 us once the memory is kept. Workers are ours and short of
# nothing else to do with the memory, so they keep it. Larger: fewer faults for larger
# samples; smaller: less memory retained by an idle worker (at most its peak heap).
_MALLOC_MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's maximum on 64-bit
_MALLOC_TRIM_THRESHOLD_BYTES = 256 << 20


@dataclasses.dataclass
class PoolSpec:
    """Everything a pool's workers share; passed to the initializer once per worker."""

    is_thread: bool
    num_workers: int
    counter: Any  # a synchronized int: hands out worker ids
    status: Any  # shared int64 table, num_workers * STATUS_ROWS_PER_WORKER rows; None for threads
    main_pid: int
    shm_prefix: str  # every segment of this pool's loaders starts with it
    payload_dir: str  # payload files of loaders that join the running pool
    generation: Any  # synchronized int, bumped when a loader leaves the pool
    closing: Any  # synchronized int, set by the caller before it asks the workers to stop


_SPEC: PoolSpec | None = None
_CACHE = SegmentCache(_MAX_MAPPED_SEGMENTS)
_SEEN_GENERATION = 0
_STATUS_ROW = [-1]  # this process worker's row offset in the status table
# Stream iterators of this worker, by (loader id, worker id): (epoch, iterator or None when
# the shard is exhausted). Keyed by worker id too, because thread workers share this module.
_STREAMS: dict[tuple[int, int], tuple[int, Any]] = {}
_STREAMS_LOCK = threading.Lock()
_THREAD_SPEC = threading.local()


def _is_orphaned(parent: int, main_pid: int) -> bool:
    if os.getppid() != parent:
        return True
    try:
        os.kill(main_pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def _remove_orphaned_segments(closing: Any, shm_prefix: str) -> None:
    """At worker exit: unless the caller asked the workers to stop, remove its segments.

    Registered with multiprocess's exit finalizers, because a worker whose caller was killed
    usually leaves through EOF on its task pipe, before the watchdog below wakes up. The
    caller's pid cannot tell: the kernel closes a dying caller's pipes before it reparents
    its children, so the worker may still see the caller as its parent here.
    """
    if not closing.value:
        unlink_prefix(shm_prefix)


def _watch_parent(parent: int, main_pid: int, shm_prefix: str) -> None:
    """Exit when the caller is gone, after removing the caller's segments."""
    while True:
        time.sleep(_PARENT_POLL_S)
        if _is_orphaned(parent, main_pid):
            unlink_prefix(shm_prefix)
            os._exit(0)


def discard_created_segment(name: str) -> None:
    """Unmap and remove a segment this worker created but never handed over (it still owns it).

    Exactly that name: other segments' names may extend it (`..._w12_1` and `..._w12_10`).
    """
    _CACHE.forget(name)
    unlink_segment(name)


def _keep_freed_memory() -> None:
    """Tune glibc malloc as described at _MALLOC_MMAP_THRESHOLD_BYTES; no-op elsewhere."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, _MALLOC_MMAP_THRESHOLD_BYTES)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, _MALLOC_TRIM_THRESHOLD_BYTES)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: keep the platform's allocator as it is


def initialize_worker(spec: PoolSpec, registrations: list[tuple[int, Payload]]) -> None:
    """Pool initializer: claim a worker id, set the process up, register the loaders.

    Never raises; see the module docstring.
    """
    global _SPEC
    try:
        with spec.counter.get_lock():
            worker_id = spec.counter.value
            spec.counter.value += 1
        _registry.set_identity(worker_id % spec.num_workers, spec.num_workers, spec.is_thread)
        if spec.is_thread:
            _THREAD_SPEC.spec = spec
        else:
            _SPEC = spec
            # Ctrl-C is the caller's to handle: it shuts the workers down itself.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            import torch

            torch.set_num_threads(1)  # one worker, one core: intra-op threads only contend
            _keep_freed_memory()
            # Under fork, the caller's objects are shared copy-on-write; a full collection in
            # this worker would write the GC header of every inherited container and copy its
            # page. Freezing moves them out of the collector's reach (O(1), no object touched).
            import gc

            gc.freeze()
            _STATUS_ROW[0] = (worker_id % (spec.num_workers * STATUS_ROWS_PER_WORKER)) * STATUS_FIELDS
            row = _STATUS_ROW[0]
            spec.status[row:row + STATUS_FIELDS] = [os.getpid(), -1, -1, -1]
            from multiprocess import util

            parent = os.getppid()
            util.Finalize(None, _remove_orphaned_segments, args=(spec.closing, spec.shm_prefix), exitpriority=10)
            threading.Thread(target=_watch_parent, args=(parent, spec.main_pid, spec.shm_prefix),
                             name="gloader-parent-watch", daemon=True).start()
        for loader_id, payload in registrations:
            _registry.register_loader(loader_id, payload)
    except BaseException:  # pragma: no cover - last resort; the first task reports the loader as missing
        logger.exception("gloader worker initialization failed")


def _current_spec() -> PoolSpec | None:
    return getattr(_THREAD_SPEC, "spec", None) or _SPEC


def _refresh_registry(spec: PoolSpec) -> None:
    """Drop loaders that left a shared pool (their payload file is gone)."""
    global _SEEN_GENERATION
    generation = spec.generation.value
    if generation == _SEEN_GENERATION:
        return
    _SEEN_GENERATION = generation
    for loader_id in _registry.registered_from_file():
        if not os.path.exists(os.path.join(spec.payload_dir, f"{loader_id}.pkl")):
            _registry.unregister_loader(loader_id)


def _find_registration(spec: PoolSpec | None, loader_id: int) -> _registry.Registration | None:
    registration = _registry.lookup(loader_id)
    if registration is None and spec is not None:
        path = os.path.join(spec.payload_dir, f"{loader_id}.pkl")
        try:
            with open(path, "rb") as handle:
                payload = pickle.load(handle)
        except FileNotFoundError:
            return None
        _registry.register_loader(loader_id, payload, from_file=True)
        registration = _registry.lookup(loader_id)
    return registration


def _error_message(exc: BaseException, tb_text: str, context: str, batch_index: int,
                   sample_index: int | None, is_thread: bool) -> tuple[Any, ...]:
    identity = _registry.current_identity() or (-1, 0)
    info = {"type": f"{type(exc).__module__}.{type(exc).__qualname__}", "message": str(exc),
            "traceback": tb_text, "context": context, "batch_index": batch_index,
            "sample_index": sample_index, "worker_id": identity[0], "pid": os.getpid()}
    if is_thread:
        info["exception"] = exc
    else:
        try:
            data = pickle.dumps(exc)
            pickle.loads(data)  # some exceptions pickle but cannot be rebuilt; find out here
            info["exception"] = data
        except Exception:
            info["exception"] = None
    return ("err", info)


def _start_batch(spec: PoolSpec | None, loader_id: int, seed: int, is_thread: bool) -> _registry.Registration:
    """Find the loader, seed this batch's generators and publish its WorkerInfo."""
    registration = _find_registration(spec, loader_id)
    if registration is None:
        raise RuntimeError(f"gloader worker has no loader {loader_id} registered; it was closed or its "
                           "pool was started without it")
    if not is_thread:
        seed_global_rng(seed)  # thread workers share the caller's generators: they use info.rng
    identity = _registry.current_identity() or (0, 1)
    _registry.set_current_info(WorkerInfo(identity[0], identity[1], seed, registration.dataset,
                                          np.random.default_rng(seed)))
    return registration


def _registration_failure(registration: _registry.Registration, batch_index: int,
                          is_thread: bool) -> tuple[Any, ...]:
    """The error message for a task of a loader whose registration failed in this worker."""
    assert registration.error is not None, "internal error: no registration failure to report"
    return _error_message(registration.error, registration.error_traceback, registration.error_context,
                          batch_index, None, is_thread)


def _make_batch(registration: _registry.Registration, samples: list[Any], is_thread: bool,
                slot: str | None, slot_capacity: int) -> Any:
    """Batchify: thread workers return the batch itself, process workers a shared-memory handle."""
    batchify_fn: Any = registration.batchify_fn
    if is_thread:
        return _batch_in_thread(batchify_fn, samples)
    return pack_batch(plan_batch(batchify_fn, samples), slot, slot_capacity, registration.prefix, _CACHE)


def run_batch(loader_id: int, epoch: int, batch_index: int, seed: int, indices: bytes,
              slot: str | None, slot_capacity: int) -> Any:
    """Load one batch: fetch its samples, batchify them, hand the result over.

    Args:
        seed: the batch's seed (from the loader's seed, the epoch and the batch index).
        indices: the sample indices as int64 bytes (one flat object: cheap to send).
        slot, slot_capacity: the shared-memory slot the caller lent for this batch.

    Returns:
        ('ok', handle or batch, fetch seconds, batchify seconds) or ('err', info); bytes from
        process workers, the tuple itself from thread workers.
    """
    spec = _current_spec()
    is_thread = spec is None or spec.is_thread
    row = -1
    sample_index: int | None = None
    try:
        if spec is not None and not is_thread:
            _refresh_registry(spec)
            row = _STATUS_ROW[0]
            spec.status[row + 1:row + STATUS_FIELDS] = [loader_id, epoch, batch_index]
        registration = _start_batch(spec, loader_id, seed, is_thread)
        if registration.error is not None:
            failure = _registration_failure(registration, batch_index, is_thread)
            return failure if is_thread else dumps_handle(failure)
        started = time.perf_counter()
        order = np.frombuffer(indices, dtype=np.int64)
        samples: list[Any] = []
        append, load = samples.append, registration.dataset.__getitem__
        for sample_index in order.tolist():
            append(load(sample_index))
        sample_index = None
        fetched = time.perf_counter()
        result = _make_batch(registration, samples, is_thread, slot, slot_capacity)
        message: tuple[Any, ...] = ("ok", result, fetched - started, time.perf_counter() - fetched)
    except BaseException as exc:
        message = _error_message(exc, traceback.format_exc(), "", batch_index, sample_index, is_thread)
    finally:
        _registry.set_current_info(None)
        if row >= 0 and spec is not None:
            spec.status[row + 3] = -1
    if is_thread:
        return message
    try:
        return dumps_handle(message)
    except Exception as exc:  # a non-tensor part of the batch cannot be pickled, even by dill
        if message[0] == "ok" and message[1][2]:
            discard_created_segment(message[1][0])
        text = traceback.format_exc()
        return dumps_handle(_error_message(exc, text, "the batch could not be pickled for the caller",
                                           batch_index, None, False))


def _next_stream_samples(loader_id: int, epoch: int, registration: _registry.Registration,
                         batch_size: int) -> list[Any] | None:
    """The next samples of this worker's shard for `epoch`; None once the shard is exhausted."""
    worker_id = (_registry.current_identity() or (0, 1))[0]
    key = (loader_id, worker_id)
    with _STREAMS_LOCK:
        state = _STREAMS.get(key)
    if state is None or state[0] != epoch:
        state = (epoch, iter(registration.dataset))  # the dataset finds its shard in get_worker_info()
    stream = state[1]
    if stream is None:
        return None
    samples: list[Any] = []
    try:
        samples.extend(itertools.islice(stream, batch_size))
    except BaseException:
        with _STREAMS_LOCK:
            _STREAMS[key] = (epoch, None)  # a generator that raised is finished
        raise
    with _STREAMS_LOCK:
        _STREAMS[key] = (epoch, stream if len(samples) == batch_size else None)
    return samples or None


def run_stream_batch(loader_id: int, epoch: int, batch_index: int, seed: int, batch_size: int,
                     keep_last: bool, slot: str | None, slot_capacity: int) -> Any:
    """Load the next batch of this worker's shard of an IterableDataset.

    Any worker may take any stream task: it answers from its own shard, so tasks need no
    routing. Returns ('ok', ...) like `run_batch`, ('end', worker id) once the shard is
    exhausted, or ('err', info).
    """
    spec = _current_spec()
    is_thread = spec is None or spec.is_thread
    message: tuple[Any, ...]
    try:
        registration = _start_batch(spec, loader_id, seed, is_thread)
        if registration.error is not None:
            message = _registration_failure(registration, batch_index, is_thread)
            return message if is_thread else dumps_handle(message)
        started = time.perf_counter()
        samples = _next_stream_samples(loader_id, epoch, registration, batch_size)
        if samples is None or (len(samples) < batch_size and not keep_last):
            message = ("end", (_registry.current_identity() or (0, 1))[0])
        else:
            fetched = time.perf_counter()
            result = _make_batch(registration, samples, is_thread, slot, slot_capacity)
            message = ("ok", result, fetched - started, time.perf_counter() - fetched)
    except BaseException as exc:
        message = _error_message(exc, traceback.format_exc(), "", batch_index, None, is_thread)
    finally:
        _registry.set_current_info(None)
    return message if is_thread else dumps_handle(message)


def _batch_in_thread(batchify_fn: Any, samples: list[Any]) -> Any:
    """Thread workers share the caller's memory: no transport, numpy output becomes tensors."""
    from ._tree import arrays_to_tensors

    return arrays_to_tensors(batchify_fn(samples))
