"""The deaths of a process pool's workers: noticed from exit codes, described, reported once.

The pool starts a replacement for a dead worker, and the task the dead worker held never
completes (as in `multiprocessing.Pool`, CPython bpo-22393). `Deaths` keeps every process the
pool started, notices those that ended, tells a death from a worker retired by a resize or
killed on purpose, and reports each death once, to the loader whose task it lost. Runs in
the caller's process, under the pool's lock (`_pool.core.ProcessCore`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import signal
from typing import Any

from .._worker.run import StatusTable
from .._worker.setup import EXIT_CALLER_GONE
from .channel import EXIT_RESULTS_CLOSED, EXIT_RETIRED, EXIT_TASKS_CLOSED
from .processes import exit_code

__all__ = ["Deaths", "WorkerProcess", "describe_exit", "describe_unstarted"]


def describe_unstarted(pids: list[int], start_method: str, replaced_after_s: float) -> str:
    """Why a batch waited, when worker processes `pids` are alive but never reached the pool's
    initializer: under fork, stopped before any Python code ran (the pool replaces such a worker
    `replaced_after_s` after it was forked); else, most likely still importing."""
    which = f"worker process{'es' if len(pids) > 1 else ''} {', '.join(map(str, pids))}"
    if start_method == "fork":
        return (f"{which} never started: alive, but no code of gloader's ran in it. A process forked while "
                "another thread of this one held the interpreter's thread-state lock stops before any Python "
                "code runs (CPython issue 112275, fixed in later releases; threads that call into Python from C, "
                f"as torch.distributed's do, make it likely); the pool replaces it {replaced_after_s:g} s after it "
                "was forked, so a timeout= above that rides it out; start_method='forkserver' avoids it")
    return (f"{which} had not started yet (still importing: a loaded machine or a slow file system); raise "
            "timeout= for the first batch")


_SIGNAL_CAUSES = {
    signal.SIGKILL: "it was killed, most often by the out-of-memory killer (check `dmesg`; lower "
                    "num_workers, prefetch or batch_size, or keep the dataset in numpy arrays)",
    signal.SIGBUS: "shared memory ran out (/dev/shm is full, used by the dataset or a library it calls; "
                   "in docker, raise --shm-size)",
    signal.SIGSEGV: "a crash in native code called by the dataset or batchify function",
    signal.SIGABRT: "native code aborted (an assertion in a C extension)",
    signal.SIGTERM: "something outside gloader terminated it",
}


# Workers that end on their own say why by their exit code.
_OWN_EXITS = {
    EXIT_TASKS_CLOSED: "its task queue was closed or could not be read, so it stopped (the caller's end of the "
                       "pool's pipes was closed: the pool was stopped, or this process closed descriptors it "
                       "did not open)",
    EXIT_RESULTS_CLOSED: "its result pipe was closed, so it stopped (the caller's end of the pool's pipes was "
                         "closed: the pool was stopped, or this process closed descriptors it did not open)",
    EXIT_CALLER_GONE: "it found its parent process or the main process gone, so it stopped",
}


def describe_exit(exitcode: int) -> str:
    """Say how a worker ended and the likely cause, from its exit code; a death by a signal in
    torch's words ("is killed by signal: Segmentation fault"), which scripts written for torch
    look for."""
    if exitcode in _OWN_EXITS:
        return f"exited with code {exitcode}: {_OWN_EXITS[exitcode]}"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        cause = _SIGNAL_CAUSES.get(-exitcode, "it received a fatal signal")  # type: ignore[call-overload]
        return f"is killed by signal: {signal.strsignal(-exitcode) or name} ({name}); likely cause: {cause}"
    return (f"exited unexpectedly with code {exitcode}; likely cause: os._exit() called in the dataset, a transform "
            "or the batchify function, or an exit of the interpreter from native code")


class WorkerProcess:
    """A worker process as torch's iterator lists them (`it._workers`): `pid`, `exitcode`,
    `is_alive()`, `join(timeout)` and `terminate()`, which keep answering after the pool has
    closed the process object to release its descriptors."""

    def __init__(self, process: Any, exit_codes: dict[int, int]) -> None:
        self._process = process
        self._exit_codes = exit_codes  # the pool's record of the processes it closed
        self.pid: int = process.pid

    @property
    def exitcode(self) -> int | None:
        try:
            return exit_code(self._process)
        except ValueError:  # closed: it had ended
            return self._exit_codes.get(self.pid)

    def is_alive(self) -> bool:
        try:
            return bool(self._process.is_alive())
        except ValueError:
            return False

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(ValueError):
            self._process.join(timeout)

    def terminate(self) -> None:
        with contextlib.suppress(ValueError):
            self._process.terminate()

    def __repr__(self) -> str:
        return f"<gloader worker process pid={self.pid} exitcode={self.exitcode}>"


@dataclasses.dataclass
class _Death:
    """A worker's death, noticed and not yet reported."""

    text: str
    owner: int | None  # the loader whose task the worker held; None: it held none


