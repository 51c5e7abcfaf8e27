"""gloader's `multiprocess.Pool`, what is done with it: its messages (a task taken whole, a
result written whole or through a file), the hooks its workers call, resizing, stopping, and
every name of multiprocess's it relies on that multiprocess does not document. Its classes
are in `_pool.mpclasses` (imported only when a process pool starts). Imports nothing of gloader's;
`_pool.core` supervises it.
"""
from __future__ import annotations

import fcntl
import itertools
import os
import pickle
import select
import socket
import struct
import termios
import time
from typing import Any, Callable

__all__ = ["ATOMIC_TASK_BYTES", "DEFAULT_PIPE_BYTES", "EXIT_RESULTS_CLOSED", "EXIT_RETIRED", "EXIT_TASKS_CLOSED",
           "MODULE_NAMES", "PARTIAL", "POOL_ATTRIBUTES", "QUEUE_ATTRIBUTES", "RESULT_PIPE_BYTES", "WorkerTarget",
           "check_multiprocess", "disk_full", "exit_counter", "failed_result", "forget_pool_after_fork", "forget_task",
           "frame", "is_retire_task", "make_thread_pool", "missing_multiprocess_names", "on_result_sent",
           "on_task_taken", "on_task_wanted", "pool_resizing", "pool_running", "pool_worker", "pool_workers",
           "preload_in_forkserver", "release_pool_files", "resize_pool", "send_partial", "spill", "stop_maintenance"]


# A task message up to this size is taken from the task socket in one read once all of it
# has arrived (see _take_message); larger ones are read in pieces. The socket holds only so
# much of a message its reader has not taken: with Linux's default 208 KiB send buffer, a
# 117 KB message stopped at 110 KB (the writer waits for room, the reader for the rest),
# 112 KB always fitted. Half of that leaves margin for other kernels; the engine keeps the
# tasks it groups under it (`_caller.sizing.TASK_KEY_BYTES`).
ATOMIC_TASK_BYTES = 64 * 1024
# How long a reader sleeps while the rest of a message it has seen the start of is written.
_ARRIVAL_POLL_S = 50e-6
# A message whose arrival has not grown for this long does not fit in the socket (the writer
# waits for room): it is read in pieces, as larger ones are, rather than waited for forever.
_STALLED_S = 0.02


# A result message up to this size goes into the result pipe whole or not at all (POSIX
# PIPE_BUF). A larger one is written only once the pipe is empty (see _write_whole).
_ATOMIC_PIPE_BYTES = select.PIPE_BUF
# The result pipe's capacity is raised to this where the system allows (Linux's default
# limit for unprivileged users): results up to it go in the pipe whole, larger ones (a batch
# that did not fit its slot) through a file (see spill).
RESULT_PIPE_BYTES = 1 << 20
# How long a writer sleeps, at most, between looks at a pipe it waits to see empty.
_DRAIN_POLL_MAX_S = 2e-3
# The result pipe's capacity assumed where the system cannot tell it (not Linux): results
# larger than the capacity go through a file (see spill).
DEFAULT_PIPE_BYTES = 16 * 1024

# Exit codes of a worker that ends on its own because its caller's end of a queue is gone,
# rather than 0, which read as the dataset's doing (see `_pool.deaths.describe_exit`).
EXIT_TASKS_CLOSED = 117  # its task socket was closed (or could not be read)
EXIT_RESULTS_CLOSED = 118  # its result pipe was closed
# The exit code of a worker that took a retire task (see resize_pool): the pool asked it to go.
EXIT_RETIRED = 120

# Run in a worker before it waits for its next task, with each task it is about to take,
# and after each result it sends (set by its initializer); None in the caller.
_task_wanted: Callable[[], None] | None = None
_task_taken: Callable[[Any], None] | None = None
_result_sent: Callable[[], None] | None = None
# In a worker: the pool's result queue and the job id of the task it runs (see send_partial).
_results: Any = None
_job: int | None = None
# The index a partial result travels with in the pool's `(job, index, (success, value))`
# result message; a task's final result has index 0.
PARTIAL = 1


