"""Side-by-side benchmark: gloader versus torch.utils.data.DataLoader in one process run.

Run `python -m gloader.bench` (add `--quick` for a short run, `--plot FILE.png` for a chart).
Every loader uses the same synthetic datasets (made from the index or written by the
benchmark, nothing is downloaded), num_workers=2 unless said, and they are measured round by
round, interleaved, so that machine noise hits all alike. Each round builds every loader
anew and closes it after its turn (the same loader built twice can read a few percent
apart, so the median is over instances too); a turn first waits until the workers of the
loaders before it are idle, then takes some batches untimed (workers start, memory is
allocated), then the timed ones. The report gives medians and min-max over the rounds.
Peers beside torch on W1-W3: the loop a user writes without workers, gloader with one
worker, and tensorpack's MultiProcessRunnerZMQ with two (W1, W2; skipped with a message when
tensorpack is not installed). On W1, W3 and W8, the compute ceiling: two processes that load
each batch's samples and drop them (no batching, no transfer), the most any loader with two
workers can deliver here; on W1 also the batching floor: the leanest loader with two worker
processes that hands over batches at all (each batch written into shared memory, no order,
seeds or supervision), the most a loader that batches can deliver here; and gloader with
num_workers='auto', which must not lose to the right fixed count (reported over gloader nw=2,
with the count it ended with).

Workloads:
    W1 tiny: samples of float32[16] + int, batch 256, shuffle.
    W2 images: uint8 224x224x3 + int, batch 64, shuffle.
    W3 CPU-bound: about 0.5 ms of numpy work per sample, batch 32.
    W8 an ImageFolder of 2,000 JPEGs (500x375) the benchmark writes, with the classic ImageNet
        training transform in PIL/numpy (decode, random resized crop to 224, flip, normalize),
        batch 64. W3 and W8 also get a scaling table: gloader and torch with 1, 2 and 4 workers.
    W9 a HuggingFace `datasets` table in torch format (50,000 rows of float32[64] + label),
        batch 256; both loaders use its batched `__getitems__`. Skipped when `datasets` is
        not installed.
    W10 the same rows in numpy arrays, with a plain `__getitems__` (one fancy index per
        batch, then a sample per row), batch 256; both loaders call it once per batch.
    W3 and W8 also run num_workers='auto' against 1, 2 and 4 workers with a validation pass
        between epochs (see `gloader.bench.gaps`).
    W4 first-batch latency: time from iter() to the first batch, epoch 1 and epochs 2+ (W2 data);
        and the time of an epoch stopped halfway, from iter() (`limit_train_batches`).
    W5, W6 memory: copy-on-write growth and shared pools; see `gloader.bench.memory`.
    W7 host-to-device transfer (needs CUDA; only when asked for): see `gloader.bench.device`.
    W11 remote storage: JPEGs from a local HTTP server that answers after 5 ms; torch and
        gloader with 2, 8 and 32 workers, gloader with 2 and fetch_threads='auto', and gloader
        with num_workers='auto', alone and with fetch_threads='auto'; see
        `gloader.bench.remote`. Skipped when Pillow is not installed.
    W12 on a local Ray instance with the same CPUs: gloader on Ray (RayPool) against Ray Data,
        torch and local gloader on W3 and W8, and the GB/s one caller receives of W2 batches
        through Ray's object store; see `gloader.bench.cluster`. Skipped when Ray is not installed.

Uses gloader's public API only, like any other user of it.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np
import torch

import gloader

from .cluster import W3_SAMPLES, measure_ray, ray_summary, report_ray
from .datasets import (
    BatchedTable,
    CpuBoundDataset,
    ImageDataset,
    JpegFolder,
    TinyDataset,
    calibrate_cpu_work,
    has_huggingface_datasets,
    has_pillow,
    huggingface_table,
    write_jpeg_folder,
)
from .figures import summary, three_digits
from .gaps import GAP_LOADERS, measure_gaps, report_gaps
from .peers import BatchingFloor, ComputeCeiling, InProcessLoop, TensorpackLoop, has_tensorpack
from .remote import measure_remote, remote_loader_names, remote_summary, report_remote

__all__ = ["main", "plot", "report", "run"]

_WORKERS = 2
# Before a loader's turn, the benchmark waits until the worker processes of the loaders before
# it have finished what they had prefetched (a window of 8 JPEG batches is ~1.6 s of CPU),
# so that no loader is timed while another's leftover work shares the cores: their CPU time
# must advance by at most _IDLE_TICKS clock ticks (1/100 s each) in _SETTLE_POLL_S, within
# _SETTLE_DEADLINE_S (then the round goes on).
_SETTLE_POLL_S = 0.1
_IDLE_TICKS = 2
_SETTLE_DEADLINE_S = 30.0


# W8's ImageFolder: JPEGs written for a full run, and at least this many for --quick (~2 ms each).
_JPEGS = 2000
_QUICK_JPEGS = 256

# Peers measured beside gloader (nw=2) and torch (nw=2, persistent workers), per workload.
_PEERS = {"W1": ("in-process", "gloader nw=1", "tensorpack", "floor", "ceiling", "gloader auto"),
          "W2": ("in-process", "gloader nw=1", "tensorpack"),
          "W3": ("in-process", "gloader nw=1", "ceiling", "gloader auto"), "W8": ("ceiling", "gloader auto")}
_SCALING = ("W3", "W8")
_SCALING_WORKERS = (1, 2, 4)
# W4's stopped epochs: each stopped after this many of its 12 batches (the rest in flight are
# dropped), this many times a round.
_STOP_AFTER = 6
_STOPS = 8
# num_workers='auto' with validation passes (see gaps): at most this many rounds (a round runs
# 4 loaders for 4 epochs and 4 passes each), and the batches of a training epoch per workload
# (W3: about 1.5 s at 2 workers; W8: about 3 s).
_GAP_ROUNDS = 3
# and of a validation pass (one worker: about 3 s alone on either).
_GAP_BATCHES = {"W3": (120, 180), "W8": (20, 14)}
# W12 (Ray): at most this many rounds (8 loader turns and 2 receive turns a round).
_RAY_ROUNDS = 3


@dataclasses.dataclass
class Workload:
    name: str
    title: str
    make: Callable[[], Any]
    batch_size: int
    sample_bytes: int
    batches: int  # per round and loader
    warm: int  # batches each new loader serves untimed before its timed ones


def _gloader(dataset: Any, batch_size: int, workers: int = _WORKERS) -> Any:
    return gloader.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers, seed=0)


def _torch(dataset: Any, batch_size: int, workers: int = _WORKERS) -> Any:
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers,
                                       persistent_workers=True)


def _make_peer(name: str, dataset: Any, batch_size: int) -> Any:
    if name == "gloader":
        return _gloader(dataset, batch_size)
    if name == "torch":
        return _torch(dataset, batch_size)
    if name == "gloader nw=1":
        return _gloader(dataset, batch_size, 1)
    if name == "gloader auto":
        return gloader.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers="auto", seed=0)
    if name == "in-process":
        return InProcessLoop(dataset, batch_size)
    if name == "ceiling":
        return ComputeCeiling(dataset, batch_size, _WORKERS)
    if name == "floor":
        return BatchingFloor(dataset, batch_size, _WORKERS)
    return TensorpackLoop(dataset, batch_size, _WORKERS)


def _close(loader: Any) -> None:
    close = getattr(loader, "close", None)  # torch's DataLoader has none: its workers end with it
    if close is not None:
        close()


def _throughput(loader: Any, batches: int, warm: int = 1) -> float:
    """Seconds for `batches` batches, counted after `warm` untimed ones (workers busy)."""
    taken = -warm
    it = iter(loader)
    start = 0.0
    while taken < batches:
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            continue
        del batch
        taken += 1
        if taken == 0:
            start = time.perf_counter()
    return time.perf_counter() - start


def _children_cpu_ticks() -> int | None:
    """CPU time (clock ticks) used so far by this process's child processes (None without /proc)."""
    me = str(os.getpid()).encode()
    total = 0
    try:
        pids = [entry for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue  # gone, or not ours to read
        if fields[1] == me:  # ppid; utime and stime are fields 14 and 15 of stat
            total += int(fields[11]) + int(fields[12])
    return total


def _settle() -> None:
    """Wait until the child processes (every loader's workers) are idle."""
    start = time.perf_counter()
    before = _children_cpu_ticks()
    while before is not None and time.perf_counter() - start < _SETTLE_DEADLINE_S:
        time.sleep(_SETTLE_POLL_S)
        after = _children_cpu_ticks()
        if after is None or after - before <= _IDLE_TICKS:
            break
        before = after


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


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _machine() -> str:
    """What the figures were measured on: the CPU, how many CPUs this process may use, the
    system and the versions that matter (runs on different machines differ by far more than
    rounds of one run)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{_cpu_model()}, {cpus} CPUs usable; {platform.system()} {platform.release()}; Python "
            f"{platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, "
            f"gloader {gloader.__version__}")



def run(quick: bool, rounds: int, only: set[str] | None = None) -> dict[str, Any]:
    """Run the workloads (all, or those named in `only`); returns per-round measurements."""
    size = calibrate_cpu_work()
    scale = 0.1 if quick else 1.0
    results: dict[str, Any] = {"rounds": rounds, "cpu_work_size": size, "machine": _machine()}
    with contextlib.ExitStack() as cleanup:
        workloads = _workloads(size, scale, only, results, cleanup)
        with_latency = only is None or "W4" in only
        scaling = [w for w in workloads if w.name in _SCALING]
        with_remote = only is None or "W11" in only
        with_ray = only is None or "W12" in only
        steps = sum(2 + len(_PEERS.get(w.name, ())) for w in workloads) + with_latency * 2 + \
            with_remote * len(remote_loader_names())
        gap_rounds = min(rounds, _GAP_ROUNDS)
        ray_rounds = min(rounds, _RAY_ROUNDS)
        progress = _Progress(rounds * steps + len(scaling) * len(_SCALING_WORKERS) * 2 * rounds
                             + len(scaling) * len(GAP_LOADERS) * gap_rounds + with_ray * ray_rounds * 10)
        datasets = {}
        for work in workloads:
            datasets[work.name] = work.make()  # once: W8 writes 2,000 JPEGs
            results[work.name] = _measure_workload(work, datasets[work.name], rounds, progress)
            if work.name not in _SCALING and not (with_ray and work.name == "W8"):
                del datasets[work.name]
        if scaling:
            results["scaling"] = {w.name: _measure_scaling(w, datasets[w.name], rounds, progress) for w in scaling}
            results["gaps"] = measure_gaps({w.name: (datasets[w.name], w.batch_size, *_GAP_BATCHES[w.name])
                                            for w in scaling}, quick, gap_rounds, progress.step)
        _run_memory(quick, only, results)
        if with_remote:
            results["W11"] = measure_remote(quick, rounds, progress.step)
        if with_ray:  # whole epochs: W3 on fewer samples, W8 on its 2,000 JPEGs
            on_ray = {w.name: w for w in _workloads(size, scale, {"W8"}, {}, cleanup)}
            on_ray_sets = {"W3": (CpuBoundDataset(int(W3_SAMPLES * scale), size), 32)}
            if "W8" in on_ray:  # the JPEGs W8 wrote, else written now
                jpegs = datasets["W8"] if "W8" in datasets else on_ray["W8"].make()
                on_ray_sets["W8"] = (jpegs, on_ray["W8"].batch_size)
            results["W12"] = measure_ray(on_ray_sets, quick, ray_rounds, progress.step)
        if only is not None and "W7" in only:
            from .device import measure_device_transfer

            results["W7"] = measure_device_transfer(quick, rounds)
        if with_latency:
            results["W4"] = _measure_latency(rounds, 5, progress)
    return results


def _workloads(size: int, scale: float, only: set[str] | None, results: dict[str, Any],
               cleanup: contextlib.ExitStack) -> list[Workload]:
    def jpegs() -> Any:
        root = tempfile.mkdtemp(prefix="gloader-bench-jpegs-")
        cleanup.callback(shutil.rmtree, root, ignore_errors=True)
        count = max(_QUICK_JPEGS, int(_JPEGS * scale))  # --quick: a few batches, no need for 2,000 files
        sys.stderr.write(f"W8: writing {count:,} JPEGs ...\n")
        write_jpeg_folder(root, count)
        return JpegFolder(root)

    workloads = [
        Workload("W1", "tiny float32[16]+int, batch 256", lambda: TinyDataset(200_000), 256, 16 * 4 + 8,
                 int(1000 * scale) or 100, 160),
        Workload("W2", "images uint8 224x224x3+int, batch 64", lambda: ImageDataset(20_000), 64,
                 224 * 224 * 3 + 8, int(400 * scale) or 40, 150 if scale == 1.0 else 15),
        Workload("W3", "CPU-bound ~0.5 ms/sample, batch 32", lambda: CpuBoundDataset(20_000, size), 32, 64 * 4 + 8,
                 int(100 * scale) or 10, 20),
        # --quick: as many untimed batches as the scaling table's most workers load at once, and
        # more: with 2, four workers had loaded the timed batches while the warm ones were taken
        # (torch nw=4 once read 5,450 samples/s, 15x nw=2).
        Workload("W8", "ImageFolder JPEGs, decode + crop/flip/normalize, batch 64", jpegs, 64,
                 3 * 224 * 224 * 4 + 8, int(24 * scale) or 3, 32 if scale == 1.0 else 2 * max(_SCALING_WORKERS)),
        Workload("W9", "HuggingFace datasets table (torch format), batch 256", lambda: huggingface_table(50_000),
                 256, 64 * 4 + 8, int(150 * scale) or 15, 4),
        Workload("W10", "numpy table with a plain __getitems__, batch 256", lambda: BatchedTable(50_000), 256,
                 64 * 4 + 8, int(150 * scale) or 15, 4),
    ]
    if only is not None:
        workloads = [w for w in workloads if w.name in only]
    for name, present, message in (
            ("W8", has_pillow, "Pillow is not installed (pip install pillow)"),
            ("W9", has_huggingface_datasets, "the datasets package is not installed (pip install datasets)")):
        if any(w.name == name for w in workloads) and not present():
            workloads = [w for w in workloads if w.name != name]
            results[name] = {"skipped": message}
    return workloads


def _time_rounds(makers: dict[str, Callable[[], Any]], work: Workload, rounds: int, progress: _Progress,
                 label: str, counts: dict[str, list[int]] | None = None) -> dict[str, list[float]]:
    """Seconds per round of each loader, the order turning each round. Every round builds each
    loader anew (its warm-up batches are untimed) and closes it after its turn: the same
    loader built twice can read a few percent apart all run long (two gloader nw=2 loaders
    on W8 in one run: 819 and 791 samples/s in each of five rounds; one W2 loader of twelve
    read 72k against 93-102k), so a median over rounds is also a median over instances."""
    names = list(makers)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            _settle()
            loader = makers[name]()
            try:
                times[name].append(_throughput(loader, work.batches, work.warm))
                if counts is not None and getattr(loader, "cpu_budget", None) is not None:  # num_workers='auto'
                    counts.setdefault(name, []).append(loader.stats()["workers"]["count"])
            finally:
                _close(loader)
                del loader  # torch's workers end with its loader: before the next turn's wait
            progress.step(f"{label} round {r + 1} {name}")
    return times


def _measure_workload(work: Workload, dataset: Any, rounds: int, progress: _Progress) -> dict[str, Any]:
    """gloader, torch and the workload's peers, round by round."""
    names = ["gloader", "torch", *_PEERS.get(work.name, ())]
    skipped = {}
    if "tensorpack" in names and not has_tensorpack():
        names.remove("tensorpack")
        skipped["tensorpack"] = "not installed (pip install tensorpack)"
    counts: dict[str, list[int]] = {}
    times = _time_rounds({name: functools.partial(_make_peer, name, dataset, work.batch_size) for name in names},
                         work, rounds, progress, work.name, counts)
    samples = work.batches * work.batch_size
    gl = times["gloader"]
    return {
        "title": work.title,
        "samples_per_s": {k: [samples / t for t in v] for k, v in times.items()},
        "mb_per_s": {k: [samples * work.sample_bytes / t / 1e6 for t in v] for k, v in times.items()},
        "ratio": [t_torch / t_gl for t_gl, t_torch in zip(gl, times["torch"])],
        "ratios": {k: [t / g for g, t in zip(gl, v)] for k, v in times.items() if k != "gloader"},
        "skipped_peers": skipped,
        "auto_workers": counts.get("gloader auto", []),  # the count num_workers='auto' had at the end, per round
    }


def _measure_scaling(work: Workload, dataset: Any, rounds: int, progress: _Progress) -> dict[str, Any]:
    """Samples/s of gloader and torch with 1, 2 and 4 workers (persistent), all six loaders
    taking turns in every round, so that the machine's drift does not fall on one column."""
    makers: dict[str, Callable[[], Any]] = {
        f"{name} nw={workers}": functools.partial(_gloader if name == "gloader" else _torch, dataset, work.batch_size,
                                                  workers)
        for workers in _SCALING_WORKERS for name in ("gloader", "torch")}
    times = _time_rounds(makers, work, rounds, progress, f"{work.name} scaling")
    return {str(workers): {name: [work.batches * work.batch_size / t for t in times[f"{name} nw={workers}"]]
                           for name in ("gloader", "torch")} for workers in _SCALING_WORKERS}


def _stopped_epoch_s(loader: Any, stops: int, take: int) -> float:
    """Median seconds of an epoch stopped after `take` batches, from iter() (as a loop with
    `limit_train_batches` or a validation loop cut short): the batches in flight are dropped
    at each stop, and the next iter() starts anew."""
    out = []
    for _ in range(stops):
        start = time.perf_counter()
        for taken, _batch in enumerate(loader, 1):
            if taken == take:
                break
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def _measure_latency(rounds: int, epochs: int, progress: _Progress) -> dict[str, Any]:
    """W4: fresh loaders per round, so epoch 1 includes starting the workers; then, with the
    same loaders, epochs stopped halfway."""
    small = ImageDataset(64 * 12)
    lat: dict[str, list[list[float]]] = {"gloader": [], "torch": []}
    stopped: dict[str, list[float]] = {"gloader": [], "torch": []}
    for r in range(rounds):
        for name in (["gloader", "torch"] if r % 2 == 0 else ["torch", "gloader"]):
            loader = _gloader(small, 64) if name == "gloader" else _torch(small, 64)
            lat[name].append(_first_batch_latency(loader, epochs))
            stopped[name].append(_stopped_epoch_s(loader, _STOPS, _STOP_AFTER) * 1e3)
            if name == "gloader":
                loader.close()
            del loader
            progress.step(f"W4 round {r + 1} {name}")
    return {
        "epoch1_ms": {k: [v[0] * 1e3 for v in vals] for k, vals in lat.items()},
        "later_ms": {k: [statistics.median(v[1:]) * 1e3 for v in vals] for k, vals in lat.items()},
        "stopped_ms": stopped,
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
             "median (min-max)", "", f"Machine: {results.get('machine') or _machine()}", "",
             "| workload | gloader samples/s | torch samples/s | gloader MB/s | torch MB/s | gloader/torch |",
             "|---|---|---|---|---|---|"]
    for name in ("W1", "W2", "W3", "W8", "W9", "W10"):
        if name not in results:
            continue
        res = results[name]
        if "skipped" in res:
            lines.append(f"| {name} skipped: {res['skipped']} | | | | | |")
            continue
        lines.append(f"| {name} {res['title']} | {summary(res['samples_per_s']['gloader'])} | "
                     f"{summary(res['samples_per_s']['torch'])} | {summary(res['mb_per_s']['gloader'])} | "
                     f"{summary(res['mb_per_s']['torch'])} | **{summary(res['ratio'])}x** |")
    lines += _report_peers(results) + _report_scaling(results) + report_gaps(results)
    from .device import report_device
    from .memory import report_memory

    if "W4" not in results:
        return "\n".join(lines + report_memory(results) + report_device(results) + report_remote(results)
                         + report_ray(results))
    w4 = results["W4"]
    lines += ["", "| W4 first batch (W2 data) | gloader ms | torch ms | torch/gloader |", "|---|---|---|---|"]
    for key, label in (("epoch1_ms", "epoch 1 (starts workers)"), ("later_ms", "epochs 2-5 (median)"),
                       ("stopped_ms", f"an epoch stopped after {_STOP_AFTER} of 12 batches, from iter() (median of {_STOPS})")):
        ratio = [t / g for g, t in zip(w4[key]["gloader"], w4[key]["torch"])]
        lines.append(f"| {label} | {summary(w4[key]['gloader'])} | {summary(w4[key]['torch'])} | "
                     f"{summary(ratio)}x |")
    return "\n".join(lines + report_memory(results) + report_device(results) + report_remote(results)
                     + report_ray(results))


SUMMARY_START = "<!-- benchmark summary: written by python -m gloader.bench --readme -->"
SUMMARY_END = "<!-- end of benchmark summary -->"


def _run_line(results: dict[str, Any]) -> str:
    minutes, seconds = divmod(round(results.get("duration_s", 0)), 60)
    return (f"Run on {results.get('date', 'an unknown date')} with `{results.get('command', 'python -m gloader.bench')}` "
            f"({minutes} min {seconds} s). Machine: {results.get('machine') or _machine()}.")


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def markdown_page(results: dict[str, Any], drawn: list[tuple[str, str]] | None = None) -> str:
    """The whole report as a documentation page: what ran, where, when, the charts drawn for it
    (`charts`: title, file name beside the page) and every table."""
    pictures = [line for title, name in drawn or [] for line in (f"![{title}]({name})", "")]
    return "\n".join([
        "# Benchmarks", "",
        "This page is written by the benchmark itself (`python -m gloader.bench --markdown docs/benchmarks.md`); "
        "every figure on it comes from the one run named here. How the benchmark measures, and what limits each "
        "workload, is in [the design notes](design.md#what-the-benchmark-measures).", "",
        _run_line(results), "",
        "Each figure is the median (min-max) over the rounds; in every round all loaders of a workload take "
        "turns, each built anew. The machine is shared and noisy: compare ratios, not rates, and runs only on "
        "the same machine.", "",
        *pictures,
        report(results), ""])


def summary_table(results: dict[str, Any]) -> str:
    """A short table of gloader's speed over torch per workload, with the run it came from."""
    lines = [_run_line(results), "", "| workload | gloader / torch |", "|---|---|"]
    for name in ("W1", "W2", "W3", "W8", "W9", "W10"):
        res = results.get(name)
        if res and "ratio" in res:
            lines.append(f"| {name} {res['title']} | {statistics.median(res['ratio']):.2f}x |")
    if "W4" in results:
        later = results["W4"]["later_ms"]
        lines.append(f"| W4 first batch of epochs 2+ (W2 data), ms: gloader / torch | "
                     f"{three_digits(statistics.median(later['gloader']))} / {three_digits(statistics.median(later['torch']))} |")
    remote = remote_summary(results)
    if remote:
        lines.append(f"| W11 HTTP store, 5 ms a request: {remote} |")
    on_ray = ray_summary(results)
    if on_ray:
        lines.append(f"| {on_ray} |")
    return "\n".join(lines)


def _check_summary_markers(parser: argparse.ArgumentParser, path: str) -> None:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        parser.error(f"--readme {path}: {exc.strerror}")
    if SUMMARY_START not in text or SUMMARY_END not in text:
        parser.error(f"--readme {path} has no lines {SUMMARY_START!r} and {SUMMARY_END!r} to write between")


def replace_summary(path: str, table: str) -> None:
    """Put `table` between the summary markers of the file at `path`."""
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    head, rest = text.split(SUMMARY_START, 1)
    _, tail = rest.split(SUMMARY_END, 1)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(f"{head}{SUMMARY_START}\n{table}\n{SUMMARY_END}{tail}")


def _report_peers(results: dict[str, Any]) -> list[str]:
    """gloader (nw=2) beside the peers other than torch: samples/s, and gloader's speed over each."""
    rows = [name for name in _PEERS if name in results and "ratios" in results[name]]
    if not rows:
        return []
    peers = ["in-process", "gloader nw=1", "tensorpack", "floor", "ceiling", "gloader auto"]
    # Each peer's cell gives gloader nw=2 / peer; the auto column, gloader's own other setting,
    # gives auto / nw=2, so that above 1 reads "auto was faster" there too.
    headers = [peer if peer != "gloader auto" else "gloader nw='auto' (auto / nw=2)" for peer in peers]
    lines = ["", "Peers beside torch, samples/s (gloader nw=2 / peer; in the auto column auto / nw=2); "
             "median (min-max) over the rounds", "",
             "| workload | gloader nw=2 | " + " | ".join(headers) + " |", "|---|---|" + "---|" * len(peers)]
    for name in rows:
        res = results[name]
        cells = []
        for peer in peers:
            if peer in res["samples_per_s"]:
                ratios = res["ratios"][peer] if peer != "gloader auto" else [1 / r for r in res["ratios"][peer]]
                cells.append(f"{summary(res['samples_per_s'][peer])} (**{statistics.median(ratios):.2f}x**)")
            else:
                cells.append(f"skipped: {res['skipped_peers'].get(peer, 'not measured here')}")
        lines.append(f"| {name} | {summary(res['samples_per_s']['gloader'])} | " + " | ".join(cells) + " |")
    autos = [f"{name} {summary([1 / r for r in results[name]['ratios']['gloader auto']]).strip()}x "
             f"(ended with {'/'.join(str(c) for c in sorted(set(results[name].get('auto_workers', []))))} workers)"
             for name in rows if "gloader auto" in results[name]["ratios"]]
    if autos:
        lines += ["", f"num_workers='auto' / gloader nw={_WORKERS} (per round): " + ", ".join(autos)]
    for bound, what in (("ceiling", "any loader"), ("floor", "a loader that batches")):
        for peer in ("torch", "tensorpack"):
            leads = []
            for name in rows:
                ratios = results[name]["ratios"]
                if bound in ratios and peer in ratios:  # per round: (t_peer / t_gloader) / (t_bound / t_gloader)
                    leads.append(f"{name} {summary([t / b for t, b in zip(ratios[peer], ratios[bound])]).strip()}x")
            if leads:
                lines += ["", f"{bound.capitalize()} / {peer} nw={_WORKERS}, the most {what} can lead {peer} by "
                          "here: " + ", ".join(leads)]
    return lines


def _report_scaling(results: dict[str, Any]) -> list[str]:
    """Samples/s by num_workers for W3 and W8, gloader and torch."""
    scaling = results.get("scaling")
    if not scaling:
        return []
    most, fewer = _SCALING_WORKERS[-1], _SCALING_WORKERS[-2]
    lines = ["", "Scaling with num_workers (samples/s, median; gloader/torch). The last column divides "
             f"nw={most} by nw={fewer} within each round (the two loaders ran under a minute apart) and "
             "gives the median (min-max) of those ratios: one loader's median against another's moves "
             "a few percent with the machine.", "",
             "| workload | " + " | ".join(f"nw={w}" for w in _SCALING_WORKERS) + f" | nw={most} / nw={fewer}, per round |",
             "|---|" + "---|" * (len(_SCALING_WORKERS) + 1)]
    for name, by_workers in scaling.items():
        cells = []
        for workers in _SCALING_WORKERS:
            got = by_workers[str(workers)]
            gl, th = statistics.median(got["gloader"]), statistics.median(got["torch"])
            cells.append(f"gloader {three_digits(gl)}, torch {three_digits(th)} ({gl / th:.2f}x)")
        paired = {loader: summary([a / b for a, b in zip(by_workers[str(most)][loader],
                                                          by_workers[str(fewer)][loader])]).strip()
                  for loader in ("gloader", "torch")}
        cells.append(f"gloader {paired['gloader']}x, torch {paired['torch']}x")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


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


# The docs page's charts: one per group of workloads, a panel per workload.
_CHART_GROUPS = (("in-memory", "Samples in memory: W1 tiny, W2 images, W9 and W10 tables",
                  ("W1", "W2", "W9", "W10")),
                 ("compute", "Samples that compute: W3 CPU-bound, W8 JPEG decode and augmentation", ("W3", "W8")),
                 ("remote", "Samples from a store 5 ms away: W11", ("W11",)))


def _rates(results: dict[str, Any], name: str) -> dict[str, list[float]]:
    """Each loader's samples/s of one workload (none when it was not run or was skipped)."""
    res = results.get(name)
    if not isinstance(res, dict) or "skipped" in res:
        return {}
    if name == "W11":
        return {loader: got["samples_per_s"] for loader, got in res.get("loaders", {}).items()}
    return dict(res.get("samples_per_s", {}))


def charts(results: dict[str, Any], page_path: str) -> list[tuple[str, str]]:
    """Draw one SVG chart per group of workloads that ran, beside the page at `page_path`
    (`<page>-<group>.svg`): every loader's median samples/s with its min-max, gloader's bars
    highlighted. Returns (title, file name) of each chart written (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem = os.path.splitext(page_path)[0]
    written = []
    for group, title, names in _CHART_GROUPS:
        panels = [(name, rates) for name in names if (rates := _rates(results, name))]
        if not panels:
            continue
        bars = max(len(rates) for _, rates in panels)
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 1.6 + 0.4 * bars), squeeze=False)
        for axis, (name, rates) in zip(axes[0], panels):
            loaders = list(rates)
            medians = [statistics.median(rates[loader]) for loader in loaders]
            spans = [[m - min(rates[loader]) for m, loader in zip(medians, loaders)],
                     [max(rates[loader]) - m for m, loader in zip(medians, loaders)]]
            colors = ["#2f6fd0" if loader.startswith("gloader") else "#b9b9b9" for loader in loaders]
            axis.barh(loaders, medians, xerr=spans, color=colors, capsize=2)
            axis.invert_yaxis()
            axis.set_title(name)
            axis.set_xlabel("samples/s (median, min-max)")
        fig.suptitle(title)
        fig.tight_layout()
        path = f"{stem}-{group}.svg"
        fig.savefig(path, format="svg", metadata={"Date": None})
        plt.close(fig)
        written.append((title, os.path.basename(path)))
    return written


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    workloads = __doc__.split("Workloads:\n", 1)[1].split("\n\nUses")[0]
    parser = argparse.ArgumentParser(prog="python -m gloader.bench", description=__doc__.split("\n")[0],
                                     epilog="workloads:\n" + workloads,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small run, under a minute")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per workload (default 5, quick 3)")
    parser.add_argument("--plot", metavar="FILE.png", help="also save a chart (needs W1-W4)")
    parser.add_argument("--workloads", metavar="W1,W2", help="run only these workloads (W1-W12; W7 needs CUDA and runs only when named)")
    parser.add_argument("--markdown", metavar="PAGE.md", help="also write the report as a documentation page "
                        "(the machine, versions, date and command of this run included)")
    parser.add_argument("--readme", metavar="README.md", help="also put this run's summary table into that file, "
                        f"between its lines {SUMMARY_START!r} and {SUMMARY_END!r}")
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
        unknown = only - {f"W{number}" for number in range(1, 13)}
        if unknown:
            parser.error(f"--workloads takes W1 to W12; got {sorted(unknown)}")
        if args.plot and not {"W1", "W2", "W3", "W4"} <= only:
            parser.error("--plot needs W1, W2, W3 and W4")
    if args.readme:
        _check_summary_markers(parser, args.readme)
    torch.set_num_threads(1)
    started = time.monotonic()
    results = run(args.quick, rounds, only)
    results["duration_s"] = time.monotonic() - started
    results["command"] = "python -m gloader.bench " + " ".join(argv if argv is not None else sys.argv[1:])
    results["date"] = datetime.date.today().isoformat()
    sys.stdout.write(report(results) + "\n")
    if args.markdown:
        drawn = charts(results, args.markdown) if _has_matplotlib() else []
        with open(args.markdown, "w", encoding="utf-8") as page:
            page.write(markdown_page(results, drawn))
        sys.stdout.write(f"report written to {args.markdown}" + (f" with {len(drawn)} charts\n" if drawn else "\n"))
    if args.readme:
        replace_summary(args.readme, summary_table(results))
        sys.stdout.write(f"summary table written into {args.readme}\n")
    if args.plot:
        plot(results, args.plot)
        sys.stdout.write(f"chart saved to {args.plot}\n")
    return 0
