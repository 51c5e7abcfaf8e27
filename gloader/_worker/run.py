"""What runs where batches are loaded: the pool initializers, the one task function, and
the per-worker state they share.

A `WorkerState` says how this worker differs from the others: where its batches go (a
`BatchWriter`), where it finds loaders (`_ProcessLink` reads payload files and keeps the
status table; `_LocalLink` uses this process's registry), whether it seeds the global
generators, and whether its answers cross a process boundary (then they are encoded bytes and
exceptions travel pickled). `execute` is the same for in-process loading, thread workers and
process workers. Entry points are module-level functions that every start method finds; they
catch `BaseException` around user code and answer with a `WorkerFailure`; the initializers
never raise (a failure is kept and reported by the first task), because a raising
initializer makes the pool respawn workers forever. Never imports caller-side code. The flow
is drawn in `_caller.engine`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import pickle
import threading
import traceback
from typing import Any, Callable, ContextManager

from .._pool.admission import Admission
from .._pool.channel import is_retire_task, on_result_sent, on_task_taken, on_task_wanted, send_partial
from .._pool.directory import open_private_file
from .._wire.protocol import StreamRequest, WorkerFailure, encode, encode_answers
from .._wire.seed import seed_global_rng
from .._wire.segment import Slot
from . import registry as _registry
from .fetch import BatchWriter, Cursor, DirectWriter, SharedMemoryWriter, load_batch
from .registry import Payload, Registration
from .setup import EXIT_CALLER_GONE, prepare_process
from .slots import SlotSpace

__all__ = ["EXIT_CALLER_GONE", "PoolSpec", "StatusTable", "WorkerState", "execute", "initialize_process_worker",
           "initialize_thread_worker", "run_task"]

logger = logging.getLogger(__name__)


class StatusTable:
    """What each process worker is doing, in shared memory the caller reads when one dies.

    A row per worker incarnation: (pid, loader id, epoch, batch index; -1 when idle). The
    pool starts a replacement when a worker dies, and the replacement must not overwrite the
    row that tells what the dead one did, so each worker id has `ROWS_PER_WORKER` rows.
    """

    FIELDS = 4
    ROWS_PER_WORKER = 4
    _PID, _LOADER, _EPOCH, _BATCH = range(FIELDS)
    _RETIRED = -2  # in the batch field: the worker took a retire task

    def __init__(self, array: Any, num_workers: int) -> None:
        self._array = array
        self.rows = num_workers * self.ROWS_PER_WORKER

    @classmethod
    def cells(cls, num_workers: int) -> int:
        """Size of the shared int64 array for `num_workers`."""
        return num_workers * cls.ROWS_PER_WORKER * cls.FIELDS

    def _base(self, row: int) -> int:
        return (row % self.rows) * self.FIELDS

    def claim(self, row: int, pid: int) -> None:
        base = self._base(row)
        self._array[base:base + self.FIELDS] = [pid, -1, -1, -1]

    def mark_busy(self, row: int, loader_id: int, epoch: int, batch_index: int) -> None:
        base = self._base(row)
        self._array[base + self._LOADER:base + self.FIELDS] = [loader_id, epoch, batch_index]

    def mark_idle(self, row: int) -> None:
        self._array[self._base(row) + self._BATCH] = -1

    def mark_retired(self, row: int) -> None:
        """The worker took a retire task (written by the pool's worker loop, before the task runs,
        where no dataset code runs): its exit with EXIT_RETIRED is the pool's request, and the
        same exit code from a dataset (`os._exit(120)` while loading) is told apart as a death."""
        base = self._base(row)
        self._array[base + self._LOADER:base + self.FIELDS] = [-1, -1, self._RETIRED]

    def retired(self, pid: int) -> bool:
        """Whether worker `pid` took a retire task (see `mark_retired`)."""
        return any(self._array[row * self.FIELDS + self._PID] == pid
                   and self._array[row * self.FIELDS + self._BATCH] == self._RETIRED for row in range(self.rows))

    def claim_id(self, incarnations: Any, pid: int) -> tuple[int, int]:
        """(worker id, row) for a starting worker: the first id whose last holder is gone.

        A replacement for a dead worker takes that worker's id, so ids stay unique (the pool
        starts it only after reaping the dead one). Call under the pool's id lock.
        """
        for worker_id in range(self.rows // self.ROWS_PER_WORKER):
            count = incarnations[worker_id]
            if count and _is_alive(self._array[self._base(worker_id * self.ROWS_PER_WORKER + (count - 1)
                                                          % self.ROWS_PER_WORKER) + self._PID]):
                continue
            row = worker_id * self.ROWS_PER_WORKER + count % self.ROWS_PER_WORKER
            incarnations[worker_id] = count + 1
            self.claim(row, pid)
            return worker_id, row
        raise RuntimeError("internal error: every worker id is held by a live process")

    def worker_id(self, pid: int) -> int | None:
        """The worker id that process `pid` claimed, or None before it claimed one."""
        for row in range(self.rows):
            if self._array[row * self.FIELDS + self._PID] == pid:
                return row // self.ROWS_PER_WORKER
        return None

    def has_started(self, pid: int) -> bool:
        return self.worker_id(pid) is not None

    def doing(self, pid: int) -> tuple[int, int, int] | None:
        """(loader id, epoch, batch index) that worker `pid` was loading, or None when idle."""
        for row in range(self.rows):
            base = row * self.FIELDS
            if self._array[base + self._PID] == pid and self._array[base + self._BATCH] >= 0:
                return (self._array[base + self._LOADER], self._array[base + self._EPOCH],
                        self._array[base + self._BATCH])
        return None


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


@dataclasses.dataclass
class PoolSpec:
    """Everything a pool's workers share; passed to the initializer once per worker."""

    num_workers: int
    counter: Any  # thread pools: a synchronized int handing out worker ids; None for processes
    id_lock: Any  # process pools: the ProcessLock that worker id claims are made under; None for threads
    status: Any  # shared int64 array of StatusTable.cells(num_workers); None for threads
    incarnations: Any  # shared int array: processes started so far per worker id; None for threads
    main_pid: int
    payload_dir: str  # payload files of loaders that join the running pool
    generation: Any  # shared int (without a lock), bumped by the caller when a loader leaves the pool
    permits: tuple[Any, ...] = ()  # process pools with more workers than CPUs: one ProcessLock per CPU


