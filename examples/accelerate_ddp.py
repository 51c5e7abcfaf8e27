"""gloader under Hugging Face Accelerate: gloader does the loading (its workers, seeds, resume,
per-batch errors), Accelerate the model, the optimizer, gradient accumulation and gathering.

`accelerator.prepare(loader)` would rebuild the loader as a torch DataLoader and load without
gloader (a RuntimeWarning says so). Instead, leave the loader out of `prepare()`, shard it with a
`gloader.sampler.DistributedBatchSampler` and iterate it through
`gloader.integrations.accelerate.AcceleratedLoader`: `accelerator.accumulate` then steps at each
epoch's last batch and `gather_for_metrics` drops the last batch's padding, as with a prepared
loader. Needs Accelerate: pip install 'gloader[accelerate]'.

Run (2 processes on CPU): ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 examples/accelerate_ddp.py
  (or: ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/accelerate_ddp.py,
  whose --multi_gpu is what starts several processes; `--cpu --num_processes 2` starts one)
With `--loader torch`, the same steps run on a torch DataLoader that `accelerator.prepare()` shards
(`split_batches=True`: each process gets its slice of every batch of 8, as the sampler gives
gloader's): rank 0 prints the per-step losses, the optimizer updates and the evaluation as JSON,
and the two runs print the same numbers.
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
from gloader.sampler import DistributedBatchSampler, RandomSampler, SequentialSampler

_SAMPLES = 100  # 13 global batches of 8 an epoch (the last padded): an odd count, for accumulation
_GLOBAL_BATCH = 8


def _data() -> gloader.ArrayDataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(_SAMPLES, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(_SAMPLES, 1))).astype(np.float32)
    return gloader.ArrayDataset(x, y)


def _loader(kind: str, accelerator: Any, dataset: Any, order: Any) -> Any:
    if kind == "torch":
        # forkserver: a worker forked from a rank while another of its threads holds the
        # interpreter's thread-state lock can deadlock before it runs (CPython issue 112275: seen
        # here on 3.11.7, 2 of ~30 runs; fixed in later releases), and torch's loader waits for
        # it for good. A gloader worker that never starts leaves the batches to the others.
        return accelerator.prepare(torch_data.DataLoader(dataset, batch_size=_GLOBAL_BATCH, sampler=order, num_workers=2,
                                                         multiprocessing_context="forkserver"))
    from gloader.integrations.accelerate import AcceleratedLoader

    batches = DistributedBatchSampler(order, _GLOBAL_BATCH // accelerator.num_processes,
                                      accelerator.num_processes, accelerator.process_index)
    device = accelerator.device if accelerator.device.type == "cuda" else None
    return AcceleratedLoader(gloader.DataLoader(dataset, batch_sampler=batches, num_workers=2, seed=0, device=device))


def evaluate(accelerator: Any, model: Any, dataset: Any, kind: str) -> tuple[float, int]:
    """Mean squared error over every sample exactly once (gather_for_metrics drops the padding),
    and how many samples it counted."""
    loader = _loader(kind, accelerator, dataset, SequentialSampler(len(dataset)))
    errors = []
    with torch.no_grad():
        for x, y in loader:
            error = ((model(x.to(accelerator.device)) - y.to(accelerator.device)) ** 2).squeeze(1)
            errors.append(accelerator.gather_for_metrics(error))
    if hasattr(loader, "loader"):
        loader.loader.close()
    gathered = torch.cat(errors)
    return float(gathered.mean()), len(gathered)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loader", choices=["gloader", "torch"], default="gloader")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)
    accelerator = Accelerator(gradient_accumulation_steps=2,
                              dataloader_config=DataLoaderConfiguration(split_batches=True))
    set_seed(0)
    model = torch.nn.Linear(8, 1)  # before prepare(loader), which draws from torch's generator under 2 processes
    dataset = _data()
    order = RandomSampler(len(dataset), seed=0)  # the same order on every rank, for either loader
    loader = _loader(args.loader, accelerator, dataset, order)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses, updates = [], 0
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x.to(accelerator.device)), y.to(accelerator.device))
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                updates += accelerator.sync_gradients
            losses.append(accelerator.gather(loss.detach()).mean().item())
    error, counted = evaluate(accelerator, model, dataset, args.loader)
    result = {"loader": args.loader, "losses": losses, "updates": updates, "eval_mse": error, "eval_samples": counted}
    if accelerator.is_main_process:
        sys.stdout.write(json.dumps(result) + "\n")
    if hasattr(loader, "loader"):
        loader.loader.close()
    accelerator.end_training()
    return result


if __name__ == "__main__":
    main()
