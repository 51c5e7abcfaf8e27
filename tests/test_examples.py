"""The examples run and do what their docstrings say."""
from __future__ import annotations

import pytest

from examples import sequences, train_model
from tests.conftest import run_group

pytestmark = pytest.mark.timeout(120)


def test_train_model_learns_the_blobs() -> None:
    assert train_model.main(epochs=3) > 0.8


def test_bucketing_cuts_padding() -> None:
    plain, bucketed = sequences.main(count=1000)
    assert bucketed < plain / 3


@pytest.mark.parametrize("loader", ["gloader", "torch"])
def test_torch_style_mnist_script_trains_with_either_import(loader: str, tmp_path) -> None:
    """The script is torch's shape; only its import line differs between the two runs."""
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "examples", "mnist_torch_style.py"), encoding="utf-8") as handle:
        source = handle.read()
    line = "from gloader import DataLoader"
    assert source.count(line) == 1
    script = tmp_path / "mnist.py"
    script.write_text(source if loader == "gloader" else source.replace(line, "from torch.utils.data import DataLoader"))
    done = subprocess.run([sys.executable, str(script), "--epochs", "2"], capture_output=True, text=True,
                          timeout=100, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Warning" not in done.stderr, done.stderr[-3000:]
    accuracy = re.findall(r"Accuracy: \d+/\d+ \((\d+)%\)", done.stdout)
    assert accuracy and int(accuracy[-1]) >= 90, done.stdout[-2000:]


@pytest.mark.timeout(300)
def test_under_accelerate_two_processes_train_the_same_steps_on_gloader_as_on_a_prepared_torch_loader() -> None:
    """examples/accelerate_ddp.py under a 2-process torchrun launch: gloader loading (left out of
    prepare(), iterated through AcceleratedLoader) gives the per-step losses of a torch DataLoader
    that prepare() shards, the same optimizer updates (an epoch of 13 batches, 2 accumulation
    steps: 7 an epoch, where a loader Accelerate does not know of made 6), and an evaluation that
    gather_for_metrics counts every sample of once, exactly."""
    pytest.importorskip("accelerate")
    import json
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = {}
    for loader in ("gloader", "torch"):
        # torch's arm is the reference, and gets a second try: beside two CPU hogs it failed in 3
        # of 130 runs (the one whose output was kept: a rank aborted in native code, "terminate
        # called without an active exception"), where gloader's arm never failed in 70.
        for _ in range(1 if loader == "gloader" else 2):
            done = run_group([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                              "examples/accelerate_ddp.py", "--loader", loader], 240, cwd=root,
                             env={**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"})  # else 1 process
            if done.returncode == 0:
                break
        assert done.returncode == 0, done.stderr[-3000:]
        assert "Warning" not in done.stderr, done.stderr[-3000:]
        runs[loader] = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(runs["gloader"]["losses"]) == 2 * 13  # 2 epochs of 13 steps a rank
    assert runs["gloader"]["losses"] == runs["torch"]["losses"]
    assert runs["gloader"]["updates"] == runs["torch"]["updates"] == 14
    assert runs["gloader"]["eval_samples"] == runs["torch"]["eval_samples"] == 100
    assert runs["gloader"]["eval_mse"] == runs["torch"]["eval_mse"]
