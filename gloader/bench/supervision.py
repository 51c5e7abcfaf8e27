"""How soon a worker's death reaches the caller waiting for its batch, and how often that
caller wakes while nothing happens: `python -m gloader.bench.supervision`.

One worker is loading a batch that never ends (its sample sleeps); the caller waits for it,
asking only once the worker is inside that sample (a batch the caller had waited for may
still send it a message a moment later, which is not a wake-up while nothing happens).
After a quiet half second the worker is killed with SIGKILL, and the time from the kill to
the exception in the caller is taken, for gloader's own pool, a shared `WorkerPool` and
torch's DataLoader, in the same run (median of `--rounds`). The caller's looks (its thread's
calls of the engine's wait on a task, seen with `sys.setprofile`) during the quiet half
second count its wake-ups: one is a single sleep.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import numpy as np

from gloader.dataset import Dataset

__all__ = ["main", "measure"]

_QUIET_S = 0.5
_STUCK_FROM = 8  # samples from this index on never finish


class _StuckAfter(Dataset[np.ndarray]):
    """Samples from _STUCK_FROM on never finish; the first of them to start creates `marker`."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, index: int) -> np.ndarray:
        if index >= _STUCK_FROM:
            open(self.marker, "a").close()
            time.sleep(600)
        return np.zeros(4, np.float32)


def _until_stuck(dataset: _StuckAfter, deadline_s: float = 60.0) -> None:
    """Return once a worker is inside a sample that never finishes."""
    give_up = time.monotonic() + deadline_s
    while not os.path.exists(dataset.marker):
        if time.monotonic() > give_up:
            raise RuntimeError(f"no worker reached sample {_STUCK_FROM} within {deadline_s:g} s")
        threading.Event().wait(0.01)


def _time_death(take: Callable[[], Any], pids: list[int], error: type[BaseException],
                looks: list[int]) -> tuple[float, int]:
    """Kill `pids` after the quiet spell while `take()` waits; (ms from the kill to `error`,
    looks during the quiet spell)."""
    killed: list[float] = []
    quiet: list[int] = []

    def kill() -> None:
        before = looks[0]
        threading.Event().wait(_QUIET_S)
        quiet.append(looks[0] - before)
        killed.append(time.monotonic())
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill)
    killer.start()
    try:
        take()
    except error:
        raised = time.monotonic()
    else:
        raise RuntimeError("the batch of a killed worker was delivered")
    finally:
        killer.join()
    return (raised - killed[0]) * 1000, quiet[0]


def _gloader(shared: bool, looks: list[int]) -> tuple[float, int]:
    import gloader

    pool = gloader.WorkerPool(1) if shared else None
    with tempfile.TemporaryDirectory(prefix="gloader-stuck-") as folder:
        dataset = _StuckAfter(os.path.join(folder, "stuck"))
        try:
            with gloader.DataLoader[Any](dataset, batch_size=4, num_workers=1, pool=pool, timeout=60) as loader:
                batches = iter(loader)
                next(batches)
                _until_stuck(dataset)  # in the third batch, the second loaded before it
                next(batches)
                return _time_death(lambda: next(batches), loader.worker_pids(), gloader.WorkerExitedError, looks)
        finally:
            if pool is not None:
                pool.close()


def _torch() -> float:
    import torch.utils.data

    with tempfile.TemporaryDirectory(prefix="gloader-stuck-") as folder:
        dataset = _StuckAfter(os.path.join(folder, "stuck"))
        loader: Any = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=1)
        batches: Any = iter(loader)
        next(batches)
        _until_stuck(dataset)
        next(batches)
        try:
            return _time_death(lambda: next(batches), [w.pid for w in batches._workers], RuntimeError, [0])[0]
        finally:
            batches._shutdown_workers()


def measure(rounds: int) -> dict[str, Any]:
    looks = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:  # the waiting thread's looks
        if event == "call" and frame.f_code.co_name == "wait" and frame.f_globals.get("__name__") == "gloader._caller.task":
            looks[0] += 1

    sys.setprofile(profile)
    try:
        own = [_gloader(False, looks) for _ in range(rounds)]
        shared = [_gloader(True, looks) for _ in range(rounds)]
    finally:
        sys.setprofile(None)
    theirs = [_torch() for _ in range(rounds)]
    return {"own pool": own, "shared WorkerPool": shared, "torch": [(ms, None) for ms in theirs]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    results = measure(parser.parse_args(argv).rounds)
    print(f"| a worker killed while the caller waits | death to error, ms, median (min-max) | "
          f"caller's looks in {_QUIET_S:g} s of nothing |")
    print("|---|---|---|")
    for name, rows in results.items():
        ms = [row[0] for row in rows]
        looks = sorted({row[1] for row in rows if row[1] is not None})
        print(f"| {name} | {statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f}) | "
              f"{', '.join(map(str, looks)) or '-'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
