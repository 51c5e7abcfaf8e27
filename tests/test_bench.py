"""The benchmark's command line: it runs, reports side-by-side ratios that agree with its own
figures, and rejects bad arguments. Speed itself is measured by running it, not here."""
from __future__ import annotations

import itertools
import math
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
import torch

from gloader import bench
from gloader.bench import cli, peers, reporting, rounds, workloads
from gloader.bench.device import report_device
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(180)


def _median(cell: str) -> float:
    return float(cell.strip().strip("*").split("(")[0])


def test_quick_run_reports_a_ratio_that_matches_its_throughputs() -> None:
    done = subprocess.run([sys.executable, "-m", "gloader.bench", "--quick", "--rounds", "1", "--workloads", "W1,W4,W7"],
                          capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("| W1"))
    cells = row.strip("|").split("|")
    gl, th, ratio = _median(cells[1]), _median(cells[2]), _median(cells[5].rstrip("x* "))
    assert gl > 0 and th > 0 and ratio == pytest.approx(gl / th, rel=0.01)
    rows = [line[:5] for line in done.stdout.splitlines()]
    assert "| W2 " not in rows and "| W5 " not in rows  # only what was asked for
    assert "| epoch 1 (starts workers) |" in done.stdout and "| epochs 2-5 (median) |" in done.stdout  # W4
    assert "| an epoch stopped after 6 of 12 batches, from iter() (median of 8) |" in done.stdout
    if not torch.cuda.is_available():
        assert "W7 host-to-device: skipped (no CUDA device)" in done.stdout
    else:
        assert "| W7 W2 batches to " in done.stdout and "| pin_memory + device, 2 workers |" in done.stdout


