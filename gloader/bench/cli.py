"""Side-by-side benchmark: gloader versus torch.utils.data.DataLoader in one process run.

Run `python -m gloader.bench` (add `--quick` for a run under a minute, `--plot FILE.png` for a
chart). Both loaders use the same synthetic datasets (made from the index, nothing is
downloaded), num_workers=2, and are measured round by round, interleaved, so that machine
noise hits both alike; the report gives medians and min-max ratios over the rounds.

Workloads:
    W1 tiny: samples of float32[16] + int, batch 256, shuffle.
    W2 images: uint8 224x224x3 + int, batch 64, shuffle.
    W3 CPU-bound: about 0.5 ms of numpy work per sample, batch 32.
    W9 a HuggingFace `datasets` table in torch format (50,000 rows of float32[64] + label),
        batch 256; both loaders use its batched `__getitems__`. Skipped when `datasets` is
        not installed.
    W4 first-batch latency: time from iter() to the first batch, epoch 1 and epochs 2+ (W2 data).
    W5, W6 memory: copy-on-write growth and shared pools; see `gloader.bench.memory`.
    W7 host-to-device transfer (needs CUDA; only when asked for): see `gloader.bench.device`.

Uses gloader's public API only, like any other user of it.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from typing import Any, Callable

import torch

import gloader

from .datasets import (
    CpuBoundDataset,
    ImageDataset,
    TinyDataset,
    calibrate_cpu_work,
    has_huggingface_datasets,
    huggingface_table,
)

__all__ = ["main", "plot", "report", "run"]

_WORKERS = 2


@dataclasses.dataclass
class Workload:
    name: str
    title: str
    make: Callable[[], Any]
    batch_size: int
    sample_bytes: int
    batches: int  # per round and loader


def _gloader(dataset: Any, batch_size: int) -> Any:
    return gloader.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=_WORKERS, seed=0)


def _torch(dataset: Any, batch_size: int) -> Any:
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=_WORKERS,
                                       persistent_workers=True)


def _throughput(loader: Any, batches: int) -> float:
    """Seconds for `batches` batches, counted from the first batch (workers warm)."""
    taken = 0
    it = iter(loader)
    next(it)
    start = time.perf_counter()
    while taken < batches:
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            continue
        del batch
        taken += 1
    return time.perf_counter() - start


def _first_batch_latency(loader: Any, epochs: int) -> list[float]:
    out = []
    for _ in range(epochs):
        start = time.perf_counter()
        it = iter(loader)
        next(it)
        out.append(time.perf_counter() - start)
        for _ in it:
            pass
    return out


class _Progress:
    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0

    def step(self, label: str) -> None:
        self.done += 1
        width = 30
        filled = width * self.done // self.total
        sys.stderr.write(f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label}\n")
        sys.stderr.flush()


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):8.2f} ({min(values):.2f}-{max(values):.2f})"


def run(quick: bool, rounds: int, only: set[str] | None = None) -> dict[str, Any]:
    """Run the workloads (all, or those named in `only`); returns per-round measurements."""
    size = calibrate_cpu_work()
    scale = 0.1 if quick else 1.0
    workloads = [
        Workload("W1", "tiny float32[16]+int, batch 256", lambda: TinyDataset(200_000), 256, 16 * 4 + 8,
                 int(300 * scale) or 30),
        Workload("W2", "images uint8 224x224x3+int, batch 64", lambda: ImageDataset(20_000), 64,
                 224 * 224 * 3 + 8, int(150 * scale) or 15),
        Workload("W3", "CPU-bound ~0.5 ms/sample, batch 32", lambda: CpuBoundDataset(20_000, size), 32, 64 * 4 + 8,
                 int(100 * scale) or 10),
        Workload("W9", "HuggingFace datasets table (torch format), batch 256", lambda: huggingface_table(50_000),
                 256, 64 * 4 + 8, int(150 * scale) or 15),
    ]
    if only is not None:
        workloads = [w for w in workloads if w.name in only]
    results: dict[str, Any] = {"rounds": rounds, "cpu_work_size": size}
    if any(w.name == "W9" for w in workloads) and not has_huggingface_datasets():
        workloads = [w for w in workloads if w.name != "W9"]
        results["W9"] = {"skipped": "the datasets package is not installed (pip install datasets)"}
    latency_epochs = 5
    with_latency = only is None or "W4" in only
    progress = _Progress(rounds * (len(workloads) + with_latency) * 2)
    for work in workloads:
        dataset = work.make()
        loaders = {"gloader": _gloader(dataset, work.batch_size), "torch": _torch(dataset, work.batch_size)}
        times: dict[str, list[float]] = {"gloader": [], "torch": []}
        for r in range(rounds):
            order = ["gloader", "torch"] if r % 2 == 0 else ["torch", "gloader"]
            for name in order:
                times[name].append(_throughput(loaders[name], work.batches))
                progress.step(f"{work.name} round {r + 1} {name}")
        loaders["gloader"].close()
        del loaders
        samples = work.batches * work.batch_size
        results[work.name] = {
            "title": work.title,
            "samples_per_s": {k: [samples / t for t in v] for k, v in times.items()},
            "mb_per_s": {k: [samples * work.sample_bytes / t / 1e6 for t in v] for k, v in times.items()},
            "ratio": [t_torch / t_gl for t_gl, t_torch in zip(times["gloader"], times["torch"])],
        }
    _run_memory(quick, only, results)
    if only is not None and "W7" in only:
        from .device import measure_device_transfer

        results["W7"] = measure_device_transfer(quick, rounds)
    if with_latency:
        results["W4"] = _measure_latency(rounds, latency_epochs, progress)
    return results


def _measure_latency(rounds: int, epochs: int, progress: _Progress) -> dict[str, Any]:
    """W4: fresh loaders per round, so epoch 1 includes starting the workers."""
    small = ImageDataset(64 * 12)
    lat: dict[str, list[list[float]]] = {"gloader": [], "torch": []}
    for r in range(rounds):
        for name in (["gloader", "torch"] if r % 2 == 0 else ["torch", "gloader"]):
            loader = _gloader(small, 64) if name == "gloader" else _torch(small, 64)
            lat[name].append(_first_batch_latency(loader, epochs))
            if name == "gloader":
                loader.close()
            del loader
            progress.step(f"W4 round {r + 1} {name}")
    return {
        "epoch1_ms": {k: [v[0] * 1e3 for v in vals] for k, vals in lat.items()},
        "later_ms": {k: [statistics.median(v[1:]) * 1e3 for v in vals] for k, vals in lat.items()},
    }


def _run_memory(quick: bool, only: set[str] | None, results: dict[str, Any]) -> None:
    from .memory import measure_copy_on_write, measure_shared_pool

    if only is None or "W5" in only:
        sys.stderr.write("W5 copy-on-write ...\n")
        results["W5"] = measure_copy_on_write(quick)
    if only is None or "W6" in only:
        sys.stderr.write("W6 shared pool ...\n")
        results["W6"] = measure_shared_pool(quick)


def report(results: dict[str, Any]) -> str:
    """Format the results as a Markdown table (medians, min-max over rounds)."""
    lines = [f"gloader vs torch.utils.data.DataLoader, num_workers={_WORKERS}, {results['rounds']} rounds, "
             "median (min-max)", "",
             "| workload | gloader samples/s | torch samples/s | gloader MB/s | torch MB/s | gloader/torch |",
             "|---|---|---|---|---|---|"]
    for name in ("W1", "W2", "W3", "W9"):
        if name not in results:
            continue
        res = results[name]
        if "skipped" in res:
            lines.append(f"| {name} skipped: {res['skipped']} | | | | | |")
            continue
        lines.append(f"| {name} {res['title']} | {_summary(res['samples_per_s']['gloader'])} | "
                     f"{_summary(res['samples_per_s']['torch'])} | {_summary(res['mb_per_s']['gloader'])} | "
                     f"{_summary(res['mb_per_s']['torch'])} | **{_summary(res['ratio'])}x** |")
    from .device import report_device
    from .memory import report_memory

    if "W4" not in results:
        return "\n".join(lines + report_memory(results) + report_device(results))
    w4 = results["W4"]
    lines += ["", "| W4 first batch (W2 data) | gloader ms | torch ms | torch/gloader |", "|---|---|---|---|"]
    for key, label in (("epoch1_ms", "epoch 1 (starts workers)"), ("later_ms", "epochs 2-5 (median)")):
        ratio = [t / g for g, t in zip(w4[key]["gloader"], w4[key]["torch"])]
        lines.append(f"| {label} | {_summary(w4[key]['gloader'])} | {_summary(w4[key]['torch'])} | "
                     f"{_summary(ratio)}x |")
    return "\n".join(lines + report_memory(results) + report_device(results))


def plot(results: dict[str, Any], path: str) -> None:
    """Save a bar chart of the throughput ratios and latencies to `path` (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["W1", "W2", "W3"]
    medians = [statistics.median(results[n]["ratio"]) for n in names]
    left.bar(names, medians, color="#3b7dd8")
    left.axhline(1.0, color="grey", linestyle="--")
    left.set_ylabel("gloader / torch throughput (median)")
    left.set_title("Throughput ratio (higher is better)")
    w4 = results["W4"]
    labels = ["epoch 1", "epochs 2+"]
    for offset, name, color in ((-0.2, "gloader", "#3b7dd8"), (0.2, "torch", "#d8753b")):
        values = [statistics.median(w4["epoch1_ms"][name]), statistics.median(w4["later_ms"][name])]
        right.bar([i + offset for i in range(2)], values, width=0.4, label=name, color=color)
    right.set_xticks(range(2), labels)
    right.set_yscale("log")
    right.set_ylabel("ms to first batch (median, log)")
    right.set_title("First-batch latency (lower is better)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m gloader.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small run, under a minute")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per workload (default 5, quick 3)")
    parser.add_argument("--plot", metavar="FILE.png", help="also save a chart (needs W1-W4)")
    parser.add_argument("--workloads", metavar="W1,W2", help="run only these workloads (W1-W7, W9; W7 needs CUDA and runs only when named)")
    args = parser.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else (3 if args.quick else 5)
    if rounds < 1:
        parser.error(f"--rounds must be >= 1, got {rounds}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401  # checked now, not after a five-minute run
        except ImportError:
            parser.error("--plot needs matplotlib: pip install -e '.[bench]'")
    only = None
    if args.workloads:
        only = {w.strip().upper() for w in args.workloads.split(",")}
        unknown = only - {"W1", "W2", "W3", "W4", "W5", "W6", "W7", "W9"}
        if unknown:
            parser.error(f"--workloads takes W1 to W7 and W9; got {sorted(unknown)}")
        if args.plot and not {"W1", "W2", "W3", "W4"} <= only:
            parser.error("--plot needs W1, W2, W3 and W4")
    torch.set_num_threads(1)
    results = run(args.quick, rounds, only)
    sys.stdout.write(report(results) + "\n")
    if args.plot:
        plot(results, args.plot)
        sys.stdout.write(f"chart saved to {args.plot}\n")
    return 0
