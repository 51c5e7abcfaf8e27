# %% [markdown]
# # Performance: gloader versus torch's DataLoader
#
# The benchmark (`python -m gloader.bench`) runs both loaders side by side in one process,
# round by round, on synthetic data. Here: one quick round of W1-W4 (docs/benchmarks.md has a full
# run). Ratios, not absolute times: this machine is shared and noisy.

# %%
import os
import tempfile

from IPython.display import Image, Markdown, display

from gloader import bench

results = bench.run(quick=True, rounds=1, only={"W1", "W2", "W3", "W4"})
display(Markdown(bench.report(results)))

# %%
with tempfile.TemporaryDirectory() as folder:  # the chart is read into the notebook, then removed
    chart = os.path.join(folder, "bench.png")
    bench.plot(results, chart)
    display(Image(chart))

# %% [markdown]
# ## Is my training input-bound?
# `loader.stats()` splits the time: how long the caller waited for batches, how long the
# workers spent fetching samples and batchifying them, and the hand-over.

# %%
import numpy as np

import gloader
from gloader import DataLoader


class Slowish:
    def __len__(self):
        return 256

    def __getitem__(self, idx):
        return np.sin(np.linspace(0, idx, 20_000)).astype(np.float32)[:16]


dataset = gloader.SimpleDataset(list(range(256))).transform(lambda i: Slowish()[i])
for method in ("fork", "spawn"):
    with DataLoader(dataset, batch_size=32, num_workers=2, start_method=method) as loader:
        for _batch in loader:
            pass
        total = loader.stats()["total"]
    print(method, {key: round(value, 4) for key, value in total.items()})

# %% [markdown]
# A `wait_fraction` near 1 means the model waits for data: add workers, make `__getitem__`
# cheaper, or keep the dataset in numpy arrays (docs/guide/datasets.md says why).

# %% [markdown]
# ## How many workers? Let the loader find out
# `num_workers='auto'` starts one worker per CPU and adjusts the count as it runs: it adds
# workers while the loop waits and the CPUs idle (samples that wait on storage or the network),
# and removes them when they idle or exceed `cpu_budget` / `memory_budget`. Batches do not
# depend on the count. Here each sample waits 4 ms, as a read from remote storage would.

# %%
import time


def fetch(i):
    time.sleep(0.004)  # the wait of a remote read
    return np.float32(i)


remote = gloader.SimpleDataset(list(range(1024))).transform(fetch)
with DataLoader(remote, batch_size=16, num_workers="auto", seed=0) as loader:
    for epoch in range(3):
        started = time.perf_counter()
        for _batch in loader:
            pass
        print(f"epoch {epoch}: {1024 / (time.perf_counter() - started):.0f} samples/s, "
              f"{loader.stats()['workers']['count']} workers")
    for change in loader.stats()["workers"]["changes"]:
        print(change["from"], "->", change["to"], ":", change["why"])
