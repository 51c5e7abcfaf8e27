"""Every DataLoader argument, checked once into one frozen config.

A bad value fails at the line that wrote it instead of inside a worker minutes later. This
is the only place that validates the loader's arguments and their combinations (sampler
against shuffle, batch_sampler against the rest, pool= against num_workers). Runs in the
caller's process; the flow is drawn in `_caller.engine`.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import os
import warnings
from typing import Any, Callable, NamedTuple, Protocol

import torch

from .._checks import (
    check_callable,
    check_flag,
    check_last_batch,
    check_non_negative_int,
    check_positive_int,
    check_seed,
    check_start_method,
    check_timeout,
    is_int,
)
from .._math import ceil_div
from .._pool.admission import usable_cpus
from .._sampling.samplers import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler, dataset_length
from .._wire.protocol import StreamRequest
from .._worker.datapipes import is_datapipe, turn_on_datapipe_shuffle
from ..batchify import EachSample, default_batchify_fn
from ..dataset import IterableDataset
from .device import check_device, check_pin_device
from .tuning import default_memory_budget, most_workers

__all__ = ["LoaderConfig", "PoolLike", "warn_if_every_rank_loads_everything"]

# num_workers above this many per CPU draws a warning at construction. Higher: fewer warnings
# for deliberately oversubscribed I/O-bound loading; lower: earlier notice of contention.
_OVERSUBSCRIBED_PER_CPU = 2


class PoolLike(Protocol):
    """What a loader reads of the pool given as pool=, a `WorkerPool` (its `core`) or a `RayPool`
    (its `start_backend` instead; a protocol, so that the options need not import either;
    `_is_pool` checks a value for it)."""

    core: Any
    num_workers: int
    thread_pool: bool
    start_method: str | None
    closed: bool


def _argument(check: Callable[[str, Any], Any], argument: str | None = None) -> Any:
    """A config field that is the DataLoader argument of its name (or `argument`), checked by
    `check(name, value)`: `LoaderConfig.build` fills it. A new argument of that kind is written
    in the DataLoader's signature (with its doc), here, and as the loader's attribute."""
    return dataclasses.field(metadata={"check": check, "argument": argument})


def _flag(name: str, value: Any) -> bool:
    return check_flag(name, value, none_means=False)


def _given(name: str, value: Any) -> Any:
    return value  # checked with others in `build`


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """The loader's validated settings; made by `LoaderConfig.build` only.

    `batch_sampler` decides a map-style epoch; `stream` is set instead for a stream dataset
    (gloader's or torch's IterableDataset). `lookahead`: whether the next epoch's first batches
    may be dispatched before the caller asks (see `build`). `seed` is the seed given as seed=,
    `base_seed` the one to start with (None: drawn at the first iter(), from `generator` if
    one was given). The fields made with `_argument` are arguments checked on their own.
    """

    dataset: Any = _argument(_given)
    timeout_s: float = _argument(lambda name, value: check_timeout(value), "timeout")
    pin_memory: bool = _argument(_flag)
    device: torch.device | None = _argument(lambda name, value: check_device(value))
    worker_init_fn: Callable[[int], None] | None = _argument(check_callable)
    pool: PoolLike | None = _argument(_given)
    progress: bool = _argument(check_flag)
    generator: torch.Generator | None = _argument(_given)
    in_order: bool = _argument(check_flag)
    # torch's argument. Workers persist across epochs either way; True also keeps their copy of
    # the dataset for the loader's life, as torch's persistent workers do (torch's own tests
    # assert it), where False (the default) restarts them when the dataset changed.
    persistent_workers: bool = _argument(_flag)
    batch_sampler: Any
    stream: StreamRequest | None
    batchify_fn: Callable[[list[Any]], Any]
    lookahead: bool
    num_workers: int
    prefetch: int
    thread_pool: bool
    pin_device_id: int
    start_method: str | None
    seed: int | None
    base_seed: int | None
    batch_size: int | None
    sampler: Any
    drop_last: bool
    stream_batches: int | None
    # torch's multiprocessing_context when a context object was given (its name is start_method).
    mp_context: Any = None
    # shuffle=True: the loader built a RandomSampler, seeded with the base seed.
    own_shuffle: bool = False
    # Threads each worker fetches a batch's samples with (None: the worker's own thread).
    fetch_threads: int | str | None = None
    # Why the loader has num_workers workers (num_workers='auto', as given, or a pool's), for stats().
    workers_chosen: str = ""
    # num_workers='auto': the CPUs the workers may keep busy and the bytes of worker memory
    # (USS, None: no limit) the count is tuned within; None otherwise.
    cpu_budget: float | None = None
    memory_budget: int | None = None
    # Whether each budget is the default, shared by the process's tuned loaders (see _tuning).
    budgets_shared: tuple[bool, bool] = (False, False)
    # The most workers the loader's pool may be resized to (num_workers unless it tunes them).
    most_workers: int = 0
    # The DataLoader's arguments as given, by name: what `_caller.attributes.changed_config` builds the config again from.
    arguments: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def tunes_workers(self) -> bool:
        """num_workers='auto' on the loader's own pool of processes, for a map-style dataset:
        the count follows what the loader measures (see `_caller.tuning`). A stream's shards are one
        per worker and a shared pool serves other loaders, so their count stays as picked."""
        return self.cpu_budget is not None and self.most_workers > self.num_workers

    @property
    def worker_kind(self) -> str:
        """'in-process', 'threads', 'processes', or what the pool given says ('Ray actors')."""
        return "in-process" if self.num_workers == 0 else "threads" if self.thread_pool else \
            getattr(self.pool, "worker_kind", "processes")

    @property
    def device_reads_slots(self) -> bool:
        """Batches reach a CUDA device straight from their page-locked shared-memory slots
        (process workers and a device): no pinning copy, so no pin thread either."""
        return self.device is not None and self.num_workers > 0 and not self.thread_pool

    @property
    def pin_thread(self) -> bool:
        """Batches are pinned in a background thread before the caller (or the device stage) gets them."""
        return self.pin_memory and not self.device_reads_slots

    @property
    def most_prefetch(self) -> int:
        """Tasks in flight at the most workers (the window follows a tuned count)."""
        return math.ceil(self.prefetch * self.most_workers / self.num_workers) if self.num_workers else self.prefetch

    @property
    def prefetch_factor(self) -> int | None:
        """torch's name: batches in flight per worker (None without workers)."""
        return self.prefetch // self.num_workers if self.num_workers else None

    @classmethod
    def build(cls, given: dict[str, Any], batches: LoaderConfig | None = None) -> LoaderConfig:
        """Check every DataLoader argument (`given`: each by its name in the signature) and their
        combinations; torch's names are merged into Gluon's. With `batches`, a config built
        before, its batch sampler (or stream) is kept as it is, with the batchify function of
        `given`.

        Raises:
            TypeError, ValueError: naming the argument, the value given and what is allowed.
        """
        checked = {field.name: field.metadata["check"](name, given[name]) for field in dataclasses.fields(cls)
                   if "check" in field.metadata for name in [field.metadata["argument"] or field.name]}
        check_flag("try_nopython", given["try_nopython"], none_means=False)  # accepted, never used
        dataset, pool, sampler, batch_sampler = given["dataset"], given["pool"], given["sampler"], given["batch_sampler"]
        batchify_fn = _one_of("batchify_fn", given["batchify_fn"], "collate_fn", given["collate_fn"])
        last_batch = _merge_drop_last(given["last_batch"], given["drop_last"])
        context = given["multiprocessing_context"]
        start_method = _one_of("start_method", given["start_method"], "multiprocessing_context", _context_name(context))
        num_workers, thread_pool = given["num_workers"], given["thread_pool"]
        if pool is not None:
            num_workers, thread_pool, start_method = _take_pool_settings(pool, num_workers, thread_pool, start_method)
        cpu_budget, memory_budget = given["cpu_budget"], given["memory_budget"]
        budget = _check_budgets(num_workers, cpu_budget, memory_budget)
        workers = _check_num_workers(num_workers, budget[0])
        chosen = (f"the workers of the {type(pool).__name__} given as pool=" if pool is not None else
                  f"num_workers='auto': one per CPU of cpu_budget={budget[0]:g} to start"
                  if num_workers == "auto" else "num_workers as given")
        method = check_start_method(start_method)
        prefetch, prefetch_factor = given["prefetch"], given["prefetch_factor"]
        _check_worker_options(workers, method, checked["persistent_workers"], prefetch, prefetch_factor)
        depth = _check_prefetch(prefetch if prefetch_factor is None else
                                check_positive_int("prefetch_factor", prefetch_factor) * workers, workers)
        given_seed = _seed_from(given["seed"], given["generator"])
        base_seed = given_seed  # None: drawn at the first iter(), where torch draws (see `_caller.serving`)
        pin_id = check_pin_device(checked["pin_memory"], given["pin_device_id"])
        batchify_fn = check_callable("batchify_fn", batchify_fn)
        plan = (_plan_batches(dataset, given["batch_size"], given["shuffle"], sampler, last_batch, batch_sampler,
                              base_seed, batchify_fn) if batches is None else _kept_batches(batches, batchify_fn))
        thread = check_flag("thread_pool", thread_pool)
        if thread and workers > 1 and is_datapipe(dataset):
            raise ValueError(f"a torch IterDataPipe allows one iterator at a time, and thread workers share one "
                             f"dataset: thread_pool=True with num_workers={workers} would read it from {workers} "
                             "threads at once; use process workers (thread_pool=False) or num_workers=1")
        fetch = _check_fetch_threads(given["fetch_threads"], workers, thread, plan.stream is not None)
        tunes = budget[0] is not None and pool is None and not thread and plan.stream is None and workers > 0
        most = max(workers, most_workers(budget[0])) if budget[0] is not None and tunes else workers
        _warn_about_setup(workers)
        # Dispatch the next epoch's first batches early only when this loader built the sampler (a user's
        # may change between epochs: set_epoch) and workers are processes, with their own copy of the dataset
        # (threads would load the next epoch from a dataset the caller may still change between epochs).
        lookahead = (sampler is None and batch_sampler is None and plan.stream is None and workers > 0
                     and not thread)
        return cls(**checked, batch_sampler=plan.batch_sampler, stream=plan.stream, batchify_fn=plan.batchify_fn,
                   lookahead=lookahead, num_workers=workers, prefetch=depth, thread_pool=thread, pin_device_id=pin_id,
                   start_method=method, seed=given_seed, base_seed=base_seed, batch_size=plan.batch_size,
                   sampler=plan.sampler, drop_last=plan.drop_last, stream_batches=plan.stream_batches,
                   mp_context=None if isinstance(context, str) else context,
                   own_shuffle=bool(given["shuffle"]) and sampler is None and batch_sampler is None
                   and plan.stream is None,
                   fetch_threads=fetch, workers_chosen=chosen, cpu_budget=budget[0], memory_budget=budget[1],
                   budgets_shared=(cpu_budget is None, memory_budget is None), most_workers=most, arguments=given)


