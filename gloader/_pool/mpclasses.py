"""The classes of gloader's `multiprocess.Pool` (see `_pool.mp`, which holds what is done
with them and every private name of multiprocess's they rely on): its queues, safe for a pool
that outlives a killed worker, and the pool itself, without three per-batch costs and with a
list of workers that wakes waiting callers when one exits. Imported only when a process pool
starts (`_pool.core`, after `_pool.mp.check_multiprocess`): importing gloader does not import
multiprocess's pool or queues.
"""
from __future__ import annotations

import collections
import fcntl
import os
import pickle
import socket
import threading
import time
from typing import Any, Callable

from multiprocess import context
from multiprocess import pool as mp_pool
from multiprocess.queues import SimpleQueue, _ForkingPickler

from . import mp as _mppool
from .directory import ProcessLock
from .mp import (
    DEFAULT_PIPE_BYTES,
    EXIT_RESULTS_CLOSED,
    EXIT_TASKS_CLOSED,
    PARTIAL,
    RESULT_PIPE_BYTES,
    WorkerTarget,
    failed_result,
    frame,
)

__all__ = ["FastPool", "TrackedQueue"]


class TrackedQueue(SimpleQueue):  # type: ignore[misc]
    """The pool's task and result queues, safe for a pool that outlives a killed worker.

    An idle worker waits for its next task holding the task queue's read lock, and a worker
    sends each result holding the result queue's write lock. Killed there (the out-of-memory
    killer picks idle workers too), it must neither keep the lock nor leave a half-read
    message: a pool that outlives the death (a shared WorkerPool) would stall. So the locks
    are `ProcessLock`s, which the kernel releases, and the task queue (`atomic_reads`) is a
    socket pair from which a worker takes each task whole with one read (`_pool.mp._take_message`):
    from a pipe it took two (the size, then the bytes), and a worker killed between them left
    the next reader to take a task's bytes for a size, which stalled the pool or ended that
    worker with code 0 (measured: 1 in ~60 random kills).
    """

    def __init__(self, *, ctx: Any, lock_dir: str, name: str, atomic_reads: bool = False) -> None:
        # Not SimpleQueue's own __init__: its two locks are semaphores, which under spawn and
        # forkserver are named files in /dev/shm until the pool closes. A process group killed
        # at once (`kill -9 -PGID`) left them there for good (its resource tracker dies with
        # it); ProcessLocks are files of the pool's directory, which the next pool sweeps.
        # Workers read tasks and write results; the caller's threads do the rest without
        # these locks (the pool's quick_put and quick_get), so the other two are never taken.
        # atomic_reads: the same framing over a socket pair, which a reader can peek into.
        self._reader, self._writer = ctx.Pipe(duplex=atomic_reads)
        self._poll = self._reader.poll
        self._rlock = ProcessLock(os.path.join(lock_dir, f"{name}.read.lock"))
        self._wlock = ProcessLock(os.path.join(lock_dir, f"{name}.write.lock"))
        if not atomic_reads:
            try:
                fcntl.fcntl(self._writer.fileno(), fcntl.F_SETPIPE_SZ, RESULT_PIPE_BYTES)
            except (OSError, AttributeError):  # above the system's limit, or not Linux
                pass
        try:
            self._pipe_bytes = fcntl.fcntl(self._writer.fileno(), fcntl.F_GETPIPE_SZ)
        except (OSError, AttributeError):
            self._pipe_bytes = DEFAULT_PIPE_BYTES
        self._spill_dir = lock_dir
        self.atomic_reads = atomic_reads
        self._socket: socket.socket | None = None
        self._creator: int | None = os.getpid()  # the caller; a worker that inherits the queue differs

    def __reduce__(self) -> Any:  # for spawned workers: rebuilt by a module-level function
        context.assert_spawning(self)
        return (_rebuild_queue, ((self._reader, self._writer, self._rlock, self._wlock, self._pipe_bytes,
                                  self._spill_dir), self.atomic_reads))

    def release(self) -> None:
        """Close this process's ends and locks now (the pool is stopped), rather than when
        the pool's reference cycles are collected: a pool restarted after each dead worker
        otherwise kept ~12 descriptors apiece until the cyclic garbage collector ran."""
        for end in (self._reader, self._writer):
            end.close()
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        self._rlock.close()
        self._wlock.close()

    def _reading_socket(self) -> socket.socket:
        if self._socket is None:  # a duplicate of the reader's descriptor, made once per process
            self._socket = socket.fromfd(self._reader.fileno(), socket.AF_UNIX, socket.SOCK_STREAM)
        return self._socket

    def get(self) -> Any:
        taken: list[Any] = []
        on_taken = _mppool._task_taken  # the worker's hooks (see _mppool.on_task_taken)

        def claim(message: memoryview) -> None:
            taken.append(_ForkingPickler.loads(message))
            if on_taken is not None:
                on_taken(taken[0])

        if _mppool._task_wanted is not None:
            _mppool._task_wanted()
        with self._rlock:
            try:
                if self.atomic_reads:
                    data = _mppool._take_message(self._reading_socket(), claim if on_taken is not None else None)
                    if on_taken is not None and not taken:  # read in pieces: claimed once read
                        claim(memoryview(data))
                else:
                    data = self._reader.recv_bytes()
            except (EOFError, OSError):
                if os.getpid() == self._creator:
                    raise
                os._exit(EXIT_TASKS_CLOSED)  # the pool's loop would end the worker with 0
        task = taken[0] if taken else _ForkingPickler.loads(data)
        _mppool._job = task[0] if type(task) is tuple and len(task) == 5 else None  # (job, i, func, args, kwargs)
        return task

    def put(self, obj: Any, finished: bool = True) -> None:
        """Send a result; `finished`: the task's final one (a partial one, see
        send_partial, leaves the task the worker's)."""
        try:  # a result (ids and bytes): the stdlib pickler takes 0.3 us, dill's 10
            data: Any = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            data = _ForkingPickler.dumps(obj)
        try:
            message = frame(data)
            if len(message) > self._pipe_bytes:  # it could not go in whole: a file takes it
                try:
                    message = frame(_mppool.spill(data, self._spill_dir))  # (patched by a test)
                except OSError as exc:  # a full disk fails the task, named, not the worker
                    message = frame(pickle.dumps(failed_result(obj, exc, len(data), self._spill_dir),
                                                  protocol=pickle.HIGHEST_PROTOCOL))
            with self._wlock:
                _mppool._write_whole(self._writer.fileno(), message)
        except (BrokenPipeError, ConnectionResetError):
            if os.getpid() == self._creator:
                raise
            # A worker whose caller is gone (killed): nobody will read this result,
            # and the pool's worker loop would print a traceback for each one.
            os._exit(EXIT_RESULTS_CLOSED)
        if finished and _mppool._result_sent is not None and os.getpid() != self._creator:
            _mppool._result_sent()