class _LocalLink:
    """Threads and in-process loading: loaders are in this process's registry."""

    def find(self, loader_id: int, state: WorkerState) -> Registration | None:
        return _registry.lookup(loader_id)

    def begin(self, loader_id: int, epoch: int, batch_index: int) -> None:
        pass


class _ProcessLink:
    """A process worker's view of its pool: payload files of joining loaders, the status table."""

    def __init__(self, spec: PoolSpec, row: int) -> None:
        self.spec = spec
        self.status = StatusTable(spec.status, spec.num_workers)
        self.row = row
        self._seen_generation = 0

    def _payload_path(self, loader_id: int) -> str:
        return os.path.join(self.spec.payload_dir, f"{loader_id}.pkl")

    def _refresh(self) -> None:
        """Drop loaders that left a shared pool (their payload file is gone)."""
        generation = self.spec.generation.value
        if generation == self._seen_generation:
            return
        self._seen_generation = generation
        for loader_id in _registry.registered_from_file():
            if not os.path.exists(self._payload_path(loader_id)):
                _registry.unregister_loader(loader_id)

    def find(self, loader_id: int, state: WorkerState) -> Registration | None:
        self._refresh()
        registration = _registry.lookup(loader_id)
        if registration is None:
            try:  # only a file of this user's, in the pool's directory of theirs alone: it is unpickled
                with open(open_private_file(self._payload_path(loader_id)), "rb") as handle:
                    payload = pickle.load(handle)
            except FileNotFoundError:
                return None
            _registry.register_loader(loader_id, payload, state.worker_id, state.num_workers, state.crosses_process,
                                     from_file=True)
            registration = _registry.lookup(loader_id)
        return registration

    def begin(self, loader_id: int, epoch: int, batch_index: int) -> None:
        """Mark the batch this worker is loading. The mark stays until the task's result is
        sent (`end`, called by the result queue), so a death up to then names the task's loader."""
        self.status.mark_busy(self.row, loader_id, epoch, batch_index)

    def end(self) -> None:
        self.status.mark_idle(self.row)


