"""How a worker process sets itself up (`prepare_process`, from the pool initializer in
`_worker.run`) and ends itself when its caller is gone. Runs in worker processes only.
"""
from __future__ import annotations

import os
import platform
import select
import signal
import struct
import sys
import threading
import time

from .slots import close_inherited_segments

__all__ = ["EXIT_CALLER_GONE", "prepare_process"]

# The exit code of a worker that ends because its parent or the main process is gone
# (see _watch_parent), rather than 0, which read as the dataset's doing.
EXIT_CALLER_GONE = 119
# How often a process worker checks that the caller is alive. Larger: less wake-up noise;
# smaller: orphaned workers exit (and free their memory) sooner after the caller is killed.
_PARENT_POLL_S = 0.2
# glibc malloc settings for process workers: keep freed heap memory instead of paying page
# faults for every sample's image or temporary (docs/design.md, "Workers keep their memory").
# Larger: fewer faults for larger samples; smaller: less memory an idle worker retains.
_MALLOC_MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's maximum on 64-bit
_MALLOC_TRIM_THRESHOLD_BYTES = 256 << 20
# The time slice process workers ask the scheduler for when a pool has more workers than the
# CPUs it may use (Linux 6.12+): fewer switches between oversubscribed CPU-bound workers, at the
# price of the caller's rare wake-up delays, so pools that fit their CPUs keep the default
# (docs/design.md, "More workers than CPUs"). Larger: fewer switches; smaller: shorter delays.
_WORKER_SLICE_NS = 10_000_000
# struct sched_attr as sched_setattr(2) takes it (its first, 56-byte version), and the
# system call's number where gloader asks for the slice.
_SCHED_ATTR = struct.Struct("IIQiIQQQII")
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}

def prepare_process(permits: bool, main_pid: int) -> None:
    """Set this worker process up: SIGINT ignored, one intra-op thread, the caller's segments
    closed, freed memory kept, a longer time slice where `permits` (more workers than CPUs),
    the inherited objects frozen, and a thread that ends the process when the caller is gone."""
    # Ctrl-C is the caller's to handle: it shuts the workers down itself. SIGINT arrives blocked
    # (see PoolCore), so one sent while this process started is discarded here, not fatal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    import torch

    torch.set_num_threads(1)  # one worker, one core: intra-op threads only contend
    close_inherited_segments()  # under fork: the caller's, which must not live on in this worker
    _keep_freed_memory()
    if permits:  # the pool has more workers than CPUs
        _lengthen_time_slice()
    # Under fork, the caller's objects are shared copy-on-write; a full collection in this
    # worker would write the GC header of every inherited container and copy its page.
    # Freezing moves them out of the collector's reach (O(1), no object touched).
    import gc

    gc.freeze()
    parent = os.getppid()
    threading.Thread(target=_watch_parent, args=(parent, main_pid),
                     name="gloader-parent-watch", daemon=True).start()


def _keep_freed_memory() -> None:
    """Tune glibc malloc as described at _MALLOC_MMAP_THRESHOLD_BYTES; no-op elsewhere."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, _MALLOC_MMAP_THRESHOLD_BYTES)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, _MALLOC_TRIM_THRESHOLD_BYTES)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: keep the platform's allocator as it is


def _lengthen_time_slice() -> None:
    """Ask for a time slice of _WORKER_SLICE_NS, keeping the policy and the nice value the
    worker inherited; a no-op where the system has no such call or refuses it."""
    number = _SCHED_SETATTR.get(platform.machine())
    if number is None or not sys.platform.startswith("linux"):
        return
    try:
        policy = os.sched_getscheduler(0)
        if policy not in (os.SCHED_OTHER, os.SCHED_BATCH, os.SCHED_IDLE):
            return  # a real-time worker (inherited): its slice is not ours to change
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        import ctypes

        attr = ctypes.create_string_buffer(_SCHED_ATTR.pack(_SCHED_ATTR.size, policy, 0, nice, 0, _WORKER_SLICE_NS,
                                                            0, 0, 0, 0), _SCHED_ATTR.size)
        ctypes.CDLL(None, use_errno=True).syscall(ctypes.c_long(number), ctypes.c_long(0), attr, ctypes.c_long(0))
    except (OSError, AttributeError):
        pass


def _is_orphaned(parent: int, main_pid: int) -> bool:
    if os.getppid() != parent:
        return True
    try:
        os.kill(main_pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def _watch_parent(parent: int, main_pid: int) -> None:
    """Exit when the caller is gone (the kernel frees the shared memory with the last mapping).

    Where the system has process file descriptors (Linux 5.3+), the thread sleeps in poll()
    until one of the two exits, holding no GIL and never waking: a thread that woke every
    _PARENT_POLL_S took the GIL from the task running beside it, and that wait is a voluntary
    context switch, which admission reads as the task having blocked (see _admission)."""
    watched = _pidfds({parent, main_pid})
    # Checked after opening: a pid already gone could have been reused by the time it was opened.
    if watched is not None and not _is_orphaned(parent, main_pid):
        watched.poll()
    while not _is_orphaned(parent, main_pid):
        time.sleep(_PARENT_POLL_S)
    os._exit(EXIT_CALLER_GONE)


def _pidfds(pids: set[int]) -> select.poll | None:
    """A poll object that wakes when any of `pids` exits; None where a pid is gone already
    or pidfd_open is missing or refused (ENOSYS before Linux 5.3, EPERM under some sandboxes)."""
    if not hasattr(os, "pidfd_open"):
        return None
    watched, opened = select.poll(), []
    try:
        for pid in pids:
            opened.append(os.pidfd_open(pid))
            watched.register(opened[-1], select.POLLIN)
    except OSError:
        for fd in opened:
            os.close(fd)
        return None
    return watched
