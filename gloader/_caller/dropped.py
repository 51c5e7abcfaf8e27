"""Work to do once an object is garbage, done outside the garbage collector's callbacks, so
that a Ctrl-C is never swallowed.

CPython runs a `weakref.finalize` callback (Python code) wherever the object happens to die,
and prints an exception raised inside it as "Exception ignored" and drops it. A training loop
drops a batch at every step, and a Ctrl-C that landed while a dropped batch's callback gave its
shared-memory slot back was lost that way (2 of 16 trials): the loop went on. Here the object's
weak reference calls C code (`deque.append`), which runs no bytecode, so no signal handler can
run inside it; the work waits in a `Drops` queue and runs in plain code: when its owner next
looks (`Drops.run`; a `SlotPool` owns one for its batches, and looks where it lends slots), or
within _IDLE_S from a thread that runs while anything is watched, so that the memory of dropped
batches goes back while the caller is idle too. That thread is never the main thread, where a
KeyboardInterrupt is raised. Runs in the caller's process.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import weakref
from typing import Any, Callable

__all__ = ["MAPPINGS", "Drops", "keep_running", "on_drop", "run_dropped"]

logger = logging.getLogger(__name__)

# How long dropped objects wait at most for their work when nothing else runs it. Shorter:
# memory back sooner after the caller stops; longer: fewer wake-ups while batches are held.
_IDLE_S = 0.1
# Passes over the queues per wake-up: a slot given back in one retires it, which drops its
# mapping, whose work the next pass runs; more passes only catch batches dropped meanwhile.
_PASSES = 3


class Drops:
    """Objects watched, and those dropped whose work has not run yet. `watch` may be written out
    where it is hot (as `SlotPool.rebuild` does): a weakref whose callback is `dropped.append`,
    and its work under `id(ref)` in `watched`, then `keep_running()`."""

    def __init__(self) -> None:
        self.dropped: collections.deque[weakref.ref[Any]] = collections.deque()  # appended to in C
        self.watched: dict[int, tuple[weakref.ref[Any], Callable[..., None], tuple[Any, ...]]] = {}
        _queues.add(self)

    def watch(self, obj: Any, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` once `obj` is garbage (`fn` must be thread-safe: it runs in whichever
        thread looks next). `fn` and `args` must not refer to `obj`."""
        ref = weakref.ref(obj, self.dropped.append)
        self.watched[id(ref)] = (ref, fn, args)  # keeps the weakref alive until its work has run
        keep_running()

    def run(self) -> None:
        """Run the work of the objects dropped so far."""
        while self.dropped:
            try:
                ref = self.dropped.popleft()
            except IndexError:  # another thread took the last one
                return
            _, fn, args = self.watched.pop(id(ref))
            fn(*args)


_queues: weakref.WeakSet[Drops] = weakref.WeakSet()
_runner: threading.Thread | None = None
_runner_lock = threading.Lock()


def keep_running() -> None:
    """Have the idle runner run (call after a watch): it ends once nothing is watched."""
    global _runner
    if _runner is not None:
        return
    with _runner_lock:  # the runner decides to end under it, after looking at what is watched
        if _runner is None:
            _runner = threading.Thread(target=_run_while_watched, name="gloader-dropped", daemon=True)
            _runner.start()


MAPPINGS = Drops()  # what `on_drop` watches: the mappings of the caller's segments


def on_drop(obj: Any, fn: Callable[..., None], *args: Any) -> None:
    """Run `fn(*args)` once `obj` is garbage (see `Drops.watch`)."""
    MAPPINGS.watch(obj, fn, *args)


def run_dropped() -> None:
    """Run the work of every object dropped so far, in this thread."""
    for queue in list(_queues):
        queue.run()


def _run_while_watched() -> None:
    global _runner
    wake = threading.Event()  # never set: a wait with a deadline
    me = threading.current_thread()
    while True:
        wake.wait(_IDLE_S)
        queues = list(_queues)
        for _ in range(_PASSES):
            if not any(queue.dropped for queue in queues):
                break
            for queue in queues:
                try:
                    queue.run()
                except Exception:  # the runner goes on: later drops still need it
                    logger.warning("giving back a dropped batch's shared memory failed", exc_info=True)
        with _runner_lock:
            # None before looking: a watch added after the look sees None and starts a runner
            # (`keep_running` reads `_runner` without the lock), one added before is seen here.
            _runner = None
            if not any(queue.watched for queue in queues):
                return
            _runner = me


def _forget_after_fork() -> None:
    """A forked child has none of the parent's threads; the objects watched are the parent's."""
    global _runner, _runner_lock
    for queue in list(_queues):
        queue.watched.clear()
        queue.dropped.clear()
    _runner, _runner_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