_NOTHING_TO_RESTORE = contextlib.nullcontext()  # reusable; a generator-made context costs ~1 us a batch


def _seed_globals(seed: int) -> ContextManager[None]:
    seed_global_rng(seed)  # a process worker's generators are its own: nothing to restore
    return _NOTHING_TO_RESTORE


def _leave_globals(seed: int) -> ContextManager[None]:
    return _NOTHING_TO_RESTORE


@dataclasses.dataclass
class WorkerState:
    """One worker's identity and the parts that differ between kinds of worker.

    `worker_id` is -1 for in-process loading, which publishes no `WorkerInfo`
    (`get_worker_info()` is None in the main process).
    """

    worker_id: int
    num_workers: int
    writer: BatchWriter
    link: _LocalLink | _ProcessLink
    seeding: Callable[[int], ContextManager[None]]
    crosses_process: bool
    streams: dict[int, tuple[int, Any]] = dataclasses.field(default_factory=dict)
    admission: Admission | None = None  # process workers of a pool with more workers than CPUs
    # Whether `seeding` seeds the process-wide generators (a process worker's own, or in-process
    # loading with seed=): then a placed batch reseeds them before each sample (see _fetch).
    seeds_globals: bool = True

    @classmethod
    def in_process(cls, seeding: Callable[[int], ContextManager[None]], seeds_globals: bool) -> WorkerState:
        """The state of in-process loading (`num_workers=0`)."""
        return cls(-1, 0, DirectWriter(), _LocalLink(), seeding, crosses_process=False, seeds_globals=seeds_globals)

    def failure(self, exc: BaseException, tb_text: str, context: str, batch_index: int,
                sample_index: Any) -> WorkerFailure:
        exception: Any = exc
        if self.crosses_process:
            try:
                exception = pickle.dumps(exc)
                pickle.loads(exception)  # some exceptions pickle but cannot be rebuilt; find out here
            except Exception:
                exception = None
        return WorkerFailure(f"{type(exc).__module__}.{type(exc).__qualname__}", _message_of(exc), tb_text, context,
                             batch_index, sample_index, self.worker_id, os.getpid(), exception)


def _message_of(exc: BaseException) -> str:
    """str(exc), or what says it could not be had: an exception whose __str__ raises still
    fails its own batch alone, named, and the batches beside it come."""
    try:
        return str(exc)
    except Exception as inner:
        return f"<str() of the {type(exc).__qualname__} raised {type(inner).__qualname__}>"


def execute(state: WorkerState, registration: Registration, loader_id: int, epoch: int, batch_index: int,
            seed: int, work: Any, space: SlotSpace | None) -> Any:
    """Load one batch of a registered loader; answer with a message, never raise."""
    if registration.error is not None:
        registration = _registry.renewed(registration, loader_id, epoch)
    if registration.error is not None:
        return state.failure(registration.error, registration.error_traceback, registration.error_context,
                             batch_index, None)
    cursor = Cursor()
    try:
        with state.seeding(seed):
            if state.worker_id >= 0:
                _registry.set_current_info((state.worker_id, state.num_workers, seed, registration.dataset))
            if state.crosses_process:  # torch's get_worker_info() is process-wide: not for threads
                _registry.set_torch_worker_info(registration.torch_info)
            return load_batch(registration, loader_id, epoch, work, space, state.writer,
                              state.streams, state.worker_id, cursor,
                              (state.worker_id, state.num_workers, seed, registration.dataset),
                              seed_global_rng if state.seeds_globals else None)
    except BaseException as exc:
        return state.failure(exc, traceback.format_exc(), "", batch_index, cursor.key)
    finally:
        _registry.set_current_info(None)