def _rebuild_queue(state: Any, atomic_reads: bool) -> Any:
    queue = TrackedQueue.__new__(TrackedQueue)
    (queue._reader, queue._writer, queue._rlock, queue._wlock, queue._pipe_bytes, queue._spill_dir) = state
    queue._poll = queue._reader.poll
    queue.atomic_reads, queue._socket, queue._creator = atomic_reads, None, None
    return queue


class _QuietCache(dict):  # type: ignore[type-arg]
    """`multiprocess.pool._PoolCache` that notifies on becoming empty only when closing."""

    closing = False
    notifier: Any

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)
        if self.closing and not self:
            self.notifier.put(None)


class _CallerQueue(SimpleQueue):  # type: ignore[misc]
    """The pool's change notifier, with thread locks: only the caller's threads use it."""

    def __init__(self, ctx: Any) -> None:
        self._reader, self._writer = ctx.Pipe(duplex=False)
        self._poll = self._reader.poll
        self._rlock = threading.Lock()
        self._wlock = threading.Lock()


class _TaskResult(mp_pool.ApplyResult):  # type: ignore[misc]
    """An AsyncResult whose task may send parts of its result before the end: `chunks`
    holds (arrival time, data) of each, in order, and is complete once `ready()`;
    `wakeup` is set as each part, notice and the final value arrive, and when a worker
    of the pool exits (the caller clears it; a loader's results may share one)."""

    def __init__(self, pool: Any, callback: Any, wakeup: threading.Event | None) -> None:
        super().__init__(pool, callback, None)
        self.chunks: list[tuple[float, Any]] = []
        self.wakeup = wakeup or threading.Event()

    def _set(self, i: int, obj: Any) -> None:
        if i == PARTIAL and obj[0]:
            if obj[1] is not None:
                self.chunks.append((time.monotonic(), obj[1]))
        else:  # the final value, or a part that failed (a full disk): the task ends with it
            super()._set(0, obj)
        self.wakeup.set()