def _kept_batches(config: LoaderConfig, batchify_fn: Any) -> _BatchPlan:
    """The batches of `config` as they are, with `batchify_fn` (None: the default)."""
    unbatched = isinstance(config.batchify_fn, EachSample)
    fn = EachSample(batchify_fn) if unbatched else (batchify_fn or default_batchify_fn)
    return _BatchPlan(config.batch_sampler, config.stream, fn, config.batch_size, config.sampler, config.drop_last,
                      config.stream_batches)


def _one_of(gluon_name: str, gluon_value: Any, torch_name: str, torch_value: Any) -> Any:
    """The value of a setting that has a Gluon name and a torch name; both given is an error."""
    if gluon_value is not None and torch_value is not None:
        raise ValueError(f"{gluon_name}={gluon_value!r} and {torch_name}={torch_value!r} are the same setting "
                         f"(Gluon's and torch's name for it); pass only one")
    return torch_value if gluon_value is None else gluon_value


def _merge_drop_last(last_batch: Any, drop_last: Any) -> Any:
    if drop_last is None:
        return last_batch
    drop_last = check_flag("drop_last", drop_last, none_means=False)  # None was taken above; named as allowed
    _one_of("last_batch", last_batch, "drop_last", drop_last)  # the error names what the user passed
    # drop_last=False is torch's default, 'keep' left unsaid: no clash beside a batch_sampler,
    # where torch accepts it (and tools that rebuild a loader pass it)
    return "discard" if drop_last else None


