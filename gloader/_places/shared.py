"""The pool several loaders share (`WorkerPool`), and what closes every loader and pool still
open when the interpreter exits, and forgets the parent's after a fork. The pool itself, its
supervision and its shutdown ladder are `_pool.core`'s.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from typing import Any

from .._checks import check_flag, check_positive_int, check_start_method
from .._pool.core import PoolCore, make_core

__all__ = ["WorkerPool", "track"]

logger = logging.getLogger(__name__)


# Pools still running at interpreter exit; closed by the exit hook below, before
# multiprocess's own exit handler would terminate (and noisily join) them.
# Each with the pid of the process that made it: forked workers inherit this table, and
# run the exit hook too (multiprocess's bootstrap calls threading._shutdown), but the
# parent's pools are not theirs to close.
_LIVE: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def track(owner: Any) -> None:
    """Have the exit hook close `owner` (anything with `close()`) if it is still open."""
    _LIVE[owner] = os.getpid()


def _close_live_pools() -> None:
    # Loaders first: a loader leaving a shared pool waits for its own tasks, which a pool
    # closed before it could never finish.
    mine = [owner for owner, pid in list(_LIVE.items()) if pid == os.getpid()]
    for owner in sorted(mine, key=lambda owner: isinstance(owner, WorkerPool)):
        try:
            owner.close()
        except Exception:  # exit must go on; say what failed
            logger.warning("closing %r at exit failed", owner, exc_info=True)


# Run before threads are joined and before any atexit handler, multiprocess's included (it
# would terminate the pools under us, and a loader leaving a shared pool would then wait for
# tasks that can never finish); concurrent.futures registers its exit hook the same way.
_register_exit = getattr(threading, "_register_atexit", atexit.register)
_register_exit(_close_live_pools)


def _forget_live_pools() -> None:
    """In a forked child: the loaders and pools it inherits are the parent's (see
    `PoolCore.forget_after_fork`). Runs in every child forked from here, the pools' own
    workers included, where it only marks objects they never use."""
    try:
        for owner in list(_LIVE):
            owner.forget_after_fork()
        _LIVE.clear()
    except Exception:  # never fail a fork
        logger.debug("forgetting the parent's pools after a fork failed", exc_info=True)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_live_pools)


class WorkerPool:
    """A pool of workers that several DataLoaders can share.

    Loaders given `pool=` register on it (their dataset reaches every worker) and leave it
    when they close; the pool keeps running until `close()`.

    Args:
        num_workers: number of workers, >= 1.
        thread_pool: run workers as threads instead of processes.
        start_method: 'fork', 'spawn', 'forkserver', or None for the platform default.

    Raises:
        TypeError, ValueError: for a bad argument, naming it.
    """

    def __init__(self, num_workers: int, *, thread_pool: bool = False, start_method: str | None = None) -> None:
        self.num_workers = check_positive_int("num_workers", num_workers)
        self.thread_pool = check_flag("thread_pool", thread_pool)
        self.start_method = check_start_method(start_method)
        self._core: PoolCore | None = make_core(self.num_workers, self.thread_pool, start_method, [])
        self._finalizer = weakref.finalize(self, _finalize_pool, self._core)
        track(self)

    @property
    def core(self) -> PoolCore:
        """The running pool; RuntimeError once closed."""
        if self._core is None:
            raise RuntimeError("this WorkerPool is closed; create a new one")
        return self._core

    def worker_pids(self) -> list[int]:
        """Pids of the worker processes now running (empty for threads or once closed)."""
        return [] if self._core is None else self._core.worker_pids()

    @property
    def closed(self) -> bool:
        """Whether `close()` has run."""
        return self._core is None

    def close(self) -> None:
        """Stop the workers; loaders still using the pool fail at their next batch."""
        core, self._core = self._core, None
        if core is not None:
            self._finalizer.detach()
            core.close()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def forget_after_fork(self) -> None:
        """In a forked child: the workers are the parent's (see `PoolCore.forget_after_fork`);
        here the pool is closed, without a warning at exit."""
        core, self._core = self._core, None
        if core is not None:
            self._finalizer.detach()
            core.forget_after_fork()

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("a gloader WorkerPool cannot be pickled or copied: it owns worker processes; share the "
                        "WorkerPool object itself, or make a new one (in another process: inside it)")

    def __repr__(self) -> str:
        kind = "threads" if self.thread_pool else "processes"
        return f"WorkerPool({self.num_workers} {kind}, {'closed' if self.closed else 'running'})"


def _finalize_pool(core: PoolCore) -> None:
    import warnings

    core.close()  # first: where warnings are errors, the warning below raises
    warnings.warn("a gloader WorkerPool was garbage-collected while running; call close() or use "
                  "`with WorkerPool(...)`", ResourceWarning, stacklevel=2)
