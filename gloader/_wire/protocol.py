"""Messages between the caller and its workers, and the errors the caller raises from them.

A task is a flat argument tuple for `_worker.run.run_task`; its answer is one of three
NamedTuples: `Loaded` (a batch, or its shared-memory handle), `ShardEnd` (a stream worker's
shard is exhausted) or `WorkerFailure` (an exception, re-raised in the caller by `reraise`).
Process workers send answers as bytes made by the stdlib pickler (`encode`): per-batch
messages must stay tiny and flat, because the pool's pipes pickle with dill otherwise (see
docs/design.md, "Supervision"). Imports nothing of gloader's: both sides use it. The flow is drawn in
`_caller.engine`.
"""
from __future__ import annotations

import array
import functools
import importlib
import io
import pickle
import sys
from typing import Any, NamedTuple, NoReturn

import numpy as np

__all__ = ["EPOCH_ENDING_ERRORS", "SharedMemoryUnreachableError", "BatchTimeoutError", "Job", "Loaded", "Placed", "ShardEnd", "StreamRequest", "WorkerExitedError", "WorkerFailure",
           "decode", "decode_answer", "decode_answers", "decode_keys", "encode", "encode_answers", "encode_keys"]


class BatchTimeoutError(TimeoutError, RuntimeError):
    """A batch took longer than the loader's `timeout`.

    A `TimeoutError` and, as torch's DataLoader raises, a `RuntimeError`.
    """


class WorkerExitedError(RuntimeError):
    """A worker process died while the loader was running."""


class SharedMemoryUnreachableError(RuntimeError):
    """Worker processes cannot open the shared memory their caller lends (through /proc). No
    batch can travel: the loader stops its workers at the first batch instead of failing each."""


# Errors after which the loader's workers are stopped and the epoch is over (the next iter()
# starts the next epoch on new workers).
EPOCH_ENDING_ERRORS = (WorkerExitedError, BatchTimeoutError, SharedMemoryUnreachableError)


class StreamRequest(NamedTuple):
    """The work of a stream task: the next `batch_size` samples of the worker's own shard."""

    batch_size: int
    keep_last: bool


class Placed(NamedTuple):
    """The work of a batch whose samples are seeded by their place in the epoch's global order
    (the samplers of `_sampling.elastic`): its keys (as `encode_keys` made them), the place of its first
    sample, and the epoch's seed. Sample `j` is seeded from (epoch seed, first + j), whichever
    rank, worker or batch it lands in."""

    keys: Any
    first: int
    epoch_seed: int


class Loaded(NamedTuple):
    """A finished batch: a shared-memory handle from process workers, the batch itself from
    thread workers and in-process loading; with the worker's timings in seconds."""

    batch: Any
    fetch_s: float
    batchify_s: float
    worker_id: int
    started: float  # time.monotonic() when the worker began and finished the batch: one clock
    finished: float  # for every process on the machine, so the caller can time the hops
    samples: int  # how many samples it holds (a stream's caller counts them against len(dataset))
    fetch_threads: int = 0  # threads its samples were fetched with (fetch_threads; 0: the worker's own)
    shard_began: bool = False  # a stream's batch that began its worker's shard for the epoch


class ShardEnd(NamedTuple):
    """A stream task whose worker found its shard exhausted."""

    worker_id: int


class _WorkerTraceback(Exception):
    """The traceback of an exception raised in a worker; set as the `__cause__` of the re-raise."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n\n" + self.text


class WorkerFailure(NamedTuple):
    """An exception raised while loading a batch, as a worker reports it.

    `exception` is the exception itself (thread workers, in-process), its pickle (process
    workers), or None when it could not be pickled; the type name and message rebuild it then.
    `context` says what failed when it was not the batch itself ("worker_init_fn raised").
    `worker_id` is -1 for in-process loading.
    """

    type_name: str
    message: str
    traceback: str
    context: str
    batch_index: int
    sample_index: Any
    worker_id: int
    pid: int
    exception: Any

    def rebuild(self) -> BaseException:
        """The exception as its own type, best effort."""
        exc = self.exception
        if isinstance(exc, bytes):
            try:
                exc = pickle.loads(exc)
            except Exception:
                exc = None
        if isinstance(exc, BaseException):
            return exc
        module, _, qualname = self.type_name.rpartition(".")
        try:
            cls: Any = importlib.import_module(module)
            for part in qualname.split("."):
                cls = getattr(cls, part)
            return cls(self.message)  # type: ignore[no-any-return]
        except Exception:
            return RuntimeError(f"{self.type_name}: {self.message}")

    def reraise(self, epoch: int) -> NoReturn:
        """Raise the exception in the caller with the worker's traceback and where it happened.

        `sys.exit()` (or any exit request) in a worker becomes a RuntimeError: it ended the
        worker's task, not the training script.
        """
        exc = self.rebuild()
        where = "the main process" if self.worker_id < 0 else f"worker {self.worker_id} (pid {self.pid})"
        if self.worker_id >= 0 and not isinstance(exc, Exception):
            exc = RuntimeError(f"{self.type_name}({self.message}) was raised in gloader {where} while loading "
                               f"batch {self.batch_index} of epoch {epoch}: a dataset, transform or batchify "
                               "function must raise an exception, not exit")
        if self.context:
            note = f"gloader: {self.context} in {where}; reported for batch {self.batch_index} of epoch {epoch}"
        else:
            note = f"gloader: raised in {where} while loading batch {self.batch_index} of epoch {epoch}"
            if self.sample_index is not None:
                note += f", at sample index {self.sample_index}"
        exc.add_note(note)
        if self.worker_id < 0:
            raise exc  # in-process: the traceback is already the exception's own
        raise exc from _WorkerTraceback(self.traceback)


def encode(message: Any) -> bytes:
    """Encode an answer for the caller: stdlib pickle; where that fails, stdlib pickle that
    also finds classes held as attributes of a module's classes (`_NestedClassPickler`); dill
    only when a value needs it (lambdas, local classes inside a batch)."""
    try:
        return b"P" + pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        pass
    try:
        buffer = io.BytesIO()
        _NestedClassPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
        return b"P" + buffer.getvalue()
    except Exception:
        import dill

        data: bytes = dill.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        return b"D" + data


class _NestedClassPickler(pickle.Pickler):
    """Saves a class that its qualified name does not find (a namedtuple made in a class body
    is named `Batch`, not `Dataset.Batch`) as an attribute of the module-level class holding
    it, so the caller gets the same class back: dill would send a copy of it, and the
    caller's `isinstance(batch, Dataset.Batch)` would be False."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type) and not _found_by_name(obj):
            held = _holding_class(obj)
            if held is not None:
                owner, name = held
                return _nested_class, (_caller_module(owner.__module__), owner.__qualname__, name)
        return NotImplemented