def _context_name(context: Any) -> str | None:
    """torch's multiprocessing_context: a start method's name or a context object."""
    if context is None or isinstance(context, str):
        return check_start_method(context, "multiprocessing_context")
    get = getattr(context, "get_start_method", None)
    if get is None:
        raise TypeError(f"multiprocessing_context must be a start method's name or a multiprocessing context, "
                        f"got {context!r}")
    return str(get())


def _check_num_workers(value: Any, cpu_budget: float | None) -> int:
    """num_workers: a non-negative int, or 'auto': to start, one worker process per CPU of the
    budget (checked before: `_check_budgets`; the count then follows what the loader measures,
    see `_caller.tuning`)."""
    if value == "auto" and cpu_budget is not None:
        return math.ceil(cpu_budget)
    try:
        return check_non_negative_int("num_workers", value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"num_workers must be a non-negative int or 'auto', got {value!r}") from None


def _check_budgets(num_workers: Any, cpu_budget: Any, memory_budget: Any) -> tuple[float | None, int | None]:
    """cpu_budget (CPUs, a positive number; default: the CPUs this process may use) and
    memory_budget (bytes, a positive int; default: half the memory available now), for
    num_workers='auto' only; (None, None) otherwise."""
    if num_workers != "auto":
        for name, value in (("cpu_budget", cpu_budget), ("memory_budget", memory_budget)):
            if value is not None:
                raise ValueError(f"{name}={value!r} bounds the workers that num_workers='auto' tunes, but "
                                 f"num_workers={num_workers!r}; pass num_workers='auto' or leave {name} out")
        return None, None
    if cpu_budget is None:
        cpus = float(usable_cpus())
    elif isinstance(cpu_budget, bool) or not isinstance(cpu_budget, numbers.Real):
        raise TypeError(f"cpu_budget must be a positive number of CPUs or None, got {cpu_budget!r}")
    else:
        cpus = float(cpu_budget)
        if not (math.isfinite(cpus) and cpus > 0):
            raise ValueError(f"cpu_budget must be a positive number of CPUs or None, got {cpu_budget!r}")
    if memory_budget is None:
        return cpus, default_memory_budget()
    if not is_int(memory_budget):
        raise TypeError(f"memory_budget must be a positive int (bytes of worker memory) or None, got "
                        f"{memory_budget!r}")
    if memory_budget <= 0:
        raise ValueError(f"memory_budget must be a positive int (bytes of worker memory) or None, got "
                         f"{memory_budget!r}")
    return cpus, int(memory_budget)


