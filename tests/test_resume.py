"""Mid-epoch resume: a state saved with torch.save continues in another process, exactly."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

import gloader
from gloader import DataLoader
from tests import _data

pytestmark = pytest.mark.timeout(90)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = {"batch_size": 6, "shuffle": True, "seed": 4, "last_batch": "rollover", "num_workers": 2}


def _epochs(loader: DataLoader, count: int) -> list:
    return [[b[0] for b in loader] for _ in range(count)]


def test_state_saved_with_torch_save_resumes_in_a_new_process_bit_identically(tmp_path) -> None:
    with DataLoader(_data.RandomAugmented(40), **SETTINGS) as loader:
        reference = _epochs(loader, 3)
    with DataLoader(_data.RandomAugmented(40), **SETTINGS) as loader:
        list(loader)
        it = iter(loader)
        head = [next(it)[0] for _ in range(2)]
        state_path = tmp_path / "state.pt"
        torch.save(loader.state_dict(), state_path)
    out_path = tmp_path / "rest.pt"
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {ROOT!r})
        from gloader import DataLoader
        from tests import _data
        if __name__ == "__main__":
            with DataLoader(_data.RandomAugmented(40), **{SETTINGS!r}) as loader:
                loader.load_state_dict(torch.load({str(state_path)!r}))
                rest = [b[0] for b in loader]
                following = [b[0] for b in loader]
            torch.save((rest, following), {str(out_path)!r})
        """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=80)
    rest, following = torch.load(out_path)
    assert all(torch.equal(a, b) for a, b in zip(head + rest, reference[1]))
    assert len(head) + len(rest) == len(reference[1])
    assert all(torch.equal(a, b) for a, b in zip(following, reference[2]))


@pytest.mark.parametrize("mode", [{"num_workers": 0}, {"num_workers": 2}, {"num_workers": 2, "thread_pool": True}])
def test_resuming_a_resumed_run_works(mode: dict) -> None:
    settings = {"batch_size": 4, "shuffle": True, "seed": 8, "last_batch": "rollover", **mode}
    with DataLoader(list(range(30)), **settings) as loader:
        reference = [torch.cat(list(loader)).tolist() for _ in range(2)]
    with DataLoader(list(range(30)), **settings) as first:
        it = iter(first)
        got = [next(it) for _ in range(2)]
        state = pickle.loads(pickle.dumps(first.state_dict()))  # a plain picklable dict
    with DataLoader(list(range(30)), **settings) as second:
        second.load_state_dict(state)
        it = iter(second)
        got += [next(it) for _ in range(3)]
        state = second.state_dict()
    with DataLoader(list(range(30)), **settings) as third:
        third.load_state_dict(state)
        got += list(third)
        following = torch.cat(list(third)).tolist()
    assert torch.cat(got).tolist() == reference[0]
    assert following == reference[1]


def test_state_at_an_epoch_boundary_starts_the_next_epoch() -> None:
    with DataLoader(list(range(10)), batch_size=4, shuffle=True, seed=1, last_batch="rollover") as loader:
        reference = [torch.cat(list(loader)).tolist() for _ in range(3)]
    with DataLoader(list(range(10)), batch_size=4, shuffle=True, seed=1, last_batch="rollover") as loader:
        list(loader)
        state = loader.state_dict()
    assert state["batches_yielded"] == 0 and state["epoch"] == 1
    with DataLoader(list(range(10)), batch_size=4, shuffle=True, seed=1, last_batch="rollover") as loader:
        loader.load_state_dict(state)
        assert [torch.cat(list(loader)).tolist() for _ in range(2)] == reference[1:]


def test_incomplete_state_is_rejected_naming_the_missing_keys() -> None:
    with DataLoader([1, 2], batch_size=1) as loader:
        with pytest.raises(ValueError, match=r"state is missing \['sampler', 'seed'\]"):
            loader.load_state_dict({"epoch": 0, "batches_yielded": 0})


def test_a_state_that_is_not_a_dict_is_rejected_naming_it() -> None:
    with DataLoader([1, 2], batch_size=1) as loader:
        with pytest.raises(TypeError, match=r"state must be a dict made by DataLoader.state_dict\(\), got 3"):
            loader.load_state_dict(3)  # type: ignore[arg-type]


def test_a_worker_death_at_an_epochs_end_rewinds_the_epoch_opened_ahead(tmp_path) -> None:
    """The next epoch's first batches were dispatched before the worker died; the next iter()
    serves that epoch, in its own order and with its own seeds, and state_dict() says so. One
    worker, so that the bad sample's first load is the one in epoch 0 (not its load ahead)."""
    done = tmp_path / "already-died"
    done.touch()
    with DataLoader(_data.DiesOnceAt(-1, str(done)), batch_size=4, shuffle=True, seed=7, num_workers=1) as clean:
        epochs = [[b.flatten().tolist() for b in clean] for _ in range(2)]
    bad = epochs[0][-1][0]  # in the last batch of epoch 0: loaded after epoch 1 was opened ahead
    marker = tmp_path / "died"
    with DataLoader(_data.DiesOnceAt(bad, str(marker)), batch_size=4, shuffle=True, seed=7,
                    num_workers=1) as loader:
        with pytest.raises(gloader.WorkerExitedError):
            list(loader)
        assert marker.exists()
        state = loader.state_dict()
        assert (state["epoch"], state["batches_yielded"]) == (1, 0)
        assert [b.flatten().tolist() for b in loader] == epochs[1]