class Deaths:
    """The worker processes a pool started, watched until they end; each death described once.

    `retiring` counts the workers asked to exit by a resize that have not yet: their exits
    (EXIT_RETIRED) are no deaths, nor are those of workers killed on purpose (`killed`)."""

    def __init__(self) -> None:
        self._watched: list[Any] = []  # worker processes not yet seen dead
        self._ended: list[Any] = []  # worker processes seen dead: their sentinels close with the pool
        self.killed: set[Any] = set()  # worker processes killed on purpose: no death to report
        self._pending: list[_Death] = []  # noticed, not reported yet
        self._exit_codes: dict[int, int] = {}  # pid -> exit code of the processes closed (see WorkerProcess)
        self.retiring = 0

    def take(self, loader_id: int | None) -> str | None:
        """A death noticed and not reported, that concerns `loader_id` (None: any), once."""
        for death in self._pending:
            if death.owner is None or loader_id is None or death.owner == loader_id:
                self._pending.remove(death)
                return death.text
        return None

    def forget_loader(self, loader_id: int) -> None:
        """A loader left the pool: deaths of its tasks' workers concern nobody else."""
        self._pending = [death for death in self._pending if death.owner != loader_id]

    def view(self, process: Any) -> WorkerProcess:
        """`process` as torch lists a worker, answering after the pool has closed it."""
        return WorkerProcess(process, self._exit_codes)

    def notice(self, pool: Any, status: StatusTable | None) -> None:
        """Look at every process `pool` started (`status`: what each worker is doing)."""
        # Every process the pool starts, from its own record: a replacement that died before
        # this look is gone from the pool's list of workers already, and would be missed there.
        started = pool.started
        while started:
            self._watched.append(started.popleft())
        alive: list[Any] = []
        dead: list[Any] = []
        for process in self._watched:
            (alive if exit_code(process) is None else dead).append(process)
        self._watched = alive
        # Ended workers' sentinels are closed once the pool's supervisor has let go of
        # them (a shared pool outlives many deaths), the rest with the pool.
        current = pool.workers
        ended = [p for p in self._ended if p in current]
        for process in self._ended:
            if process not in ended:
                self.close_process(process)
        self._ended = ended + dead
        for process in dead:
            code = process.exitcode
            if process in self.killed:
                self.killed.discard(process)
                continue
            if code == EXIT_RETIRED and self.retiring and status is not None and status.retired(process.pid):
                # it took a retire task: asked to go (a dataset's own exit with that code is a death)
                self.retiring -= 1
                continue
            if not (status is not None and status.has_started(process.pid)):
                text = f"DataLoader worker (pid {process.pid}) {describe_exit(code)}, while starting" if code < 0 else (
                    f"DataLoader worker (pid {process.pid}) exited with code {code} while starting, before it "
                    "could load anything; under spawn or forkserver the main script is imported again in "
                    "each worker, so guard it with `if __name__ == '__main__':` (its traceback is on stderr)")
                self._pending.append(_Death(text, None))
                continue
            doing = status.doing(process.pid)
            text = f"DataLoader worker (pid {process.pid}) {describe_exit(code)}"
            if doing is not None:
                text += f". It was loading batch {doing[2]} of epoch {doing[1]} for loader {doing[0]}"
            self._pending.append(_Death(text, None if doing is None else doing[0]))

    def close_process(self, process: Any) -> None:
        """Release an ended process's descriptors, keeping its exit code for `WorkerProcess`."""
        self._exit_codes[process.pid] = process.exitcode
        process.close()

    def close_ended(self, pool: Any) -> None:
        """The pool has stopped: release every ended process's descriptors."""
        for process in {*self._ended, *self._watched, *pool.started, *pool.workers}:
            if process.exitcode is not None:
                self.close_process(process)