def on_task_wanted(callback: Callable[[], None] | None) -> None:
    """Have this worker process call `callback()` each time, before it waits for a task on
    the task queue (before it competes with the other workers for the queue's read lock)."""
    global _task_wanted
    _task_wanted = callback


def on_task_taken(callback: Callable[[Any], None] | None) -> None:
    """Have this worker process call `callback(task)` with each task just before taking it
    from the task queue (tasks read in pieces, over ATOMIC_TASK_BYTES, just after)."""
    global _task_taken
    _task_taken = callback


def on_result_sent(callback: Callable[[], None] | None) -> None:
    """Have this worker process call `callback` after each result it sends: until then the
    task is the worker's, and a worker that dies before has lost it."""
    global _result_sent
    _result_sent = callback


def send_partial(data: bytes | None) -> bool:
    """From a worker's task: send `data` to the caller now, as part of the task's result,
    which goes on (the caller's `TaskResult.chunks`, in order, before its final value), or
    with None only wake the caller up. False where there is no process pool's task to send it
    for (thread workers)."""
    if _results is None or _job is None:
        return False
    _results.put((_job, PARTIAL, (True, data)), finished=False)
    return True


def pool_worker(inqueue: Any, outqueue: Any, *rest: Any) -> None:
    """The pool's worker loop, with the result queue known to `send_partial`."""
    global _results
    from multiprocess import pool as mp_pool

    _results = outqueue
    mp_pool.worker(inqueue, outqueue, *rest)
    _end_process()


def _end_process() -> None:
    """End a worker whose loop took its stop sentinel, as a forked process ends (multiprocess's
    exit hooks, the standard streams flushed, `os._exit`), whatever started it. A spawned one
    would otherwise go on to `sys.exit`, which frees every object it holds before the process
    is gone: a dataset of 500,000 records took over a second, and close() took that for a hang."""
    import sys

    from multiprocess import util

    util._exit_function()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(0)


def _available(fd: int) -> int:
    """Bytes waiting to be read from a socket or pipe."""
    found = bytearray(4)
    fcntl.ioctl(fd, termios.FIONREAD, found)
    return int.from_bytes(found, "little", signed=True)


def _take_message(sock: socket.socket, claim: Callable[[memoryview], None] | None = None) -> bytes | memoryview:
    """One message of the pool's framing (a 4-byte size, or -1 and an 8-byte size, then the
    bytes) taken whole by a single read, so that a reader killed at any point leaves the
    stream at a message boundary: it only peeks until the whole message is there. Messages
    over ATOMIC_TASK_BYTES, and any that stops arriving before it is whole (the socket is
    full), are read in pieces instead.

    `claim(message)` sees a whole message before it is taken, so that a worker can say which
    task it holds before the task leaves the socket: killed between the two, it has claimed a
    task that is still there, which costs a needless error, never a lost task unreported."""
    while True:
        head = sock.recv(12, socket.MSG_PEEK)
        if not head:
            raise EOFError("the task socket was closed")
        if len(head) >= 4:
            size = struct.unpack("!i", head[:4])[0]
            if size != -1:
                header = 4
                break
            if len(head) == 12:
                size, header = struct.unpack("!Q", head[4:])[0], 12
                break
        time.sleep(_ARRIVAL_POLL_S)
    total = header + size
    if total > ATOMIC_TASK_BYTES:
        return _read_in_pieces(sock, total, header)
    arrived, since = _available(sock.fileno()), time.monotonic()
    while arrived < total:
        time.sleep(_ARRIVAL_POLL_S)
        now = _available(sock.fileno())
        if now > arrived:
            arrived, since = now, time.monotonic()
        elif time.monotonic() - since > _STALLED_S:
            return _read_in_pieces(sock, total, header)  # it does not fit: waiting would never end
    if claim is not None:
        claim(memoryview(sock.recv(total, socket.MSG_PEEK))[header:])
    whole = sock.recv(total)  # all of it is there: one read takes it whole
    if len(whole) != total:  # pragma: no cover - the kernel returns what is queued, up to total
        raise OSError(f"read {len(whole)} of a {total}-byte task message")
    return memoryview(whole)[header:]


