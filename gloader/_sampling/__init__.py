"""Which samples an epoch loads, in which batches, and where a loader stands: the numbered,
resumable epochs of a loader and their self-checking state (`schedule`), gloader's samplers
(`samplers`, public as `gloader.sampler`), and the samplers of a global order, elastic across
ranks: `elastic` (DistributedBatchSampler), `mixture` (WeightedMixtureSampler), `budget`
(TokenBudgetBatchSampler). Nothing here starts a process or touches CUDA.
"""
