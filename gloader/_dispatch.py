"""Dispatcher: keeps a window of batches in flight on the pool and collects them in order.

The whole flow, with who runs each step::

    caller's thread                          worker (process or thread)
    ---------------                          --------------------------
    batch sampler -> (epoch, i, indices)
    SlotPool.acquire() -> free slot
    pool.apply_async(run_batch, (loader id,  -> registry[loader id] -> dataset[j] for j in indices
        epoch, i, seed, indices bytes,          -> batchify plan -> write into the slot (shm)
        slot name))                          <- handle bytes: (slot, capacity, created, spec)
    ... up to `prefetch` tasks in flight, across the end of an epoch into the next ...
    wait for the oldest task (in short slices: check worker exit codes, the timeout)
    SlotPool.rebuild(handle) -> tensors viewing the slot (zero copy)
    [pin memory, in the caller's pin thread] -> [copy to device on a side stream]   (_device)
    -> the user's iterator (_epoch), which counts what it hands over (state_dict, stats);
    the slot is free again when the batch's last tensor is freed

Thread workers skip the slots: they share the caller's memory and return the batch itself.
`_pool` owns the workers and their supervision, `_transport` the slots, `_worker` the task,
`_registry` the per-loader state inside workers, `_runtime` a loader's running parts and their
release, `loader` the epochs and the public API.
"""
from __future__ import annotations

import collections
import dataclasses
import importlib
import logging
import pickle
import time
from typing import Any, Iterator, NoReturn

import numpy as np

from ._pool import PoolCore, WorkerExitedError
from ._transport import SlotPool, loads_handle
from ._worker import run_batch, run_stream_batch

__all__ = ["BatchTimeoutError", "Dispatcher", "EpochRun", "ShardDone", "Task", "raise_worker_error"]

logger = logging.getLogger(__name__)

# How long one wait lasts before worker exit codes and the deadline are checked again.
# Longer: fewer wake-ups; shorter: a dead worker is reported sooner.
_POLL_S = 0.05


class ShardDone:
    """What `collect` returns for a stream task whose worker's shard is exhausted."""

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id


class BatchTimeoutError(TimeoutError):
    """A batch took longer than the loader's `timeout`."""


class _WorkerTraceback(Exception):
    """The traceback of an exception raised in a worker; set as the `__cause__` of the re-raise."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n\n" + self.text


@dataclasses.dataclass(eq=False)
class Task:
    """One batch dispatched to the pool and not yet collected."""

    epoch: int
    index: int
    indices: list[int]
    slot: str | None
    result: Any


@dataclasses.dataclass
class EpochRun:
    """One epoch's batches: where the sampler stands and which batches are in flight."""

    number: int
    length: int
    sampler_state: Any
    batches: Iterator[tuple[int, list[int]]]
    skipped: int = 0
    yielded: int = 0
    exhausted: bool = False  # every batch of the epoch was dispatched (or loaded in-process)
    finished: bool = False  # the caller's iterator reached the epoch's end
    pending: collections.deque[Task] = dataclasses.field(default_factory=collections.deque)
    stream: tuple[int, bool] | None = None  # (batch size, keep last) for an IterableDataset
    shards_done: set[int] = dataclasses.field(default_factory=set)


def _rebuild_exception(info: dict[str, Any]) -> BaseException:
    exc = info["exception"]
    if isinstance(exc, bytes):
        try:
            exc = pickle.loads(exc)
        except Exception:
            exc = None
    if isinstance(exc, BaseException):
        return exc
    module, _, qualname = info["type"].rpartition(".")
    try:
        cls: Any = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        return cls(info["message"])  # type: ignore[no-any-return]
    except Exception:
        return RuntimeError(f"{info['type']}: {info['message']}")


def raise_worker_error(info: dict[str, Any], epoch: int) -> NoReturn:
    """Re-raise a worker's exception as its own type, with its traceback and where it happened."""
    exc = _rebuild_exception(info)
    where = f"worker {info['worker_id']} (pid {info['pid']})"
    if info["context"]:
        note = f"gloader: {info['context']} in {where}; reported for batch {info['batch_index']} of epoch {epoch}"
    else:
        note = f"gloader: raised in {where} while loading batch {info['batch_index']} of epoch {epoch}"
        if info["sample_index"] is not None:
            note += f", at sample index {info['sample_index']}"
    exc.add_note(note)
    raise exc from _WorkerTraceback(info["traceback"])


