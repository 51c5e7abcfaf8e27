"""Side-by-side benchmark: gloader versus torch.utils.data.DataLoader in one process run.

Run `python -m gloader.bench` (`--quick` for a first look in about a minute: gloader against
torch on W1-W4 and W8, each workload's table printed as it is measured; `--plot FILE.png` for a
chart). Every run prints each workload's tables as it finishes, the time left on stderr, and the
whole report at the end.
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
    W5 a dataset held once: what a list of dicts, a dict of lists and numpy arrays cost each worker,
        fork growth, spawn and forkserver start-up, beside torch; see `gloader.bench.held`.
    W6 shared pools: train and val loaders on one pool or a pool each; see `gloader.bench.memory`.
    W7 host-to-device transfer (needs CUDA; only when asked for): see `gloader.bench.device`.
    W11 remote storage: JPEGs from a local HTTP server that answers after 5 ms; torch and
        gloader with 2, 8 and 32 workers, gloader with 2 and fetch_threads='auto', and gloader
        with num_workers='auto', alone and with fetch_threads='auto'; see
        `gloader.bench.remote`. Skipped when Pillow is not installed.
    W12 on a local Ray instance with the same CPUs: gloader on Ray (RayPool) against Ray Data,
        torch and local gloader on W3 and W8, and the GB/s one caller receives of W2 batches
        through Ray's object store; see `gloader.bench.cluster`. Skipped when Ray is not installed.
    W13 the samplers of a global order (DistributedBatchSampler, WeightedMixtureSampler,
        TokenBudgetBatchSampler): what a batch costs to draw against a plain RandomSampler, and
        W1's samples/s with each sample seeded from its place; see `gloader.bench.samplers`.

Uses gloader's public API only, like any other user of it.
"""
from __future__ import annotations

import argparse
import datetime
import signal
import sys
import time
from typing import Any, Callable

import torch

from .cluster import W3_SAMPLES, measure_ray
from .datasets import CpuBoundDataset, calibrate_cpu_work
from .gaps import GAP_LOADERS, measure_gaps
from .held import held_runs
from .remote import measure_remote, remote_loader_names
from .reporting import (
    SUMMARY_END,
    SUMMARY_START,
    charts,
    has_matplotlib,
    markdown_page,
    plot,
    replace_summary,
    report,
    summary_table,
)
from .rounds import Progress, measure_latency, measure_scaling, measure_workload
from .workloads import PEERS, SCALING, SCALING_WORKERS, machine, make_workloads

__all__ = ["FIRST_LOOK", "main", "run"]

# What every part of the report reads beside its workload's results.
_EVERY_REPORT = ("rounds", "cpu_work_size", "machine")
# --quick without --workloads: the first look, gloader against torch only.
FIRST_LOOK = frozenset({"W1", "W2", "W3", "W8", "W4"})
# num_workers='auto' with validation passes (see gaps): at most this many rounds (a round runs
# 4 loaders for 4 epochs and 4 passes each), and the batches of a training epoch per workload
# (W3: about 1.5 s at 2 workers; W8: about 3 s).
_GAP_ROUNDS = 3
# and of a validation pass (one worker: about 3 s alone on either).
_GAP_BATCHES = {"W3": (120, 180), "W8": (20, 14)}
# W12 (Ray): at most this many rounds (8 loader turns and 2 receive turns a round).
_RAY_ROUNDS = 3