@pytest.mark.parametrize("argv, says", [
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--workloads", "W1,W14"], r"--workloads takes W1 to W13; got \['W14'\]"),
    (["--workloads", "W1", "--plot", "x.png"], "--plot needs W1, W2, W3 and W4"),
])
def test_bad_arguments_exit_with_a_message(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 2 and re.search(says, capsys.readouterr().err)


def test_device_report_gives_medians_the_median_ratios_and_the_shares_of_both_ceilings() -> None:
    lines = report_device({"W7": {"device": "GPU X", "copy_loop": [20.0, 22.0, 24.0, 30.0, 18.0, 22.0],
                                  "workers": {"2": {"gloader": [10.0, 12.0, 11.0], "torch": [5.0, 4.0, 5.5],
                                                    "gloader_host": [10.0, 12.0, 22.0]},
                                              "8": {"gloader": [20.0, 18.0, 19.0], "torch": [19.0, 18.0, 20.0],
                                                    "gloader_host": [20.0, 20.0, 20.0]}}}})
    assert lines[1].startswith("| W7 W2 batches to GPU X |")
    # ratios 2, 3, 2 -> 2.00x; plain loop's median 22 -> 11/22 = 0.50x; host-only ratios 1, 1, 0.5 -> 1.00x
    assert lines[3] == ("| pin_memory + device, 2 workers | 11.0 (10.0-12.0) | 5.00 (4.00-5.50) | 2.00x | 0.50x | "
                        "12.0 (10.0-22.0) | 1.00x |")
    assert lines[4] == ("| pin_memory + device, 8 workers | 19.0 (18.0-20.0) | 19.0 (18.0-20.0) | 1.00x | 0.86x | "
                        "20.0 (20.0-20.0) | 0.95x |")
    assert lines[5].startswith("| plain loop copying one pinned batch") and "22.0 (18.0-30.0)" in lines[5]


def test_huggingface_workload_is_skipped_with_a_message_without_the_datasets_package(monkeypatch) -> None:

    monkeypatch.setattr(workloads, "has_huggingface_datasets", lambda: False)
    results = bench.run(quick=True, rounds=1, only={"W9"})
    assert results["W9"] == {"skipped": "the datasets package is not installed (pip install datasets)"}
    assert "| W9 skipped: the datasets package is not installed" in bench.report(results)


def test_plain_getitems_workload_fetches_what_its_samples_are_and_reports_a_row() -> None:
    from gloader.bench.datasets import BatchedTable

    table = BatchedTable(100)
    keys = [7, 0, 99, 7]
    for (row, label), key in zip(table.__getitems__(keys), keys, strict=True):
        assert (row == table[key][0]).all() and label == table[key][1]
    results = bench.run(quick=True, rounds=1, only={"W10"})
    assert set(results) >= {"W10"} and not {"W1", "W9"} & set(results)
    row = next(line for line in bench.report(results).splitlines() if line.startswith("| W10 "))
    got = results["W10"]["samples_per_s"]
    assert _median(row.strip("|").split("|")[5].rstrip("x* ")) == pytest.approx(got["gloader"][0] / got["torch"][0],
                                                                                 rel=0.01)


def test_peers_are_reported_beside_gloader_and_a_missing_tensorpack_is_skipped_with_a_message(monkeypatch) -> None:

    monkeypatch.setattr(rounds, "has_tensorpack", lambda: False)
    results = bench.run(quick=True, rounds=1, only={"W1"})
    assert results["W1"]["skipped_peers"] == {"tensorpack": "not installed (pip install tensorpack)"}
    got = results["W1"]["samples_per_s"]
    assert set(got) == {"gloader", "torch", "in-process", "gloader nw=1", "floor", "ceiling", "gloader auto"}
    assert all(v[0] > 0 for v in got.values())
    assert results["W1"]["auto_workers"] and all(count >= 1 for count in results["W1"]["auto_workers"])
    row = next(line for line in bench.report(results).splitlines() if line.startswith("| W1 |"))
    cells = row.strip("|").split("|")
    assert _median(cells[1]) == pytest.approx(got["gloader"][0], rel=5e-3)  # three significant digits
    in_process = float(cells[2].split("(**")[1].rstrip("x*) "))
    assert in_process == pytest.approx(got["gloader"][0] / got["in-process"][0], abs=0.01)
    assert "skipped: not installed (pip install tensorpack)" in cells[4]
    auto = next(line for line in bench.report(results).splitlines() if line.startswith("num_workers='auto' / gloader"))
    assert auto.startswith("num_workers='auto' / gloader nw=2 (per round): W1 ")
    assert f"x (ended with {results['W1']['auto_workers'][0]} workers)" in auto


def _ratio_of_rounded(ratio: float, numerator: float, denominator: float) -> bool:
    """Whether `ratio` (printed to 2 decimals, or to three significant digits as the per-round
    column is) can be the ratio of two rates printed to three significant digits: each is within
    half a unit of its last digit of what it stands for."""
    def half_unit(value: float) -> float:
        return 0.5 * 10 ** (math.floor(math.log10(abs(value))) - 2) if value else 0.5

    low = (numerator - half_unit(numerator)) / (denominator + half_unit(denominator))
    high = (numerator + half_unit(numerator)) / max(denominator - half_unit(denominator), 1e-9)
    slack = max(0.005, half_unit(ratio))
    return low - slack <= ratio <= high + slack


def test_scaling_and_validation_gap_tables_agree_with_their_own_figures() -> None:
    # W3 (CPU-bound samples) has both tables, as W8 does, from the same code, in a third of the time.
    done = subprocess.run([sys.executable, "-m", "gloader.bench", "--quick", "--rounds", "1", "--workloads", "W3"],
                          capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr
    scaling = next(line for line in done.stdout.splitlines() if line.startswith("| W3 | gloader"))
    ratios = re.findall(r"gloader ([\d.]+), torch ([\d.]+) \(([\d.]+)x\)", scaling)
    assert len(ratios) == 3  # num_workers 1, 2, 4
    assert all(_ratio_of_rounded(float(r), float(g), float(t)) for g, t, r in ratios)
    # One round: the per-round nw=4 / nw=2 ratio is that round's, for each loader.
    paired = re.search(r"gloader ([\d.]+) \([\d.]+-[\d.]+\)x, torch ([\d.]+) \([\d.]+-[\d.]+\)x \|$", scaling)
    assert paired is not None, scaling
    for column, found in ((0, paired.group(1)), (1, paired.group(2))):
        assert _ratio_of_rounded(float(found), float(ratios[2][column]), float(ratios[1][column])), scaling
    # num_workers='auto' beside 1, 2 and 4 workers with validation passes between epochs
    assert "training samples/s over epoch 2, the passes' time included" in done.stdout  # --quick times one epoch
    gaps = next(line for line in done.stdout.splitlines() if line.startswith("| W3 |") and line.endswith("workers |"))
    cells = [cell.strip() for cell in gaps.strip("|").split("|")]
    rates = [float(cell.split()[0]) for cell in cells[1:5]]
    assert all(rate > 0 for rate in rates) and 1 <= int(cells[7].split()[0]) <= 4
    # One round: the best count is that round's fastest. The cells print rates rounded, so two
    # counts can read alike (200 and 200); the one named must be among the fastest read.
    fastest = {k for k in range(3) if rates[k] == max(rates[:3])}
    named = re.search(r"\(nw=(\d)\)$", cells[5])
    assert named is not None and (1, 2, 4).index(int(named.group(1))) in fastest, cells
    for cell in cells[5:7]:
        assert _ratio_of_rounded(float(cell.split()[0].strip("*x")), rates[3], max(rates[:3])), cells


def test_jpeg_folder_workload_reports_a_row_from_jpegs_written_once_into_the_cache(tmp_path, monkeypatch) -> None:
    import glob

    pytest.importorskip("PIL")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    results: dict[str, Any] = {"rounds": 1}
    (work,) = workloads.make_workloads(1, 0.1, {"W8"}, {})
    dataset = work.make()
    (folder,) = glob.glob(f"{tmp_path}/gloader/bench/jpegs-*")
    assert len(glob.glob(f"{folder}/class_*/*.jpg")) == len(dataset) >= 256
    written = os.stat(dataset.files[0][0]).st_mtime_ns
    assert work.make().files == dataset.files and os.stat(dataset.files[0][0]).st_mtime_ns == written  # reused
    image, label = dataset[0]
    assert image.shape == (3, 224, 224) and image.dtype == np.float32 and label == 0
    results["W8"] = rounds.measure_workload(work, dataset, 1, rounds.Progress(len(workloads.PEERS["W8"]) + 2))
    row = next(line for line in reporting.report(results).splitlines() if line.startswith("| W8 ImageFolder JPEGs"))
    cells = row.strip("|").split("|")
    assert _median(cells[1]) > 0 and _median(cells[2]) > 0


@pytest.mark.timeout(120)
def test_a_run_stopped_with_kill_leaves_nothing_in_the_temp_directory(tmp_path) -> None:
    """A benchmark stopped with `kill` left its JPEGs (141 MB) in the temp directory; they live in
    the cache now, and SIGTERM stops the run as Ctrl-C does: its loaders close."""
    pytest.importorskip("PIL")
    temp, cache = tmp_path / "temp", tmp_path / "cache"
    temp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "gloader.bench", "--quick", "--rounds", "5", "--workloads", "W8"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(temp), "XDG_CACHE_HOME": str(cache)})
    try:
        for line in proc.stderr:
            if line.startswith("[") and " left" in line:  # measuring: loaders and their workers are running
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait(10)
        proc.stderr.close()
    assert list(temp.iterdir()) == []
    assert len(list((cache / "gloader" / "bench").iterdir())) == 1  # the JPEGs, for the next run