_PROCESS_STATE: WorkerState | None = None
_ADMITTED = contextlib.nullcontext()  # the tasks of pools that fit their CPUs: no permits
_THREAD_STATE = threading.local()


def _drop_inherited_thread_state() -> None:
    """A process forked from a thread worker (an inner loader's pool, made in a thread pool's
    task) keeps that thread's locals in its only thread: they are not this process's worker."""
    _THREAD_STATE.__dict__.pop("state", None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_inherited_thread_state)


def run_task(loader_id: int, epoch: int, batches: tuple[tuple[int, int, Any], ...], slot: Slot | None,
             cancel: list[bool] | None = None) -> Any:
    """The pool's task: load one or more consecutive batches of one epoch in this worker.

    Args:
        batches: per batch, `(batch index, seed, work)`: its seed (from the loader's seed,
            the epoch and the batch index) and its work (the sample keys, see
            `_wire.protocol.encode_keys`, or a `StreamRequest`).
        slot: the shared-memory slot the caller lent for the task's batches, which are
            written into it one after the other (None: none yet).
        cancel: thread workers: the caller sets `cancel[0]` when nobody will collect the
            task; batches not begun by then are skipped (answered with None).

    Returns:
        A list of answers, one per batch (`Loaded`, `ShardEnd` or `WorkerFailure`). Process
        workers publish each answer in the slot as its batch is written (see `_worker.slots`)
        and return `encode_answers` bytes of (position, encoded answer) for those that did
        not fit there and were not sent before (see `_tell_caller`). A failed batch does not
        stop the others: each answer is re-raised when the caller reaches its batch.
    """
    state: WorkerState | None = getattr(_THREAD_STATE, "state", None) or _PROCESS_STATE
    if state is None:
        failure = WorkerFailure("builtins.RuntimeError", "gloader worker was not initialized", "", "",
                                batches[0][0], None, -1, os.getpid(), None)
        return encode_answers([failure] * len(batches))
    try:
        registration, missing = state.link.find(loader_id, state), None
    except OSError as unreadable:  # its payload file could not be read, or is not the user's alone (see _pool.directory)
        registration, missing = None, unreadable
    space = _opened_space(state, slot)
    answers: list[Any] = []  # in-process and threads: every answer; processes: those not published
    notified = 0  # the caller's WANTED last answered (see _tell_caller)
    admission = state.admission.task(isinstance(batches[0][2], StreamRequest)) if state.admission else _ADMITTED
    with admission:
        for position, (batch_index, seed, work) in enumerate(batches):
            if cancel is not None and cancel[0]:
                answers.append(None)
                continue
            if registration is None:
                exc = missing or RuntimeError(f"gloader worker has no loader {loader_id} registered; it was closed "
                                              "or its pool was started without it")
                message: Any = state.failure(exc, "", "", batch_index, None)
            else:
                state.link.begin(loader_id, epoch, batch_index)
                message = execute(state, registration, loader_id, epoch, batch_index, seed, work, space)
            if not state.crosses_process:
                answers.append(message)
                continue
            encoded = _send(state, message, batch_index)
            if answers or not space.publish(position, encoded):  # published in order, up to the first that did not fit
                answers.append((position, encoded))
            if position + 1 < len(batches):
                notified, answers = _tell_caller(space, notified, answers)
    if not state.crosses_process:
        return answers
    return encode_answers(answers) if answers else b""  # b"": every answer is in the slot


def _opened_space(state: WorkerState, slot: Slot | None) -> SlotSpace:
    """The task's view of `slot`, opened in this process's mapping of it where workers write
    into shared memory (a slot that cannot be opened publishes no answer: writing a batch
    into it reports the error, per batch)."""
    space = SlotSpace(slot)
    maps = state.writer.maps if isinstance(state.writer, SharedMemoryWriter) else None
    if maps is not None:
        with contextlib.suppress(Exception):
            space.open(maps)
    return space


