"""In-process loading (`num_workers=0`): a task runs in the caller's thread when its batch is
collected, with the loader's own registration, seeded so that the caller's generators are
left as they were (see `DESIGN.md`). One strategy of `gloader._places`.
"""
from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Iterator

from .._caller.options import LoaderConfig
from .._caller.slots import SlotPool
from .._caller.tuning import Tuner
from .._wire.seed import preserved_global_rng, seed_global_rng
from .._worker.registry import Payload, Registration
from .._worker.run import WorkerState, execute

__all__ = ["InProcess"]


class _Deferred:
    """In-process loading's stand-in for an AsyncResult: the task runs when it is collected."""

    def __init__(self, run: Callable[[], Any]) -> None:
        self._run = run

    def ready(self) -> bool:
        return True

    def wait(self, timeout_s: float) -> None:
        pass

    def get(self, timeout_s: float) -> Any:
        return self._run()


@contextlib.contextmanager
def _seeded_preserving_caller(seed: int) -> Iterator[None]:
    """In-process loading with a seed: the batch's draws are seeded, the caller's restored."""
    with preserved_global_rng():
        seed_global_rng(seed)
        yield


@contextlib.contextmanager
def _unseeded(seed: int) -> Iterator[None]:
    yield


class InProcess:
    """Runs tasks in the caller's thread with the loader's own registration."""

    slots: SlotPool | None = None

    def __init__(self, config: LoaderConfig, payload: Payload) -> None:
        self._registration = Registration(dataset=payload.parts[0], batchify_fn=payload.parts[1],
                                          base_seed=payload.base_seed)
        seeded = config.seed is not None
        self._state = WorkerState.in_process(_seeded_preserving_caller if seeded else _unseeded, seeded)

    def submit(self, args: tuple[Any, ...], on_ready: Callable[[Any], None]) -> _Deferred:
        loader_id, epoch, batches = args[:3]
        return _Deferred(lambda: [execute(self._state, self._registration, loader_id, epoch, number, seed, work, None)
                                  for number, seed, work in batches])

    # Nothing runs elsewhere: no copy of the dataset, no workers to watch, tune or forget, and
    # no round trip a task of several batches would share.
    copies_dataset = False
    task_target_s = 0.0
    exits = types.SimpleNamespace(exited=0)  # nothing runs elsewhere to exit
    owns_workers = True
    has_workers = False

    def find_dead_worker(self) -> str | None:
        return None

    def worker_pids(self) -> list[int]:
        return []

    def worker_processes(self) -> list[Any]:
        return []

    def tune(self, tuner: Tuner, waited_s: float, worker_s: float) -> None:
        pass

    def timed_out(self, epoch: int, batch_indices: list[int]) -> None:
        pass

    def why_late(self) -> str | None:
        return None

    def forget(self, result: Any) -> None:
        pass

    def forget_after_fork(self) -> bool:
        return False

    def close(self, drain: Callable[[float], None], prompt: bool = False) -> None:
        pass
