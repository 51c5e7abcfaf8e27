"""The wire between a process pool's caller and its workers, and the workers' side of the pool:
the task socket each task is taken from whole, the result pipe each result goes into whole (or
through a file), the hooks a worker calls around them, and the worker's loop. Imports nothing
of gloader's but the pool's lock files (`_pool.directory`); `_pool.processes` runs the caller's
side, `_worker.run` sets the hooks.
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

from .directory import ProcessLock

__all__ = ["ATOMIC_TASK_BYTES", "EXIT_RESULTS_CLOSED", "EXIT_RETIRED", "EXIT_TASKS_CLOSED", "PARTIAL", "TrackedQueue",
           "disk_full", "dumps", "is_retire_task", "loads", "on_result_sent", "on_task_taken", "on_task_wanted",
           "retire", "send_partial", "spill", "worker_main"]


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
_RESULT_PIPE_BYTES = 1 << 20
# How long a writer sleeps, at most, between looks at a pipe it waits to see empty.
_DRAIN_POLL_MAX_S = 2e-3
# The result pipe's capacity assumed where the system cannot tell it (not Linux): results
# larger than the capacity go through a file (see spill).
_DEFAULT_PIPE_BYTES = 16 * 1024

# Exit codes of a worker that ends on its own because its caller's end of a queue is gone,
# rather than 0, which read as the dataset's doing (see `_pool.deaths.describe_exit`).
EXIT_TASKS_CLOSED = 117  # its task socket was closed (or could not be read)
EXIT_RESULTS_CLOSED = 118  # its result pipe was closed
# The exit code of a worker that took a retire task (see `retire`): the pool asked it to go.
EXIT_RETIRED = 120

# The index a partial result travels with in a result message `(job, index, (success,
# value))`; a task's final result has index 0.
PARTIAL = 1

# Run in a worker before it waits for its next task, with each task it is about to take,
# and after each final result it sends (set by its initializer); None in the caller.
_task_wanted: Callable[[], None] | None = None
_task_taken: Callable[[Any], None] | None = None
_result_sent: Callable[[], None] | None = None
# In a worker: the pool's result queue and the job id of the task it runs (see send_partial).
_results: TrackedQueue | None = None
_job: int | None = None


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
    """Have this worker process call `callback` after each task's final result: until then
    the task is the worker's, and a worker that dies before has lost it."""
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


def retire() -> None:
    """A retire task: the worker that takes it exits (it holds no batch: tasks are taken one
    at a time, so it had finished its last)."""
    os._exit(EXIT_RETIRED)


def is_retire_task(task: Any) -> bool:
    """Whether `task`, as a worker takes it (`(job, func, args)`), is a retire task."""
    return type(task) is tuple and len(task) == 3 and task[1] is retire


def worker_main(tasks: TrackedQueue, results: TrackedQueue, initializer: Callable[..., None],
                initargs: tuple[Any, ...]) -> None:
    """A worker process: `initializer(*initargs)`, then each task `(job, func, args)` taken in
    turn, its `func(*args)` sent back as `(job, 0, (success, value or exception))`, until the
    stop (None)."""
    global _results, _job
    _results = results
    initializer(*initargs)
    while True:
        task = tasks.get()
        if task is None:
            break
        job, func, args = task
        _job = job
        try:
            outcome = (True, func(*args))
        except Exception as exc:
            outcome = (False, exc)
        results.put((job, 0, outcome))
        del task, func, args, outcome  # nothing of the last task is kept while waiting for the next
    _end_process()


def _end_process() -> None:
    """End a worker that took its stop, as a forked process ends (multiprocess's exit hooks,
    the standard streams flushed, `os._exit`), whatever started it. A spawned one would
    otherwise go on to `sys.exit`, which frees every object it holds before the process is
    gone: a dataset of 500,000 records took over a second, and close() took that for a hang."""
    import sys

    from multiprocess import util

    util._exit_function()  # (not documented: the hooks multiprocess runs at a process's end)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(0)


