"""Samplers: which sample indices make up an epoch, and how they are grouped into batches.

Gluon's samplers with Gluon's semantics, plus resumable state (`state_dict`) and a
`DistributedSampler` for torch.distributed; and the samplers of a global order, elastic across
ranks: `DistributedBatchSampler`, `WeightedMixtureSampler` and `TokenBudgetBatchSampler` (see
docs/guide/elastic.md). Each is also an instance of torch's sampler of the same kind
(`isinstance(s, torch.utils.data.RandomSampler)`), so tools that look for those (Lightning's
shuffle detection and sampler injection) see them for what they are. Nothing here starts a
process or touches CUDA; they live in `gloader._sampling`.
"""
from ._sampling.budget import TokenBudgetBatchSampler
from ._sampling.elastic import DistributedBatchSampler
from ._sampling.mixture import WeightedMixtureSampler
from ._sampling.samplers import (
    BatchSampler,
    DistributedSampler,
    FilterSampler,
    IntervalSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

__all__ = ["BatchSampler", "DistributedBatchSampler", "DistributedSampler", "FilterSampler", "IntervalSampler",
           "RandomSampler", "Sampler", "SequentialSampler", "TokenBudgetBatchSampler", "WeightedMixtureSampler"]

for _name in __all__:
    globals()[_name].__module__ = __name__  # pickled by reference, and documented, as gloader.sampler's
del _name