def _nested_class(module: str, owner: str, name: str) -> Any:
    """The caller's side of `_NestedClassPickler`: `module.owner.name`."""
    return getattr(getattr(importlib.import_module(module), owner), name)


def _caller_module(name: str) -> str:
    """A spawned worker runs the caller's main script as `__mp_main__`: it is `__main__` there."""
    return "__main__" if name == "__mp_main__" else name


def _found_by_name(cls: type) -> bool:
    found: Any = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is cls


@functools.lru_cache(maxsize=64)  # asked again for every batch that holds the class
def _holding_class(cls: type) -> tuple[type, str] | None:
    """(module-level class, attribute name) holding `cls`, searched in `cls`'s module: the
    class itself, or else a class of its name and fields (a spawned worker's copy of a class
    from the caller's `__main__` holds a copy of it, not the one its `__main__` defines)."""
    module = sys.modules.get(cls.__module__)  # in a spawned worker, "__main__" is the caller's script
    owners = [owner for owner in (list(vars(module).values()) if module is not None else [])
              if isinstance(owner, type) and owner is not cls and _found_by_name(owner)]
    for by_identity in (True, False):
        for owner in owners:
            for name, value in list(vars(owner).items()):
                if value is cls if by_identity else _alike(value, cls):
                    return owner, name
    return None


def _alike(value: Any, cls: type) -> bool:
    return (isinstance(value, type) and value.__qualname__ == cls.__qualname__
            and _caller_module(value.__module__) == _caller_module(cls.__module__)
            and getattr(value, "_fields", None) == getattr(cls, "_fields", None))


def decode(data: bytes) -> Any:
    """Decode bytes made by `encode`."""
    body = memoryview(data)[1:]  # no copy: a batch may travel inside
    if data[:1] == b"P":
        return pickle.loads(body)
    import dill

    return dill.loads(body)


def encode_answers(answers: list[Any]) -> bytes:
    """One task's answers as one bytes object for the caller. Items may be `encode`d bytes (a
    process worker sends each answer so), which the caller decodes one by one, at its batch's
    turn (`decode_answer`): an answer that cannot be rebuilt there fails its own batch only."""
    return encode(answers)


def decode_answers(answer: Any) -> list[Any]:
    """A task's answers, from `encode_answers` bytes (items still `encode`d, see
    `decode_answer`) or the list thread workers and in-process loading return."""
    if isinstance(answer, bytes):
        return list(decode(answer))
    return list(answer)


def decode_answer(item: Any) -> Any:
    """One answer of `decode_answers`, decoded if it came encoded (may raise what unpickling it
    raises in this process)."""
    return decode(item) if isinstance(item, bytes) else item


def encode_keys(keys: Any) -> Any:
    """Sample keys for a task: int64 bytes when they are all integers (one flat object, cheap
    to send), otherwise the keys themselves, so that any key reaches `__getitem__` unchanged."""
    try:
        array = np.asarray(keys)
    except Exception:
        return list(keys)
    kind, size = array.dtype.kind, array.dtype.itemsize
    if array.ndim == 1 and (kind == "i" or (kind == "u" and size < 8)):
        return array.astype(np.int64, copy=False).tobytes()
    return list(keys)


def decode_keys(keys: Any) -> list[Any]:
    """The sample keys of a task, as `encode_keys` received them."""
    if isinstance(keys, bytes):  # int64 in this machine's byte order, from this machine's caller
        return array.array("q", keys).tolist()  # half the time of numpy's frombuffer(...).tolist()
    return keys  # type: ignore[no-any-return]


class Job(NamedTuple):
    """One batch to load: its epoch, its index in the epoch, its seed, and its work (encoded
    sample keys or a `StreamRequest`). The caller's side of a task."""

    epoch: int
    batch_index: int
    seed: int
    work: Any
