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
"""
from __future__ import annotations

import fcntl
import glob
import logging
import os
import shutil
import tempfile
import time

__all__ = ["PoolDirectory"]

logger = logging.getLogger(__name__)

_PREFIX = "gloader-payload-"
_ALIVE = "alive"
# A directory without an `alive` file is left alone this long: one being made right now, or
# one of an older gloader. Older: such directories wait longer to be removed; younger: the
# margin over a directory's first microseconds shrinks (any value well over a second works).
_UNMARKED_GRACE_S = 3600.0


class PoolDirectory:
    """Make a pool's directory, marked alive, after removing those whose process is gone."""

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix=_PREFIX)
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
        fd = os.open(os.path.join(path, _ALIVE), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:  # being made, or an older gloader's: by age
        try:
            return time.time() - os.stat(path).st_mtime > _UNMARKED_GRACE_S
        except OSError:
            return False
    except OSError:  # another user's, or gone already
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: its pool lives
    finally:
        os.close(fd)  # drops the lock we may have taken; nobody else wants it
    return True
