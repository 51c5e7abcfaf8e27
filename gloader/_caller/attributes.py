"""torch's DataLoader attributes on gloader's loader: read-only views of its checked config.

Code written for torch reads them (`loader.batch_size`, `loader.sampler`, ...), and tools that
build the loader again read them through `vars(loader)` (Lightning, to put in a distributed
sampler), so each is also in the instance dict (`IN_VARS`). Runs in the caller's process.
"""
from __future__ import annotations

from typing import Any, TypeVar

import torch.utils.data as torch_data

from ..batchify import EachSample
from .options import LoaderConfig

__all__ = ["IN_VARS", "ReadOnlyAttributeError", "TorchAttributes", "changed_config"]

_T_co = TypeVar("_T_co", covariant=True)


class _FromConfig:
    """A loader attribute, read from the loader's checked config; also in the loader's instance
    dict (see IN_VARS). Set, it goes through `DataLoader._change_setting`: torch's rule decides
    which can change (`changed_config`)."""

    def __init__(self, field: str, doc: str) -> None:
        self._field = field
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, loader: Any, owner: type) -> Any:
        return self if loader is None else getattr(loader._options, self._field)

    def __set__(self, loader: Any, value: Any) -> None:
        loader._change_setting(self._name, value)


class TorchAttributes(torch_data.DataLoader[_T_co]):
    """torch's DataLoader attributes, read from `_caller.options`, the loader's `LoaderConfig`; also
    the Gluon arguments with no torch name. Those torch lets code set after construction can be
    set (the next iter() loads with them), the others raise (see `changed_config`)."""

    _options: LoaderConfig

    def _change_setting(self, name: str, value: Any) -> None:
        raise NotImplementedError  # the loader's
    dataset = _FromConfig("dataset", "The dataset batches are loaded from.")
    batch_size = _FromConfig("batch_size", "Samples per batch; None with batch_sampler= or batch_size=None.")
    sampler = _FromConfig("sampler", "The sampler that decides the order (call its set_epoch between "
                                     "epochs); None for a stream or a batch_sampler without one.")
    drop_last = _FromConfig("drop_last", "Whether a short last batch is dropped (last_batch='discard').")
    num_workers = _FromConfig("num_workers", "Worker processes (or threads); 0 loads in the calling thread.")
    pin_memory = _FromConfig("pin_memory", "Whether batches are pinned.")

    @property
    def timeout(self) -> float:
        """Most seconds to wait for one batch from the workers; 0.0 with num_workers=0, where
        batches load in the calling thread and nothing waits (torch's value there, which a torch
        DataLoader built from this one's attributes requires: Accelerate's prepare()).
        `vars(loader)["timeout"]` keeps the value given, for a DataLoader built again from vars()."""
        return 0.0 if self._options.num_workers == 0 else self._options.timeout_s

    @timeout.setter
    def timeout(self, value: Any) -> None:
        self._change_setting("timeout", value)

    worker_init_fn = _FromConfig("worker_init_fn", "Called once in each worker with its id.")
    prefetch_factor = _FromConfig("prefetch_factor", "Batches in flight per worker (None without workers).")
    collate_fn = _FromConfig("batchify_fn", "The batchify function (torch's name).")
    generator = _FromConfig("generator", "The torch.Generator the seed was drawn from, if one was given.")
    persistent_workers = _FromConfig("persistent_workers", "As given (False by default). Workers persist either way; "
                                                           "True also keeps their copy of the dataset, unchanged.")
    in_order = _FromConfig("in_order", "Whether batches come in sampler order (False: a ready batch may go first).")
    fetch_threads = _FromConfig("fetch_threads", "Threads each worker fetches a batch's samples with (None: one).")
    cpu_budget = _FromConfig("cpu_budget", "num_workers='auto': the CPUs the workers may keep busy (None otherwise).")
    memory_budget = _FromConfig("memory_budget", "num_workers='auto': the bytes of memory the workers may hold "
                                                 "(None otherwise, or where it cannot be measured).")
    pin_device_id = _FromConfig("pin_device_id", "The CUDA device pinned memory is meant for.")
    device = _FromConfig("device", "The CUDA device batches are moved to (None: they stay on the host).")
    seed = _FromConfig("seed", "The seed given (None: drawn from torch's default generator).")
    thread_pool = _FromConfig("thread_pool", "Whether the workers are threads of this process.")
    pool = _FromConfig("pool", "The WorkerPool or RayPool the loader runs on, if one was given.")
    progress = _FromConfig("progress", "Whether a progress bar is shown.")

    @property
    def multiprocessing_context(self) -> Any:
        """The context object given as multiprocessing_context, else, as torch returns it, the
        multiprocessing context of the start method named (None: the platform's default)."""
        if self._options.mp_context is not None:
            return self._options.mp_context
        if self._options.start_method is None:
            return None
        import multiprocessing  # as torch's, a name given comes back as the stdlib's context of that name

        return multiprocessing.get_context(self._options.start_method)

    @multiprocessing_context.setter
    def multiprocessing_context(self, value: Any) -> None:
        self._change_setting("multiprocessing_context", value)

    @property
    def pin_memory_device(self) -> str:
        """torch's attribute: '' (the pin thread's device is `pin_device_id`)."""
        return ""

    @pin_memory_device.setter
    def pin_memory_device(self, value: str) -> None:
        if value != "":
            raise ValueError(f"pin_memory_device={value!r}: gloader pins for the CUDA device pin_device_id names; pass "
                             "pin_device_id= (and device= to move batches too) when building the DataLoader")

    @property
    def _auto_collation(self) -> bool:
        """torch's: whether batches are made from lists of indices (batch_size or batch_sampler)."""
        return self.batch_sampler is not None

    @property
    def _index_sampler(self) -> Any:
        """torch's: what yields each batch's keys (the batch sampler, or the sampler unbatched)."""
        return self.batch_sampler if self._auto_collation else self.sampler

    @property
    def batch_sampler(self) -> Any:
        """The batch sampler: the one given, or the one built from batch_size (None for a stream
        or with batch_size=None)."""
        opts = self._options
        unbatched = isinstance(opts.batchify_fn, EachSample)
        return None if opts.stream is not None or unbatched else opts.batch_sampler

    @batch_sampler.setter
    def batch_sampler(self, value: Any) -> None:
        self._change_setting("batch_sampler", value)