def _read_in_pieces(sock: socket.socket, total: int, header: int) -> memoryview:
    """Read a message as it arrives (a reader killed in the middle leaves part of it)."""
    data = bytearray()
    while len(data) < total:
        chunk = sock.recv(total - len(data))
        if not chunk:
            raise EOFError("the task socket was closed")
        data += chunk
    return memoryview(data)[header:]


def frame(data: bytes) -> bytes:
    """`data` with the size header that multiprocess's `Connection.recv_bytes` reads."""
    size = len(data)
    header = struct.pack("!i", size) if size <= 0x7FFFFFFF else struct.pack("!iQ", -1, size)
    return header + data


def _write_whole(fd: int, message: bytes) -> None:
    """Write one framed message to a pipe so that a writer killed at any point leaves either
    all of it or none: a partial message would make the reader take the next writer's bytes
    for the rest of it, and a pool that outlives the death (a shared WorkerPool) would stall.

    The kernel writes up to PIPE_BUF bytes in one piece. A larger write is cut only where it
    must wait for room, so it waits for an empty pipe first (the caller's result thread reads
    at once) and then goes in with one write; a message must fit the pipe's capacity (larger
    results go through a file, see spill). Call holding the pipe's write lock.
    """
    if len(message) > _ATOMIC_PIPE_BYTES:
        pause = _ARRIVAL_POLL_S
        while _available(fd):
            time.sleep(pause)
            pause = min(pause * 2, _DRAIN_POLL_MAX_S)
    view = memoryview(message)
    while view:
        view = view[os.write(fd, view):]


_spilled = itertools.count()


class _Spilled:
    """A result written to a file; unpickled, it reads the file, removes it and is the result."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (_load_spilled, (self.path,))


def _load_spilled(path: str) -> Any:
    from multiprocess.queues import _ForkingPickler

    try:  # never through a link (the pool's directory is the user's alone: see _pool.directory)
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as file:
            data = file.read()
    finally:
        os.unlink(path)
    return _ForkingPickler.loads(data)


def disk_full(path: str, what: str, exc: OSError) -> OSError:
    """The error for a file of a pool's that the disk had no room for (`what`: "a 4.0 MiB
    result"): the path and the fix, as an OSError of the same errno."""
    return OSError(exc.errno, f"could not write {what} to {path}: {os.strerror(exc.errno or 0)}; free space in "
                              "the temp directory or point TMPDIR at a larger one", path)


def failed_result(obj: Any, exc: OSError, size: int, directory: str) -> Any:
    """The pool's result message `(job, i, (success, value))` for a result that could not be
    written to a file: the task fails, named (see disk_full)."""
    return (obj[0], obj[1], (False, disk_full(directory, f"a {size / 2**20:.1f} MiB result", exc)))


def spill(data: bytes, directory: str) -> bytes:
    """Write a result too large for the pipe to go in whole into a file of the pool's own
    directory, and return the small message that stands for it. A writer killed while it
    writes the file has put nothing into the pipe (the file goes with the directory when the
    pool closes); the message it sends after is under PIPE_BUF, written whole."""
    path = os.path.join(directory, f"result-{os.getpid()}-{next(_spilled)}.pkl")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600), "wb") as file:
        file.write(data)
    return pickle.dumps(_Spilled(path), protocol=pickle.HIGHEST_PROTOCOL)


def forget_task(pool: Any, result: Any) -> None:
    """Drop a task whose worker died holding it from the pool's record of pending tasks: it
    will never complete, and while it is recorded the pool's maintenance thread keeps the
    workers running after `close()` (no stop sentinels), so closing waited its full second.
    A result that comes after all is dropped by the pool (it ignores unknown jobs)."""
    pool._cache.pop(result._job, None)


# What gloader asks of a running pool (its own process pool, or multiprocess's ThreadPool),
# here so that multiprocess's private names stay in this module.

