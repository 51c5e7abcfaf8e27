"""Train on R ranks (torchrun, gloo) with W workers each, over three elastic samplers in turn (a
plain RandomSampler, a weighted mixture of 3 datasets, token-budget batches): every global batch
(each rank's batch gathered in rank order: the samples and one random draw each) is written
by rank 0, and the loaders' state after STOP steps too; or, given a state file, resume there.

Run: python -m torch.distributed.run --nproc_per_node R tests/trainer_scripts/elastic_ddp.py
     W OUT.json [STOP] [STATE.json]"""
from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import gloader
from gloader.batchify import Pad
from gloader.sampler import DistributedBatchSampler, RandomSampler, TokenBudgetBatchSampler, WeightedMixtureSampler

GLOBAL_BATCH = 12  # samples of a global batch: 2 ranks of 6, 1 of 12, 4 of 3
GLOBAL_TOKENS = 240  # padded tokens of a global token-budget batch


class Tagged(gloader.Dataset):
    """Sample i: (dataset tag, i, a random augmentation's draw)."""

    def __init__(self, tag: int, length: int) -> None:
        self.tag, self.length = tag, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([self.tag, i, np.random.rand() + torch.rand(()).item()], dtype=np.float64)


class Sentences(gloader.Dataset):
    """Sample i: i repeated over its length, plus a random draw (token-budget batches)."""

    def __init__(self, length: int) -> None:
        self.lengths = (np.arange(length) * 7919) % 37 + 3

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(self.lengths[i], i, dtype=np.float64) + np.random.rand()


def loader(kind: str, workers: int) -> gloader.DataLoader:
    replicas, rank = dist.get_world_size(), dist.get_rank()
    if kind == "plain":
        sampler = DistributedBatchSampler(RandomSampler(150, seed=1), GLOBAL_BATCH // replicas, replicas, rank)
        return gloader.DataLoader(Tagged(0, 150), batch_sampler=sampler, num_workers=workers, seed=7)
    if kind == "mixture":
        data = torch.utils.data.ConcatDataset([Tagged(0, 40), Tagged(1, 90), Tagged(2, 20)])
        mixture = WeightedMixtureSampler([40, 90, 20], [0.5, 0.3, 0.2], seed=2, exact_every=GLOBAL_BATCH)
        sampler = DistributedBatchSampler(mixture, GLOBAL_BATCH // replicas, replicas, rank)
        return gloader.DataLoader(data, batch_sampler=sampler, num_workers=workers, seed=7)
    sentences = Sentences(200)
    budget = TokenBudgetBatchSampler(sentences.lengths, max_tokens=GLOBAL_TOKENS // replicas, num_replicas=replicas,
                                     rank=rank, seed=3)
    return gloader.DataLoader(sentences, batch_sampler=budget, num_workers=workers, seed=7,
                              batchify_fn=Pad(pad_val=-1))


def samples_of(kind: str, batch: torch.Tensor) -> list[list[float]]:
    """The batch's samples in order: rows, or for padded sentences (id, draw) without the padding."""
    if kind != "budget":
        return batch.tolist()
    return [[float(row[0] // 1), float(row[0] % 1)] for row in batch]


def main() -> None:
    dist.init_process_group("gloo")
    workers, out = int(sys.argv[1]), sys.argv[2]
    stop = int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] != "-" else None
    states = json.load(open(sys.argv[4])) if len(sys.argv) > 4 else None
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    written: dict[str, Any] = {"batches": {}, "states": {}}
    for kind in ("plain", "mixture", "budget"):
        batches: list[list[list[float]]] = []
        with loader(kind, workers) as data:
            if states is not None:
                data.load_state_dict(states[kind])
            for _ in range(2):  # two epochs
                for batch in data:
                    mine = samples_of(kind, batch)
                    loss = model(torch.tensor([[row[-1]] for row in mine], dtype=torch.float32)).pow(2).mean()
                    optimizer.zero_grad()
                    loss.backward()  # gradients all-reduced over the ranks
                    optimizer.step()
                    parts: list[Any] = [None] * dist.get_world_size()
                    dist.all_gather_object(parts, mine)
                    batches.append([row for part in parts for row in part])
                    if len(batches) == stop:
                        written["states"][kind] = data.state_dict()
        written["batches"][kind] = batches
    if dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump(written, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
