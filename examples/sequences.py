"""Variable-length sequences: pad in the workers, and bucket by length to waste less padding.

Shows: a dataset of (token ids, label) with lengths from 5 to 200, `Group(Pad(ret_length=True),
Stack())` as batchify function, and a bucketing batch sampler (sort indices by length inside
shuffled chunks, then batch), compared with plain shuffled batches by padding overhead.

Run: python examples/sequences.py
"""
from __future__ import annotations

import sys
from typing import Any, Iterator

import numpy as np

from gloader import DataLoader, SimpleDataset
from gloader.batchify import Group, Pad, Stack
from gloader.sampler import Sampler


class BucketBatchSampler(Sampler):
    """Shuffles, cuts the order into chunks of `batch_size * chunk_batches` indices, sorts each
    chunk by length and batches it: batches of similar lengths, still randomly ordered."""

    def __init__(self, lengths: list[int], batch_size: int, chunk_batches: int = 8, seed: int = 0) -> None:
        self._lengths = np.asarray(lengths)
        self._batch_size = batch_size
        self._chunk = batch_size * chunk_batches
        self._seed = seed
        self._epoch = 0

    def __iter__(self) -> Iterator[list[int]]:
        rng = np.random.default_rng([self._seed, self._epoch])
        self._epoch += 1
        order = rng.permutation(len(self._lengths))
        batches = []
        for start in range(0, len(order), self._chunk):
            chunk = order[start:start + self._chunk]
            chunk = chunk[np.argsort(self._lengths[chunk], kind="stable")]
            batches += [chunk[i:i + self._batch_size].tolist() for i in range(0, len(chunk), self._batch_size)]
        for index in rng.permutation(len(batches)):
            yield batches[index]

    def __len__(self) -> int:
        return -(-len(self._lengths) // self._batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._epoch = int(state["epoch"])


def padding_overhead(loader: DataLoader) -> float:
    """Padded tokens / real tokens - 1 over one epoch."""
    padded = real = 0
    for (tokens, lengths), _ in loader:
        padded += tokens.numel()
        real += int(lengths.sum())
    return padded / real - 1


def main(count: int = 2000, num_workers: int = 2) -> tuple[float, float]:
    """Returns the padding overhead of plain shuffled batches and of bucketed batches."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 200, count).tolist()
    data = SimpleDataset([(rng.integers(1, 1000, n), n % 2) for n in lengths])
    batchify = Group(Pad(pad_val=0, ret_length=True), Stack())
    with DataLoader(data, batch_size=32, shuffle=True, seed=0, batchify_fn=batchify, num_workers=num_workers) as plain:
        plain_overhead = padding_overhead(plain)
    buckets = BucketBatchSampler(lengths, batch_size=32)
    with DataLoader(data, batch_sampler=buckets, batchify_fn=batchify, num_workers=num_workers) as bucketed:
        bucket_overhead = padding_overhead(bucketed)
    sys.stdout.write(f"padding overhead: shuffled {plain_overhead:.0%}, bucketed {bucket_overhead:.0%}\n")
    return plain_overhead, bucket_overhead


if __name__ == "__main__":
    main()
