"""gloader under Hugging Face Accelerate: gloader does the loading (its workers, seeds, resume,
per-batch errors), Accelerate the model, the optimizer, gradient accumulation and gathering.

`accelerator.prepare(loader)` would rebuild the loader as a torch DataLoader and load without
gloader (a RuntimeWarning says so). Instead, leave the loader out of `prepare()`, shard it with
a DistributedSampler of this process's rank, call `set_epoch` before each epoch, and move the
batches to `accelerator.device` (or pass `device=` on a GPU). `accelerator.accumulate` and
`accelerator.gather` work as they do with a prepared loader; `gather_for_metrics` drops a
prepared loader's padding only, so for exact metrics evaluate with
`gloader.sampler.DistributedSampler(..., last_batch='pad')` and keep each sample's first
prediction by index, as `evaluate` does below.

Run (2 processes on CPU): ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 examples/accelerate_ddp.py
  (or: accelerate launch --cpu --num_processes 2 examples/accelerate_ddp.py; without a GPU and
  without ACCELERATE_USE_CPU, Accelerate runs each torchrun process alone)
With `--loader torch`, the same steps run on torch's DataLoader with the same sampler: rank 0
prints the per-step losses as JSON, and the two runs print the same numbers.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np
import torch
import torch.utils.data as torch_data

import gloader

_SAMPLES = 96


def _data() -> gloader.ArrayDataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(_SAMPLES, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(_SAMPLES, 1))).astype(np.float32)
    return gloader.ArrayDataset(x, y)


def _loader(kind: str, dataset: Any, sampler: Any, device: Any) -> Any:
    if kind == "torch":
        return torch_data.DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2)
    return gloader.DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2, seed=0,
                              device=device if device.type == "cuda" else None)


def evaluate(accelerator: Any, model: Any, dataset: Any, kind: str) -> float:
    """Mean squared error over every sample exactly once, whatever padding the ranks got."""
    sampler = gloader.sampler.DistributedSampler(len(dataset), num_replicas=accelerator.num_processes,
                                                 rank=accelerator.process_index, shuffle=False, last_batch="pad")
    indexed = gloader.ArrayDataset(np.arange(len(dataset)), *(np.stack(part) for part in zip(*dataset)))
    errors: dict[int, float] = {}
    with torch.no_grad():
        for index, x, y in _loader(kind, indexed, sampler, accelerator.device):
            error = ((model(x.to(accelerator.device)) - y.to(accelerator.device)) ** 2).squeeze(1)
            for i, e in zip(accelerator.gather(index.to(accelerator.device)).tolist(),
                            accelerator.gather(error).tolist()):
                errors.setdefault(i, e)  # a padded repeat comes after the sample's own
    assert sorted(errors) == list(range(len(dataset)))
    return float(np.mean(list(errors.values())))


def main(argv: list[str] | None = None) -> list[float]:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loader", choices=["gloader", "torch"], default="gloader")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)
    accelerator = Accelerator(gradient_accumulation_steps=2)
    set_seed(0)
    dataset = _data()
    sampler = torch_data.DistributedSampler(dataset, num_replicas=accelerator.num_processes,
                                            rank=accelerator.process_index, shuffle=True, seed=0)
    loader = _loader(args.loader, dataset, sampler, accelerator.device)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x.to(accelerator.device)), y.to(accelerator.device))
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(accelerator.gather(loss.detach()).mean().item())
    error = evaluate(accelerator, model, dataset, args.loader)
    if accelerator.is_main_process:
        sys.stdout.write(json.dumps({"loader": args.loader, "losses": losses, "eval_mse": error}) + "\n")
    if hasattr(loader, "close"):
        loader.close()
    accelerator.end_training()
    return losses


if __name__ == "__main__":
    main()
