"""Worker pools: one of gloader's own pools (`_pool.processes`), supervised, with a shutdown ladder.

`PoolCore` wraps the pool itself. The pool tells nobody which task a dead worker held: its
supervisor counts each exit and wakes the waiting callers, and a caller that sees the count
grow asks `find_dead_worker()`, which reads the exit codes and the status table (`_pool.deaths`).
Shutdown climbs a ladder: ask (close), join with a deadline, terminate, join, kill.

A loader that owns its pool uses a `PoolCore` directly; `_places.shared.WorkerPool`, the pool
several loaders may share, holds one. The whole flow is drawn in `_caller.engine`.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import pickle
import signal
import threading
import time
import types
from typing import Any, Callable, Iterator

from .._wire.protocol import WorkerExitedError
from .._worker.registry import Payload, register_loader, unregister_loader
from .._worker.run import (
    PoolSpec,
    StatusTable,
    initialize_process_worker,
    initialize_thread_worker,
    run_task,
)
from .admission import usable_cpus
from .channel import disk_full
from .deaths import Deaths, describe_unstarted
from .directory import PoolDirectory, ProcessLock, open_private_file
from .processes import ProcessPool, ThreadPool, exit_code, preload_in_forkserver

__all__ = ["PoolCore", "ProcessCore", "ThreadCore", "WorkerExitedError", "make_core"]

logger = logging.getLogger(__name__)

# Shutdown ladder deadlines. Longer: workers finishing a batch get to exit cleanly; shorter:
# close() returns sooner when a batch is stuck in user code.
_ASK_S = 1.0
_TERMINATE_S = 1.5
_KILL_S = 2.0
# Deadline for the pool's own bookkeeping threads once every worker is gone.
_POOL_THREADS_S = 5.0
# A forked worker that has not reached the pool's initializer this long after it was first seen
# is stuck in the interpreter's after-fork step (CPython issue 112275; a healthy one takes
# milliseconds) and is killed, so that the pool starts another. Shorter: a worker slowed by a
# loaded machine may be replaced needlessly (harmless); longer: a loader with one worker waits
# that long, or times out first.
_START_DEADLINE_S = 10.0


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """Block SIGINT in the calling thread for the block (a Ctrl-C meanwhile is delivered after)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)