# Attributes a torch DataLoader keeps in its instance dict, which tools read through vars()
# to build the loader again (Lightning, to put in a DistributedSampler); also the Gluon
# arguments with no torch name, so a loader built again keeps them.
IN_VARS = tuple(name for name, attribute in vars(TorchAttributes).items() if isinstance(attribute, _FromConfig)) + (
    "timeout", "pin_memory_device", "batch_sampler")


# torch's attributes that torch lets code set after construction, each with the Gluon twins
# that the torch name replaces (a twin given at construction would clash with the new value).
_SETTABLE: dict[str, dict[str, Any]] = {
    "num_workers": {}, "pin_memory": {}, "timeout": {}, "worker_init_fn": {}, "generator": {},
    "in_order": {}, "collate_fn": {"batchify_fn": None}, "prefetch_factor": {"prefetch": None},
    "multiprocessing_context": {"start_method": None},
}
# The arguments that mean something only with workers (see _check_worker_options).
_WORKERS_ONLY = {"prefetch_factor": None, "multiprocessing_context": None, "start_method": None,
                 "persistent_workers": None, "fetch_threads": None, "prefetch": None}
# What torch refuses to set after construction (its words: they decide the batches), and why.
_READ_ONLY = {name: "it decides the batches: torch refuses it too" for name in
              ("dataset", "batch_size", "batch_sampler", "sampler", "drop_last")}
_READ_ONLY["persistent_workers"] = "torch refuses it too"
_GLOADERS_OWN = "gloader's own arguments are set at construction"


class ReadOnlyAttributeError(AttributeError, ValueError):
    """Setting a loader attribute that cannot change: an AttributeError, and a ValueError, as
    torch's DataLoader raises for `batch_size`, `sampler`, `dataset` and the like, so code
    catching either works."""


def changed_config(config: LoaderConfig, name: str, value: Any) -> LoaderConfig:
    """`config` after `loader.<name> = value`, for an attribute of torch's that torch lets
    code set after construction (Lightning sets `worker_init_fn`), checked as the argument of
    that name is: the batches (dataset, sampler, batch size) stay as they are, a torch name
    replaces its Gluon twin given at construction.

    Raises:
        AttributeError, ValueError: for one torch refuses too (`_READ_ONLY`, naming it); TypeError,
            ValueError: for a value the argument does not allow.
    """
    if name not in _SETTABLE:
        raise ReadOnlyAttributeError(f"DataLoader.{name} cannot be set after the DataLoader is built ("
                                     f"{_READ_ONLY.get(name, _GLOADERS_OWN)}); build a new DataLoader to change it")
    given = {**config.arguments, name: value, **_SETTABLE[name]}
    if name == "num_workers" and value == 0:  # what only workers use is dropped, not refused
        given.update(_WORKERS_ONLY)
    return LoaderConfig.build(given, batches=config)
