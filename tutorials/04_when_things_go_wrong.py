# %% [markdown]
# # When things go wrong
#
# gloader never hangs: every wait has a deadline, and workers are supervised. This notebook
# shows what a worker error, a killed worker and a stuck batch look like.

# %%
import os
import signal
import time

import numpy as np

import gloader
from gloader import DataLoader


class Flaky(gloader.Dataset):
    def __init__(self, fail=None, die=None, stall=None):
        self.fail, self.die, self.stall = fail, die, stall

    def __len__(self):
        return 32

    def __getitem__(self, idx):
        if idx == self.fail:
            raise KeyError(f"record {idx} is missing")
        if idx == self.die and gloader.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)  # what the out-of-memory killer does
        if idx == self.stall:
            time.sleep(30)
        return np.array([idx])

# %% [markdown]
# ## An exception in a worker
# It arrives as the same type, with the worker's traceback as its cause and a note saying
# which worker, batch and sample. The loader stays usable.

# %%
for method in ("fork", "spawn"):
    with DataLoader(Flaky(fail=9), batch_size=4, num_workers=2, start_method=method) as loader:
        loaded, it = [], iter(loader)
        while True:
            try:
                loaded.append(next(it))
            except StopIteration:
                break
            except KeyError as exc:
                print(method, "->", type(exc).__name__, exc)
                print("   ", exc.__notes__[0])
        print(f"    the epoch went on: {len(loaded)} of {len(loader)} batches loaded")

# %% [markdown]
# ## A worker killed mid-epoch
# The pool would silently replace it and wait forever for the lost batch; gloader checks the
# workers' exit codes itself and raises within a fraction of a second.

# %%
with DataLoader(Flaky(die=13).transform(lambda x: x * 10), batch_size=4, num_workers=2,
                start_method="spawn") as loader:
    started = time.monotonic()
    try:
        list(loader)
    except RuntimeError as exc:
        print(f"after {time.monotonic() - started:.2f} s:", exc)

# %% [markdown]
# ## A stuck batch
# `timeout` (seconds per batch) turns a hang into a `TimeoutError` naming the batch.

# %%
with DataLoader(Flaky(stall=5), batch_size=4, num_workers=2, timeout=1.0) as loader:
    try:
        list(loader)
    except TimeoutError as exc:
        print(type(exc).__name__, exc)