class PoolCore:
    """One running pool of `num_workers` workers, with its supervision: `ProcessCore` or
    `ThreadCore` (see `make_core`).

    Args:
        num_workers: workers to start.
        start_method: 'fork', 'spawn', 'forkserver' or None (platform default).
        registrations: (loader id, payload) pairs the initializer registers in every worker.
        capacity: the most workers the pool may be resized to (`resize`; process pools only);
            worker ids stay below it, and workers see it as `num_workers`. Default num_workers.
    """

    is_thread = False
    status: StatusTable | None = None  # process pools: what each worker is doing
    # Its `exited` counts the workers that exited so far (the process pool's own count): a
    # caller looks for deaths (`find_dead_worker`) only once it grew. Threads do not exit
    # apart from the caller.
    exits: Any = types.SimpleNamespace(exited=0)
    pool: Any

    def __init__(self, num_workers: int, start_method: str | None, registrations: list[tuple[int, Payload]],
                 capacity: int | None = None) -> None:
        import multiprocess

        self.num_workers = num_workers  # at the start; `resize` changes the count of a process pool
        self.capacity = max(num_workers, capacity or 0)
        self.start_method = start_method
        self._directory = PoolDirectory()
        self.payload_dir = self._directory.path
        self._closed = False
        self._lock = threading.Lock()  # loaders on a shared pool may wait and leave in different threads
        self._id_lock: ProcessLock | None = None
        self._permits: tuple[ProcessLock, ...] = ()
        try:
            self._start(multiprocess.get_context(start_method), registrations)
        except BaseException:  # the pool did not start: nothing will close it
            self._close_files()
            raise
        logger.debug("started %d %s workers (%s)", num_workers, self._kind, start_method or "default start method")

    @property
    def _kind(self) -> str:
        return "thread" if self.is_thread else "process"

    def _start(self, ctx: Any, registrations: list[tuple[int, Payload]]) -> None:
        raise NotImplementedError

    def submit(self, args: tuple[Any, ...], on_ready: Callable[[Any], None] | None = None,
               wakeup: threading.Event | None = None) -> Any:
        """Queue one `_worker.run_task(*args)` on the pool; returns its `TaskResult`.
        `on_ready(value)` runs in the thread that receives the result as it arrives; `wakeup`
        is set as the task progresses (on a process pool, also when a worker exits)."""
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        return self._closed

    def worker_pids(self) -> list[int]:
        """Pids of the worker processes (none for threads)."""
        return []

    def resize(self, count: int) -> bool:
        """Keep `count` workers from now on (1 to `capacity`), without losing a task; False
        when the pool cannot now (a thread pool, or the last resize is still under way)."""
        return False

    def workers_ready(self) -> bool:
        """Whether every worker the pool keeps runs and has claimed its id (a resize is done)."""
        return True

    def worker_processes(self) -> list[Any]:
        """The worker processes, by worker id (none for threads)."""
        return []

    def find_dead_worker(self, loader_id: int | None = None) -> str | None:
        """Describe a worker process that has died, once, to the loader it concerns; or None
        (threads do not die apart from the caller)."""
        return None

    def why_late(self) -> str | None:
        """What a batch over its timeout waited for when it is not the dataset: worker processes
        alive that never started (see `_pool.deaths.describe_unstarted`); None for threads."""
        return None

    def kill_worker_loading(self, loader_id: int, epoch: int, batch_indices: list[int]) -> int | None:
        """Kill the worker process stuck on one of those batches; its pid, or None."""
        return None

    def join(self, loader_id: int, payload: Payload) -> None:
        """Register a loader on the running pool."""
        raise NotImplementedError

    def forget(self, result: Any) -> None:
        """A task of a loader leaving the pool that did not finish: the pool stops waiting for it."""

    def leave(self, loader_id: int) -> None:
        """Drop a loader."""
        raise NotImplementedError

    def close(self, prompt: bool = False) -> None:
        """Stop every worker, climbing the ladder; idempotent, bounded in time.

        `prompt`: skip asking (after a dead worker or a timeout nobody waits for batches, and
        a stuck worker would not answer anyway): terminate at once.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._stop_workers(prompt)
        finally:  # the workers are gone (or being killed): their files go
            self._close_files()
        logger.debug("stopped %d %s workers", self.num_workers, self._kind)

    def _stop_workers(self, prompt: bool) -> None:
        raise NotImplementedError

    def forget_after_fork(self) -> None:
        """In a process forked (by `os.fork()`, not by the pool) from the one that made this
        pool: its workers are the parent's. Mark it closed so that nothing here stops them,
        neither `close()` nor, at this process's exit, multiprocess's exit handler, which
        terminates every daemonic child it knows of (in the parent's table)."""
        self._closed = True
        pool = getattr(self, "pool", None)  # None: forked while the pool was being made
        if isinstance(pool, ProcessPool):
            pool.forget_after_fork()

    def _close_files(self) -> None:
        for lock in (self._id_lock, *self._permits):
            if lock is not None:
                lock.close()
        self._directory.close()


class ThreadCore(PoolCore):
    """A pool of worker threads: they share this process's registry and memory."""

    is_thread = True

    def _start(self, ctx: Any, registrations: list[tuple[int, Payload]]) -> None:
        self.spec = PoolSpec(num_workers=self.num_workers, counter=ctx.Value("i", 0), id_lock=None, status=None,
                             incarnations=None, main_pid=os.getpid(), payload_dir=self.payload_dir,
                             generation=ctx.Value("i", 0, lock=False))
        self.pool = ThreadPool(self.num_workers, initialize_thread_worker, (self.spec, registrations))

    def submit(self, args: tuple[Any, ...], on_ready: Callable[[Any], None] | None = None,
               wakeup: threading.Event | None = None) -> Any:
        return self.pool.apply_async(run_task, args, on_ready, wakeup)

    def join(self, loader_id: int, payload: Payload) -> None:
        """Register a loader on the running pool (this process's registry: at once)."""
        register_loader(loader_id, payload, 0, self.num_workers, seeds_globals=False)

    def leave(self, loader_id: int) -> None:
        """Drop a loader, at once."""
        unregister_loader(loader_id)

    def _stop_workers(self, prompt: bool) -> None:
        self._close_threads()

    def _close_threads(self) -> None:
        pool = self.pool
        pool.close()
        deadline = time.monotonic() + _ASK_S + _TERMINATE_S
        for thread in pool.workers:
            thread.join(max(0.0, deadline - time.monotonic()))
        busy = [t.name for t in pool.workers if t.is_alive()]
        if busy:
            logger.warning("gloader thread workers %s are still running user code after %.1f s; "
                           "they are daemon threads and end with the interpreter", busy, _ASK_S + _TERMINATE_S)


class ProcessCore(PoolCore):
    """A pool of worker processes, supervised: the pool tells nobody which task a dead worker
    held (see the module's docstring), so `find_dead_worker` reads exit codes itself."""

    def __init__(self, num_workers: int, start_method: str | None, registrations: list[tuple[int, Payload]],
                 capacity: int | None = None) -> None:
        import multiprocess

        if multiprocess.current_process().daemon:
            # multiprocess would fail later with "daemonic processes are not allowed to have children"
            raise RuntimeError(f"cannot start {num_workers} worker processes from a daemonic process (pid "
                               f"{os.getpid()}), such as a gloader worker: it cannot have children of its own; "
                               "give the inner DataLoader num_workers=0 or thread_pool=True")
        self._deaths = Deaths()  # read and changed under self._lock
        self._claimed: set[int] = set()  # pids of workers seen holding their id (see workers_ready)
        self._first_seen: dict[int, float] = {}  # pid -> when a worker not yet started was first seen
        super().__init__(num_workers, start_method, registrations, capacity)

    def _start(self, ctx: Any, registrations: list[tuple[int, Payload]]) -> None:
        # Sized for the most workers the pool may be resized to: ids, rows and permits.
        num_workers = self.capacity
        status = ctx.Array("q", [-1] * StatusTable.cells(num_workers), lock=False)
        self.status = StatusTable(status, num_workers)
        incarnations = ctx.Array("q", [0] * num_workers, lock=False)
        # What workers share holds no semaphore: one that a killed worker held would stay taken
        # (a worker killed while reading a synchronized generation counter blocked the next
        # loader to leave, and every worker, for good). Ids are claimed under a lock the kernel
        # releases; the generation is a plain shared int that only this process writes.
        self._id_lock = ProcessLock(os.path.join(self.payload_dir, "ids.lock"))
        cpus = usable_cpus()
        if num_workers > cpus:  # see _admission
            self._permits = tuple(ProcessLock(os.path.join(self.payload_dir, f"permit-{i}.lock"))
                                  for i in range(cpus))
        self.spec = PoolSpec(num_workers=num_workers, counter=None, id_lock=self._id_lock, status=status,
                             incarnations=incarnations, main_pid=os.getpid(), payload_dir=self.payload_dir,
                             generation=ctx.Value("i", 0, lock=False), permits=self._permits)
        # SIGINT blocked in this thread while the pool starts: the workers (and the pool's
        # threads, hence the workers they start later) inherit the mask, so a Ctrl-C while a
        # spawned worker still imports cannot kill it before its initializer ignores SIGINT.
        # The resource tracker is started first: starting it unblocks SIGINT in its caller.
        if ctx.get_start_method() != "fork":
            from multiprocess import resource_tracker

            resource_tracker.ensure_running()
        if ctx.get_start_method() == "forkserver":
            preload_in_forkserver("gloader")
        with _sigint_blocked():
            self.pool = ProcessPool(ctx, self.num_workers, initialize_process_worker, (self.spec, registrations),
                                    self.payload_dir, self._kill_stuck if ctx.get_start_method() == "fork" else None)
        self.exits = self.pool

    def submit(self, args: tuple[Any, ...], on_ready: Callable[[Any], None] | None = None,
               wakeup: threading.Event | None = None) -> Any:
        """Queue one `_worker.run_task(*args)`; its result receives the parts a task sends
        before its end in `chunks` (see `_pool.channel.send_partial`), and sets `wakeup` as they
        come and when a worker exits."""
        return self.pool.apply_async(run_task, args, on_ready, wakeup)

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.pool.workers]

    def resize(self, count: int) -> bool:
        """Keep `count` workers from now on: new ones start (and claim free ids), or idle ones
        take retire tasks queued behind the tasks already queued, so none is lost; their exits
        (EXIT_RETIRED) are not deaths. A worker that dies meanwhile is reported as any death."""
        if not 1 <= count <= self.capacity:
            raise ValueError(f"a pool of capacity {self.capacity} cannot keep {count} workers")
        with self._lock:
            if self._closed or self.pool.resizing or self._deaths.retiring:
                return False
            self._deaths.retiring += self.pool.resize(count)
        logger.debug("resizing the pool to %d workers", count)
        return True

    def workers_ready(self) -> bool:
        if self._closed or self.status is None:
            return False
        with self._lock:
            if self.pool.resizing or self._deaths.retiring:
                self._deaths.notice(self.pool, self.status)  # counts the retired
                if self.pool.resizing or self._deaths.retiring:
                    return False
            # Workers seen with their id are not looked up again: a look scans the status table.
            pids = {p.pid for p in self.pool.workers}
            self._claimed &= pids
            self._claimed.update(pid for pid in pids - self._claimed if self.status.worker_id(pid) is not None)
            return self._claimed == pids

    def _kill_stuck(self, workers: list[Any]) -> bool:
        """Under fork, in the pool's supervisor: kill the workers that have not started within
        _START_DEADLINE_S of being first seen (see there); True while any has not started."""
        status, now = self.status, time.monotonic()
        assert status is not None
        # Kept for the unstarted workers of this look only: a pid kept for a worker gone since
        # would date a later worker given that pid from the first one's start.
        first_seen: dict[int, float] = {}
        for process in workers:
            if status.worker_id(process.pid) is not None:
                continue
            since = self._first_seen.get(process.pid, now)
            if now - since < _START_DEADLINE_S:
                first_seen[process.pid] = since
                continue
            with self._lock:
                self._deaths.killed.add(process)  # no death to report: it held no task
            process.kill()
            logger.warning("killed gloader worker %d: it never started (%.0f s after it was forked, no code of "
                           "gloader's had run in it; see CPython issue 112275); starting another",
                           process.pid, _START_DEADLINE_S)
        self._first_seen = first_seen
        return bool(first_seen)

    def why_late(self) -> str | None:
        if self._closed or self.status is None:
            return None
        status = self.status
        unstarted = [p.pid for p in self.pool.workers if p.pid is not None and status.worker_id(p.pid) is None]
        if not unstarted:
            return None
        import multiprocess

        return describe_unstarted(unstarted, multiprocess.get_context(self.start_method).get_start_method(),
                                  _START_DEADLINE_S)

    def worker_processes(self) -> list[Any]:
        processes = list(self.pool.workers)
        if self.status is not None:
            ids = {p.pid: self.status.worker_id(p.pid) for p in processes}
            processes.sort(key=lambda p: (ids[p.pid] is None, ids[p.pid] or 0))  # one not yet started last
        return [self._deaths.view(p) for p in processes]

    def find_dead_worker(self, loader_id: int | None = None) -> str | None:
        """Describe a worker process that has died, once, to the loader it concerns; or None.

        Reads exit codes itself: the pool replaces dead workers without a word. A worker
        that died holding a task (loading it or sending its result) lost that task: its death
        is reported to the loader the task belongs to (`loader_id`; None takes any), so on a
        shared pool the other loaders, which lost nothing, go on. A death while idle lost no
        task and is reported to the first loader that asks.
        """
        if self._closed:
            return None
        with self._lock:
            self._deaths.notice(self.pool, self.status)
            return self._deaths.take(loader_id)

    def kill_worker_loading(self, loader_id: int, epoch: int, batch_indices: list[int]) -> int | None:
        """Kill the worker process stuck on one of those batches (a shared pool's hung worker
        would hold a place forever); the pool starts a replacement. Returns its pid, or None."""
        if self.status is None:
            return None
        for process in self.pool.workers:
            doing = self.status.doing(process.pid)
            if doing is not None and doing[:2] == (loader_id, epoch) and doing[2] in batch_indices:
                batch_index = doing[2]
                with self._lock:
                    self._deaths.killed.add(process)  # killed on purpose: not a death to report
                process.kill()
                logger.warning("killed gloader worker %d: it spent longer than the timeout on batch %d of "
                               "epoch %d for loader %d", process.pid, batch_index, epoch, loader_id)
                return int(process.pid)
        return None

    def join(self, loader_id: int, payload: Payload) -> None:
        """Register a loader on the running pool: workers read its payload file at their first
        task for it."""
        path = os.path.join(self.payload_dir, f"{loader_id}.pkl")
        handle = open(open_private_file(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb")
        try:
            with handle:
                pickle.dump(payload, handle, protocol=pickle.HIGHEST_PROTOCOL)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(path + ".tmp")
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # a bare "[Errno 28]" named no file
                size = f"{len(payload.parts) / 2**20:.1f} MiB" if payload.pickled else "a loader's payload"
                raise disk_full(path + ".tmp", size, exc) from exc
            raise
        os.replace(path + ".tmp", path)  # atomic: a worker never reads half a file

    def forget(self, result: Any) -> None:
        """A task of a loader leaving the pool that did not finish (its worker died, or hangs):
        the pool stops waiting for it."""
        self.pool.forget(result)

    def leave(self, loader_id: int) -> None:
        """Drop a loader at the workers' next task for it (its payload file is gone and the
        generation moves on)."""
        with self._lock:
            # Deaths of its tasks' workers concern nobody else.
            self._deaths.forget_loader(loader_id)
            try:
                os.unlink(os.path.join(self.payload_dir, f"{loader_id}.pkl"))
            except FileNotFoundError:
                return
            self.spec.generation.value += 1

    def _stop_workers(self, prompt: bool) -> None:
        try:
            self._close_processes(prompt)
        except BaseException:  # a second Ctrl-C while asking: stop them at once, then re-raise
            self._close_processes(prompt=True)
            raise

    def _close_processes(self, prompt: bool) -> None:
        pool = self.pool
        pool.close()  # ask: each worker takes a stop after the tasks queued, and exits; none is replaced
        processes = pool.workers
        if not prompt:
            _join_all(processes, _ASK_S)
        alive = [p for p in processes if exit_code(p) is None]
        if alive:
            busy = [p.pid for p in alive if self.status is not None and self.status.doing(p.pid) is not None]
            if prompt:
                logger.warning("gloader workers %s: terminating them after a failed batch (a dead worker or "
                               "a timeout)", [p.pid for p in alive])
            elif len(busy) == len(alive):  # loading batches nobody wants any more: nothing is wrong
                logger.debug("gloader workers %s still load batches no longer wanted after %.1f s; terminating them",
                             busy, _ASK_S)
            else:
                logger.warning("gloader workers %s did not stop within %.1f s; terminating them",
                               [p.pid for p in alive], _ASK_S)
            for process in alive:
                process.terminate()
            if not _join_all(alive, _TERMINATE_S):
                alive = [p for p in alive if exit_code(p) is None]
                logger.warning("gloader workers %s ignored SIGTERM for %.1f s; killing them",
                               [p.pid for p in alive], _TERMINATE_S)
                for process in alive:
                    process.kill()
                if not _join_all(alive, _KILL_S):
                    logger.warning("gloader workers %s survived SIGKILL", [p.pid for p in alive if exit_code(p) is None])
        # The queues' locks need no freeing: the kernel released those a killed worker held.
        # The pool's threads and pipes go now, not when the pool object is collected, which an
        # exception's traceback (kept by a notebook) can delay; the same for the ended workers'
        # sentinels.
        stopper = threading.Thread(target=pool.stop, name="gloader-pool-stop", daemon=True)
        stopper.start()
        stopper.join(_POOL_THREADS_S)
        if stopper.is_alive():
            logger.warning("the pool's threads did not stop within %.1f s", _POOL_THREADS_S)
            return
        self._deaths.close_ended(self.pool)


def make_core(num_workers: int, is_thread: bool, start_method: str | None,
              registrations: list[tuple[int, Payload]], capacity: int | None = None) -> PoolCore:
    """A running pool of `num_workers` threads (`is_thread`) or processes (which `resize` may
    take up to `capacity`)."""
    return (ThreadCore if is_thread else ProcessCore)(num_workers, start_method, registrations, capacity)


def _join_all(processes: list[Any], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    return all(exit_code(p) is not None for p in processes)
