"""Fixtures shared by all tests: the leak guard and helpers for checking it."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from typing import Any, Callable, Iterator

import psutil
import pytest

# The run's own temp directory, set before any pool starts (child processes inherit it): the
# tests that count gloader's files under `<tmp>/gloader-<uid>` then count only what this run
# made, whatever other programs of the same user (another gloader program too) make meanwhile.
# Made once a process (the tests also import this module as tests.conftest), removed by the
# process that made it.
_MADE_BY = os.environ.get("GLOADER_TESTS_TMPDIR_OF")
if _MADE_BY != str(os.getpid()):
    os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="gl-")  # short: AF_UNIX paths under it stop at 107 bytes
    os.environ["GLOADER_TESTS_TMPDIR_OF"] = str(os.getpid())
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
_RUN_TMP = os.environ["TMPDIR"]


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    if os.environ.get("GLOADER_TESTS_TMPDIR_OF") == str(os.getpid()):
        shutil.rmtree(_RUN_TMP, ignore_errors=True)

# Grace period for the operating system to reap children and for daemon threads to finish
# after close() returned. Polled, not slept: the check passes as soon as counts are back.
_SETTLE_S = 5.0


def _helper_pids() -> set[int]:
    """Long-lived helpers started by multiprocess itself (forkserver, resource tracker)."""
    pids = set()
    try:
        from multiprocess import forkserver, resource_tracker

        for pid in (getattr(forkserver._forkserver, "_forkserver_pid", None),
                    getattr(resource_tracker._resource_tracker, "_pid", None)):
            if pid:
                pids.add(pid)
    except ImportError:
        pass
    from multiprocessing import resource_tracker as stdlib_tracker  # used by torch.multiprocessing

    pid = getattr(stdlib_tracker._resource_tracker, "_pid", None)
    if pid:
        pids.add(pid)
    return pids


# Ray's system config for the test instances: workers at the priority of the process that
# starts Ray, not reniced by 15 (Ray's default), so that actors start in seconds on a machine
# busy with other programs.
RAY_WORKERS_NOT_NICED = {"worker_niceness": 0}


def dev_shm_names() -> set[str]:
    """Names in /dev/shm: gloader must never add one (its segments are anonymous). Leaves out
    multiprocessing's semaphores ("sem.*"), which live for a moment while a lock is made."""
    return {name for name in os.listdir("/dev/shm") if not name.startswith("sem.")}


def semaphore_names() -> set[str]:
    """The named semaphores in /dev/shm ("sem.*"): multiprocessing's, where a lock is made
    under spawn or forkserver. A pool must not keep one: a process group killed at once leaves
    it there for good (the resource tracker that would remove it dies with the group)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("sem.")}


def payload_dirs() -> set[str]:
    """The pool directories (locks, payloads of joining loaders) now in the temp directory."""
    import glob
    import tempfile

    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"gloader-{os.getuid()}", "gloader-payload-*")))


def segment_sizes(pids: list[int]) -> dict[str, int]:
    """gloader's shared-memory segments mapped by any of `pids`: inode -> mapped bytes.
    A segment's memory is in use exactly while some process maps it (or, briefly, holds
    the descriptor of one it just created)."""
    sizes: dict[str, int] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                lines = [line for line in maps if "/memfd:gloader" in line]
        except (FileNotFoundError, ProcessLookupError):
            continue
        for line in lines:
            fields = line.split()
            start, end = (int(part, 16) for part in fields[0].split("-"))
            sizes[fields[4]] = max(sizes.get(fields[4], 0), end - start)
    return sizes


def wait_until(condition: Callable[[], object], timeout_s: float) -> bool:
    """Poll `condition` until it is true (returns True) or `timeout_s` passes (returns False).
    For states another thread or process reaches on its own, with nothing to wait on."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def run_group(args: list[str], timeout_s: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(args, capture_output=True, text=True, **kwargs)` in a process group of its
    own, the whole of which is killed when it runs past `timeout_s`: a launcher's ranks and their
    workers go with it, where killing the launcher alone left them running for good. Raises
    AssertionError naming the command and the end of what it wrote to stderr."""
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"{' '.join(args)} ran past {timeout_s:g} s; stderr ends: {err[-3000:]}") from None
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def snapshot() -> dict[str, set]:
    me = psutil.Process()
    return {
        "children": {p.pid for p in me.children(recursive=True)} - _helper_pids(),
        "threads": {t.ident for t in threading.enumerate()},
        "fds": set(os.listdir("/proc/self/fd")),
        "shm": dev_shm_names(),
        "segments": set(segment_sizes([os.getpid()])),
    }


def leaks(before: dict[str, set]) -> dict[str, set]:
    """What exists now that did not before, after waiting up to _SETTLE_S for it to go."""
    deadline = time.monotonic() + _SETTLE_S
    while True:
        now = snapshot()
        extra = {key: now[key] - before[key] for key in now}
        extra["children"] -= _helper_pids()
        extra = {key: value for key, value in extra.items() if value}
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.05)


@pytest.fixture(autouse=True, scope="session")
def _warm_shared_heap() -> None:
    """Start multiprocess's process-wide helpers before the first leak snapshot: the heap
    arenas of synchronized values (two fds each; a pool's status table grows with the most
    workers it may have, 128 at most: 17 KiB, so an arena that holds several is made and
    kept, as the heap keeps arenas under 4 MiB for reuse), the resource tracker (spawn; one pipe) and the
    forkserver (one pipe; importing gloader, as gloader starts it), and the stdlib's resource
    tracker that torch.multiprocessing uses.
    Each is made once per process and reused, never per loader. On a GPU machine, also the
    CUDA context, whose device files stay open for the life of the process."""
    from multiprocessing import resource_tracker as stdlib_tracker

    import multiprocess
    from multiprocess import forkserver, resource_tracker

    stdlib_tracker.ensure_running()
    multiprocess.get_context("fork").Value("i", 0)
    multiprocess.get_context("fork").Array("q", 8192, lock=False)  # 64 KiB, freed at once, its arena kept
    resource_tracker.ensure_running()
    from gloader._pool.processes import preload_in_forkserver

    preload_in_forkserver("gloader")  # as the first forkserver loader would have it start
    forkserver.ensure_running()
    import torch

    if torch.cuda.is_available():
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.ones(1).pin_memory().to("cuda", non_blocking=True)
        torch.cuda.synchronize()


@pytest.fixture(autouse=True)
def no_leaks(_warm_shared_heap: None) -> Iterator[None]:
    """Fail any test that leaves child processes, threads, fds, /dev/shm names or mapped segments behind."""
    import gc

    gc.collect()
    # What survived that collection is not this test's garbage: later collections skip it, so
    # each test pays for the objects it made, not for everything torch and the earlier tests made.
    gc.freeze()
    before = snapshot()
    yield
    gc.collect()
    extra = leaks(before)
    assert not extra, f"test leaked: {extra}"


def take_all(iterator: Any, error: type[BaseException]) -> tuple[list[Any], list[BaseException]]:
    """Every batch an iterator yields until its end, going on past batches that raise `error`:
    (the batches, the errors), each in order."""
    got: list[Any] = []
    errors: list[BaseException] = []
    while True:
        try:
            got.append(next(iterator))
        except StopIteration:
            return got, errors
        except error as exc:
            errors.append(exc)
