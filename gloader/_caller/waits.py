"""Waits in the caller's thread that a Ctrl-C ends as a KeyboardInterrupt, whatever the moment.

CPython's `threading.Condition.wait` (under `Event.wait` and `queue.Queue.get`) releases its
lock, waits, and takes the lock back; a SIGINT handled right after the release raises the
KeyboardInterrupt there, and leaving the `with` block then releases the lock a second time,
which raises `RuntimeError: release unlocked lock` in its place, the KeyboardInterrupt as its
context (seen in the test suite's Ctrl-C test on a busy machine). The user pressed Ctrl-C, and
that is what the caller gets. The lock is left released, as after any wait, so the object stays
usable.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, NoReturn

__all__ = ["as_ctrl_c", "ctrl_c_as_itself"]


@contextlib.contextmanager
def ctrl_c_as_itself() -> Iterator[None]:
    """Re-raise the KeyboardInterrupt that a lock's second release hid."""
    try:
        yield
    except RuntimeError as exc:
        as_ctrl_c(exc)


def as_ctrl_c(exc: RuntimeError) -> NoReturn:
    """Raise the KeyboardInterrupt that `exc`, raised by a wait, hid; else `exc` itself (for
    a hot wait: `except RuntimeError as exc: as_ctrl_c(exc)`)."""
    if isinstance(exc.__context__, KeyboardInterrupt):
        raise exc.__context__ from None
    raise exc
