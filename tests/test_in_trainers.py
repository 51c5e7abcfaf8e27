"""gloader in the trainers themselves (Lightning, Accelerate, the transformers Trainer), each
run as a user runs it: a script in its own process. Skipped where the trainer is not installed
(the test extra installs them)."""
from __future__ import annotations

import json
import os
import sys
import textwrap
from typing import Any

import pytest

from tests.conftest import run_group

pytestmark = pytest.mark.timeout(240)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args: list[str], timeout_s: float = 200, env: dict[str, str] | None = None) -> Any:
    """Run a Python script in a new process from the repository's root; its last line of output, as JSON."""
    done = run_group([sys.executable, *args], timeout_s, cwd=_ROOT, env={**os.environ, "PYTHONPATH": _ROOT, **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_lightning_seed_everything_with_workers_fits_the_same_steps_for_any_worker_count() -> None:
    """`seed_everything(workers=True)` sets the loader's worker_init_fn (LightningCLI does so by
    default); that crashed every fit. Its workers run Lightning's seeding once; each batch is then
    seeded from (seed, epoch, batch index), so one worker and two train the same steps."""
    pytest.importorskip("lightning")
    runs = [_run(["tests/trainer_scripts/lightning_fit.py", str(workers)]) for workers in (1, 2)]
    assert runs[0]["worker_init_fn"] == "pl_worker_init_function"  # Lightning's, set on gloader's loader
    assert len(runs[0]["losses"]) == 16 and runs[0]["losses"] == runs[1]["losses"]


def test_accelerates_seedable_sampler_goes_into_the_loaders_batch_sampler() -> None:
    """`DataLoaderConfiguration(use_seedable_sampler=True)`, the transformers Trainer's path, sets
    `batch_sampler.sampler`; gloader's BatchSampler refused it (no setter). The prepared loader
    (torch's, built from gloader's attributes) then serves every sample once an epoch, in the
    order of Accelerate's seed."""
    pytest.importorskip("accelerate")
    script = textwrap.dedent("""
        import json, warnings
        import numpy as np
        from accelerate import Accelerator
        from accelerate.utils import DataLoaderConfiguration, set_seed
        import gloader
        warnings.simplefilter("ignore", RuntimeWarning)  # gloader says the prepared loader is torch's
        accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
        orders = []
        for seed in (0, 0, 1):
            set_seed(seed)
            prepared = accelerator.prepare(gloader.DataLoader(np.arange(20), batch_size=4, shuffle=True))
            epochs = []
            for epoch in range(2):
                prepared.set_epoch(epoch)
                epochs.append([int(i) for batch in prepared for i in batch])
            orders.append(epochs)
        print(json.dumps(orders))
        """)
    orders = _run(["-c", script])
    assert all(sorted(epoch) == list(range(20)) for epochs in orders for epoch in epochs)
    assert orders[0] == orders[1] and orders[0] != orders[2] and orders[0][0] != orders[0][1]


def test_a_transformers_trainer_resumed_mid_epoch_trains_the_uninterrupted_runs_steps(tmp_path) -> None:
    """The Trainer resumes an epoch by loading its rest in a torch DataLoader of its own (0 of 12
    losses equal); with `LoaderStateCallback` and `ignore_data_skip=True` gloader resumes it."""
    pytest.importorskip("transformers")
    full = _run(["tests/trainer_scripts/hf_resume.py", str(tmp_path / "full")])
    resumed = _run(["tests/trainer_scripts/hf_resume.py", str(tmp_path / "full"),
                    str(tmp_path / "full" / "checkpoint-12")])  # a new process, as after a preemption
    assert len(full) == 24 and sorted(resumed) == [str(step) for step in range(13, 25)]
    assert [resumed[step] for step in sorted(resumed)] == [full[step] for step in sorted(resumed)]
    assert os.path.exists(tmp_path / "full" / "checkpoint-12" / "gloader_loader_state.json")


def test_the_trainer_callback_says_what_it_needs_before_training_begins() -> None:
    pytest.importorskip("transformers")
    import types

    import numpy as np

    from gloader import DataLoader
    from gloader.integrations.transformers import LoaderStateCallback

    state = types.SimpleNamespace(global_step=0)
    with pytest.raises(TypeError, match="override get_train_dataloader"):
        LoaderStateCallback().on_train_begin(types.SimpleNamespace(ignore_data_skip=True), state, None,
                                             train_dataloader=[1, 2])
    with DataLoader(np.arange(4)) as loader, pytest.raises(ValueError, match="ignore_data_skip=True"):
        LoaderStateCallback().on_train_begin(types.SimpleNamespace(ignore_data_skip=False), state, None,
                                             train_dataloader=loader)