def test_a_first_look_prints_each_workload_as_it_is_measured_then_the_ratios() -> None:
    """`--quick` alone: gloader against torch on W1-W4 and W8, each table printed as it is
    measured (stdout), the time left on each progress line (stderr), the ratios at the end."""
    done = subprocess.run([sys.executable, "-m", "gloader.bench", "--quick", "--rounds", "1"],
                          capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    starts = [out.index(f"| {name} ") for name in ("W1", "W2", "W3")] + [out.index("| W4 first batch")]
    assert starts == sorted(starts) and out.index("First look") > starts[-1]
    assert "tensorpack" not in out and "Scaling" not in out  # torch alone beside gloader
    summary_rows = out[out.index("First look"):].splitlines()
    assert [row.split()[1] for row in summary_rows if row.startswith("| W")][:3] == ["W1", "W2", "W3"]
    progress = [line for line in done.stderr.splitlines() if line.startswith("[")]
    assert progress and all(re.search(r"about \d+ (s|min) left$", line) for line in progress)


def _spin_then_wait(began: Any, spun: Any, release: Any) -> None:
    began.set()
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    spun.set()
    release.wait(30)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_turn_waits_until_the_workers_of_the_loaders_before_it_are_idle(monkeypatch) -> None:
    # A loader's turn must not share the cores with what another loader prefetched. The child
    # spins for CPU time, not wall time, and the deadline is wide: on a machine busy with other
    # programs its 0.3 s of CPU can take seconds.
    monkeypatch.setattr(rounds, "_SETTLE_DEADLINE_S", 60.0)
    # Beside other CPU-bound programs the spinning child may get under 3 ticks of a 0.1 s poll and
    # look idle: half-second polls, and idle meaning no tick at all, tell it apart there too.
    monkeypatch.setattr(rounds, "_SETTLE_POLL_S", 0.5)
    monkeypatch.setattr(rounds, "_IDLE_TICKS", 0)
    context = multiprocessing.get_context("fork")
    began, spun, release = context.Event(), context.Event(), context.Event()
    child = context.Process(target=_spin_then_wait, args=(began, spun, release))
    child.start()
    try:
        assert began.wait(30)
        assert rounds.children_cpu_ticks() is not None
        rounds.settle()
        assert spun.is_set()  # it waited for the child's CPU time
    finally:
        release.set()
        child.join(30)
        if child.exitcode is not None:
            child.close()


class _CountedLoader:
    """A loader that records its life: built, closed."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name
        log.append(f"built {name}")

    def __iter__(self) -> Any:
        return iter(range(1000))

    def close(self) -> None:
        self.log.append(f"closed {self.name}")


def test_every_round_builds_each_loader_anew_and_closes_it_after_its_turn() -> None:
    # One instance per loader would carry its luck into every round (see rounds.time_rounds).
    log: list[str] = []
    makers = {name: (lambda name=name: _CountedLoader(log, name)) for name in ("a", "b")}
    work = workloads.Workload("T", "test", lambda: None, 1, 1, batches=3, warm=2)
    times = rounds.time_rounds(makers, work, 3, rounds.Progress(6), "T")
    assert {name: len(t) for name, t in times.items()} == {"a": 3, "b": 3}
    assert log == ["built a", "closed a", "built b", "closed b",  # the order turns each round
                   "built b", "closed b", "built a", "closed a",
                   "built a", "closed a", "built b", "closed b"]


class _Indexed:
    def __len__(self) -> int:
        return 64

    def __getitem__(self, idx: int) -> int:
        return idx


def test_the_compute_ceiling_loads_batches_in_its_workers_and_ends_them_on_close() -> None:
    ceiling = peers.ComputeCeiling(_Indexed(), 8, 2)
    workers = list(ceiling._workers)
    try:
        got = list(itertools.islice(iter(ceiling), 20))  # more than the 8 of one epoch: they go on
        assert got == [None] * 20 and all(w.is_alive() for w in workers)
    finally:
        ceiling.close()
    assert all(not w.is_alive() for w in workers) and ceiling._workers == []


def test_the_compute_ceiling_reports_quick_batches_in_counts_not_one_message_each() -> None:
    """A message per W1 batch (thousands a second) cost the ceiling's processes and the caller
    CPU that the loading needs: the ceiling read 13% low."""
    ceiling = peers.ComputeCeiling(_Indexed(), 8, 1)  # batches of microseconds
    try:
        first = ceiling._done.get(timeout=30)
        assert first > 1
        it = iter(ceiling)
        assert list(itertools.islice(it, first + 5)) == [None] * (first + 5)  # a None per batch
    finally:
        ceiling.close()


class _Pairs:
    """Sample i: (float32[3] filled with i, i), W1's form."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, idx: int) -> tuple[Any, int]:
        import numpy as np

        return np.full(3, idx, dtype=np.float32), idx


def test_the_batching_floor_hands_over_whole_batches_of_samples_and_ends_its_workers_on_close() -> None:
    floor = peers.BatchingFloor(_Pairs(), 8, 2)
    workers = list(floor._workers)
    try:
        # More batches than both processes' slots hold: taking the next gives the last one back.
        seen = []
        for values, labels in itertools.islice(iter(floor), 3 * 2 * peers._FLOOR_SLOTS):
            assert values.shape == (8, 3) and values.dtype == torch.float32 and labels.dtype == torch.int64
            assert torch.equal(values, labels[:, None].float().expand(8, 3))  # each row its sample's
            assert len(set(labels.tolist())) == 8  # a batch holds distinct samples of one pass
            seen += labels.tolist()
        assert set(seen) <= set(range(40)) and len(set(seen)) > 8
        assert all(w.is_alive() for w in workers)
    finally:
        floor.close()
    assert all(not w.is_alive() for w in workers) and floor._workers == []


def test_the_batching_floor_names_the_exit_code_of_a_worker_that_ended() -> None:
    floor = peers.BatchingFloor(_Pairs(), 8, 1)
    try:
        floor._workers[0].kill()
        floor._workers[0].join(10)
        it = iter(floor)
        with pytest.raises(RuntimeError, match=r"one of the floor's workers ended \(exit codes \[-9\]\)"):
            for _ in range(peers._FLOOR_SLOTS + 1):  # what it wrote before it was killed comes first
                next(it)
    finally:
        floor.close()


def test_the_compute_ceiling_tunes_malloc_as_gloaders_workers_do() -> None:
    from gloader._worker import setup as _process_setup

    assert (peers._MALLOC_MMAP_THRESHOLD_BYTES, peers._MALLOC_TRIM_THRESHOLD_BYTES) == (
        _process_setup._MALLOC_MMAP_THRESHOLD_BYTES, _process_setup._MALLOC_TRIM_THRESHOLD_BYTES)


def test_the_compute_ceiling_names_its_workers_exit_codes_when_they_stop_loading(monkeypatch) -> None:
    monkeypatch.setattr(peers, "_CEILING_WAIT_S", 2.0)
    ceiling = peers.ComputeCeiling(list(range(5)), 8, 1)  # not one whole batch: the worker ends at once
    try:
        ceiling._workers[0].join(30)
        with pytest.raises(RuntimeError, match=r"the ceiling's workers loaded no batch in 2 s \(exit codes \[0\]\)"):
            next(iter(ceiling))
    finally:
        ceiling.close()


def test_the_report_gives_the_ceiling_over_torch_from_each_rounds_times() -> None:
    # Round times (s): gloader 1.0 and 2.0, torch 1.5 and 2.2, ceiling 0.9 and 2.0.
    ratios = {"torch": [1.5, 1.1], "ceiling": [0.9, 1.0]}
    samples = {"gloader": [100.0, 50.0], "torch": [66.7, 45.5], "ceiling": [111.1, 50.0]}
    results = {"rounds": 2, "W8": {"title": "t", "samples_per_s": samples, "mb_per_s": samples, "ratio": [1.5, 1.1],
                                   "ratios": ratios, "skipped_peers": {}}}
    lines = bench.report(results).splitlines()
    row = next(line for line in lines if line.startswith("| W8 |"))
    assert "skipped: not measured here" in row.split("|")[3]  # in-process: not a W8 peer
    assert float(row.split("|")[-3].split("(**")[1].rstrip("x*) ")) == pytest.approx(0.95)  # gloader / ceiling
    assert "skipped: not measured here" in row.split("|")[-2]  # gloader auto: not in these results
    bound = next(line for line in lines if line.startswith("Ceiling / torch"))
    # 1.5 / 0.9 = 1.67 and 1.1 / 1.0 = 1.10: their median is 1.38
    assert bound.endswith("W8 1.38 (1.10-1.67)x")
    assert not any(line.startswith("Ceiling / tensorpack") for line in lines)  # not a W8 peer


def test_the_report_gives_the_ceiling_over_tensorpack_where_both_ran() -> None:
    # Round times (s): gloader 1.0 and 1.0, tensorpack 0.9 and 1.2, ceiling 0.6 and 1.0.
    ratios = {"torch": [5.0, 6.0], "tensorpack": [0.9, 1.2], "ceiling": [0.6, 1.0]}
    samples = {"gloader": [10.0, 10.0], "torch": [2.0, 1.7], "tensorpack": [11.1, 8.3], "ceiling": [16.7, 10.0]}
    results = {"rounds": 2, "W1": {"title": "t", "samples_per_s": samples, "mb_per_s": samples, "ratio": [5.0, 6.0],
                                   "ratios": ratios, "skipped_peers": {}}}
    lines = bench.report(results).splitlines()
    bound = next(line for line in lines if line.startswith("Ceiling / tensorpack"))
    # per round 0.9 / 0.6 = 1.50 and 1.2 / 1.0 = 1.20, median 1.35 (a ratio of the medians would read 1.31)
    assert bound.endswith("W1 1.35 (1.20-1.50)x")


def test_the_report_gives_the_batching_floor_over_tensorpack_beside_the_ceiling() -> None:
    # Round times (s): gloader 1.0 and 1.0, tensorpack 0.9 and 1.2, floor 0.75 and 0.8, ceiling 0.6 and 0.5.
    ratios = {"torch": [5.0, 6.0], "tensorpack": [0.9, 1.2], "floor": [0.75, 0.8], "ceiling": [0.6, 0.5]}
    samples = {"gloader": [10.0, 10.0], "torch": [2.0, 1.7], "tensorpack": [11.1, 8.3], "floor": [13.3, 12.5],
               "ceiling": [16.7, 20.0]}
    results = {"rounds": 2, "W1": {"title": "t", "samples_per_s": samples, "mb_per_s": samples, "ratio": [5.0, 6.0],
                                   "ratios": ratios, "skipped_peers": {}}}
    lines = bench.report(results).splitlines()
    header = next(line for line in lines if line.startswith("| workload | gloader nw=2 |"))
    assert header.split("|")[5:8] == [" tensorpack ", " floor ", " ceiling "]
    # per round 0.9 / 0.75 = 1.20 and 1.2 / 0.8 = 1.50; the ceiling's 1.50 and 2.40
    assert next(line for line in lines if line.startswith("Floor / tensorpack")).endswith("W1 1.35 (1.20-1.50)x")
    assert next(line for line in lines if line.startswith("Ceiling / tensorpack")).endswith("W1 1.95 (1.50-2.40)x")
    assert next(line for line in lines if line.startswith("Floor / torch")).endswith("W1 7.08 (6.67-7.50)x")


def test_the_report_names_the_machine_it_ran_on() -> None:
    results = bench.run(quick=True, rounds=1, only={"W13"})
    line = next(line for line in bench.report(results).splitlines() if line.startswith("Machine: "))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert f", {cpus} CPUs usable;" in line and f"torch {torch.__version__}," in line
    assert results["machine"] == line.removeprefix("Machine: ")


@pytest.fixture(scope="module")
def fonts_open() -> None:
    """matplotlib keeps the font files it drew with open for the process's life (a cache): draw
    once before the leak guard's snapshot, so a test that draws a chart is not charged for it."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots()
    axis.set_title("fonts")
    fig.savefig(io.StringIO(), format="svg")
    plt.close(fig)


def test_markdown_page_and_readme_summary_come_from_one_run(fonts_open: None, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:

    readme = tmp_path / "README.md"
    readme.write_text(f"# Project\n\nbefore\n{cli.SUMMARY_START}\nan old table\n{cli.SUMMARY_END}\nafter\n")
    page = tmp_path / "benchmarks.md"
    assert bench.main(["--quick", "--rounds", "1", "--workloads", "W1", "--markdown", str(page),
                       "--readme", str(readme)]) == 0
    printed = capsys.readouterr().out
    w1_row = next(line for line in printed.splitlines() if line.startswith("| W1"))
    text = page.read_text()
    assert text.startswith("# Benchmarks") and w1_row in text and "Machine: " in text
    assert "`python -m gloader.bench --quick --rounds 1 --workloads W1 --markdown" in text
    # the run's chart of its group, beside the page, shown on it; gloader's bars highlighted
    assert "![Samples in memory: W1 tiny, W2 images, W9 and W10 tables](benchmarks-in-memory.svg)" in text
    chart = (tmp_path / "benchmarks-in-memory.svg").read_text()
    assert chart.count("#2f6fd0") == 3 and "samples/s" in chart  # gloader, gloader nw=1, gloader auto
    assert sorted(p.name for p in tmp_path.glob("*.svg")) == ["benchmarks-in-memory.svg"]  # one group ran
    ratio = float(w1_row.strip("|").split("|")[5].strip(" *x").split()[0])  # to 3 significant digits
    updated = readme.read_text()
    assert updated.startswith("# Project\n\nbefore\n") and updated.endswith(f"{cli.SUMMARY_END}\nafter\n")
    summary_row = next(line for line in updated.splitlines() if line.startswith("| W1 "))
    assert "an old table" not in updated
    assert float(summary_row.split("|")[2].strip(" x")) == pytest.approx(ratio, rel=0.006)  # the same run's median


def test_readme_without_the_summary_markers_is_refused_before_the_run(tmp_path, capsys) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# Project\n")
    with pytest.raises(SystemExit) as info:
        bench.main(["--workloads", "W1", "--readme", str(readme)])
    assert info.value.code == 2 and "has no lines" in capsys.readouterr().err


def test_the_remote_storage_workload_serves_every_sample_over_http_and_reports_each_loader(monkeypatch) -> None:
    pytest.importorskip("PIL")
    import psutil

    from gloader.bench import remote

    monkeypatch.setattr(remote, "_WORKER_COUNTS", (2,))
    monkeypatch.setattr(remote, "_QUICK_SAMPLES", 96)
    monkeypatch.setattr(remote, "_SETTLE_S", 0.5)  # the tuned loaders' count holds this long before their timed epoch
    steps: list[str] = []
    results = {"W11": remote.measure_remote(quick=True, rounds=1, step=steps.append)}
    names = ("torch nw=2", "gloader nw=2", remote._AUTO, remote._AUTO_WORKERS, remote._AUTO_BOTH)
    assert steps == [f"W11 round 1 {name}" for name in names]
    loaders = results["W11"]["loaders"]
    assert all(got["samples_per_s"][0] > 0 and got["uss_mb"][0] > 0 for got in loaders.values())
    assert loaders[remote._AUTO]["threads"][0] >= 1 and loaders[remote._AUTO_BOTH]["threads"][0] >= 1
    assert loaders["gloader nw=2"]["workers"] == [2] and loaders[remote._AUTO_WORKERS]["workers"][0] >= 1
    lines = remote.report_remote(results)
    assert any(line.startswith("| gloader nw=2 fetch_threads=auto |") and "per worker" in line for line in lines)
    assert any(line.startswith("| gloader nw=auto | ") for line in lines)
    line = next(line for line in lines if line.startswith("W11: gloader nw=auto fetch_threads=auto reads"))
    assert "the best torch configuration (torch nw=2)" in line
    # CPU time is counted in ticks of 10 ms: these epochs of 96 samples are too short to bound it
    assert all(0 <= got["cpus_busy"][0] <= results["W11"]["cpus"] + 1 for got in loaders.values()), loaders
    results["W11"]["loaders"] = {name: dict(got, cpus_busy=[1.0], samples_per_s=[500.0 if name == "torch nw=2" else
                                                                                 1000.0]) for name, got in loaders.items()}
    bound = remote.report_remote(results)[-1]  # 1 CPU busy at 1,000 samples/s: 1 ms a sample, 2 CPUs serve 2,000
    assert bound == (f"W11 CPU bound here: the least CPU a sample took was 1.00 ms (HTTP client, decode, server, "
                     f"batching), so {results['W11']['cpus']} CPUs serve at most {results['W11']['cpus'] * 1000} "
                     f"samples/s, {results['W11']['cpus'] * 2:.2f}x the best torch.")
    assert remote.remote_summary(results).startswith("gloader nw=auto fetch_threads=auto / the best torch (torch nw=2)")
    def left() -> list[Any]:  # but the resource tracker and the fork server, which live with this process
        return [child for child in psutil.Process().children(recursive=True)
                if not any(helper in " ".join(child.cmdline()) for helper in ("resource_tracker", "forkserver"))]

    assert wait_until(lambda: not left(), 10.0), [c.cmdline() for c in left()]  # the server and every worker are gone


def test_figures_are_printed_to_three_significant_digits() -> None:
    from gloader.bench.figures import summary, three_digits

    assert [three_digits(v) for v in (675590.46, 1837.79, 43.83, 1.0, 0.012345)] == \
        ["676000", "1840", "43.8", "1.00", "0.0123"]
    assert summary([675590.46, 543227.25, 841917.39]) == "676000 (543000-842000)"


def test_help_names_every_workload() -> None:
    done = subprocess.run([sys.executable, "-m", "gloader.bench", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0
    listed = done.stdout.split("\nworkloads:\n")[1]
    starts = re.findall(r"^\s+(W\d+)(?:, (W\d+))? ", listed, re.MULTILINE)  # each line that says what one is
    assert sorted({name for pair in starts for name in pair if name}, key=lambda n: int(n[1:])) == \
        [f"W{i}" for i in range(1, 14)]


def test_module_changes_count_each_entry_into_another_module_of_the_package() -> None:
    """`python -m gloader.bench.boundaries` counts, in one call, each time a call enters a module
    of the package other than the one entered last; calls outside the package do not count."""
    from gloader.bench.boundaries import count_changes

    code = compile("def call(then=None):\n    return then() if then else 0\n", "<fake>", "exec")
    calls = {}
    for name in ("pkg.a", "pkg.b", "other"):
        space: dict = {"__name__": name}
        exec(code, space)
        calls[name] = space["call"]
    a, b, other = calls["pkg.a"], calls["pkg.b"], calls["other"]
    assert count_changes(lambda: a(lambda: a()), "pkg") == 0
    assert count_changes(lambda: a(lambda: other(lambda: a())), "pkg") == 0
    assert count_changes(lambda: a(lambda: b(lambda: a())), "pkg") == 2
    assert count_changes(lambda: a(lambda: other(lambda: b())), "pkg") == 1


@pytest.mark.timeout(120)
def test_supervision_reports_each_loader_and_the_callers_single_look(capsys) -> None:
    """`python -m gloader.bench.supervision`: a row for gloader's own pool, a shared pool and
    torch, each with the time from the kill to the error, and gloader's caller woken once."""
    from gloader.bench import supervision

    assert supervision.main(["--rounds", "1"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    assert [row[0].strip("| ") for row in rows] == ["own pool", "shared WorkerPool", "torch"]
    assert all(0 < float(row[1].split()[0]) < 60_000 for row in rows)  # by the death, not a timeout
    assert [row[2].strip(" |") for row in rows] == ["1", "1", "-"]


def test_w12_report_and_scale_out_model_follow_the_measured_figures() -> None:
    """The model is nodes x the measured per-node rate, up to what one caller received."""
    from gloader.bench import cluster

    def loaders(rate: float) -> dict[str, Any]:
        return {name: {"samples_per_s": [rate * (1 + index)], "caller_ms": [0.5]}
                for index, name in enumerate(("gloader on Ray", "Ray Data", "torch", "gloader local"))}

    results = {"W12": {"cpus": 2, "W3": loaders(1000.0), "W8": loaders(100.0),
                       "receive": {"batch_mb": 2.4, "gloader on Ray": {"gb_per_s": [0.5], "caller_ms": [0.8]},
                                   "gloader local": {"gb_per_s": [4.0], "caller_ms": [0.2]}}}}
    assert cluster.scale_out(results, "W3", 4) == 4000.0  # far under the bound: 0.5 GB/s of 264-byte samples
    w8_bound = 0.5e9 / (3 * 224 * 224 * 4 + 8)
    assert cluster.scale_out(results, "W8", 64) == pytest.approx(w8_bound)
    assert cluster.scale_out(results, "W8", 2) == 200.0
    lines = cluster.report_ray(results)
    w3 = next(line for line in lines if line.startswith("| W3 |"))
    assert "(**0.50x**)" in w3  # gloader on Ray over Ray Data, which read twice as fast here
    assert cluster.ray_summary(results) == ("W12 gloader on Ray / Ray Data, same CPUs | W3 0.50x, W8 0.50x; "
                                            "one caller receives 0.50 GB/s")
    assert cluster.report_ray({"W12": {"skipped": "Ray is not installed"}}) == ["", "W12 skipped: Ray is not installed"]


def test_the_samplers_workload_reports_each_samplers_cost_beside_the_plain_one() -> None:
    results = bench.run(quick=True, rounds=1, only={"W13"})
    lines = bench.report(results).splitlines()
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ") and "x |" in line}
    assert {"RandomSampler (plain)", "DistributedBatchSampler", "WeightedMixtureSampler, 3 datasets",
            "TokenBudgetBatchSampler"} <= set(rows)
    assert rows["RandomSampler (plain)"].split("|")[3].strip().startswith("1.00")  # itself, per round
    loaded = results["W13"]["loaded"]
    placed = next(line for line in lines if line.startswith("| DistributedBatchSampler, each sample seeded"))
    assert f"({loaded['placed'][0] / loaded['plain'][0]:.3g}" in placed.replace("x |", "")


def test_the_held_once_workload_measures_each_run_in_a_fresh_process_and_reports_both_loaders() -> None:
    from gloader.bench import held

    runs = {loader: held._run_one("fork", "list of dicts", loader, 2, 20_000) for loader in ("gloader", "torch")}
    assert all(len(run["growth_mb"]) == 2 and run["first_s"] > 0 for run in runs.values())
    spawned = held._run_one("spawn", "dict of lists", "gloader", 2, 20_000)
    assert len(spawned["uss_mb"]) == 2 and min(spawned["uss_mb"]) > 0
    fake = {"length": 20_000, "fork": {f"{store}|{loader}": runs[loader] for store in held.STORES
                                       for loader in ("gloader", "torch")},
            "spawn": {f"{store}|{loader}|2": spawned for store in (*held.STORES, "ints") for loader in ("gloader", "torch")}}
    lines = held.report_held({"W5": fake})
    assert sum(line.startswith("| list of dicts |") for line in lines) == 2  # a fork row and a spawn row
    assert any(line.startswith("| 1,000 ints (starting the processes alone) | 2 |") for line in lines)
    served = held._run_one("forkserver", "list of dicts", "gloader", 2, 20_000)
    assert len(served["uss_mb"]) == 2 and min(served["uss_mb"]) > 0
    fake["forkserver"] = {f"{store}|{loader}|2": served for store in ("list of dicts", "ints")
                          for loader in ("gloader", "torch")}
    lines = held.report_held({"W5": fake})
    assert any(line.startswith("| W5 forkserver, 20,000 records") for line in lines)
    assert sum(line.startswith("| list of dicts |") for line in lines) == 3  # and a forkserver row