def make_thread_pool(workers: int, initializer: Callable[..., None], initargs: tuple[Any, ...]) -> Any:
    """multiprocess's ThreadPool of `workers` threads."""
    from multiprocess.pool import ThreadPool

    return ThreadPool(workers, initializer=initializer, initargs=initargs)


def pool_running(pool: Any) -> bool:
    """Neither closed nor terminated (multiprocess terminates pools at interpreter exit)."""
    from multiprocess.pool import RUN

    return bool(pool._state == RUN)


def exit_counter(pool: Any) -> Any:
    """What counts a process pool's worker exits as its maintenance thread sees them: its
    `exited` grows by one each time (read it as an attribute, without a call)."""
    return pool._pool


def pool_workers(pool: Any) -> list[Any]:
    """The pool's current worker processes (threads for a ThreadPool)."""
    return [worker for worker in pool._pool if worker is not _GROW]


class WorkerTarget:
    """How many workers a process pool keeps: its `processes`, which multiprocess reads as an
    int (`processes - len(pool)` workers to start) and which `resize_pool` changes while the
    pool runs. multiprocess hands the count to its maintenance thread once, at the start, so
    an int could not change."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __sub__(self, other: int) -> int:
        return self.value - other

    def __lt__(self, other: int) -> bool:
        return self.value < other

    def __index__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return str(self.value)


class _GrowRequest:
    """Put in a pool's list of workers to have its maintenance thread start workers up to the
    target: it starts new ones only after it has removed an ended worker, and this one has
    ended. All starting stays in that one thread, so two starts never race past the target."""

    exitcode = 0
    pid = None

    def join(self, timeout: float | None = None) -> None:
        pass

    def is_alive(self) -> bool:
        return False

    def terminate(self) -> None:
        pass


_GROW = _GrowRequest()


def _retire() -> None:
    """A retire task: the worker that takes it exits (it holds no batch: tasks are taken one
    at a time, so it had finished its last)."""
    os._exit(EXIT_RETIRED)


def is_retire_task(task: Any) -> bool:
    """Whether `task`, as the worker loop takes it (`(job, i, func, args, kwargs)`), is a retire task."""
    return isinstance(task, tuple) and len(task) == 5 and task[2] is _retire


def pool_resizing(pool: Any) -> bool:
    """Whether the pool's workers differ from its target: started or retired, not yet there."""
    return _GROW in pool._pool or len(pool._pool) != pool._processes.value


def resize_pool(pool: Any, count: int) -> int:
    """Have a running process pool keep `count` workers from now on: the maintenance thread
    starts the new ones, or as many idle workers as there are too many each take a retire
    task, queued behind the tasks already queued (none is lost) and exit with EXIT_RETIRED.
    Returns how many retire tasks were queued. Call only when `pool_resizing` is false."""
    from multiprocess import pool as mp_pool

    target: WorkerTarget = pool._processes
    before: int = target.value
    target.value = count
    if count > before:
        pool._pool.append(_GROW)
        pool._change_notifier.put(None)
        return 0
    for _ in range(before - count):  # a task no result is awaited for: the pool ignores unknown jobs
        pool._taskqueue.put(([(next(mp_pool.job_counter), 0, _retire, (), {})], None))
    return before - count


def stop_maintenance(pool: Any, timeout_s: float) -> bool:
    """Stop the pool's maintenance thread, which replaces workers that exit; True once it has."""
    from multiprocess.pool import TERMINATE

    pool._worker_handler._state = TERMINATE
    pool._change_notifier.put(None)  # it sleeps until notified
    pool._worker_handler.join(timeout_s)
    return not pool._worker_handler.is_alive()


def release_pool_files(pool: Any, processes: bool) -> None:
    """Close a stopped pool's pipes and locks now, not when its reference cycles are collected."""
    pool._change_notifier.close()
    if processes:
        pool._inqueue.release()
        pool._outqueue.release()


