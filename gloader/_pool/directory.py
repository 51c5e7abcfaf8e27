"""A pool's directory of files: the locks its workers share and the payloads of loaders that
join it while it runs (a pickled dataset, hundreds of MB at times).

The pool removes its directory when it closes. When its process dies first (`kill -9`, the
out-of-memory killer, a scheduler's cancel), nothing of it runs again, so the next pool
removes what is left: each directory holds a `flock` on its `alive` file for as long as the
pool's process lives (forked workers share it), and a lock that can be taken means that
nobody lives to use the directory. flock works across pid namespaces (containers sharing
/tmp), unlike pid checks, and a pid reused by another process cannot fool it. The kernel
may hold a killed process's lock a moment after the process is gone (it closes the files of
the dead late: a sweep ~50 ms after a kill found ~8 in ~140 still held here); such a
directory goes with a later sweep.

The directories live in a base directory of the user's own, `gloader-<uid>` in the temp
directory (removed when its last pool directory goes), made with mode 0700 and checked (a directory, not a link, owned by the user, closed
to others) before use, so no other user can plant, read or remove anything there; where another
user took that path first, a private directory of the process's own serves instead. A sweep opens
nothing in a way that can block or follow a link: a FIFO or a link named `alive` is left alone.
"""
from __future__ import annotations

import errno
import fcntl
import glob
import logging
import os
import shutil
import stat
import struct
import tempfile
import time
from typing import Any, Callable

__all__ = ["PoolDirectory", "ProcessLock", "check_private_directory", "is_private_directory", "open_private_file",
           "user_base"]

logger = logging.getLogger(__name__)

_PREFIX = "gloader-payload-"
_ALIVE = "alive"
# A directory without an `alive` file is left alone this long: one being made right now, or
# one of an older gloader. Older: such directories wait longer to be removed; younger: the
# margin over a directory's first microseconds shrinks (any value well over a second works).
_UNMARKED_GRACE_S = 3600.0


# This process's own base directory, used where `<tmp>/gloader-<uid>` cannot be (see user_base).
_private_base: str | None = None
_said_private = False


