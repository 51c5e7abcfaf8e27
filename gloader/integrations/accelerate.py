"""gloader under Hugging Face Accelerate, loading in gloader's workers as a prepared loader would.

`accelerator.prepare(loader)` rebuilds a gloader loader as a torch DataLoader (batches then load
in torch's loader, not gloader's). Leave the loader out of `prepare()`, shard it with a
`gloader.sampler.DistributedBatchSampler`, and iterate it through `AcceleratedLoader`: Accelerate's
gradient state then sees it as it sees a prepared loader, so `accelerator.accumulate` steps the
optimizer at the epoch's last batch (an epoch of 27 batches with 2 accumulation steps makes 14
updates, not 13), and `accelerator.gather_for_metrics` drops the samples that padded the last
global batch (every sample counted once)::

    sampler = DistributedBatchSampler(RandomSampler(len(dataset), seed=0), batch_size=32,
                                      num_replicas=accelerator.num_processes, rank=accelerator.process_index)
    loader = AcceleratedLoader(gloader.DataLoader(dataset, batch_sampler=sampler, num_workers=4, seed=0))
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            with accelerator.accumulate(model):
                ...

The batches are those of `accelerator.prepare(torch DataLoader(..., batch_size=32 * num_processes))`
with `DataLoaderConfiguration(split_batches=True)` and the same sampler: each rank gets its slice
of every global batch (`examples/accelerate_ddp.py` checks they train the same losses).
"""
from __future__ import annotations

from typing import Any, Iterator

from accelerate.data_loader import DataLoaderStateMixin
from accelerate.state import GradientState

from .._sampling.elastic import GlobalBatchSampler
from ..loader import DataLoader

__all__ = ["AcceleratedLoader"]

_END = object()


class AcceleratedLoader(DataLoaderStateMixin):  # type: ignore[misc]  # accelerate ships no type information
    """Iterate a gloader `DataLoader` where Accelerate's gradient state sees it as a prepared one.

    Args:
        loader: the gloader DataLoader, left out of `accelerator.prepare()`.

    With a `DistributedBatchSampler` (last_batch='pad') the last global batch's padding is known
    and `gather_for_metrics` drops it; with another sampler it cannot tell the padding from the
    samples and keeps all (Accelerate says so in its log).

    Raises:
        TypeError: `loader` is not a gloader DataLoader.
    """

    def __init__(self, loader: DataLoader[Any]) -> None:
        if not isinstance(loader, DataLoader):
            raise TypeError(f"AcceleratedLoader iterates a gloader DataLoader, got {type(loader).__name__}")
        self.loader = loader
        self.gradient_state = GradientState()

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the loader's samplers (call it before each epoch, on every rank)."""
        for sampler in {id(s): s for s in (self.loader.batch_sampler, self.loader.sampler) if s is not None}.values():
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)

    def _padding_remainder(self) -> int:
        """The samples of the epoch's last global batch that are not padding (0: none pads it),
        or -1 where the sampler cannot tell (see the class)."""
        batches: Any = self.loader.batch_sampler
        order: Any = getattr(batches, "sampler", None)
        if isinstance(batches, GlobalBatchSampler) and getattr(batches, "last_batch", None) == "pad" \
                and hasattr(batches, "global_batch_size") and order is not None:
            return int(len(order) % batches.global_batch_size)
        return -1

    def __iter__(self) -> Iterator[Any]:
        self.reset()
        self.gradient_state._add_dataloader(self)  # what DataLoaderStateMixin.begin does, with our remainder
        self.remainder = self._padding_remainder()
        try:
            iterator = iter(self.loader)
            batch = next(iterator, _END)
            while batch is not _END:
                following = next(iterator, _END)  # one ahead: the last batch is known as it is handed over
                if following is _END:
                    self.end_of_dataloader = True
                yield batch
                batch = following
        finally:
            self.end()
