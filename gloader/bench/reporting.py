"""The benchmark's report: Markdown tables of one run (`report`), the documentation page and
its charts, the README's summary table, and the chart of `--plot`.
"""
from __future__ import annotations

import os
import statistics
from typing import Any

from .cluster import ray_summary, report_ray
from .figures import summary, three_digits
from .gaps import report_gaps
from .remote import remote_summary, report_remote
from .workloads import PEERS, SCALING_WORKERS, STOP_AFTER, STOPS, WORKERS, machine

__all__ = ["SUMMARY_END", "SUMMARY_START", "charts", "has_matplotlib", "markdown_page", "plot", "replace_summary",
           "report", "summary_table"]

def report(results: dict[str, Any], heading: bool = True) -> str:
    """Format the results as Markdown tables (medians, min-max over rounds); `heading`: with the
    line that says what was run and the machine."""
    lines = [f"gloader vs torch.utils.data.DataLoader, num_workers={WORKERS}, {results['rounds']} rounds, "
             "median (min-max)", "", f"Machine: {results.get('machine') or machine()}", ""] if heading else []
    rows = [name for name in ("W1", "W2", "W3", "W8", "W9", "W10") if name in results]
    if rows:
        lines += ["| workload | gloader samples/s | torch samples/s | gloader MB/s | torch MB/s | gloader/torch |",
                  "|---|---|---|---|---|---|"]
    for name in rows:
        res = results[name]
        if "skipped" in res:
            lines.append(f"| {name} skipped: {res['skipped']} | | | | | |")
            continue
        lines.append(f"| {name} {res['title']} | {summary(res['samples_per_s']['gloader'])} | "
                     f"{summary(res['samples_per_s']['torch'])} | {summary(res['mb_per_s']['gloader'])} | "
                     f"{summary(res['mb_per_s']['torch'])} | **{summary(res['ratio'])}x** |")
    lines += _report_peers(results) + _report_scaling(results) + report_gaps(results) + _report_latency(results)
    from .device import report_device
    from .held import report_held
    from .memory import report_memory
    from .samplers import report_samplers

    return "\n".join(lines + report_held(results) + report_memory(results) + report_device(results) + report_remote(results)
                     + report_ray(results) + report_samplers(results)).strip("\n")


def _report_latency(results: dict[str, Any]) -> list[str]:
    """W4's table: the first batch of epoch 1 and of later epochs, and an epoch stopped halfway."""
    if "W4" not in results:
        return []
    w4 = results["W4"]
    lines = ["", "| W4 first batch (W2 data) | gloader ms | torch ms | torch/gloader |", "|---|---|---|---|"]
    for key, label in (("epoch1_ms", "epoch 1 (starts workers)"), ("later_ms", "epochs 2-5 (median)"),
                       ("stopped_ms", f"an epoch stopped after {STOP_AFTER} of 12 batches, from iter() (median of {STOPS})")):
        ratio = [t / g for g, t in zip(w4[key]["gloader"], w4[key]["torch"])]
        lines.append(f"| {label} | {summary(w4[key]['gloader'])} | {summary(w4[key]['torch'])} | "
                     f"{summary(ratio)}x |")
    return lines


SUMMARY_START = "<!-- benchmark summary: written by python -m gloader.bench --readme -->"
SUMMARY_END = "<!-- end of benchmark summary -->"


def _run_line(results: dict[str, Any]) -> str:
    minutes, seconds = divmod(round(results.get("duration_s", 0)), 60)
    return (f"Run on {results.get('date', 'an unknown date')} with `{results.get('command', 'python -m gloader.bench')}` "
            f"({minutes} min {seconds} s). Machine: {results.get('machine') or machine()}.")


def has_matplotlib() -> bool:
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
    rows = [name for name in PEERS if name in results and set(results[name].get("ratios", ())) - {"torch"}]
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
        lines += ["", f"num_workers='auto' / gloader nw={WORKERS} (per round): " + ", ".join(autos)]
    for bound, what in (("ceiling", "any loader"), ("floor", "a loader that batches")):
        for peer in ("torch", "tensorpack"):
            leads = []
            for name in rows:
                ratios = results[name]["ratios"]
                if bound in ratios and peer in ratios:  # per round: (t_peer / t_gloader) / (t_bound / t_gloader)
                    leads.append(f"{name} {summary([t / b for t, b in zip(ratios[peer], ratios[bound])]).strip()}x")
            if leads:
                lines += ["", f"{bound.capitalize()} / {peer} nw={WORKERS}, the most {what} can lead {peer} by "
                          "here: " + ", ".join(leads)]
    return lines


def _report_scaling(results: dict[str, Any]) -> list[str]:
    """Samples/s by num_workers for W3 and W8, gloader and torch."""
    scaling = results.get("scaling")
    if not scaling:
        return []
    most, fewer = SCALING_WORKERS[-1], SCALING_WORKERS[-2]
    lines = ["", "Scaling with num_workers (samples/s, median; gloader/torch). The last column divides "
             f"nw={most} by nw={fewer} within each round (the two loaders ran under a minute apart) and "
             "gives the median (min-max) of those ratios: one loader's median against another's moves "
             "a few percent with the machine.", "",
             "| workload | " + " | ".join(f"nw={w}" for w in SCALING_WORKERS) + f" | nw={most} / nw={fewer}, per round |",
             "|---|" + "---|" * (len(SCALING_WORKERS) + 1)]
    for name, by_workers in scaling.items():
        cells = []
        for workers in SCALING_WORKERS:
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