def dumps(obj: Any) -> bytes:
    """`obj` pickled: gloader's own messages (ids and bytes) by the stdlib pickler (~1 us,
    dill's ~30), anything it refuses by dill (multiprocess's pickler)."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        from multiprocess.reduction import ForkingPickler

        return bytes(ForkingPickler.dumps(obj))


def loads(data: Any) -> Any:
    """What `dumps` pickled (dill reads the stdlib's pickles too)."""
    global _unpickle
    if _unpickle is None:  # imported once, when first needed: importing gloader imports no multiprocess
        from multiprocess.reduction import ForkingPickler

        _unpickle = ForkingPickler.loads
    return _unpickle(data)


_unpickle: Callable[[Any], Any] | None = None


def _available(fd: int) -> int:
    """Bytes waiting to be read from a socket or pipe."""
    found = bytearray(4)
    fcntl.ioctl(fd, termios.FIONREAD, found)
    return int.from_bytes(found, "little", signed=True)


def _take_message(sock: socket.socket, claim: Callable[[memoryview], None] | None = None) -> bytes | memoryview:
    """One message (a 4-byte size, or -1 and an 8-byte size, then the bytes: the framing of
    multiprocess's `Connection.send_bytes`) taken whole by a single read, so that a reader
    killed at any point leaves the stream at a message boundary: it only peeks until the whole
    message is there. Messages over ATOMIC_TASK_BYTES, and any that stops arriving before it
    is whole (the socket is full), are read in pieces instead.

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


def _frame(data: bytes) -> bytes:
    """`data` with the size header that `Connection.recv_bytes` reads."""
    size = len(data)
    header = struct.pack("!i", size) if size <= 0x7FFFFFFF else struct.pack("!iQ", -1, size)
    return header + data


def _write_whole(fd: int, message: bytes) -> None:
    """Write one framed message to a pipe so that a writer killed at any point leaves either
    all of it or none: a partial message would make the reader take the next writer's bytes
    for the rest of it, and a pool that outlives the death (a shared WorkerPool) would stall.

    The kernel writes up to PIPE_BUF bytes in one piece. A larger write is cut only where it
    must wait for room, so it waits for an empty pipe first (the caller's supervisor thread
    reads at once) and then goes in with one write; a message must fit the pipe's capacity (larger
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
    try:  # never through a link (the pool's directory is the user's alone: see _pool.directory)
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as file:
            data = file.read()
    finally:
        os.unlink(path)
    return loads(data)


def disk_full(path: str, what: str, exc: OSError) -> OSError:
    """The error for a file of a pool's that the disk had no room for (`what`: "a 4.0 MiB
    result"): the path and the fix, as an OSError of the same errno."""
    return OSError(exc.errno, f"could not write {what} to {path}: {os.strerror(exc.errno or 0)}; free space in "
                              "the temp directory or point TMPDIR at a larger one", path)


def spill(data: bytes, directory: str) -> bytes:
    """Write a result too large for the pipe to go in whole into a file of the pool's own
    directory, and return the small message that stands for it. A writer killed while it
    writes the file has put nothing into the pipe (the file goes with the directory when the
    pool closes); the message it sends after is under PIPE_BUF, written whole."""
    path = os.path.join(directory, f"result-{os.getpid()}-{next(_spilled)}.pkl")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600), "wb") as file:
        file.write(data)
    return pickle.dumps(_Spilled(path), protocol=pickle.HIGHEST_PROTOCOL)