def user_base() -> str:
    """The user's own directory for pool directories: `<tmp>/gloader-<uid>`, made 0700 if absent,
    checked if present. Where that path is taken by something that is not a directory of this
    user's closed to others (another user made it first, or a link), a private directory of
    this process's own (`<tmp>/gloader-<uid>-XXXXXXXX`, random, 0700) serves instead, and a
    warning says so once: nobody can keep another user's loaders from starting."""
    path = os.path.join(tempfile.gettempdir(), f"gloader-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if is_private_directory(info):
        return path
    return _private(f"{path} is {_describe(info)}, not a directory of this user's (uid {os.getuid()}) closed to "
                    "others")


def is_private_directory(info: os.stat_result) -> bool:
    """Whether `info` (from `os.lstat`: a link is not followed) is a directory of this user's
    that nobody else can read, write or enter."""
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077


def _private(why: str) -> str:
    global _private_base, _said_private
    if _private_base is None or not _still_private(_private_base):
        # Made anew, never reused by name: once the last pool removed it, anyone may have put
        # a link or a directory of theirs there.
        _private_base = tempfile.mkdtemp(prefix=f"gloader-{os.getuid()}-")
    if not _said_private:
        _said_private = True
        logger.warning("%s; this process keeps its pool directories in %s instead (remove the other path, or point "
                       "TMPDIR at a directory of your own, to share one with the user's other processes)", why,
                       _private_base)
    return _private_base


def _still_private(path: str) -> bool:
    try:
        return is_private_directory(os.lstat(path))
    except OSError:
        return False


def check_private_directory(path: str) -> None:
    """Raise PermissionError unless `path` is a directory of this user's closed to others,
    reached without following a link (a pool's directory, before a worker reads a payload or
    a result from it)."""
    info = os.lstat(path)
    if not is_private_directory(info):
        raise PermissionError(errno.EACCES, f"gloader will not read files from {path}: it is {_describe(info)}, "
                                            f"not a directory of this user's (uid {os.getuid()}) closed to others",
                              path)


def _describe(info: os.stat_result) -> str:
    kind = ("a directory" if stat.S_ISDIR(info.st_mode) else "a link" if stat.S_ISLNK(info.st_mode) else
            "a file" if stat.S_ISREG(info.st_mode) else "not a directory or file")
    return f"{kind} of uid {info.st_uid} with mode {stat.S_IMODE(info.st_mode):o}"


def open_private_file(path: str, flags: int = os.O_RDONLY) -> int:
    """Open a file gloader wrote in a pool's directory (a payload, a spilled result) for
    reading, or (`flags` with O_CREAT) make a new one, mode 0600: never through a link, never
    one another user owns or can write, never anything that could block (a FIFO). Returns the
    descriptor; PermissionError names the path and what was found."""
    check_private_directory(os.path.dirname(path))
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
            raise PermissionError(errno.EACCES, f"gloader will not use {path}: it is {_describe(info)}, not a file "
                                                f"of this user's (uid {os.getuid()}) that only they can write", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class PoolDirectory:
    """Make a pool's directory, marked alive, after removing those whose process is gone."""

    def __init__(self) -> None:
        for attempt in range(3):
            try:
                self.path = tempfile.mkdtemp(prefix=_PREFIX, dir=user_base())
                break
            except FileNotFoundError:  # another process's last pool removed the empty base just now
                if attempt == 2:
                    raise
        # mkdtemp made it 0700 and new (it never follows a link): checked all the same, as
        # workers check it before they read what the caller left there.
        check_private_directory(self.path)
        marking = os.path.join(self.path, _ALIVE + ".new")
        self._alive = os.open(marking, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._alive, fcntl.LOCK_SH)  # shared: a sweeper's try for LOCK_EX fails
        os.rename(marking, os.path.join(self.path, _ALIVE))  # seen by sweepers only once locked
        removed = sweep_orphans(os.path.dirname(self.path), keep=self.path)
        if removed:
            logger.debug("removed %d pool directories left by processes that are gone", removed)

    def close(self) -> None:
        """Remove the directory (call once the pool's workers are gone)."""
        if self._alive >= 0:
            shutil.rmtree(self.path, ignore_errors=True)
            os.close(self._alive)
            self._alive = -1
            try:  # the last pool leaves no trace in the temp directory: the base goes once empty
                os.rmdir(os.path.dirname(self.path))
            except OSError:
                pass


def sweep_orphans(parent: str, keep: str | None = None) -> int:
    """Remove the pool directories under `parent` that no living process holds; return how many."""
    removed = 0
    for path in glob.glob(os.path.join(parent, _PREFIX + "*")):
        if path != keep and _orphaned(path):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


def _orphaned(path: str) -> bool:
    try:
        info = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return False  # not a directory of ours: never touched
    try:  # never blocks (a FIFO), never follows a link
        fd = os.open(os.path.join(path, _ALIVE), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:  # being made, or an older gloader's: by age
        return time.time() - info.st_mtime > _UNMARKED_GRACE_S
    except OSError:  # a link, another user's, or gone already
        return False
    try:
        marker = os.fstat(fd)
        if not stat.S_ISREG(marker.st_mode) or marker.st_uid != os.getuid():
            return False  # not a marker any pool made
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: its pool lives
    finally:
        os.close(fd)  # drops the lock we may have taken; nobody else wants it
    return True


# struct flock as fcntl(2) takes it on Linux: type, whence, start, length, pid (padded to 32 bytes).
_FLOCK = struct.Struct("@hhqqi4x")


class ProcessLock:
    """A lock between processes that the kernel releases when its holder dies: a POSIX record
    lock on a file of the pool's. Owned by the process (every thread of it), so the pool's own
    threads in the caller (`terminate`) never wait for one another on it.

    A multiprocess Lock (a semaphore) held by a killed worker stays taken, and no process can
    tell who holds it: recording the holder beside it left a window (between taking the lock
    and writing the pid) in which a kill stalled a shared pool for good (measured: 1 stall in
    ~300 random kills). The descriptor is inherited under fork; a spawned worker opens the
    file by its path (the pool's directory lives until the pool is closed).
    """

    def __init__(self, path: str) -> None:
        self._path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)

    def __getstate__(self) -> str:
        return self._path

    def __setstate__(self, path: str) -> None:
        self._path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)

    def close(self, _os_close: Callable[[int], None] = os.close) -> None:
        """Close the descriptor (which drops this process's hold on the lock, if any).
        (`os.close` is bound early: at interpreter exit, `__del__` may run after `os` is gone.)"""
        if self._fd >= 0:
            _os_close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        # `timeout` is accepted for the Lock interface; gloader's waits end by killing the
        # workers, which frees the lock, or by block=False.
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX if block else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):  # held by another process
            return False
        return True

    def release(self) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_UN)

    def holder(self) -> int | None:
        """The pid of the process that holds the lock (as the kernel says), None when no
        other process does (a lock this process holds is not reported)."""
        asked = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        kind, _, _, _, pid = _FLOCK.unpack(fcntl.fcntl(self._fd, fcntl.F_GETLK, asked))
        return None if kind == fcntl.F_UNLCK else int(pid)

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
