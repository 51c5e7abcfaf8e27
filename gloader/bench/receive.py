"""W12's receive bound alone: `python -m gloader.bench.receive --workers 2,8,14`.

One caller takes W2 batches (2.4 MB) from `RayPool(n)` and from local gloader with n workers,
in turns, for each n. The main job measures it with its two workers; on a machine with more
CPUs this shows what one caller takes when the actors are not what limits it. Ray without
Ray Data is enough.
"""
from __future__ import annotations

import argparse

from ..bench import cluster
from .figures import summary


def _worker_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--workers takes worker counts >= 1 separated by commas, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> None:
    """`python -m gloader.bench.receive --workers 2,8`: W12's receive bound alone, for each
    count of actors (Ray without Ray Data is enough), printed as a Markdown table. On a
    machine with more CPUs than the main job's two workers use, the bound is what one caller
    takes when the actors are not what limits it."""
    parser = argparse.ArgumentParser(prog="python -m gloader.bench.receive", description=main.__doc__)
    parser.add_argument("--workers", type=_worker_counts, default=[cluster.WORKERS],
                        help="actor counts, comma-separated (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each timing Ray and local in turns")
    parser.add_argument("--quick", action="store_true", help="a tenth of the batches (a check, not a figure)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds takes a number >= 1, got {args.rounds}")
    try:
        import ray
    except ImportError:
        parser.error("Ray is not installed (pip install 'gloader[ray]')")

    cpus, started_here = cluster.start_ray()
    try:
        for row, workers in enumerate(args.workers):
            got = cluster.measure_receive(args.rounds, args.quick, lambda label: None, workers)
            if row == 0:
                print(f"W12 receive on a local Ray instance with {cpus} CPUs: W2 batches of {got['batch_mb']:.1f} MB, "
                      f"one caller, {args.rounds} rounds, median (min-max)\n")
                print("| workers | gloader on Ray GB/s | caller CPU ms per batch | gloader local GB/s | caller CPU ms "
                      "per batch |")
                print("|---|---|---|---|---|")
            cells = [f"{summary(got[name]['gb_per_s'])} | {summary(got[name]['caller_ms'])}"
                     for name in ("gloader on Ray", "gloader local")]
            print(f"| {workers} | " + " | ".join(cells) + " |", flush=True)
    finally:
        if started_here:
            ray.shutdown()


if __name__ == "__main__":
    main()