class TrackedQueue:
    """A pool's task or result queue, safe for a pool that outlives a killed worker.

    An idle worker waits for its next task holding the task queue's read lock, and a worker
    sends each result holding the result queue's write lock. Killed there (the out-of-memory
    killer picks idle workers too), it must neither keep the lock nor leave a half-read
    message: a pool that outlives the death (a shared WorkerPool) would stall. So the locks
    are `ProcessLock`s, which the kernel releases (files of the pool's directory, which the
    next pool sweeps, where semaphores under spawn stayed in /dev/shm after `kill -9 -PGID`),
    and the task queue (`atomic_reads`) is a socket pair from which a worker takes each task
    whole with one read (`_take_message`): from a pipe it took two (the size, then the bytes),
    and a worker killed between them left the next reader to take a task's bytes for a size,
    which stalled the pool or ended that worker with code 0 (measured: 1 in ~60 random kills).
    Only workers take the locks: the caller has one thread on each end (`_pool.processes`).
    """

    def __init__(self, *, ctx: Any, lock_dir: str, name: str, atomic_reads: bool = False) -> None:
        self._reader, self._writer = ctx.Pipe(duplex=atomic_reads)
        self._rlock = ProcessLock(os.path.join(lock_dir, f"{name}.read.lock"))
        self._wlock = ProcessLock(os.path.join(lock_dir, f"{name}.write.lock"))
        if not atomic_reads:
            try:
                fcntl.fcntl(self._writer.fileno(), fcntl.F_SETPIPE_SZ, _RESULT_PIPE_BYTES)
            except (OSError, AttributeError):  # above the system's limit, or not Linux
                pass
        try:
            self._pipe_bytes = fcntl.fcntl(self._writer.fileno(), fcntl.F_GETPIPE_SZ)
        except (OSError, AttributeError):
            self._pipe_bytes = _DEFAULT_PIPE_BYTES
        self._spill_dir = lock_dir
        self.atomic_reads = atomic_reads
        self._socket: socket.socket | None = None
        self._creator: int | None = os.getpid()  # the caller; a worker that inherits the queue differs

    def __reduce__(self) -> Any:  # for spawned workers: rebuilt by a module-level function
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

    def reading_socket(self) -> socket.socket:
        """The reader's end as a socket (a task queue), made once per process."""
        if self._socket is None:
            self._socket = socket.fromfd(self._reader.fileno(), socket.AF_UNIX, socket.SOCK_STREAM)
        return self._socket

    def get(self) -> Any:
        """In a worker: the next task, taken whole (the stop: None)."""
        taken: list[Any] = []
        on_taken = _task_taken

        def claim(message: memoryview) -> None:
            taken.append(loads(message))
            if on_taken is not None:
                on_taken(taken[0])

        if _task_wanted is not None:
            _task_wanted()
        with self._rlock:
            try:
                if self.atomic_reads:
                    data = _take_message(self.reading_socket(), claim if on_taken is not None else None)
                    if on_taken is not None and not taken:  # read in pieces: claimed once read
                        claim(memoryview(data))
                else:
                    data = self._reader.recv_bytes()
            except (EOFError, OSError):
                if os.getpid() == self._creator:
                    raise
                os._exit(EXIT_TASKS_CLOSED)  # no task can come: say why, not a code 0 read as the dataset's
        return taken[0] if taken else loads(data)

    def put(self, obj: Any, finished: bool = True) -> None:
        """In a worker: send a result `(job, index, (success, value))`; `finished`: the task's
        final one (a partial one, see send_partial, leaves the task the worker's)."""
        try:
            data = dumps(obj)
        except Exception as exc:  # a result not even dill can pickle fails its task, named
            data = dumps((obj[0], obj[1], (False, RuntimeError(f"the task's result could not be pickled: {exc!r}"))))
        try:
            message = _frame(data)
            if len(message) > self._pipe_bytes:  # it could not go in whole: a file takes it
                try:
                    message = _frame(spill(data, self._spill_dir))
                except OSError as exc:  # a full disk fails the task, named, not the worker
                    failed = disk_full(self._spill_dir, f"a {len(data) / 2**20:.1f} MiB result", exc)
                    message = _frame(dumps((obj[0], obj[1], (False, failed))))
            with self._wlock:
                _write_whole(self._writer.fileno(), message)
        except (BrokenPipeError, ConnectionResetError):
            if os.getpid() == self._creator:
                raise
            # A worker whose caller is gone (killed): nobody will read this result.
            os._exit(EXIT_RESULTS_CLOSED)
        if finished and _result_sent is not None:
            _result_sent()


def _rebuild_queue(state: Any, atomic_reads: bool) -> TrackedQueue:
    queue = TrackedQueue.__new__(TrackedQueue)
    (queue._reader, queue._writer, queue._rlock, queue._wlock, queue._pipe_bytes, queue._spill_dir) = state
    queue.atomic_reads, queue._socket, queue._creator = atomic_reads, None, None
    return queue