def _check_fetch_threads(value: Any, workers: int, thread_pool: bool, stream: bool) -> int | str | None:
    """fetch_threads: None, a positive int or 'auto', for a map-style dataset on worker processes."""
    if value is None:
        return None
    if value != "auto":
        try:
            value = check_positive_int("fetch_threads", value)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"fetch_threads must be a positive int, 'auto' or None, got {value!r}") from None
    if workers == 0 or thread_pool:
        raise ValueError(f"fetch_threads={value!r} fetches samples on threads inside each worker process; with "
                         f"{'thread_pool=True' if thread_pool else 'num_workers=0'} there are none: "
                         "use worker processes, or raise num_workers for thread workers")
    if stream:
        raise ValueError(f"fetch_threads={value!r} fetches a batch's samples by key, concurrently; an "
                         "IterableDataset yields them one after the other: leave fetch_threads out")
    return value  # type: ignore[no-any-return]


def _check_worker_options(workers: int, start_method: Any, persistent_workers: bool, prefetch: Any,
                          prefetch_factor: Any) -> None:
    """Options that mean something only with workers, as torch checks them."""
    if workers == 0:
        for name, value in (("start_method (or multiprocessing_context)", start_method),
                            ("prefetch_factor", prefetch_factor), ("persistent_workers", persistent_workers or None)):
            if value is not None:
                raise ValueError(f"{name}={value!r} needs worker processes, but num_workers=0 loads in the "
                                 "calling thread; set num_workers >= 1 or leave it out")
    if prefetch is not None and prefetch_factor is not None:
        raise ValueError(f"prefetch={prefetch!r} and prefetch_factor={prefetch_factor!r} set the same window "
                         "(total in flight, or per worker); pass only one")


def _seed_from(seed: Any, generator: Any) -> int | None:
    checked = check_seed(seed)
    if generator is None:
        return checked
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {generator!r}")
    if checked is not None:
        raise ValueError(f"seed={seed!r} and generator= both choose the seed; pass only one")
    return None  # drawn from the generator at the first iter()


