"""Stress a shared WorkerPool with random worker kills (not collected by pytest).

Two loaders share a pool of 2 workers: one of text batches, whose results are ~33 KB a task
(written to the result pipe in several pages), and one of small int batches. Their batches
are taken in a random interleaving, and at a random step of each round a random worker is
SIGKILLed, busy or idle. Every kill must end in a prompt WorkerExitedError given to the
loader whose task the worker held (or, for an idle worker, to any one loader), never in a
timeout (a stalled pool) and never in an error for a loader that lost nothing.

    python -m tests.stress_shared_pool --kills 20 --seeds 25

Prints the counts; exits 1 if any timeout or misdirected error was seen.
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import re
import signal
import sys
import time

import numpy as np

import gloader
from gloader import BatchTimeoutError, DataLoader, WorkerExitedError, WorkerPool


class Text(gloader.Dataset):
    def __len__(self) -> int:
        return 32 * 60

    def __getitem__(self, index: int) -> dict:
        return {"text": "w" * (index % 50), "label": index}


def _owner(exc: Exception, names: dict[int, str]) -> str | None:
    found = re.search(r"for loader (\d+)", str(exc))
    return names.get(int(found.group(1))) if found else None


def run(kills: int, seed: int, timeout: float) -> collections.Counter:
    """One pool, `kills` kills; counts of what each loader saw."""
    rng = random.Random(seed)
    seen: collections.Counter = collections.Counter()
    with WorkerPool(2) as pool, DataLoader(Text(), batch_size=32, pool=pool, timeout=timeout) as text, \
            DataLoader(np.arange(400), batch_size=8, pool=pool, timeout=timeout) as ints:
        loaders = {"text": text, "ints": ints}
        names = {loader._engine._loader_id: name for name, loader in loaders.items()}
        done = 0
        history: list = []
        while done < kills:
            running = {name: iter(loader) for name, loader in loaders.items()}
            kill_at, step = rng.randrange(1, 40), 0
            while running:
                name = rng.choice(sorted(running))
                step += 1
                if step == kill_at:
                    try:
                        victim = rng.choice(pool.worker_pids())
                        history.append((victim, pool.core.status.doing(victim), round(time.monotonic(), 2)))
                        os.kill(victim, signal.SIGKILL)
                        done += 1
                    except (ProcessLookupError, IndexError):  # gone already, or none started yet
                        pass
                try:
                    next(running[name])
                except StopIteration:
                    del running[name]
                except WorkerExitedError as exc:
                    owner = _owner(exc, names)
                    seen["error, own task" if owner == name else "error, idle worker" if owner is None
                         else "ERROR FOR ANOTHER LOADER'S TASK"] += 1
                    del running[name]
                except BatchTimeoutError as exc:
                    seen["TIMEOUT"] += 1
                    print(f"timeout in {name} (loader {loaders[name]._engine._loader_id}): {exc}; last kills "
                          f"(pid, (loader, epoch, batch) it held, time): {history[-4:]}", flush=True)
                    del running[name]
        seen["kills"] += done
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20, help="kills per pool")
    parser.add_argument("--seeds", type=int, default=25, help="pools, one per seed")
    parser.add_argument("--first-seed", type=int, default=0, help="the first pool's seed")
    parser.add_argument("--timeout", type=float, default=10.0, help="the loaders' timeout (s)")
    args = parser.parse_args()
    started = time.monotonic()
    total: collections.Counter = collections.Counter()
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        seen = run(args.kills, seed, args.timeout)
        print(f"seed {seed}: {dict(seen)}", flush=True)
        total += seen
    print(dict(total), f"in {time.monotonic() - started:.0f} s")
    return 1 if total["TIMEOUT"] or total["ERROR FOR ANOTHER LOADER'S TASK"] else 0


if __name__ == "__main__":
    sys.exit(main())
