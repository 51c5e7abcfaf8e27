"""Where tasks run on a Ray cluster: `RayPool`, given as `DataLoader(..., pool=RayPool(8))`.

Everything Ray-specific lives here; the engine sees one more strategy (see `_places`). The
loader's workers are Ray actors, one per worker id, started when the loader first loads:
constructing an actor is the pool initializer (the loader's payload goes to Ray's object store
once, `ray.put`, and each actor registers it by loader id in its process, as a process
worker's initializer does). A task is an actor call that loads one batch with the same
`_worker.run.execute` as every other worker, and answers with the batch's numpy arrays, which Ray
keeps in its object store and the caller maps without a copy on the same node.

A task lost with its actor or node (the actor died, the node left the cluster, the result's
object was lost) is run again on another actor, and a replacement actor with the dead one's
worker id is started where Ray finds room. A batch is a pure function of the loader's seed,
the epoch, its index and its sample keys, so the epoch completes as an undisturbed one would
(a stream's batch is not: it is its worker's next samples, so a lost stream task fails the
epoch with `WorkerExitedError`, as a dead local worker does). When no actor is left and none
can start, the batch's `timeout` ends the wait.

Ray is imported only when a RayPool starts its first loader: a local loader never imports it.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import types
import warnings
from typing import Any, Callable, Iterator

import numpy as np
import torch

from .._caller.tuning import Tuner
from .._checks import check_positive_int
from .._wire.protocol import Loaded, StreamRequest, WorkerExitedError
from .._wire.tree import as_torch_dtype, map_structure
from .._worker import registry as _registry
from .._worker.registry import Payload
from .._worker.run import WorkerState, _LocalLink, _seed_globals, execute
from .ray_cluster import amounts, check_reachable, resources_each, warn_if_no_room

__all__ = ["RayPool"]

# How many times one task may be run again after losing its actor, per worker of the pool,
# before the loader gives up with WorkerExitedError (every actor keeps dying: a dataset that
# kills its process, or a cluster without room). Larger: survives more churn; smaller: fails sooner.
_RERUNS_PER_WORKER = 2
# The worker time a task's batches add up to (see `_caller.sizing`). An actor call costs ~1.2 ms of
# CPU between the caller, Ray's daemons and the actor on a 2-CPU host (small answers, two
# actors: 1,400-1,900 calls/s), against ~0.15 ms a local task: W3 on RayPool(2) made 2,420
# samples/s with one batch (16 ms) a call, 2,650 at 0.05 s and 2,840 at 0.1 s a task (medians of
# 3 rounds). Longer: less overhead; shorter: less in flight, and an answer comes sooner.
_TASK_TARGET_S = 0.1
# The concurrency group of the calls that ask an actor what it is loading, answered beside
# the call that loads (Ray runs each group in its own thread), and how long such an answer may
# take (the caller waits that long at most, once per batch over its timeout).
_PROBE_GROUP = "probe"
_PROBE_S = 5.0
# While a task waits for an actor Ray has not placed (started) yet, it is looked at this often,
# to go to one that is placed (it is cancelled where it waited: see `_RayResult._move_if_unplaced`).
_PLACEMENT_LOOK_S = 0.5
def _numpy_leaves(batch: Any) -> Any:
    """The batch with its CPU tensors as numpy arrays sharing their memory: Ray stores numpy
    arrays out of band and the caller maps them without a copy (tensors would be pickled)."""
    return map_structure(lambda leaf: leaf.numpy() if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu"
                         else leaf, batch)


class _ArrayWriter:
    """The batch itself, as numpy arrays (see `_numpy_leaves`)."""

    def write(self, batchify_fn: Callable[[list[Any]], Any], samples: list[Any], space: Any) -> Any:
        return _numpy_leaves(batchify_fn(samples))


class RayWorker:
    """One worker of a loader on Ray (the actor's class; `ray.remote` wraps it when a pool
    starts). Its first task registers the loader, as a pool initializer does, in the thread
    that runs every task (Ray runs them in one thread of their own beside the probes' thread):
    a dataset that keeps thread-bound handles (sqlite) is made and used in one thread. Never
    raises (a failure is kept and reported by each batch)."""

    def __init__(self, loader_id: int, payload: Payload, worker_id: int, num_workers: int,
                 caller_path: list[str]) -> None:
        # As a spawned local worker does, find modules where the caller finds them (those of
        # its paths that exist on this node), before the payload is unpickled.
        sys.path.extend(path for path in caller_path if path not in sys.path and os.path.isdir(path or "."))
        self._loader_id = loader_id
        self._payload: Payload | None = payload
        self._worker = (worker_id, num_workers)
        self._state = WorkerState(worker_id, num_workers, _ArrayWriter(), _LocalLink(), _seed_globals,
                                  crosses_process=True)
        # The batch being loaded: (epoch, its number, the task's answers so far), set as one
        # value, so that a probe reads the answers of exactly the batches before it.
        self._loading: tuple[int, int, list[Any]] | None = None

    def ready(self) -> int:
        """The actor's pid, once it is constructed."""
        return os.getpid()

    def run(self, epoch: int, batches: tuple[tuple[int, int, Any], ...]) -> list[Any]:
        """Load the task's batches; one answer per batch (Loaded, ShardEnd or WorkerFailure)."""
        if self._payload is not None:
            payload, self._payload = self._payload, None
            _registry.register_loader(self._loader_id, payload, *self._worker, True)
        registration = _registry.lookup(self._loader_id)  # registered above, which never fails
        assert registration is not None
        answers: list[Any] = []
        for number, seed, work in batches:
            self._loading = (epoch, number, answers)
            answers.append(execute(self._state, registration, self._loader_id, epoch, number, seed, work, None))
        self._loading = None
        return answers

    def loading(self) -> tuple[int, int, list[Any]] | None:
        """(epoch, batch number) of the batch being loaded, with the answers of its task's
        batches before it; None between tasks. Called in the probes' concurrency group, while a
        task runs."""
        now = self._loading
        return None if now is None else (now[0], now[1], list(now[2]))


class RayPool:
    """Run a loader's workers as Ray actors, on this machine or across a Ray cluster.

    Given as `DataLoader(..., pool=RayPool(num_workers=32))`. Each loader it is given to
    starts its own actors at its first batch (the dataset goes to Ray's object store once) and
    ends them at `close()`. Batches are bit-identical to `num_workers=0` with the same `seed=`,
    whatever the number of actors; `state_dict()`, samplers, per-batch errors and `timeout`
    work as with local workers; a task lost with its actor or node runs again on another
    actor (see docs/guide/ray.md).

    Args:
        num_workers: actors per loader, >= 1.
        address: the cluster to connect to when Ray is not initialized yet: None (Ray's
            default: `RAY_ADDRESS`, else a new local instance), 'auto' (a running cluster on
            this machine) or 'ray://host:port'. An initialized Ray is used as it is.
        num_cpus: CPUs Ray reserves for each actor (> 0).
        resources: custom resources each actor needs, e.g. `{"cpu_node": 1}` to keep the
            workers on CPU-only nodes.
        actor_options: further `ray.remote` options for each actor (`scheduling_strategy`,
            `memory`, `runtime_env`, ...).
        init_options: further `ray.init` options, used when this pool initializes Ray.

    Raises:
        TypeError, ValueError: for a bad argument, naming it.
    """

    # What a loader reads of a pool given as pool= (see `_caller.options.PoolLike`).
    worker_kind = "Ray actors"
    thread_pool = False
    start_method = None
    closed = False

    def __init__(self, num_workers: int, *, address: str | None = None, num_cpus: float = 1.0,
                 resources: dict[str, float] | None = None, actor_options: dict[str, Any] | None = None,
                 init_options: dict[str, Any] | None = None) -> None:
        self.num_workers = check_positive_int("num_workers", num_workers)
        if address is not None and not isinstance(address, str):
            raise TypeError(f"address must be a str ('auto', 'ray://host:port') or None, got {address!r}")
        if isinstance(num_cpus, bool) or not isinstance(num_cpus, (int, float)) or not num_cpus > 0:
            raise ValueError(f"num_cpus must be a number > 0 (CPUs reserved per actor), got {num_cpus!r}")
        for name, value in (("resources", resources), ("actor_options", actor_options),
                            ("init_options", init_options)):
            if value is not None and not isinstance(value, dict):
                raise TypeError(f"{name} must be a dict or None, got {type(value).__name__}")
        self.address = address
        self.num_cpus = float(num_cpus)
        self.resources = dict(resources or {})
        self.actor_options = dict(actor_options or {})
        self.init_options = dict(init_options or {})

    def __repr__(self) -> str:
        return f"RayPool(num_workers={self.num_workers}, address={self.address!r}, num_cpus={self.num_cpus:g})"

    def connect(self, timeout_s: float) -> Any:
        """The `ray` module, initialized (with this pool's address and options if it was not).

        Raises:
            ConnectionError: nothing answers at the cluster's address within `timeout_s` (ray.init
                itself would wait for minutes), naming the address.
        """
        import ray

        if not ray.is_initialized():
            check_reachable(self.address or os.environ.get("RAY_ADDRESS") or None, timeout_s)
            ray.init(address=self.address, **self.init_options)
        return ray

    def start_backend(self, config: Any, loader_id: int, make_payload: Callable[..., Payload]) -> OnRay:
        """Start a loader's actors (the strategy `_places.start` returns for this pool)."""
        return OnRay(self, config, loader_id, make_payload(True, shared=False))  # its object store takes the buffers


class _RayResult:
    """A task in flight on an actor, as the engine waits for it (`ready`, `wait`, `get`).
    Re-runs the task on another actor when its actor or its result is lost."""

    def __init__(self, backend: OnRay, epoch: int, batches: tuple[tuple[int, int, Any], ...],
                 on_ready: Callable[[Any], None]) -> None:
        self._backend = backend
        self._epoch = epoch
        self._batches = batches
        self._on_ready = on_ready
        self._value: list[Any] | None = None
        self.reruns = 0
        self.worker, self.actor, self.ref = backend.dispatch(epoch, batches)

    def ready(self) -> bool:
        if self._value is None:
            with self._backend.connected():
                done, _ = self._backend.ray.wait([self.ref], timeout=0, fetch_local=False)
            if done:
                self._take()
            else:
                self._move_if_unplaced()
        return self._value is not None

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self._value is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            with self._backend.connected():
                done, _ = self._backend.ray.wait([self.ref], timeout=min(left, _PLACEMENT_LOOK_S))
            if done:
                self._take()
            else:
                self._move_if_unplaced()

    def _move_if_unplaced(self) -> None:
        """Send the task to a placed actor while its own is not placed (starting, or waiting for
        room: see `OnRay.unplaced`); it is cancelled where it waited, so nothing runs twice."""
        backend = self._backend
        if backend.unplaced(self.worker):
            with contextlib.suppress(Exception):  # a call Ray cannot cancel is dropped when it ends
                backend.ray.cancel(self.ref)
            backend.finished(self.worker)
            self.worker, self.actor, self.ref = backend.dispatch(self._epoch, self._batches)

    def loading(self) -> tuple[int, list[Any]] | None:
        """The position in the task of the batch its actor is loading, when it is one of this
        task's, with the answers of the batches before it: a task's answers come back together,
        so at a deadline the caller takes in those finished (see `Task.overdue`); None when the
        actor is not on this task, is not placed yet, or does not answer in time."""
        ray = self._backend.ray
        if self._backend.waits_for_placement(self.worker):
            return None  # nothing can answer: the caller's deadline stands
        try:
            found = ray.get(self.actor.loading.options(concurrency_group=_PROBE_GROUP).remote(), timeout=_PROBE_S)
        except Exception:  # lost, or busy past the probe's deadline: the batch waited for is the late one
            return None
        if found is None or found[0] != self._epoch:
            return None
        for position, (number, _, _) in enumerate(self._batches):
            if number == found[1]:
                return position, [_rebuilt(answer) for answer in found[2]]
        return None

    def get(self, timeout_s: float) -> list[Any]:
        if self._value is None:
            raise RuntimeError("internal error: a Ray task's answers were read before it was ready")
        return self._value

    def _take(self) -> None:
        """Read the finished task's answers; a lost actor or result runs it again elsewhere."""
        backend = self._backend
        ray = backend.ray
        try:
            with backend.connected():
                answers = ray.get(self.ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError, ray.exceptions.WorkerCrashedError,
                ray.exceptions.NodeDiedError) as exc:
            backend.lost(self.worker, self.actor, exc)
            if isinstance(self._batches[0][2], StreamRequest):
                raise WorkerExitedError(f"gloader Ray worker {self.worker} was lost ({type(exc).__name__}) while "
                                        "loading a stream's batch, which is its shard's next samples and cannot "
                                        "be loaded again elsewhere") from exc
            self.reruns += 1
            if self.reruns > _RERUNS_PER_WORKER * backend.count:
                raise WorkerExitedError(f"gloader Ray workers kept being lost: batch {self._batches[0][0]} of epoch "
                                        f"{self._epoch} was run {self.reruns} times ({type(exc).__name__}: "
                                        f"{exc})") from exc
            self.worker, self.actor, self.ref = backend.dispatch(self._epoch, self._batches)
            return
        backend.finished(self.worker)
        self._value = [_rebuilt(answer) for answer in answers]
        self._on_ready(None)


def _viewing_tensor(leaf: Any) -> Any:
    if not isinstance(leaf, np.ndarray) or leaf.dtype.hasobject or as_torch_dtype(leaf.dtype) is None:
        return leaf
    try:
        return torch.from_numpy(leaf)
    except ValueError:  # a reversed view (negative strides)
        return torch.from_numpy(np.ascontiguousarray(leaf))


def _rebuilt(answer: Any) -> Any:
    """A batch from the object store as tensors viewing it, without a copy. Ray hands its
    arrays out read-only, though the memory is writable: the object is this batch's alone and
    is released with its last tensor, as a batch in a shared-memory slot is."""
    if not isinstance(answer, Loaded):
        return answer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "The given NumPy array is not writable"
        return answer._replace(batch=map_structure(_viewing_tensor, answer.batch))


class OnRay:
    """Runs a loader's tasks on its Ray actors (see the module's docstring)."""

    slots = None  # batches come through Ray's object store
    exits = types.SimpleNamespace(exited=0)  # a lost actor's tasks run again elsewhere: no death to report
    has_workers = True
    owns_workers = True
    task_target_s = _TASK_TARGET_S

    def __init__(self, pool: RayPool, config: Any, loader_id: int, payload: Payload) -> None:
        self.ray = pool.connect(config.timeout_s)
        self._driver = self.ray.get_runtime_context().get_worker_id()  # this session's: see `connected`
        self._pool = pool
        self._loader_id = loader_id
        self.count = pool.num_workers
        # Actors hold a copy of the dataset; torch's persistent workers keep theirs.
        self.copies_dataset = not config.persistent_workers
        self._payload = self.ray.put(payload)
        options: dict[str, Any] = {"num_cpus": pool.num_cpus, "max_restarts": 0, "max_task_retries": 0,
                                   "concurrency_groups": {_PROBE_GROUP: 1},
                                   **({"resources": pool.resources} if pool.resources else {}), **pool.actor_options}
        self._actor_class = self.ray.remote(**options)(RayWorker)
        self._pending: dict[int, Any] = {}  # worker id -> its actor's ready() while Ray has not placed it
        warn_if_no_room(self.ray, pool, config.timeout_s)
        self._placement_deadline = time.monotonic() + config.timeout_s  # see dispatch
        self._actors: list[Any] = [self._start(worker) for worker in range(self.count)]
        self._loads = [0] * self.count  # tasks in flight per worker id
        self._next = 0

    def _start(self, worker: int) -> Any:
        actor = self._actor_class.remote(self._loader_id, self._payload, worker, self.count, sys.path)
        self._pending[worker] = actor.ready.remote()
        return actor

    def dispatch(self, epoch: int, batches: tuple[tuple[int, int, Any], ...]) -> tuple[int, Any, Any]:
        """Send a task to a placed worker with the fewest in flight (in turn among equals); to
        one Ray has not placed yet (its calls wait for it) only when none is placed. While none
        is, the loader's first tasks wait for the first to start, up to one `timeout` from the
        start in all (an actor's start is not a batch's time); after that, a batch whose actor is
        not placed fails at its own timeout, saying why (see `why_late`)."""
        left = self._placement_deadline - time.monotonic()
        if left > 0 and len(self._pending) == self.count:
            with self.connected():
                self.ray.wait(list(self._pending.values()), num_returns=1, timeout=left, fetch_local=False)
        self._look_for_placed()
        order = [(self._next + offset) % self.count for offset in range(self.count)]
        worker = min(order, key=lambda worker: (worker in self._pending, self._loads[worker]))
        self._next = (worker + 1) % self.count
        self._loads[worker] += 1
        actor = self._actors[worker]
        with self.connected():
            return worker, actor, actor.run.remote(epoch, batches)

    def _look_for_placed(self) -> None:
        if self._pending:
            refs = list(self._pending.values())
            with self.connected():
                placed, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            for worker in [worker for worker, ref in self._pending.items() if ref in placed]:
                del self._pending[worker]

    def waits_for_placement(self, worker: int) -> bool:
        """Whether Ray has not yet placed (started) the actor of `worker`."""
        self._look_for_placed()
        return worker in self._pending

    def unplaced(self, worker: int) -> bool:
        """Whether the actor of `worker` is not placed while another is: its tasks go to those."""
        return self.waits_for_placement(worker) and len(self._pending) < self.count

    def why_late(self) -> str | None:
        """What a batch over its timeout was waiting for, when it is not the dataset: actors Ray
        has not placed for want of resources."""
        self._look_for_placed()
        if not self._pending:
            return None
        needed = resources_each(self._pool)
        return (f"{len(self._pending)} of its {self.count} Ray actors still wait for resources (each needs {needed}; "
                f"the cluster has {amounts(self.ray.available_resources(), needed)} available): other actors hold "
                "them, another loader's on the same RayPool too; close those, lower num_cpus or add nodes")

    @contextlib.contextmanager
    def connected(self) -> Iterator[None]:
        """Ray calls made while Ray was shut down underneath (`ray.shutdown()` by the program, or
        a shut down and a new start) raise WorkerExitedError saying so, before Ray starts anew on
        its own (a remote call does): the loader's actors are gone, and the next iter() starts new
        ones on the Ray that is initialized then."""
        self._check_session()
        try:
            yield
        except Exception as exc:
            self._check_session(exc)
            raise

    def _same_session(self) -> bool:
        return bool(self.ray.is_initialized()) and self.ray.get_runtime_context().get_worker_id() == self._driver

    def _check_session(self, cause: BaseException | None = None) -> None:
        if self._same_session():
            return
        raise WorkerExitedError("Ray was shut down (ray.shutdown()) while this loader's actors ran: they are gone, "
                                "and so are the batches they held; a new iter() starts new actors once Ray is "
                                "initialized again (the RayPool initializes it when it is not)") from cause

    def finished(self, worker: int) -> None:
        self._loads[worker] = max(0, self._loads[worker] - 1)

    def lost(self, worker: int, actor: Any, exc: BaseException) -> None:
        """A task's `actor` or its result was lost: replace the actor (once: its other tasks
        in flight fail too, after its replacement has started)."""
        if self._actors[worker] is not actor:
            return  # replaced already (its count of tasks in flight began anew)
        self.finished(worker)
        if isinstance(exc, self.ray.exceptions.ObjectLostError):
            return  # only the result is gone; the actor may be fine
        self._actors[worker] = self._start(worker)
        self._loads[worker] = 0  # its other tasks fail too and are run again elsewhere
        self.ray.kill(actor, no_restart=True)

    def submit(self, args: tuple[Any, ...], on_ready: Callable[[Any], None]) -> _RayResult:
        loader_id, epoch, batches = args[:3]
        return _RayResult(self, epoch, batches, on_ready)

    def find_dead_worker(self) -> str | None:
        return None  # a lost actor's task runs again elsewhere (see `_RayResult._take`)

    def worker_pids(self) -> list[int]:
        return []  # the actors' processes may be on other machines

    def worker_processes(self) -> list[Any]:
        return []

    def tune(self, tuner: Tuner, waited_s: float, worker_s: float) -> None:
        pass  # a RayPool's count stays as given

    def timed_out(self, epoch: int, batch_indices: list[int]) -> None:
        pass  # the loader's own actors: stopping them ends the hung one

    def forget(self, result: Any) -> None:
        pass

    def forget_after_fork(self) -> bool:
        return True  # Ray's connection is the parent's

    def close(self, drain: Callable[[float], None], prompt: bool = False) -> None:
        actors, self._actors = self._actors, []
        if not self._same_session():
            return  # Ray was shut down: the actors went with it (and a call now would start Ray anew)
        for actor in actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # pragma: no cover - Ray already shut down at exit
                pass
