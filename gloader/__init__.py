"""gloader: Gluon-style, pool-based data loading for PyTorch.

`DataLoader(dataset, batch_size=64, shuffle=True, last_batch='rollover', num_workers=4)`
works as in MXNet Gluon and yields batches of torch tensors. Workers run in one persistent
`multiprocess` pool per loader (or a shared `WorkerPool`) and write batches straight into
reused shared memory, which the caller maps without copying. `RayPool` runs them as Ray
actors across a cluster instead.
"""
from . import batchify, sampler
from ._places.ray import RayPool
from ._places.shared import WorkerPool
from ._wire.protocol import BatchTimeoutError, WorkerExitedError
from ._worker.registry import WorkerInfo, get_worker_info
from .dataset import ArrayDataset, Dataset, IterableDataset, SharedDict, SharedList, SimpleDataset
from .loader import DataLoader

__all__ = ["ArrayDataset", "BatchTimeoutError", "DataLoader", "Dataset", "IterableDataset", "RayPool", "SharedDict",
           "SharedList", "SimpleDataset", "WorkerExitedError", "WorkerInfo", "WorkerPool", "batchify", "get_worker_info",
           "sampler"]

for _name in ("ArrayDataset", "BatchTimeoutError", "DataLoader", "Dataset", "IterableDataset", "RayPool",
              "SharedDict", "SharedList", "SimpleDataset", "WorkerExitedError", "WorkerInfo", "WorkerPool",
              "get_worker_info"):
    globals()[_name].__module__ = __name__
del _name

__version__ = "0.1.0"