def _tell_caller(space: SlotSpace, notified: int, unpublished: list[tuple[int, bytes]]
                 ) -> tuple[int, list[tuple[int, bytes]]]:
    """When the caller waits for a batch of this task that is written (the slot's WANTED) and
    more batches of the task follow, send it a message now rather than at the task's end: a
    notice when the batch's answer is published in the slot, or the answers that were not.
    The caller sleeps until a message comes (it does not poll), and the next batch may take
    long. Returns the WANTED answered and the answers still to send."""
    wanted = space.wanted()
    if wanted <= notified or wanted > space.published + len(unpublished):
        return notified, unpublished  # not waiting, answered already, or its batch not written yet
    if send_partial(encode_answers(unpublished) if wanted > space.published else None):
        return wanted, [] if wanted > space.published else unpublished
    return notified, unpublished


def _send(state: WorkerState, message: Any, batch_index: int) -> bytes:
    try:
        return encode(message)
    except Exception as exc:  # a non-tensor part of the batch cannot be pickled, even by dill
        return encode(state.failure(exc, traceback.format_exc(), "the batch could not be pickled for the caller",
                                    batch_index, None))


def _claim_thread_id(spec: PoolSpec) -> int:
    with spec.counter.get_lock():
        count = spec.counter.value
        spec.counter.value += 1
    return int(count % spec.num_workers)


def _register_all(state: WorkerState, registrations: list[tuple[int, Payload]]) -> None:
    for loader_id, payload in registrations:
        _registry.register_loader(loader_id, payload, state.worker_id, state.num_workers, state.crosses_process)


def initialize_thread_worker(spec: PoolSpec, registrations: list[tuple[int, Payload]]) -> None:
    """Thread pool initializer: this thread's state (thread workers share the caller's
    generators, so they do not seed them: `get_worker_info().rng` is their source)."""
    try:
        worker_id = _claim_thread_id(spec)
        state = WorkerState(worker_id, spec.num_workers, DirectWriter(), _LocalLink(), _leave_globals,
                            crosses_process=False, seeds_globals=False)
        _THREAD_STATE.state = state
        _register_all(state, registrations)
    except BaseException:  # pragma: no cover - last resort; the first task reports the loader as missing
        logger.exception("gloader thread worker initialization failed")


def initialize_process_worker(spec: PoolSpec, registrations: list[tuple[int, Payload]]) -> None:
    """Process pool initializer: claim a worker id, set the process up, register the loaders."""
    global _PROCESS_STATE
    try:
        status = StatusTable(spec.status, spec.num_workers)
        with spec.id_lock:
            worker_id, row = status.claim_id(spec.incarnations, os.getpid())
        prepare_process(bool(spec.permits), spec.main_pid)
        link = _ProcessLink(spec, row)
        on_task_taken(functools.partial(_claim_task, link))
        on_result_sent(link.end)
        admission = (Admission(spec.permits, worker_id, lambda pid: link.status.doing(pid) is not None)
                     if spec.permits else None)
        if admission is not None:
            on_task_wanted(admission.before_task)
        _PROCESS_STATE = WorkerState(worker_id, spec.num_workers, SharedMemoryWriter(), link, _seed_globals,
                                     crosses_process=True, admission=admission)
        _register_all(_PROCESS_STATE, registrations)
    except BaseException:  # pragma: no cover - last resort; the first task reports the loader as missing
        logger.exception("gloader worker initialization failed")


def _claim_task(link: _ProcessLink, task: Any) -> None:
    """Mark a task of the pool's worker loop, `(job, func, args)`, as this worker's before it
    takes it (the stop, None, is no task)."""
    if type(task) is tuple and len(task) == 3 and task[1] is run_task:
        loader_id, epoch, batches = task[2][:3]
        link.begin(loader_id, epoch, batches[0][0])
    elif is_retire_task(task):
        link.status.mark_retired(link.row)
