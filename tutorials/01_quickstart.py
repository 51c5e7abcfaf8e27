# %% [markdown]
# # gloader quickstart
#
# gloader is MXNet Gluon's `DataLoader` API for PyTorch, on a persistent worker pool whose
# batches reach you through shared memory. This notebook defines its dataset class and
# transforms right here, in cells, and loads them with worker processes started by `fork`
# and by `spawn`: dill carries notebook-defined code to the workers by value.

# %%
import numpy as np

import gloader
from gloader import DataLoader, SimpleDataset
from gloader.batchify import Group, Pad, Stack

# %% [markdown]
# ## Datasets and `transform_first`
# Any object with `__getitem__` and `__len__` is a dataset. `transform_first` applies a
# function to the first element of each sample (the image), leaving the label alone.

# %%
SCALE = 255.0  # a module global that the lambda below refers to


class Digits(gloader.Dataset):
    """A synthetic image dataset defined in the notebook."""

    def __len__(self):
        return 100

    def __getitem__(self, idx):
        image = np.full((8, 8), idx % 256, dtype=np.uint8)
        return image, idx % 10


images = Digits().transform_first(lambda img: img.astype(np.float32) / SCALE)
x, y = images[7]
x.dtype, x.max(), y

# %% [markdown]
# ## A loader, with workers started by fork and by spawn
# `last_batch='rollover'` carries the short remainder of an epoch into the next one, and
# `len(loader)` tells how many batches the next epoch yields.

# %%
for method in ("fork", "spawn"):
    with DataLoader(images, batch_size=32, shuffle=True, last_batch="rollover", num_workers=2,
                    start_method=method, seed=0) as loader:
        sizes = []
        for _ in range(3):
            expected = len(loader)
            batches = list(loader)
            assert len(batches) == expected
            sizes.append([len(b[1]) for b in batches])
        xb, yb = batches[0]
        print(method, sizes, xb.shape, xb.dtype, yb.dtype)

# %% [markdown]
# ## Variable-length sequences with `Pad`
# `Group` applies one batchify function per field; `Pad` pads to the longest sequence in the
# batch and can return the original lengths.

# %%
sentences = SimpleDataset([(np.arange(1, n + 1), n % 2) for n in (3, 7, 5, 2, 9, 4)])
batchify = Group(Pad(pad_val=0, ret_length=True), Stack())
with DataLoader(sentences, batch_size=3, batchify_fn=batchify, num_workers=2, start_method="spawn") as loader:
    for (tokens, lengths), labels in loader:
        print(tokens, lengths, labels, sep="\n", end="\n\n")

# %% [markdown]
# GluonNLP's spellings work as written: `NamedTuple` keeps a namedtuple sample's class,
# `Dict({...})` takes keys of any type, and `Pad(val=..., axis=...)` pads one axis.

# %%
from collections import namedtuple

from gloader.batchify import Dict, NamedTuple

Pair = namedtuple("Pair", ["tokens", "meta"])
pairs = SimpleDataset([Pair(np.arange(n), {"label": n % 2, 0: float(n)}) for n in (3, 5, 2, 4)])
batchify = NamedTuple(Pair, {"tokens": Pad(val=-1, axis=0), "meta": Dict({"label": Stack(), 0: Stack()})})
with DataLoader(pairs, batch_size=2, batchify_fn=batchify) as loader:
    batch = next(iter(loader))
print(type(batch).__name__, batch.tokens, batch.meta, sep="\n")

# %% [markdown]
# Batches are torch tensors that view shared memory written by the workers; keeping one
# (in a list, across epochs, after `close()`) is safe: its memory is reused only once the
# last tensor viewing it is gone.
