"""DataLoader: Gluon's DataLoader API on a persistent, supervised worker pool.

This module owns epochs (which batches, in which order, resumable) and the public API; the
data flow below it is drawn in `_dispatch`.
"""
from __future__ import annotations

import itertools
import time
import weakref
from typing import Any, Callable, Iterator

import numpy as np

from . import _pool
from ._device import DevicePipeline, PinThread, warn_if_cannot_pin
from ._dispatch import BatchTimeoutError, Dispatcher, EpochRun, ShardDone
from ._options import Options, check_last_batch, check_positive_int, validate_options
from ._payload import build_payload
from ._pool import WorkerExitedError, WorkerPool
from ._runtime import Resources, Runtime, start_runtime
from ._epoch import BatchIterator, StreamBatches
from ._stats import PipelineStats
from ._seed import derive_batch_seed, draw_base_seed, preserved_global_rng, seed_global_rng
from ._tree import arrays_to_tensors
from .batchify import default_batchify_fn
from .dataset import IterableDataset
from .sampler import BatchSampler, RandomSampler, SequentialSampler, dataset_length

__all__ = ["DataLoader"]

_LOADER_IDS = itertools.count(1)
_STATE_KEYS = ("epoch", "batches_yielded", "sampler", "seed")
class DataLoader:
    """Loads batches from a dataset, in-process or on a persistent pool of workers.

    Args:
        dataset: any object with `__getitem__` and `__len__` (list, numpy array, tensor,
            `torch.utils.data.Dataset`, `gloader.Dataset`).
        batch_size: samples per batch, >= 1; required unless `batch_sampler` is given.
        shuffle: draw a new permutation every epoch (excludes `sampler`).
        sampler: yields sample indices (excludes `shuffle`).
        last_batch: 'keep', 'discard' or 'rollover' (carry the remainder into the next epoch);
            None means 'keep'.
        batch_sampler: yields lists of indices (excludes batch_size, shuffle, sampler, last_batch).
        batchify_fn: turns a list of samples into a batch; default: `default_batchify_fn`.
        num_workers: worker processes (or threads); 0 loads in the calling thread.
        pin_memory: pin batches in page-locked memory (for faster copies to CUDA).
        pin_device_id: the CUDA device that pinned memory is meant for.
        prefetch: most batches in flight; default 2 * num_workers.
        thread_pool: run the workers as threads of this process.
        timeout: most seconds to wait for one batch before raising a TimeoutError.
        device: a CUDA device to move batches to (copied one batch ahead on a side stream).
        worker_init_fn: called as `worker_init_fn(worker_id)` once in each worker.
        seed: makes shuffling and per-batch random draws reproducible for any num_workers.
        start_method: 'fork', 'spawn', 'forkserver' or None (the platform default).
        pool: a `gloader.WorkerPool` to run on instead of starting one.
        progress: show a progress bar on stderr (batches/s and the share of time spent
            waiting for input) for every epoch.

    Raises:
        TypeError, ValueError: for a bad argument or combination, naming the value.
    """

    def __init__(self, dataset: Any, batch_size: int | None = None, shuffle: bool = False, sampler: Any = None,
                 last_batch: str | None = None, batch_sampler: Any = None,
                 batchify_fn: Callable[[list[Any]], Any] | None = None, num_workers: int = 0,
                 pin_memory: bool = False, pin_device_id: int = 0, prefetch: int | None = None,
                 thread_pool: bool = False, timeout: float = 120, *, device: Any = None,
                 worker_init_fn: Callable[[int], None] | None = None, seed: int | None = None,
                 start_method: str | None = None, pool: WorkerPool | None = None, progress: bool = False) -> None:
        self._resources = Resources()
        self._finalizer = weakref.finalize(self, self._resources.close_from_gc)
        self._closed = False
        if pool is not None:
            num_workers, thread_pool, start_method = self._take_pool_settings(pool, num_workers, thread_pool,
                                                                                start_method)
        self._options: Options = validate_options(
            num_workers=num_workers, prefetch=prefetch, thread_pool=thread_pool, timeout=timeout,
            pin_memory=pin_memory, pin_device_id=pin_device_id, device=device, start_method=start_method,
            worker_init_fn=worker_init_fn, seed=seed, progress=progress)
        if batchify_fn is not None and not callable(batchify_fn):
            raise TypeError(f"batchify_fn must be callable or None, got {batchify_fn!r}")
        if not hasattr(dataset, "__getitem__") and not isinstance(dataset, IterableDataset):
            raise TypeError(f"dataset must support __getitem__ and __len__ (or be a gloader.IterableDataset), "
                            f"got {type(dataset).__name__}")
        self._dataset = dataset
        self._is_stream = isinstance(dataset, IterableDataset)
        self._batch_sampler = self._build_batch_sampler(dataset, batch_size, shuffle, sampler, last_batch,
                                                        batch_sampler, seed)
        self._batchify_fn = batchify_fn or default_batchify_fn
        # Dispatch the next epoch's first batches before the caller asks for them only when
        # this loader built the sampler: a user's sampler may be changed between epochs
        # (DistributedSampler.set_epoch), which batches drawn early would not see. Streams
        # have no sampler to look ahead with.
        self._lookahead = sampler is None and batch_sampler is None and not self._is_stream
        self._pool = pool
        self._id = next(_LOADER_IDS)
        self._base_seed = seed if seed is not None else draw_base_seed()
        self._next_epoch = 0
        self._resume_skip = 0
        # _current: the run being dispatched (its batches may all be fetched, by the pin thread
        # or the device stage, before the caller has them); _served: the run the caller's
        # latest iterator hands out, which is what state_dict and len describe.
        self._current: EpochRun | None = None
        self._served: EpochRun | None = None
        self._upcoming: EpochRun | None = None
        self._device = DevicePipeline(self._options.device) if self._options.device is not None else None
        self._pinner: PinThread | None = None
        self._stats = PipelineStats()
        if self._options.pin_memory:
            warn_if_cannot_pin()
        _pool.track(self._resources)

    @staticmethod
    def _take_pool_settings(pool: WorkerPool, num_workers: int, thread_pool: bool,
                            start_method: str | None) -> tuple[int, bool, str | None]:
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

    @staticmethod
    def _build_batch_sampler(dataset: Any, batch_size: Any, shuffle: Any, sampler: Any, last_batch: Any,
                             batch_sampler: Any, seed: int | None) -> Any:
        if batch_sampler is not None:
            given = {"batch_size": batch_size, "shuffle": shuffle or None, "sampler": sampler,
                     "last_batch": last_batch}
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
        if isinstance(dataset, IterableDataset):
            if shuffle or sampler is not None:
                raise ValueError("an IterableDataset has no indices: shuffle and sampler are not allowed")
            check_positive_int("batch_size", batch_size)
            if mode == "rollover":
                raise ValueError("last_batch='rollover' needs a map-style dataset; use 'keep' or 'discard'")
            return StreamBatches(dataset, batch_size, mode)
        if sampler is None:
            length = dataset_length(dataset)
            sampler = RandomSampler(length, seed) if shuffle else SequentialSampler(length)
        elif shuffle:
            raise ValueError(f"shuffle=True excludes sampler={sampler!r}; shuffle inside the sampler instead")
        return BatchSampler(sampler, batch_size, mode)

    # ---- epochs -------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise RuntimeError("this DataLoader is closed; create a new one")
        if self._current is not None:
            self._abandon(self._current)
        self._stop_pinner()
        run, self._upcoming = self._upcoming or self._new_run(), None
        self._current = self._served = run
        iterator = BatchIterator(self, run)
        if self._options.pin_memory:
            self._pinner = PinThread(iterator, self._options.pin_device_id, self._options.timeout_s)
        return iterator

    def __len__(self) -> int:
        if self._is_stream:
            raise TypeError("a DataLoader over an IterableDataset has no length: the stream decides when it ends")
        run = self._served if self._served is not None and not self._served.finished else self._upcoming
        if run is not None:
            return run.length - run.skipped
        return len(self._batch_sampler) - self._resume_skip

    def _new_run(self) -> EpochRun:
        state = self._batch_sampler.state_dict() if hasattr(self._batch_sampler, "state_dict") else None
        length = len(self._batch_sampler) if hasattr(self._batch_sampler, "__len__") else -1
        skip, self._resume_skip = self._resume_skip, 0
        stream = None
        if self._is_stream and self._options.num_workers > 0:
            # Workers form the batches from their own shards; the run just numbers the tasks.
            batches: Iterator[tuple[int, list[Any]]] = ((i, []) for i in itertools.count())
            stream = (self._batch_sampler.batch_size, self._batch_sampler.keep_last)
        else:
            batches = enumerate(iter(self._batch_sampler))
            for _ in range(skip):
                next(batches, None)
        run = EpochRun(self._next_epoch, length, state, batches, skipped=skip, yielded=skip, stream=stream)
        self._next_epoch += 1
        return run

    def _stop_pinner(self) -> None:
        pinner, self._pinner = self._pinner, None
        if pinner is not None:
            pinner.stop()

    def _abandon(self, run: EpochRun) -> None:
        self._stop_pinner()
        if self._resources.runtime is not None:
            self._resources.runtime.dispatcher.discard(run)
        if run is self._current:
            self._current = None

    def _batch_seed(self, epoch: int, index: int) -> int:
        return derive_batch_seed(self._base_seed, epoch, index)

    def _next_host_batch(self, run: EpochRun) -> Any:
        if run is not self._current:
            raise StopIteration  # a newer iteration (or load_state_dict) replaced this one
        if self._options.num_workers == 0:
            return self._next_inline(run)
        runtime = self._ensure_runtime()
        while True:
            self._fill(runtime.dispatcher)
            if not run.pending:
                self._current = None
                raise StopIteration
            task = run.pending.popleft()
            try:
                batch = runtime.dispatcher.collect(task)
            except (WorkerExitedError, BatchTimeoutError):
                self._stop_runtime()
                raise
            if not isinstance(batch, ShardDone):
                self._stats.record_work(run.number, *runtime.dispatcher.last_timings)
                self._fill(runtime.dispatcher)
                return batch
            run.shards_done.add(batch.worker_id)  # a stream worker's shard is exhausted
            if len(run.shards_done) >= runtime.core.num_workers:
                run.exhausted = True

    def _fill(self, dispatcher: Dispatcher) -> None:
        """Top the window up: the current epoch first, then the start of the next one."""
        while dispatcher.has_room and self._current is not None:
            run = self._current
            if run.exhausted:
                if self._upcoming is None:
                    if not self._lookahead:
                        return
                    self._upcoming = self._new_run()
                run = self._upcoming
                if run.exhausted:
                    return
            dispatcher.submit_next(run, self._batch_seed)

    def _next_inline(self, run: EpochRun) -> Any:
        try:
            index, indices = next(run.batches)
        except StopIteration:
            run.exhausted = True
            self._current = None
            raise
        if self._options.seed is None:
            return self._load_inline(run.number, index, indices)
        with preserved_global_rng():
            seed_global_rng(self._batch_seed(run.number, index))
            return self._load_inline(run.number, index, indices)

    def _load_inline(self, epoch: int, index: int, indices: Any) -> Any:
        started = time.perf_counter()
        if self._is_stream:  # the "indices" are the samples themselves
            batch = arrays_to_tensors(self._batchify_fn(indices))
            self._stats.record_work(epoch, 0.0, time.perf_counter() - started, 0.0)
            return batch
        position = None
        try:
            samples = []
            for position in indices:
                samples.append(self._dataset[position])
            position = None
            fetched = time.perf_counter()
            batch = arrays_to_tensors(self._batchify_fn(samples))
            done = time.perf_counter()
            self._stats.record_work(epoch, fetched - started, done - fetched, 0.0)
            return batch
        except Exception as exc:
            note = f"gloader: raised in the main process while loading batch {index} of epoch {epoch}"
            exc.add_note(note + (f", at sample index {position}" if position is not None else ""))
            raise

    # ---- workers ------------------------------------------------------------------------

    def _ensure_runtime(self) -> Runtime:
        if self._resources.runtime is None:
            self._resources.runtime = start_runtime(self._options, self._id, self._pool, self._payload)
        return self._resources.runtime

    def _payload(self, prefix: str, pickled: bool) -> Any:
        return build_payload(self._dataset, self._batchify_fn, self._options.worker_init_fn, self._base_seed,
                             prefix, pickled)

    def _stop_runtime(self) -> None:
        """After a dead worker or a timeout: shut the pool down; the next epoch starts a new one."""
        self._current = None
        self._upcoming = None
        self._resources.close()

    # ---- state and lifetime -------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Return where the loader stands: enough for another loader to continue exactly.

        Returns:
            A plain picklable dict: the epoch, the batches of it already yielded, the batch
            sampler's state at the epoch's start, and the base seed.

        Raises:
            TypeError: for an IterableDataset, which has no positions to resume from.
        """
        if self._is_stream:
            raise TypeError("state_dict needs a map-style dataset; an IterableDataset stream has no "
                            "positions to resume from")
        run = self._served
        if run is None or run.finished or 0 <= run.length <= run.yielded:
            if run is not None:
                self._stop_pinner()  # the caller has every batch; the thread could only fetch the end
                if not run.exhausted:
                    for _ in run.batches:  # move the sampler past the end, as finishing the epoch would
                        pass
                    run.exhausted = True
            run = self._upcoming
        if run is not None:
            return {"epoch": run.number, "batches_yielded": run.yielded, "sampler": run.sampler_state,
                    "seed": self._base_seed}
        state = self._batch_sampler.state_dict() if hasattr(self._batch_sampler, "state_dict") else None
        return {"epoch": self._next_epoch, "batches_yielded": self._resume_skip, "sampler": state,
                "seed": self._base_seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (made by `state_dict`): the next iteration yields exactly the
        batches that were not yet yielded, in the same order, then the following epochs.

        Raises:
            ValueError: when `state` lacks a key that `state_dict` writes.
        """
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"state is missing {missing}; pass a dict made by DataLoader.state_dict()")
        for run in (self._current, self._upcoming):
            if run is not None:
                self._abandon(run)
        self._current = self._served = self._upcoming = None
        if state["sampler"] is not None and hasattr(self._batch_sampler, "load_state_dict"):
            self._batch_sampler.load_state_dict(state["sampler"])
        self._next_epoch = int(state["epoch"])
        self._resume_skip = int(state["batches_yielded"])
        self._base_seed = int(state["seed"])

    def close(self) -> None:
        """Stop the workers (or leave the shared pool) and release shared memory; idempotent.

        Batches already yielded stay valid.
        """
        self._closed = True
        self._stop_pinner()
        for run in (self._current, self._upcoming):
            if run is not None:
                self._abandon(run)
        self._current = self._served = self._upcoming = None
        self._finalizer.detach()
        self._resources.close()

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        """Return where loading time goes, per epoch and overall.

        Returns:
            {"epochs": {epoch: timings}, "total": timings, "in_flight": batches dispatched and
            not yet handed over, "shared_memory_bytes": mapped by this loader}. Timings (in
            seconds) are: `batches`, `wall_s` (first batch requested to last handed over),
            `waited_s` (time the caller spent waiting for batches), `wait_fraction` (near 1:
            training is input-bound; near 0: loading keeps up), `worker_fetch_s` (getting
            samples, transforms included) and `worker_batchify_s` (summed over workers),
            `handover_s` (turning a finished batch into tensors here) and `batches_per_s`.
        """
        runtime = self._resources.runtime
        in_flight = runtime.dispatcher.in_flight if runtime is not None else 0
        shm = runtime.slots.in_use_bytes() if runtime is not None and runtime.slots is not None else 0
        return self._stats.snapshot(in_flight, shm)

    def worker_pids(self) -> list[int]:
        """Pids of the worker processes now running for this loader (empty before the first batch)."""
        runtime = self._resources.runtime
        return runtime.core.worker_pids() if runtime is not None else []

    def __repr__(self) -> str:
        opts = self._options
        kind = "in-process" if opts.num_workers == 0 else (
            f"{opts.num_workers} {'threads' if opts.thread_pool else 'processes'}")
        return f"DataLoader(id={self._id}, {kind}, prefetch={opts.prefetch}, {'closed' if self._closed else 'open'})"