class Dispatcher:
    """Submits batches of epoch runs to a pool and collects them in order.

    Args:
        core: the running pool.
        loader_id: the loader's id in the workers' registry.
        slots: the loader's shared-memory slots (None for thread workers).
        prefetch: most batches in flight at once.
        timeout_s: most seconds to wait for one batch.
    """

    def __init__(self, core: PoolCore, loader_id: int, slots: SlotPool | None, prefetch: int,
                 timeout_s: float) -> None:
        self.core = core
        self._loader_id = loader_id
        self._slots = slots
        self._prefetch = prefetch
        self._timeout_s = timeout_s
        self._in_flight = 0
        self._discarded: list[Task] = []
        self._outstanding: set[Task] = set()  # submitted and not yet collected or reaped
        # Timings of the last collected batch: worker fetch, worker batchify, hand-over.
        self.last_timings = (0.0, 0.0, 0.0)

    @property
    def has_room(self) -> bool:
        return self._in_flight < self._prefetch

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit_next(self, run: EpochRun, seed_of: Any) -> None:
        """Dispatch `run`'s next batch, or mark the run exhausted."""
        try:
            index, indices = next(run.batches)
        except StopIteration:
            run.exhausted = True
            return
        slot, capacity = self._slots.acquire() if self._slots is not None else (None, 0)
        seed = seed_of(run.number, index)
        if run.stream is not None:
            args: tuple[Any, ...] = (self._loader_id, run.number, index, seed, *run.stream, slot, capacity)
            result = self.core.submit(run_stream_batch, args)
        else:
            order = np.asarray(indices, dtype=np.int64).tobytes()
            result = self.core.submit(run_batch, (self._loader_id, run.number, index, seed, order, slot, capacity))
        task = Task(run.number, index, indices, slot, result)
        run.pending.append(task)
        self._outstanding.add(task)
        self._in_flight += 1

    def collect(self, task: Task) -> Any:
        """Wait for `task` and return its batch; re-raise its error; never wait unbounded."""
        self._reap_discarded()
        started = time.perf_counter()
        deadline = time.monotonic() + self._timeout_s
        result = task.result
        try:
            while not result.ready():
                result.wait(_POLL_S)
                if not result.ready():
                    self._check(task, started, deadline)
        except BaseException:
            self._discarded.append(task)  # interrupted (Ctrl-C, timeout, dead worker): not ours any more
            self._in_flight -= 1
            raise
        self._in_flight -= 1
        self._outstanding.discard(task)
        ready = time.perf_counter()
        message = self._decode(result.get(0))
        if message[0] != "ok":
            if self._slots is not None:
                self._slots.settle(task.slot, None)
            if message[0] == "end":
                return ShardDone(message[1])
            raise_worker_error(message[1], task.epoch)
        _, payload, fetch_s, batchify_s = message
        if self._slots is None:
            batch = payload
        else:
            self._slots.settle(task.slot, payload)
            if payload[0] is not None:
                self._slots.warn_if_shm_small(payload[1], self._prefetch + 2)  # checks once per loader
            batch = self._slots.rebuild(payload)
        self.last_timings = (fetch_s, batchify_s, time.perf_counter() - ready)
        return batch

    def _check(self, task: Task, started: float, deadline: float) -> None:
        dead = self.core.find_dead_worker()
        if dead is not None:
            raise WorkerExitedError(f"{dead}. The loader was waiting for batch {task.index} of epoch "
                                    f"{task.epoch}; its pool is shut down and the next epoch starts a new one.")
        if time.monotonic() > deadline:
            elapsed = time.perf_counter() - started
            shown = f"{task.indices[:8]}{'...' if len(task.indices) > 8 else ''}"
            raise BatchTimeoutError(f"batch {task.index} of epoch {task.epoch} (sample indices {shown}) took "
                                    f"more than {elapsed:.1f} s, the loader's timeout={self._timeout_s:g}; raise "
                                    "timeout= if batches are legitimately slow, or look for a hang in the dataset")

    def drain(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) for every task still out, and free what they return."""
        deadline = time.monotonic() + timeout_s
        self._discarded = list(self._outstanding)
        for task in self._discarded:
            task.result.wait(max(0.0, deadline - time.monotonic()))
        self._reap_discarded()

    def _decode(self, raw: Any) -> Any:
        return loads_handle(raw) if isinstance(raw, bytes) else raw

    def discard(self, run: EpochRun) -> None:
        """Drop `run`'s batches in flight; their slots come back as they finish.

        They leave the window at once, so the next epoch is dispatched without waiting for them.
        """
        self._in_flight -= len(run.pending)
        self._discarded.extend(run.pending)
        run.pending.clear()
        self._reap_discarded()

    def _reap_discarded(self) -> None:
        keep = []
        for task in self._discarded:
            if not task.result.ready():
                keep.append(task)
                continue
            self._outstanding.discard(task)
            try:
                message = self._decode(task.result.get(0))
            except Exception:
                message = ("err", None)
            if self._slots is None:
                continue
            if message[0] == "ok" and isinstance(message[1], tuple):
                self._slots.settle(task.slot, message[1])
                if message[1][0] is not None:
                    self._slots.release(message[1][0])
            else:
                self._slots.settle(task.slot, None)
        self._discarded = keep
