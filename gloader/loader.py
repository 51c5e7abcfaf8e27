"""DataLoader: Gluon's DataLoader API on a persistent, supervised worker pool.

A facade: it checks the arguments into a `LoaderConfig` (torch's attributes read it:
`_caller.attributes`), and delegates the epochs served and the position to `Serving`, their
batches to a `Schedule`, loading to an `Engine` and iteration to an `EpochIterator`. The
flow is drawn in `_caller.engine`.
"""
from __future__ import annotations

import functools
import itertools
import warnings
import weakref
from typing import Any, Callable, Iterator, TypeVar

from ._caller.attributes import IN_VARS, TorchAttributes, changed_config
from ._caller.device import DevicePipeline, warn_if_cannot_pin
from ._caller.engine import Engine
from ._caller.options import LoaderConfig, warn_if_every_rank_loads_everything
from ._caller.payload import build_payload
from ._caller.serving import LatestIterator, Serving
from ._caller.stats import PipelineStats
from ._places import shared as _shared_pool
from ._places.ray import RayPool
from ._places.shared import WorkerPool
from ._sampling.schedule import Schedule
from ._wire.seed import draw_base_seed

__all__ = ["DataLoader"]


_LOADER_IDS = itertools.count(1)
_T_co = TypeVar("_T_co", covariant=True)


