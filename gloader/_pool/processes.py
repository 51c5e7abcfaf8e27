"""gloader's own pools, in the shape of `multiprocessing.Pool` (started once with an initializer,
tasks submitted asynchronously, each answered by a result to wait on): `ProcessPool`, worker
processes of multiprocess's contexts (dill-pickled under spawn), and `ThreadPool`, worker
threads. `_pool.core` supervises them; a worker process runs `_pool.channel.worker_main`.

A process pool runs two threads in the caller. One writes the submitted tasks to the task
socket (a write may wait for room while the workers are busy). The other, the supervisor,
sleeps on the result pipe, the workers' sentinels and a wake-up pipe together: it hands each
result to its `TaskResult`, and on a worker's exit counts it (`exited`), wakes every result
awaited (`wakeup`), so that a waiting caller looks for the death at once, and starts a
replacement while the pool runs. It tells nobody which task a dead worker held (the pool's
status table does: `_pool.deaths`), and starts every worker, so that two starts never race
past the target `resize` sets.
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import queue
import select
import socket
import threading
import time
from typing import Any, Callable

from .channel import PARTIAL, TrackedQueue, dumps, loads, retire, worker_main

__all__ = ["ProcessPool", "TaskResult", "ThreadPool", "exit_code", "preload_in_forkserver"]

logger = logging.getLogger(__name__)

_STOP = object()  # ends the task writer (never sent)
# How long the supervisor waits for a worker whose sentinel closed to end (it is exiting: well
# under a millisecond), looking every _ENDING_POLL_S, and how often it looks at one that closed
# its sentinel and lives on.
_ENDING_S = 1.0
_ENDING_POLL_S = 1e-4
_BLIND_POLL_S = 0.1
# How long a reader waits for the exit code of a child another thread has reaped.
_RECORDED_S = 0.1


def _has_ended(process: Any) -> bool:
    """Whether child `process` has ended, without reaping it (the supervision reads its exit
    code, see `exit_code`). Where the system has no waitid (not Linux), by its exit code."""
    if not hasattr(os, "waitid"):
        return process.exitcode is not None
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True


def exit_code(process: Any) -> int | None:
    """`process.exitcode`, read safely beside another thread that reaps it (multiprocess reaps
    every ended child of its table as it starts a process, and the supervisor starts workers):
    the thread whose wait finds the child reaped reads None until the other has recorded the
    code, a moment later."""
    code = process.exitcode
    if code is None and _has_ended(process):
        deadline = time.monotonic() + _RECORDED_S
        while (code := process.exitcode) is None and time.monotonic() < deadline:
            time.sleep(_ENDING_POLL_S)
    return code  # type: ignore[no-any-return]


class TaskResult:
    """A submitted task's result: `ready()`, `wait(timeout)`, `get(timeout)` (its value, or
    its exception raised), as `multiprocessing.pool.AsyncResult`'s. A task may send parts of
    its result before the end: `chunks` holds (arrival time, data) of each, in order, and is
    complete once `ready()`. `wakeup` is set as each part and the final value arrive, and when
    a worker of the pool exits (the caller clears it; a loader's results may share one).
    `callback(value)` runs as a successful final value arrives, in the thread that receives it."""

    __slots__ = ("chunks", "wakeup", "_callback", "_done", "_outcome")

    def __init__(self, callback: Callable[[Any], None] | None = None, wakeup: threading.Event | None = None) -> None:
        self.chunks: list[tuple[float, Any]] = []
        self.wakeup = wakeup or threading.Event()
        self._callback = callback
        self._done = threading.Event()
        self._outcome: tuple[bool, Any] = (False, None)

    def ready(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def get(self, timeout: float | None = None) -> Any:
        if not self._done.wait(timeout):
            raise TimeoutError("the task has not finished")
        success, value = self._outcome
        if success:
            return value
        raise value

    def set(self, index: int, outcome: tuple[bool, Any]) -> None:
        """A part (`index` PARTIAL) or the final `(success, value)` of the task arrived."""
        if index == PARTIAL and outcome[0]:
            if outcome[1] is not None:
                self.chunks.append((time.monotonic(), outcome[1]))
        else:  # the final value, or a part that failed (a full disk): the task ends with it
            self._outcome = outcome
            if outcome[0] and self._callback is not None:
                self._callback(outcome[1])
            self._done.set()
        self.wakeup.set()


class ThreadPool:
    """`workers` threads, each running `initializer(*initargs)` and then the tasks submitted."""

    def __init__(self, workers: int, initializer: Callable[..., None], initargs: tuple[Any, ...]) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.workers = [threading.Thread(target=self._work, args=(initializer, initargs), daemon=True,
                                         name=f"gloader-thread-worker-{i}") for i in range(workers)]
        for thread in self.workers:
            thread.start()

    def apply_async(self, func: Callable[..., Any], args: tuple[Any, ...],
                    callback: Callable[[Any], None] | None = None, wakeup: threading.Event | None = None) -> TaskResult:
        result = TaskResult(callback, wakeup)
        self._queue.put((result, func, args))
        return result

    def _work(self, initializer: Callable[..., None], initargs: tuple[Any, ...]) -> None:
        initializer(*initargs)
        while (task := self._queue.get()) is not None:
            result, func, args = task
            try:
                outcome = (True, func(*args))
            except BaseException as exc:
                outcome = (False, exc)
            result.set(0, outcome)
            del task, result, func, args, outcome

    def close(self) -> None:
        """Each thread ends once the tasks submitted before are done."""
        for _ in self.workers:
            self._queue.put(None)


class ProcessPool:
    """`processes` worker processes of `ctx`, each running `initializer(*initargs)` and then
    the tasks submitted (see the module's docstring); `lock_dir`: the pool's private directory
    (the queues' locks, spilled results); `watch_starts(workers)`: see `_supervise`.

    `workers`: the processes now running; `started`: every process started, replacements
    included, until the supervision (`_pool.deaths`) takes it; `exited`: the workers' exits so far.
    """

    def __init__(self, ctx: Any, processes: int, initializer: Callable[..., None], initargs: tuple[Any, ...],
                 lock_dir: str, watch_starts: Callable[[list[Any]], bool] | None = None) -> None:
        self._ctx = ctx
        # Called by the supervisor with the workers after each of its rounds, and every
        # _BLIND_POLL_S while it answers True (some worker has not started yet).
        self._watch_starts = watch_starts
        self.target = processes
        self.workers: list[Any] = []
        self.started: collections.deque[Any] = collections.deque()
        self.exited = 0
        self.running = True
        self._stopping = False  # `stop` ran: the supervisor ends
        self._awaited: dict[int, TaskResult] = {}  # job -> result, until its final value
        self._jobs = itertools.count()
        self._names = itertools.count()  # gloader-worker-N, replacements included
        self._lock = threading.Lock()  # starting a worker, against closing
        self.tasks = TrackedQueue(ctx=ctx, lock_dir=lock_dir, name="tasks", atomic_reads=True)
        self.results = TrackedQueue(ctx=ctx, lock_dir=lock_dir, name="results")
        self._worker_args = (self.tasks, self.results, initializer, initargs)
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        self._threads: list[threading.Thread] = []
        try:
            self._top_up()
            for target, name in ((self._write_tasks, "tasks"), (self._supervise, "results")):
                self._threads.append(threading.Thread(target=target, name=f"gloader-pool-{name}", daemon=True))
                self._threads[-1].start()
        except BaseException:
            self.running = False
            for process in self.workers:
                process.kill()
                process.join()
            self._release()
            raise

    def apply_async(self, func: Callable[..., Any], args: tuple[Any, ...],
                    callback: Callable[[Any], None] | None = None, wakeup: threading.Event | None = None) -> TaskResult:
        """Queue `func(*args)` on a worker; its result may come in parts (`channel.send_partial`)."""
        if not self.running:
            raise ValueError("the pool is closed")
        job = next(self._jobs)
        result = self._awaited[job] = TaskResult(callback, wakeup)
        self._outbox.put((job, func, args))
        return result

    def forget(self, result: TaskResult) -> None:
        """Stop waiting for a task (its worker died holding it); a value that comes after all is dropped."""
        for job, awaited in list(self._awaited.items()):
            if awaited is result:
                self._awaited.pop(job, None)

    @property
    def resizing(self) -> bool:
        """Whether the workers differ from the target: started or retired, not yet there."""
        return len(self.workers) != self.target

    def resize(self, count: int) -> int:
        """Keep `count` workers from now on: the supervisor starts the new ones, or as many
        idle workers as there are too many each take a retire task, queued behind the tasks
        already queued (none is lost), and exit with EXIT_RETIRED. Returns how many retire
        tasks were queued. Call only when not `resizing`."""
        before, self.target = self.target, count
        if count > before:
            os.write(self._wake_write, b"+")
            return 0
        for _ in range(before - count):  # no result is awaited for it
            self._outbox.put((next(self._jobs), retire, ()))
        return before - count

    def close(self) -> None:
        """Ask: each worker exits once the tasks queued before are done; none is replaced."""
        with self._lock:
            self.running = False
            for _ in self.workers:
                self._outbox.put(None)

    def stop(self) -> None:
        """Once the workers are gone: end the pool's threads and close its pipes and locks."""
        self.running, self._stopping = False, True
        self._outbox.put(_STOP)
        os.write(self._wake_write, b".")
        writer, supervisor = self._threads or (None, None)
        reader = self.tasks.reading_socket()
        while writer is not None and writer.is_alive():  # it may wait for room nobody else makes now
            try:
                reader.recv(1 << 16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                writer.join(0.01)
        if supervisor is not None:
            supervisor.join()
        self._release()

    def forget_after_fork(self) -> None:
        """In a process forked (not by the pool) from the caller: the workers are the parent's;
        neither stop them nor start any. multiprocess's exit handler, which terminates every
        daemonic child in its table (the parent's, inherited), is told to leave them."""
        from multiprocess import process

        self.running = False
        children = getattr(process, "_children", None)  # (not documented: multiprocess's table of children)
        if children is not None:
            for worker in self.workers:
                children.discard(worker)

    def _release(self) -> None:
        self.tasks.release()
        self.results.release()
        for fd in (self._wake_read, self._wake_write):
            os.close(fd)

    def _top_up(self) -> None:
        """Start workers up to the target while the pool runs."""
        while True:
            with self._lock:
                if not self.running or len(self.workers) >= self.target:
                    return
                process = self._ctx.Process(target=worker_main, args=self._worker_args, daemon=True,
                                            name=f"gloader-worker-{next(self._names)}")
                process.start()
                self.started.append(process)
                self.workers = [*self.workers, process]

    def _write_tasks(self) -> None:
        send = self.tasks._writer.send_bytes
        while (task := self._outbox.get()) is not _STOP:
            try:
                data = dumps(task)
            except Exception as exc:  # a task not even dill can pickle fails, named
                result = self._awaited.pop(task[0], None)
                if result is not None:
                    result.set(0, (False, exc))
                continue
            try:
                send(data)
            except OSError:  # the pool is stopping
                return

    def _supervise(self) -> None:
        reader, wake = self.results._reader, self._wake_read
        everything, results = select.poll(), select.poll()  # kept: a selector made per wait cost ~4% of W1
        reader_fd = reader.fileno()
        for fd in (reader_fd, wake):
            everything.register(fd, select.POLLIN)
        results.register(reader_fd, select.POLLIN)
        watched: dict[int, Any] = {}  # sentinel -> worker process
        blind: list[Any] = []  # alive with their sentinel closed (they closed the descriptor): polled
        known: list[Any] = []  # the list of workers last looked at (a change rebinds it)
        starting = self._watch_starts is not None  # some worker may not have started: looked at again
        while True:
            if self.workers is not known:
                known = self.workers
                for process in set(known) - set(watched.values()) - set(blind):
                    watched[process.sentinel] = process
                    everything.register(process.sentinel, select.POLLIN)
            events = everything.poll(int(_BLIND_POLL_S * 1000) if blind or starting else None)
            if len(events) == 1 and events[0][0] == reader_fd and not blind and not starting:  # results alone
                self._take_results(reader, results)
                continue
            ready = {fd for fd, _ in events}
            if reader_fd in ready:
                self._take_results(reader, results)
            closed = [watched.pop(fd) for fd in ready if fd in watched]
            for process in closed:
                everything.unregister(process.sentinel)
            deadline = time.monotonic() + _ENDING_S  # its descriptors close a moment before it has ended
            while closed and not all(_has_ended(p) for p in closed) and time.monotonic() < deadline:
                time.sleep(_ENDING_POLL_S)
            ended = [process for process in closed + blind if _has_ended(process)]
            blind += [process for process in closed if process not in ended]
            if ended:
                blind = [process for process in blind if process not in ended]
                self.workers = [process for process in self.workers if process not in ended]
                self.exited += len(ended)  # counted once its exit code is there for the caller to read
                for result in list(self._awaited.values()):
                    result.wakeup.set()
            if wake in ready:
                os.read(wake, 64)
                if self._stopping:
                    return
            try:
                self._top_up()
            except Exception:  # out of processes or descriptors: the next exit or resize tries again
                logger.warning("gloader could not start a worker process", exc_info=True)
            if self._watch_starts is not None:
                starting = self._watch_starts(self.workers)

    def _take_results(self, reader: Any, results: select.poll) -> None:
        while True:
            try:
                job, index, outcome = loads(reader.recv_bytes())
            except (EOFError, OSError):
                return
            result = self._awaited.get(job)
            if result is not None:  # else forgotten, or a retire task's
                if index != PARTIAL or not outcome[0]:
                    del self._awaited[job]
                result.set(index, outcome)
            if not results.poll(0):
                return


def preload_in_forkserver(module: str) -> None:
    """Have multiprocess's fork server import `module` when it starts, beside what it preloads
    already (`__main__`, or a list the program set): each worker it forks then starts with
    gloader and torch imported, in ~0.05 s, not ~1.5-2 s of a fresh interpreter importing
    torch, for every loader after the first and every worker a pool adds or replaces. No
    effect once the server runs (it started without it: its workers import as before)."""
    from multiprocess import forkserver

    preloaded = list(forkserver._forkserver._preload_modules)  # (not documented: what it preloads)
    if module not in preloaded:
        forkserver.set_forkserver_preload([*preloaded, module])
