"""gloader's `multiprocess.Pool`: without three per-batch costs, and with queues that say
which worker holds their locks. Imports nothing of gloader's; `_pool` supervises it.
"""
from __future__ import annotations

import os
import pickle
from typing import Any

__all__ = ["free_locks_of", "make_pool_class"]


def _make_queue_class() -> Any:
    """The pool's task and result queues, saying which process holds their locks.

    An idle worker waits for its next task holding the task queue's read lock, and a worker
    sends each result holding the result queue's write lock. Killed there (the out-of-memory
    killer picks idle workers too), it takes the lock with it, and no worker can read a task
    (or send a result) again: a pool that outlives the death (a shared WorkerPool) would hang.
    The queues record the holder's pid, so the caller can release a dead holder's lock
    (`PoolCore.find_dead_worker`); a multiprocess Lock is a semaphore, any process may.
    Built lazily (importing gloader does not import multiprocess's queues).
    """
    global _TrackedQueue
    if _TrackedQueue is None:
        from multiprocess import context
        from multiprocess.queues import SimpleQueue, _ForkingPickler

        class TrackedQueue(SimpleQueue):  # type: ignore[misc]
            def __init__(self, *, ctx: Any) -> None:
                super().__init__(ctx=ctx)
                self.reader_pid = ctx.Value("q", 0, lock=False)
                self.writer_pid = ctx.Value("q", 0, lock=False)

            def __reduce__(self) -> Any:  # for spawned workers: rebuilt by a module-level function
                context.assert_spawning(self)
                return (_rebuild_queue, ((self._reader, self._writer, self._rlock, self._wlock),
                                         self.reader_pid, self.writer_pid))

            def get(self) -> Any:
                with self._rlock:
                    self.reader_pid.value = os.getpid()
                    data = self._reader.recv_bytes()
                    self.reader_pid.value = 0
                return _ForkingPickler.loads(data)

            def put(self, obj: Any) -> None:
                data = _ForkingPickler.dumps(obj)
                if self._wlock is None:  # pipe writes are atomic there (Windows)
                    self._writer.send_bytes(data)
                    return
                with self._wlock:
                    self.writer_pid.value = os.getpid()
                    self._writer.send_bytes(data)
                    self.writer_pid.value = 0

        _TrackedQueue = TrackedQueue
    return _TrackedQueue


_TrackedQueue: Any = None


def _rebuild_queue(state: Any, reader_pid: Any, writer_pid: Any) -> Any:
    cls = _make_queue_class()
    queue = cls.__new__(cls)
    (queue._reader, queue._writer, queue._rlock, queue._wlock) = state
    queue._poll = queue._reader.poll
    queue.reader_pid, queue.writer_pid = reader_pid, writer_pid
    return queue


def free_locks_of(pool: Any, pid: int) -> bool:
    """Release the queue locks that dead process `pid` held; whether it held any."""
    freed = False
    for queue, holder, lock in ((pool._inqueue, "reader_pid", "_rlock"), (pool._outqueue, "writer_pid", "_wlock")):
        if getattr(queue, holder).value == pid:
            getattr(queue, holder).value = 0
            getattr(queue, lock).release()
            freed = True
    return freed


def make_pool_class() -> type:
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
    gloader supervises its workers itself (`PoolCore.find_dead_worker`).
    """
    # Over 40 lines: one class body, built lazily so that importing gloader does not import
    # multiprocess's pool; its three overrides only make sense read together.
    from multiprocess import pool as mp_pool

    class _QuietCache(dict):  # type: ignore[type-arg]
        """`multiprocess.pool._PoolCache` that notifies on becoming empty only when closing."""

        closing = False
        notifier: Any

        def __delitem__(self, key: Any) -> None:
            super().__delitem__(key)
            if self.closing and not self:
                self.notifier.put(None)

    class _FastPool(mp_pool.Pool):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._cache.__class__ = _QuietCache

        def _get_sentinels(self) -> list[Any]:
            return [self._change_notifier._reader]

        def close(self) -> None:
            self._cache.closing = True
            super().close()  # wakes the maintenance thread, which sees whether tasks remain

        def _setup_queues(self) -> None:  # multiprocess's own, with the queues that track lock holders
            self._inqueue = _make_queue_class()(ctx=self._ctx)
            self._outqueue = _make_queue_class()(ctx=self._ctx)
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

    return _FastPool