def run(quick: bool, rounds: int, only: set[str] | None = None, peers: bool = True,
        measured: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the workloads (all, or those named in `only`); returns per-round measurements.
    Without `peers`, only gloader and torch (no scaling, gap, memory, remote or Ray tables).
    `measured` is given the results so far, restricted to each workload as it finishes."""
    size = calibrate_cpu_work()
    scale = 0.1 if quick else 1.0
    results: dict[str, Any] = {"rounds": rounds, "cpu_work_size": size, "machine": machine()}

    def done(*names: str) -> None:
        if measured is not None:
            measured({key: value for key, value in results.items() if key in names or key in _EVERY_REPORT})

    workloads = make_workloads(size, scale, only, results)
    with_latency = only is None or "W4" in only
    scaling = [w for w in workloads if w.name in SCALING] if peers else []
    with_remote = peers and (only is None or "W11" in only)
    with_ray = peers and (only is None or "W12" in only)
    steps = sum(2 + (len(PEERS.get(w.name, ())) if peers else 0) for w in workloads) + with_latency * 2 + \
        with_remote * len(remote_loader_names())
    held_steps = held_runs(quick) if peers and (only is None or "W5" in only) else 0
    gap_rounds, ray_rounds = min(rounds, _GAP_ROUNDS), min(rounds, _RAY_ROUNDS)
    progress = Progress(rounds * steps + len(scaling) * len(SCALING_WORKERS) * 2 * rounds
                        + len(scaling) * len(GAP_LOADERS) * gap_rounds + with_ray * ray_rounds * 10 + held_steps)
    datasets = {}
    for work in workloads:
        datasets[work.name] = work.make()  # once: W8's JPEGs are read from their cache
        results[work.name] = measure_workload(work, datasets[work.name], rounds, progress, peers)
        done(work.name)
        if work.name not in [w.name for w in scaling] and not (with_ray and work.name == "W8"):
            del datasets[work.name]
    if scaling:
        results["scaling"] = {w.name: measure_scaling(w, datasets[w.name], rounds, progress) for w in scaling}
        results["gaps"] = measure_gaps({w.name: (datasets[w.name], w.batch_size, *_GAP_BATCHES[w.name])
                                        for w in scaling}, quick, gap_rounds, progress.step)
        done("scaling", "gaps")
    if peers:
        _run_memory(quick, only, results, progress.step)
        done("W5", "W6")
    if with_remote:
        results["W11"] = measure_remote(quick, rounds, progress.step)
        done("W11")
    if with_ray:
        results["W12"] = _run_ray(size, scale, datasets, quick, ray_rounds, progress.step)
        done("W12")
    if peers and (only is None or "W13" in only):
        from .samplers import measure_samplers

        sys.stderr.write("W13 samplers of a global order ...\n")
        results["W13"] = measure_samplers(quick, rounds)
        done("W13")
    if only is not None and "W7" in only:
        from .device import measure_device_transfer

        results["W7"] = measure_device_transfer(quick, rounds)
        done("W7")
    if with_latency:
        results["W4"] = measure_latency(rounds, 5, progress)
        done("W4")
    return results


def _run_ray(size: int, scale: float, datasets: dict[str, Any], quick: bool, rounds: int,
             step: Callable[[str], None]) -> dict[str, Any]:
    """W12: whole epochs on a RayPool, W3 on fewer samples and W8 on its 2,000 JPEGs (those W8
    read, in `datasets`, else read now)."""
    on_ray = {w.name: w for w in make_workloads(size, scale, {"W8"}, {})}
    on_ray_sets = {"W3": (CpuBoundDataset(int(W3_SAMPLES * scale), size), 32)}
    if "W8" in on_ray:
        jpegs = datasets["W8"] if "W8" in datasets else on_ray["W8"].make()
        on_ray_sets["W8"] = (jpegs, on_ray["W8"].batch_size)
    return measure_ray(on_ray_sets, quick, rounds, step)


def _run_memory(quick: bool, only: set[str] | None, results: dict[str, Any], step: Callable[[str], None]) -> None:
    from .held import measure_held
    from .memory import measure_shared_pool

    if only is None or "W5" in only:
        results["W5"] = measure_held(quick, step)
    if only is None or "W6" in only:
        sys.stderr.write("W6 shared pool ...\n")
        results["W6"] = measure_shared_pool(quick)


def _check_summary_markers(parser: argparse.ArgumentParser, path: str) -> None:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        parser.error(f"--readme {path}: {exc.strerror}")
    if SUMMARY_START not in text or SUMMARY_END not in text:
        parser.error(f"--readme {path} has no lines {SUMMARY_START!r} and {SUMMARY_END!r} to write between")



def _stop_on_sigterm() -> None:
    """`kill` stops the run as Ctrl-C does: the loaders close and nothing is left behind."""
    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def _print_as_measured(results: dict[str, Any]) -> None:
    sys.stdout.write(report(results, heading=False) + "\n\n")
    sys.stdout.flush()


def _parser() -> argparse.ArgumentParser:
    """The command line: the workloads, their rounds, and where the report goes."""
    workloads = __doc__.split("Workloads:\n", 1)[1].split("\n\nUses")[0]
    parser = argparse.ArgumentParser(prog="python -m gloader.bench", description=__doc__.split("\n")[0],
                                     epilog="workloads:\n" + workloads,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a first look in about a minute: gloader against torch on "
                        f"{', '.join(sorted(FIRST_LOOK))}, 3 rounds; with --workloads, those workloads at a tenth of "
                        "their batches")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per workload (default 5, quick 3)")
    parser.add_argument("--plot", metavar="FILE.png", help="also save a chart (needs W1-W4)")
    parser.add_argument("--workloads", metavar="W1,W2", help="run only these workloads (W1-W13; W7 needs CUDA and runs only when named)")
    parser.add_argument("--markdown", metavar="PAGE.md", help="also write the report as a documentation page "
                        "(the machine, versions, date and command of this run included)")
    parser.add_argument("--readme", metavar="README.md", help="also put this run's summary table into that file, "
                        f"between its lines {SUMMARY_START!r} and {SUMMARY_END!r}")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = _parser()
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
        unknown = only - {f"W{number}" for number in range(1, 14)}
        if unknown:
            parser.error(f"--workloads takes W1 to W13; got {sorted(unknown)}")
        if args.plot and not {"W1", "W2", "W3", "W4"} <= only:
            parser.error("--plot needs W1, W2, W3 and W4")
    if args.readme:
        _check_summary_markers(parser, args.readme)
    first_look = args.quick and only is None
    if first_look:
        only = set(FIRST_LOOK)
    torch.set_num_threads(1)
    _stop_on_sigterm()
    started = time.monotonic()
    sys.stdout.write(f"gloader vs torch.utils.data.DataLoader, {rounds} rounds. Machine: {machine()}\n\n")
    results = run(args.quick, rounds, only, peers=not first_look, measured=_print_as_measured)
    results["duration_s"] = time.monotonic() - started
    results["command"] = "python -m gloader.bench " + " ".join(argv if argv is not None else sys.argv[1:])
    results["date"] = datetime.date.today().isoformat()
    if first_look:
        sys.stdout.write("First look: gloader / torch, median over the rounds (the whole benchmark: python -m "
                         "gloader.bench)\n\n" + summary_table(results) + "\n")
    else:
        sys.stdout.write("The whole report:\n\n" + report(results) + "\n")
    if args.markdown:
        drawn = charts(results, args.markdown) if has_matplotlib() else []
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
