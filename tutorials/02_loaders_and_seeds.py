# %% [markdown]
# # Several loaders, a shared pool, and reproducible augmentation
#
# Train and validation loaders often live side by side in a notebook. Each loader registers
# its dataset under its own id in every worker, so loaders never see each other's data,
# and several loaders can share one `WorkerPool`.

# %%
import random

import numpy as np
import torch

import gloader
from gloader import DataLoader, WorkerPool


class Noisy(gloader.Dataset):
    """Random augmentation from the global generators of random, numpy and torch."""

    def __init__(self, tag, length=24):
        self.tag, self.length = tag, length

    def __len__(self):
        return self.length

    def __getitem__(self, idx):
        noise = random.random() + np.random.rand() + torch.rand(()).item()
        return np.array([self.tag, idx, noise])

# %% [markdown]
# ## Two loaders on one shared pool, interleaved

# %%
with WorkerPool(2, start_method="spawn") as pool:
    # A lambda defined in the notebook, carried to spawned workers by value.
    train_set = Noisy(tag=1).transform(lambda row: row * np.array([1, 1, 0.5]))
    train = DataLoader(train_set, batch_size=4, shuffle=True, pool=pool, seed=0)
    val = DataLoader(Noisy(tag=2), batch_size=6, pool=pool)
    for train_batch, val_batch in zip(train, val):
        assert (train_batch[:, 0] == 1).all() and (val_batch[:, 0] == 2).all()
    print("each loader saw only its own data")
    val.close()  # leaves the pool; train keeps running on it
    print(len(list(train)), "train batches after val left")
    train.close()

# %% [markdown]
# ## Seeds: the same batches for any `num_workers`
# Seeds are derived per batch from `(seed, epoch, batch index)`, and every worker seeds
# `random`, `numpy` and `torch` with them before loading a batch. So the augmentation is
# bit-identical with 0, 1 or 3 workers, under fork or spawn.

# %%
results = {}
for workers, method in ((0, None), (1, "fork"), (3, "spawn")):
    with DataLoader(Noisy(tag=1), batch_size=4, shuffle=True, seed=42, num_workers=workers,
                    start_method=method) as loader:
        results[workers] = torch.cat([torch.cat(list(loader)) for _ in range(2)])
print(all(torch.equal(results[0], other) for other in results.values()))

# %% [markdown]
# In-process loading (`num_workers=0`) seeds inside a save-and-restore block, so your own
# random streams are not disturbed. With `thread_pool=True` the global generators are shared
# by all threads; draw from `gloader.get_worker_info().rng` for reproducible randomness there.

# %% [markdown]
# ## Changing the dataset between epochs
# Worker processes keep the copy of the dataset they started with. When you change the
# dataset between epochs (a curriculum's difficulty, `set_epoch`, a new transform), the next
# `iter(loader)` finds the changed attribute and restarts the workers, so that epoch loads
# the dataset as it now is, as torch's default (non-persistent) workers would.
# `persistent_workers=True` keeps the workers' copy instead, as torch's persistent workers do.
# Assign new values and new arrays; a write inside an array (`data[:] = ...`) is not seen.

# %%
class Scaled(gloader.Dataset):
    def __init__(self):
        self.scale = 1

    def __len__(self):
        return 4

    def __getitem__(self, idx):
        return idx * self.scale


scaled = Scaled()
with DataLoader(scaled, batch_size=4, num_workers=2) as loader:
    for scale in (1, 10, 100):
        scaled.scale = scale
        print(torch.cat(list(loader)).tolist())
