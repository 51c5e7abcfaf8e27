"""Work to do once an object is garbage, done outside the garbage collector's callbacks, so
that a Ctrl-C is never swallowed.

CPython runs a `weakref.finalize` callback (Python code) wherever the object happens to die,
and prints an exception raised inside it as "Exception ignored" and drops it. A training loop
drops a batch at every step, and a Ctrl-C that landed while a dropped batch's callback gave its
shared-memory slot back was lost that way (2 of 16 trials): the loop went on. Here the object's
weak reference calls C code (`deque.append`), which runs no bytecode, so no signal handler can
run inside it; the work waits in a queue and runs in plain code: when its owner next looks
(`run_dropped`, from where slots are lent), or within _IDLE_S from a thread that runs while
anything is watched, so that the memory of dropped batches goes back while the caller is idle
too. That thread is never the main thread, where a KeyboardInterrupt is raised. Runs in the
caller's process.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import weakref
from typing import Any, Callable

__all__ = ["dropped", "on_drop", "run_dropped"]

logger = logging.getLogger(__name__)

# How long dropped objects wait at most for their work when nothing else runs it. Shorter:
# memory back sooner after the caller stops; longer: fewer wake-ups while batches are held.
_IDLE_S = 0.1

# The weakrefs of objects dropped whose work has not run (appended to by the weakrefs, in C):
# true while there is work for `run_dropped`.
dropped: collections.deque[weakref.ref[Any]] = collections.deque()
_work: dict[int, tuple[weakref.ref[Any], Callable[..., None], tuple[Any, ...]]] = {}  # id(ref) -> what to run
_runner: threading.Thread | None = None
_runner_lock = threading.Lock()


def on_drop(obj: Any, fn: Callable[..., None], *args: Any) -> None:
    """Run `fn(*args)` once `obj` is garbage (`fn` must be thread-safe: it runs in whichever
    thread looks next). `fn` and `args` must not refer to `obj`."""
    global _runner
    ref = weakref.ref(obj, dropped.append)
    _work[id(ref)] = (ref, fn, args)  # keeps the weakref alive until its work has run
    with _runner_lock:  # the runner decides to end under it, after looking at _work
        if _runner is None:
            _runner = threading.Thread(target=_run_while_watched, name="gloader-dropped", daemon=True)
            _runner.start()


def run_dropped() -> None:
    """Run the work of the objects dropped so far."""
    while dropped:
        try:
            ref = dropped.popleft()
        except IndexError:  # another thread took the last one
            return
        _, fn, args = _work.pop(id(ref))
        fn(*args)


def _run_logged() -> None:
    try:
        run_dropped()
    except Exception:  # the runner goes on: later drops still need it
        logger.warning("giving back a dropped batch's shared memory failed", exc_info=True)


def _run_while_watched() -> None:
    global _runner
    wake = threading.Event()  # never set: a wait with a deadline
    while True:
        wake.wait(_IDLE_S)
        _run_logged()
        with _runner_lock:
            if not _work:  # nothing left to watch: a new watch starts a new thread
                _runner = None
                return


def _forget_after_fork() -> None:
    """A forked child has none of the parent's threads; the objects watched are the parent's."""
    global _runner, _runner_lock
    _work.clear()
    dropped.clear()
    _runner, _runner_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
