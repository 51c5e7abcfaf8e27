"""The examples run and do what their docstrings say."""
from __future__ import annotations

import pytest

from examples import sequences, train_model

pytestmark = pytest.mark.timeout(120)


def test_train_model_learns_the_blobs() -> None:
    assert train_model.main(epochs=3) > 0.8


def test_bucketing_cuts_padding() -> None:
    plain, bucketed = sequences.main(count=1000)
    assert bucketed < plain / 3