class DataLoader(TorchAttributes[_T_co]):
    """Loads batches from a dataset, in-process or on a persistent pool of workers.

    A `torch.utils.data.DataLoader` to code that checks (`isinstance`), with its attributes;
    none of torch's loading machinery runs.

    Args:
        dataset: any object with `__getitem__` and `__len__` (list, numpy array, tensor,
            `torch.utils.data.Dataset`, `gloader.Dataset`).
        batch_size: samples per batch, >= 1 (default 1); None: unbatched (see below).
        shuffle: draw a new permutation every epoch (excludes `sampler`).
        sampler: yields sample indices (excludes `shuffle`).
        last_batch: 'keep', 'discard' or 'rollover' (carry the remainder into the next epoch);
            None means 'keep'.
        batch_sampler: yields lists of indices (excludes batch_size, shuffle, sampler, last_batch).
        batchify_fn: turns a list of samples into a batch; default: `default_batchify_fn`.
        num_workers: worker processes (or threads); 0 loads in the calling thread; 'auto':
            the loader picks the count and adjusts it as it runs, within `cpu_budget` and
            `memory_budget`: it starts with one worker per CPU of the budget (the attribute
            gives that count; `stats()["workers"]` the current one and why it changed) and
            adds workers while training waits for batches that wait on storage or the network
            and CPUs are idle, removes them when they idle or exceed a budget. No batch is
            lost or reordered and seeds do not depend on it. It adjusts the loader's own
            worker processes for a map-style dataset; for a stream, thread workers or a
            shared pool the count stays as picked. Add fetch_threads for samples that wait.
        pin_memory: pin batches in page-locked memory (for faster copies to CUDA).
        pin_device_id: the CUDA device that pinned memory is meant for.
        prefetch: most tasks in flight; default 2 * num_workers (with num_workers='auto',
            per worker of the count, and up to 4x that between epochs). A task is one batch,
            or for small batches that load quickly as many consecutive ones as the workers
            load in about 20 ms, at most 32 and 1 MiB.
        thread_pool: run the workers as threads of this process.
        timeout: most seconds to wait for one batch, counted from when the loop asks for it,
            before raising `gloader.BatchTimeoutError` (a TimeoutError).
        device: a CUDA device to move batches to (copied one batch ahead on a side stream).
        worker_init_fn: called as `worker_init_fn(worker_id)` once in each worker.
        seed: makes shuffling and per-batch random draws reproducible for any num_workers.
        start_method: 'fork', 'spawn', 'forkserver' or None (the platform default).
        pool: a `gloader.WorkerPool` to run on instead of starting one, or a `gloader.RayPool`
            to run the workers as Ray actors, on this machine or across a Ray cluster.
        progress: show a progress bar on stderr (batches/s and the share of time spent
            waiting for input) for every epoch.
        collate_fn: torch's name for `batchify_fn`. Passing both a torch name and its Gluon
            counterpart (here and below) is a ValueError.
        drop_last: torch's name: True is last_batch='discard', False 'keep'.
        prefetch_factor: torch's name: batches in flight per worker (prefetch / num_workers).
        multiprocessing_context: torch's name for the start method: a name or a context.
        generator: a torch.Generator to draw the seed from, at the first iter().
        persistent_workers: workers persist across epochs either way. False (the default) has
            them restarted at an epoch's start when the dataset changed since they took their
            copy (torch's default workers start afresh every epoch); True keeps their copy for
            the loader's life, as torch's persistent workers do.
        in_order: False lets a batch that is ready go ahead of an older one still loading
            (torch's meaning), so one slow batch does not hold back the ones behind it; the
            batches themselves (samples, seeds) are the same. For a stream, a shard with
            nothing ready lets the others' batches go first. True (default): sampler order
            (for a stream, the shards take turns).
        fetch_threads: fetch each batch's samples on this many threads inside each worker
            process, for datasets whose samples wait (object storage, a network file system,
            an HTTP service); 'auto' follows how much they wait. Opt-in: `__getitem__` must be
            thread-safe. Each sample's `get_worker_info()` has its own seed and `rng`, the same
            for any thread count (1 included) and worker count, but not the batch's that they
            are without fetch_threads; the process-wide generators (`random`, numpy's, torch's) are
            seeded per batch and shared by the threads, so their draws are not reproducible.
            None (default): samples are fetched one after the other.
        cpu_budget: with num_workers='auto', the CPUs the workers may keep busy (a positive
            number; default: the CPUs this process may use).
        memory_budget: with num_workers='auto', the bytes of memory the workers may hold
            (their USS, together; default: half the memory available when the loader is built).
        try_nopython: MXNet 2.0's switch to its C++ loader, accepted so Gluon 2.0 code runs
            unchanged: workers always run the Python pipeline (what MXNet falls back to for
            Python datasets and transforms), whatever its value.

    With `batch_size=None` (torch's unbatched mode) each sample is its own batch, converted
    as torch's `default_convert` does (or passed to `collate_fn`). With `seed=None` the seed is
    drawn from torch's default generator (or `generator`) at the first iter(), where torch's
    loader draws, so `torch.manual_seed(s)` reproduces a run and building the loader leaves
    torch's random stream alone.
    torch's attributes (`dataset`, `batch_size`, `sampler`, `batch_sampler`, `drop_last`,
    `num_workers`, `pin_memory`, `timeout`, `worker_init_fn`, `prefetch_factor`,
    `collate_fn`, `generator`, ...) are readable.

    Raises:
        TypeError, ValueError: for a bad argument or combination, naming the value.
    """

    def __init__(self, dataset: Any, batch_size: int | None = 1, shuffle: bool = False, sampler: Any = None,
                 last_batch: str | None = None, batch_sampler: Any = None,
                 batchify_fn: Callable[[list[Any]], Any] | None = None, num_workers: int | str = 0,
                 pin_memory: bool = False, pin_device_id: int = 0, prefetch: int | None = None,
                 thread_pool: bool = False, timeout: float = 120, *, device: Any = None,
                 worker_init_fn: Callable[[int], None] | None = None, seed: int | None = None,
                 start_method: str | None = None, pool: WorkerPool | RayPool | None = None, progress: bool = False,
                 collate_fn: Callable[[list[Any]], Any] | None = None, drop_last: bool | None = None,
                 persistent_workers: bool | None = None, prefetch_factor: int | None = None,
                 multiprocessing_context: Any = None, generator: Any = None, in_order: bool = True,
                 fetch_threads: int | str | None = None, try_nopython: bool | None = None,
                 cpu_budget: float | None = None, memory_budget: int | None = None) -> None:
        self._options = LoaderConfig.build({name: value for name, value in locals().items() if name != "self"})
        config = self._options
        self._id = next(_LOADER_IDS)
        self._schedule = Schedule(config.batch_sampler, config.stream, config.base_seed, config.lookahead,
                                  functools.partial(draw_base_seed, config.generator),
                                  config.sampler if config.own_shuffle else None)
        self._engine = Engine(config, self._id, functools.partial(_make_payload, schedule=self._schedule))
        self._serving = Serving(config, self._schedule, self._engine)
        self._finalizer = weakref.finalize(self, _close_unreferenced, self._engine, self._serving.latest)
        self._device = DevicePipeline(config.device) if config.device is not None else None
        self._stats = PipelineStats()
        self._closed = False
        if config.pin_memory:
            warn_if_cannot_pin()
        _shared_pool.track(self._engine)
        self.__dict__.update({name: getattr(self, name) for name in IN_VARS})  # read through the properties
        self.__dict__["timeout"] = config.timeout_s  # as given: a gloader DataLoader built again refuses 0
        if config.cpu_budget is not None:  # a loader built again from vars() tunes its workers too
            self.__dict__["num_workers"] = "auto"

    def __iter__(self) -> Iterator[_T_co]:  # type: ignore[override]  # torch's returns its own iterator type
        if self._closed:
            raise RuntimeError("this DataLoader is closed; create a new one")
        warn_if_every_rank_loads_everything(self._options)
        if self._serving.config is not self._options:  # an attribute was set since the last iter()
            self._serving.reconfigure(self._options)
        return self._serving.iterate(self._stats, self._device)

    def _change_setting(self, name: str, value: Any) -> None:
        """`loader.<name> = value`, for the attributes torch lets code set after construction
        (Lightning sets `worker_init_fn`): checked now, used from the next iter() on (see
        `changed_config`)."""
        self._options = changed_config(self._options, name, value)
        if name in IN_VARS:
            self.__dict__[name] = value  # as given, as at construction
        if name == "pin_memory" and self._options.pin_memory:
            warn_if_cannot_pin()

    def __len__(self) -> int:
        return self._serving.length()

    def state_dict(self) -> dict[str, Any]:
        """Return where the loader stands: enough for another loader to continue exactly.

        Reads only: the iteration in progress goes on undisturbed.

        Returns:
            A plain picklable dict: the epoch, the batches of it already yielded, the batch
            sampler's state at the epoch's start, and the base seed.

        Raises:
            TypeError: for an IterableDataset, which has no positions to resume from.
            ValueError: in the middle of an epoch that `in_order=False` served out of order.
        """
        return self._serving.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (made by `state_dict`): the next iteration yields exactly the
        batches that were not yet yielded, in the same order, then the following epochs.

        Raises:
            ValueError: when `state` lacks a key that `state_dict` writes, or holds an
                impossible value (naming the field).
        """
        self._serving.load_state_dict(state)

    def close(self) -> None:
        """Stop the workers (or leave the shared pool) and release shared memory; idempotent.

        Batches already yielded stay valid.
        """
        if self._closed and not hasattr(self, "_engine"):
            return
        self._closed = True
        self._serving.end("close")
        self._finalizer.detach()
        self._engine.close()
        if self._device is not None:
            self._device.settle()

    def __enter__(self) -> DataLoader[_T_co]:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Without this, pickle failed on an internal lock and copy.copy() made a second loader
        # that shared (and could close) this one's workers.
        raise TypeError("a gloader DataLoader cannot be pickled or copied: it owns worker processes, threads and "
                        "shared memory; make a new DataLoader with the same arguments where you need one (in "
                        "another process: inside it)")

    def stats(self) -> dict[str, Any]:
        """Return where loading time goes, per epoch and overall.

        Returns:
            {"epochs": {epoch: timings} (the latest 64 epochs; "total" counts all), "total":
            timings, "in_flight": batches dispatched and not yet handed over, "shared_memory_bytes":
            what this loader's shared memory holds in memory (batches held, in flight and free
            slots' written pages), "shared_memory_capacity_bytes": what it has mapped}.
            Timings (in seconds) are: `batches`, `wall_s` (first batch
            requested to last handed over), `waited_s` (time the caller spent waiting for batches),
            `wait_fraction` (near 1: training is input-bound; near 0: loading keeps up),
            `batches_per_s`, and each hop of a batch's trip, summed over batches: `dispatch_s`
            (queued until a worker began it), `worker_fetch_s` (getting samples, transforms
            included), `worker_batchify_s`, `return_s` (the finished batch's trip back),
            `window_s` (finished, waiting for you to ask) and `handover_s` (turning it into
            tensors here). "workers": {"count" (now), "kind" ('processes', 'threads' or
            'in-process'), "chosen_by": why the loader has that many}; with num_workers='auto'
            also "most" (the most it may grow to), "cpu_budget", "memory_budget",
            "budgets_shared_by" (the tuned loaders of this process sharing the default budgets,
            itself included; None where the loader set both its own) and "changes":
            the latest changes of the count, each {"at_s" (seconds since the loader was built),
            "from", "to", "why" (what was measured)}. With fetch_threads, also "fetch_threads":
            {worker id: threads its latest batch was fetched with}.
        """
        resident, mapped = self._engine.workers.shared_memory_bytes()
        snapshot = self._stats.snapshot(self._engine.tasks.in_flight, resident)
        snapshot["shared_memory_capacity_bytes"] = mapped
        opts = self._options
        workers: dict[str, Any] = {"count": self._engine.workers.count, "kind": opts.worker_kind,
                                   "chosen_by": opts.workers_chosen}
        tuner = self._engine.tuner
        if tuner is not None:
            changes = list(tuner.changes)
            if changes:
                workers["chosen_by"] = f"num_workers='auto', {changes[-1]['why']}"
            workers.update(most=tuner.most, cpu_budget=tuner.cpu_budget, memory_budget=tuner.memory_budget,
                           budgets_shared_by=tuner.budgets_left()[2] if any(tuner.shared) else None,
                           changes=changes)
        elif opts.cpu_budget is not None:
            workers.update(most=opts.num_workers, cpu_budget=opts.cpu_budget, memory_budget=opts.memory_budget,
                           changes=[])
        snapshot["workers"] = workers
        if self._options.fetch_threads is not None:
            snapshot["fetch_threads"] = dict(self._engine.fetch_threads)
        return snapshot

    def worker_pids(self) -> list[int]:
        """Pids of the worker processes now running for this loader (empty before the first batch)."""
        return self._engine.workers.pids()

    def __repr__(self) -> str:
        opts = self._options
        kind = opts.worker_kind if opts.num_workers == 0 else f"{opts.num_workers} {opts.worker_kind}"
        return f"DataLoader(id={self._id}, {kind}, prefetch={opts.prefetch}, {'closed' if self._closed else 'open'})"


def _make_payload(config: LoaderConfig, pickled: bool, *, schedule: Schedule, shared: bool = True) -> Any:
    """What the workers register for this loader (see `_caller.payload`); `shared`: its large buffers
    in shared memory (False: for Ray's object store)."""
    processes = config.num_workers > 0 and not config.thread_pool
    payload = build_payload(config.dataset, config.batchify_fn, config.worker_init_fn, schedule.base_seed, pickled,
                            shared, processes)
    payload.fetch_threads = config.fetch_threads
    return payload


def _close_unreferenced(engine: Engine, latest: LatestIterator) -> None:
    """A dropped loader's finalizer: its workers stop now or, while its newest iterator is still
    in use, once that iterator is dropped too. `for batch in DataLoader(...)` and
    `next(iter(DataLoader(...)))` keep only the iterator: the loader is collected before the
    first batch starts the workers, which nothing would stop before exit otherwise."""
    iterator = latest.ref() if latest.ref is not None else None
    if iterator is not None:
        weakref.finalize(iterator, _close_collected, engine)
        return
    _close_collected(engine)


def _close_collected(engine: Engine) -> None:
    """Close a collected loader's workers, and say so when they were still running. Where
    warnings are errors (`python -W error`, pytest's `filterwarnings = error`) the warning
    is raised, so it is given only after the workers have stopped."""
    running = engine.workers.backend is not None and engine.workers.backend.has_workers
    engine.stop_workers()
    if running:
        warnings.warn("a gloader DataLoader with running workers was garbage-collected without close(); "
                      "use `with DataLoader(...) as loader:` or call loader.close()", ResourceWarning,
                      stacklevel=2)