class _WorkerList(list):  # type: ignore[type-arg]
    """The pool's list of workers. Its maintenance thread sleeps on the workers' sentinels
    and removes a worker here as soon as it has exited: then every result awaited is woken
    (`wakeup`), so a waiting caller sees a death at once rather than by polling."""

    cache: dict[Any, Any] | None = None  # the pool's results awaited, once it has them
    exited = 0  # workers removed after their exit so far: a caller looks for deaths once it grows

    def __delitem__(self, index: Any) -> None:
        super().__delitem__(index)
        self.exited += 1
        for result in list((self.cache or {}).values()):
            wakeup = getattr(result, "wakeup", None)
            if wakeup is not None:
                wakeup.set()


class FastPool(mp_pool.Pool):  # type: ignore[misc]
    """A `multiprocess.Pool` without three per-batch costs that gloader does not need.

    Measured on W1 (batch 256 of tiny samples), its maintenance thread used 0.4 ms of CPU per
    batch and its task thread 0.13 ms, more than a worker spends building the batch:
    1. The maintenance thread also wakes whenever a result is waiting in the result queue
       (to replace workers under `maxtasksperchild`, unused here) and spins until the result
       thread has read it. It now wakes only for its notifier and for worker exits.
    2. It is also woken (by a pickled message on a pipe) every time the result cache
       empties, which with a small window is nearly every batch; that matters only once the
       pool is closing, so the cache stays quiet until `close()` sets `closing`.
    3. Tasks are pickled with dill (~29 us per task tuple here) though gloader's are plain;
       the stdlib pickler takes ~1 us, and workers' dill reads stdlib pickles. Anything the
       stdlib pickler refuses still goes through dill.
    gloader supervises its workers itself (`PoolCore.find_dead_worker`), woken by their exits
    (`_WorkerList`). Its `submit_task` is `apply_async` with a result that may come in parts
    (see `_pool.mp.send_partial`).
    """

    @property
    def _change_notifier(self) -> Any:
        return self._notifier

    @_change_notifier.setter
    def _change_notifier(self, made: Any) -> None:
        # multiprocess makes it with the context's SimpleQueue, whose two semaphores are named
        # files in /dev/shm under spawn and forkserver for the pool's life, left behind for
        # good when the process group is killed at once. Replaced as it is set, before the
        # pool's threads take it; its semaphores go with it (their finalizer removes the names).
        made.close()
        self._notifier = _CallerQueue(self._ctx)

    def __init__(self, processes: int, *args: Any, lock_dir: str, **kwargs: Any) -> None:
        self._lock_dir = lock_dir  # where the queues' lock files live; _setup_queues runs inside __init__
        # Every worker process started, replacements included, until the supervisor takes it.
        self.started: collections.deque[Any] = collections.deque()
        super().__init__(WorkerTarget(processes), *args, **kwargs)
        self._cache.__class__ = _QuietCache
        self._pool.cache = self._cache

    def Process(self, ctx: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - multiprocess's name
        # multiprocess's own is a staticmethod, but it is only ever called as `self.Process`,
        # bound here: the pool starts every worker through it.
        if kwargs.get("target") is mp_pool.worker:
            kwargs["target"] = _mppool.pool_worker
        process = ctx.Process(*args, **kwargs)
        self.started.append(process)
        return process

    def _get_sentinels(self) -> list[Any]:
        return [self._change_notifier._reader]

    def submit_task(self, func: Callable[..., Any], args: tuple[Any, ...],
                    callback: Callable[[Any], None] | None = None,
                    wakeup: threading.Event | None = None) -> Any:
        """`apply_async(func, args, callback=callback)` with a `_TaskResult` that sets
        `wakeup` (its own Event if None) as it makes progress."""
        self._check_running()
        result = _TaskResult(self, callback, wakeup)
        self._taskqueue.put(([(result._job, 0, func, args, {})], None))
        return result

    def close(self) -> None:
        self._cache.closing = True
        super().close()  # wakes the maintenance thread, which sees whether tasks remain

    def _setup_queues(self) -> None:  # multiprocess's own, with queues that survive a killed worker
        self._pool = _WorkerList()  # still empty: multiprocess sets it just before, and starts workers after
        self._inqueue = TrackedQueue(ctx=self._ctx, lock_dir=self._lock_dir, name="tasks", atomic_reads=True)
        self._outqueue = TrackedQueue(ctx=self._ctx, lock_dir=self._lock_dir, name="results")
        self._quick_get = self._outqueue._reader.recv
        send_bytes = self._inqueue._writer.send_bytes
        dill_send = self._inqueue._writer.send

        def quick_put(obj: Any) -> None:
            try:
                data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:
                dill_send(obj)
                return
            send_bytes(data)

        self._quick_put = quick_put