def forget_pool_after_fork(pool: Any, processes: bool) -> None:
    """In a process forked from the pool's: neither stop its workers (the parent's) at exit
    nor let its finalizer warn or wake the parent's maintenance thread."""
    from multiprocess import process
    from multiprocess.pool import CLOSE

    terminate = getattr(pool, "_terminate", None)
    if terminate is not None:
        terminate.cancel()
    children = getattr(process, "_children", None)
    if children is not None and processes:
        for worker in list(pool._pool):
            children.discard(worker)
    pool._state = CLOSE


# Every name of multiprocess's that this module relies on and multiprocess does not document:
# module attributes, and the attributes of a running pool (`POOL_ATTRIBUTES`) and its queues
# (`QUEUE_ATTRIBUTES`). setup.py caps multiprocess's version; `missing_multiprocess_names` (run
# as a pool is made, and by the tests against the installed release) names any that a release
# renamed, so that the error says so instead of an AttributeError from inside a pool's thread.
MODULE_NAMES = {
    "multiprocess.pool": ("worker", "RUN", "CLOSE", "TERMINATE", "job_counter", "ApplyResult", "Pool", "ThreadPool",
                          "Pool._setup_queues", "Pool._get_sentinels", "Pool._check_running",
                          "Pool._repopulate_pool_static", "Pool._join_exited_workers", "ApplyResult._set"),
    "multiprocess.queues": ("SimpleQueue", "_ForkingPickler"),
    "multiprocess.process": ("_children",),
    "multiprocess.util": ("_exit_function",),
    "multiprocess.forkserver": ("_forkserver._preload_modules", "set_forkserver_preload"),
}
POOL_ATTRIBUTES = ("_cache", "_pool", "_processes", "_state", "_taskqueue", "_inqueue", "_outqueue", "_ctx",
                   "_change_notifier", "_worker_handler", "_terminate", "_quick_put", "_quick_get")
QUEUE_ATTRIBUTES = ("_reader", "_writer", "_rlock", "_wlock", "_poll")


def preload_in_forkserver(module: str) -> None:
    """Have multiprocess's fork server import `module` when it starts, beside what it preloads
    already (`__main__`, or a list the program set): each worker it forks then starts with
    gloader and torch imported, in ~0.05 s, not ~1.5-2 s of a fresh interpreter importing
    torch, for every loader after the first and every worker a pool adds or replaces. No
    effect once the server runs (it started without it: its workers import as before)."""
    from multiprocess import forkserver

    preloaded = list(forkserver._forkserver._preload_modules)
    if module not in preloaded:
        forkserver.set_forkserver_preload([*preloaded, module])


def missing_multiprocess_names(pool: Any = None) -> list[str]:
    """The names of MODULE_NAMES (and of POOL_ATTRIBUTES on `pool`, a running pool, and
    QUEUE_ATTRIBUTES on multiprocess's SimpleQueue) that the installed multiprocess lacks."""
    import importlib

    missing = []
    for module_name, names in MODULE_NAMES.items():
        module = importlib.import_module(module_name)
        for name in names:
            found: Any = module
            for part in name.split("."):
                found = getattr(found, part, _GONE)
            if found is _GONE:
                missing.append(f"{module_name}.{name}")
    if pool is not None:
        missing += [f"Pool().{name}" for name in POOL_ATTRIBUTES if not hasattr(pool, name)]
        from multiprocess import get_context

        queue = get_context().SimpleQueue()
        try:
            missing += [f"SimpleQueue().{name}" for name in QUEUE_ATTRIBUTES if not hasattr(queue, name)]
        finally:
            queue.close()
    return missing


_GONE = object()


def check_multiprocess() -> None:
    """Raise ImportError naming multiprocess's renamed names, if the installed release lacks any."""
    global _CHECKED
    if _CHECKED:
        return
    missing = missing_multiprocess_names()
    if missing:
        import multiprocess

        raise ImportError(f"gloader's process pool relies on names that multiprocess "
                          f"{getattr(multiprocess, '__version__', '?')} no longer has ({', '.join(missing)}); "
                          "install the release setup.py names (pip install 'multiprocess>=0.70.15,<0.71')")
    _CHECKED = True


_CHECKED = False
