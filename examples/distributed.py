"""Distributed data loading: two ranks on CPU (gloo), one gloader per rank, sharded by
`gloader.sampler.DistributedSampler`, which takes its world size and rank from
torch.distributed.

Each rank calls `sampler.set_epoch(epoch)` before every epoch, so all ranks draw the same
permutation and take disjoint shares of it; the ranks then gather what they saw and rank 0
checks that together they covered the dataset. In real training, save `loader.state_dict()`
next to the model checkpoint on every rank and load it on resume.

Run: python examples/distributed.py
"""
from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing

import gloader
from gloader.sampler import DistributedSampler


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_rank(rank: int, world_size: int, port: int, length: int, epochs: int, result_path: str) -> None:
    """One rank: join the group, load `epochs` epochs of this rank's shard, gather at rank 0."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        sampler = DistributedSampler(length, seed=0)  # num_replicas and rank from torch.distributed
        seen = []
        with gloader.DataLoader(np.arange(length), batch_size=8, sampler=sampler, num_workers=1) as loader:
            for epoch in range(epochs):
                sampler.set_epoch(epoch)
                seen.append(torch.cat(list(loader)).tolist())
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, seen)
        if rank == 0:
            with open(result_path, "w") as handle:
                json.dump(gathered, handle)
    finally:
        dist.destroy_process_group()


def main(length: int = 103, epochs: int = 2, world_size: int = 2) -> list[list[list[int]]]:
    """Run the ranks; returns indices[rank][epoch] and prints a summary."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "seen.json")
        torch.multiprocessing.spawn(run_rank, args=(world_size, _free_port(), length, epochs, path),
                                    nprocs=world_size, join=True)
        with open(path) as handle:
            seen = json.load(handle)
    for epoch in range(epochs):
        union = set().union(*(set(rank[epoch]) for rank in seen))
        per_rank = [len(rank[epoch]) for rank in seen]
        padded = sum(per_rank) - length
        sys.stdout.write(f"epoch {epoch}: {per_rank} indices per rank, union covers {len(union)}/{length}, "
                         f"{padded} repeated as padding\n")
    return seen


if __name__ == "__main__":
    main()
