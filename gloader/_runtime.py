"""A loader's running parts: its pool (own or shared), shared-memory slots and dispatcher;
started at the first batch, and released on close, on error, on garbage collection and at exit.

Runs in the caller's process. The whole flow is drawn in `_dispatch`.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Callable

from ._dispatch import Dispatcher
from ._options import Options
from ._pool import PoolCore, WorkerPool
from ._transport import SlotPool

__all__ = ["Resources", "Runtime", "start_runtime"]

# Deadline for a loader leaving a shared pool to see its batches in flight finish, so that
# nothing it owns is written after it has released its shared memory.
_LEAVE_SHARED_POOL_S = 5.0
# Free shared-memory slots a loader keeps mapped beyond those in flight and those the caller
# holds. Two cover the batch being handed over and the one the caller just dropped. Larger:
# fewer new segments after the caller holds a burst of batches; smaller: less idle memory.
_SPARE_SLOTS = 2


class Runtime:
    """A loader's running parts: pool (owned or shared), slots and dispatcher."""

    def __init__(self, core: PoolCore, owns_core: bool, slots: SlotPool | None, dispatcher: Dispatcher,
                 loader_id: int) -> None:
        self.core = core
        self.owns_core = owns_core
        self.slots = slots
        self.dispatcher = dispatcher
        self.loader_id = loader_id

    def close(self) -> None:
        if self.owns_core:
            self.core.close()
        else:
            self.dispatcher.drain(_LEAVE_SHARED_POOL_S)
            self.core.announce_departure(self.loader_id)
        if self.core.is_thread:
            # Thread workers share this process's registry: drop the dataset here and now.
            from ._registry import unregister_loader

            unregister_loader(self.loader_id)
        if self.slots is not None:
            self.slots.close()


class Resources:
    """What the loader's finalizer and the exit hook release; holds no reference to the loader."""

    def __init__(self) -> None:
        self.runtime: Runtime | None = None

    def close(self) -> None:
        runtime, self.runtime = self.runtime, None
        if runtime is not None:
            runtime.close()

    def close_from_gc(self) -> None:
        if self.runtime is not None:
            warnings.warn("a gloader DataLoader with running workers was garbage-collected without close(); "
                          "use `with DataLoader(...) as loader:` or call loader.close()", ResourceWarning)
        self.close()


def start_runtime(options: Options, loader_id: int, pool: WorkerPool | None,
                  payload: Callable[[str, bool], Any]) -> Runtime:
    """Start a loader's workers (or join `pool`) with the payload `payload(prefix, pickled)`."""
    import multiprocess

    start_method = multiprocess.get_context(options.start_method).get_start_method()
    if pool is not None:
        core = pool.core
        prefix = f"{pool.shm_prefix}{loader_id}_"
        core.publish_payload(loader_id, payload(prefix, True))
    else:
        prefix = f"gl{os.getpid()}_{os.urandom(4).hex()}_{loader_id}_"
        pickled = not options.thread_pool and start_method != "fork"
        core = PoolCore(options.num_workers, options.thread_pool, options.start_method, prefix,
                        [(loader_id, payload(prefix, pickled))])
    slots = None if options.thread_pool else SlotPool(prefix, max_spare=_SPARE_SLOTS)
    dispatcher = Dispatcher(core, loader_id, slots, options.prefetch, options.timeout_s)
    return Runtime(core, pool is None, slots, dispatcher, loader_id)