_WARNED: set[str] = set()  # warnings given once per process (see _warn_about_setup)


def _warn_about_setup(workers: int) -> None:
    """Warn about setups that work but are likely mistakes, as torch's DataLoader does."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if workers > _OVERSUBSCRIBED_PER_CPU * cpus:
        # Begins in torch's words, which warning filters written for torch match.
        warnings.warn(f"This DataLoader will create {workers} workers (num_workers={workers}), far above the {cpus} "
                      "CPUs this process may use: excessive worker creation might get DataLoader running slow or "
                      f"even freeze, as the workers compete for the CPUs. Try num_workers={cpus}.",
                      UserWarning, stacklevel=4)


def warn_if_every_rank_loads_everything(config: LoaderConfig) -> None:
    """Called as a loader starts an epoch: in a distributed run, a sampler that is not distributed
    gives every rank the whole dataset (said once a process). Not at construction: Lightning and
    Accelerate build the loader first and then put a distributed sampler in (a new loader, or
    their own shard of the batches), and the loader built first never loads."""
    if config.stream is not None or "distributed" in _WARNED or not torch.distributed.is_available():
        return
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() < 2:
        return
    sharded = getattr(config.batch_sampler, "num_replicas", 1) > 1  # a DistributedBatchSampler, say
    if not sharded and not isinstance(config.sampler, (DistributedSampler, torch.utils.data.DistributedSampler)):
        _WARNED.add("distributed")
        warnings.warn(f"torch.distributed runs {torch.distributed.get_world_size()} ranks, but this DataLoader's "
                      "sampler is not distributed, so every rank loads the whole dataset; pass "
                      "sampler=gloader.sampler.DistributedSampler(len(dataset)) (or torch's DistributedSampler)",
                      UserWarning, stacklevel=3)


class _BatchPlan(NamedTuple):
    batch_sampler: Any
    stream: StreamRequest | None
    batchify_fn: Callable[[list[Any]], Any]
    batch_size: int | None
    sampler: Any
    drop_last: bool
    stream_batches: int | None


def _plan_batches(dataset: Any, batch_size: Any, shuffle: Any, sampler: Any, last_batch: Any, batch_sampler: Any,
                  base_seed: int | None, batchify_fn: Any) -> _BatchPlan:
    """How the dataset becomes batches: the batch sampler (or stream request) and the batchify."""
    is_stream = isinstance(dataset, (IterableDataset, torch.utils.data.IterableDataset))
    if not hasattr(dataset, "__getitem__") and not is_stream:
        raise TypeError(f"dataset must support __getitem__ and __len__ (or be a gloader.IterableDataset), "
                        f"got {type(dataset).__name__}")
    shuffle = check_flag("shuffle", shuffle, none_means=False)
    unbatched = batch_size is None and batch_sampler is None
    if unbatched and check_last_batch(last_batch) != "keep":
        raise ValueError(f"batch_size=None loads one sample at a time (torch's unbatched mode); last_batch="
                         f"{last_batch!r} (or drop_last) has no batch to drop or carry over")
    fn = EachSample(batchify_fn) if unbatched else (batchify_fn or default_batchify_fn)
    size = 1 if unbatched else batch_size
    if is_stream:
        stream = _check_stream(dataset, size, shuffle, sampler, last_batch, batch_sampler)
        return _BatchPlan(None, stream, fn, None if unbatched else stream.batch_size, None,
                          not stream.keep_last, _stream_batches(dataset, stream))
    # Without a base seed yet (drawn at the first iter()), the loader's RandomSampler is seedless
    # until then: iterated without gloader (a tool that rebuilds a torch DataLoader from this
    # one's attributes), it draws each epoch from torch's default generator, as torch's does.
    batches = _build_batch_sampler(dataset, size, shuffle, sampler, last_batch, batch_sampler, base_seed)
    index_sampler = getattr(batches, "sampler", None)
    if batch_sampler is None:
        batches._loader_owned = True  # iterated by anything but this loader: a warning says so (see sampler)
    if batch_sampler is not None:
        return _BatchPlan(batches, None, fn, None, index_sampler, False, None)
    return _BatchPlan(batches, None, fn, None if unbatched else batches.batch_size, index_sampler,
                      batches.drop_last, None)


def _stream_batches(dataset: Any, stream: StreamRequest) -> int | None:
    """Batches of a stream whose dataset has `__len__` (torch's rule), else None."""
    try:
        samples = len(dataset)
    except TypeError:
        return None
    return ceil_div(samples, stream.batch_size) if stream.keep_last else samples // stream.batch_size


def _is_pool(value: Any) -> bool:
    """Whether `value` has what a `PoolLike` has (read without running a property: a closed
    pool's `core` raises): a `WorkerPool`'s `core`, or a `RayPool`'s `start_backend`."""
    return all(inspect.getattr_static(value, name, None) is not None for name in ("num_workers", "thread_pool", "closed")) \
        and any(inspect.getattr_static(value, name, None) is not None for name in ("core", "start_backend"))


def _take_pool_settings(pool: Any, num_workers: Any, thread_pool: Any,
                        start_method: Any) -> tuple[int, bool, str | None]:
    if not _is_pool(pool):
        raise TypeError(f"pool must be a gloader.WorkerPool, a gloader.RayPool or None, got {type(pool).__name__}")
    if pool.closed:
        raise ValueError("pool= is a closed WorkerPool; create a new one (or close it after its loaders)")
    if num_workers not in (0, "auto", pool.num_workers):
        raise ValueError(f"num_workers={num_workers} conflicts with pool= ({pool.num_workers} workers); "
                         "leave num_workers out when passing a pool")
    if thread_pool and not pool.thread_pool:
        raise ValueError("thread_pool=True conflicts with pool=, a process pool; leave thread_pool out")
    if start_method is not None and start_method != pool.start_method:
        raise ValueError(f"start_method={start_method!r} conflicts with pool= (start_method="
                         f"{pool.start_method!r}); leave start_method out when passing a pool")
    return pool.num_workers, pool.thread_pool, pool.start_method


def _check_stream(dataset: Any, batch_size: Any, shuffle: bool, sampler: Any, last_batch: Any,
                  batch_sampler: Any) -> StreamRequest:
    if sampler is not None or batch_sampler is not None or (shuffle and not is_datapipe(dataset)):
        raise ValueError("an IterableDataset has no indices: shuffle, sampler and batch_sampler are not allowed "
                         "(shuffle=True is, for a torch IterDataPipe: it turns on the graph's shuffle steps)")
    if shuffle:
        turn_on_datapipe_shuffle(dataset)
    size = check_positive_int("batch_size", batch_size)
    mode = check_last_batch(last_batch)
    if mode == "rollover":
        raise ValueError("last_batch='rollover' needs a map-style dataset; use 'keep' or 'discard'")
    return StreamRequest(size, mode == "keep")


def _build_batch_sampler(dataset: Any, batch_size: Any, shuffle: Any, sampler: Any, last_batch: Any,
                         batch_sampler: Any, seed: Any) -> Any:
    if batch_sampler is not None:
        given = {"batch_size": None if batch_size == 1 else batch_size, "shuffle": shuffle or None,
                 "sampler": sampler, "last_batch": last_batch}
        clashing = sorted(name for name, value in given.items() if value is not None)
        if clashing:
            raise ValueError(f"batch_sampler excludes {', '.join(clashing)}; pass either batch_sampler or "
                             "batch_size/shuffle/sampler/last_batch")
        if not hasattr(batch_sampler, "__iter__"):
            raise TypeError(f"batch_sampler must be iterable, got {type(batch_sampler).__name__}")
        return batch_sampler
    mode = check_last_batch(last_batch)
    if sampler is None:
        length = dataset_length(dataset)
        sampler = RandomSampler(length, seed) if shuffle else SequentialSampler(length)
        sampler._follow(dataset)  # a dataset that grows or shrinks between epochs is followed, as in torch
    elif shuffle:
        raise ValueError(f"shuffle=True excludes sampler={sampler!r}; shuffle inside the sampler instead")
    return BatchSampler(sampler, batch_size, mode)


def _check_prefetch(prefetch: Any, workers: int) -> int:
    depth = 2 * workers if prefetch is None else check_non_negative_int("prefetch", prefetch)
    # A window of zero batches would dispatch nothing; one is the smallest that works.
    return max(depth, 1)
