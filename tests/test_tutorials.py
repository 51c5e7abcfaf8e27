"""Tutorials: committed without outputs, in sync with their plain-text twins, and they run
top to bottom in a fresh kernel (in a subprocess, so the kernel's resources stay there)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile

import nbformat
import pytest

TUTORIALS = pathlib.Path(__file__).resolve().parent.parent / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("[0-9]*.ipynb"))

sys.path.insert(0, str(TUTORIALS))
from sync import notebook_from_twin  # noqa: E402  # tutorials/ is not a package

_RUN = """
import sys, nbformat
from nbclient import NotebookClient
notebook = nbformat.read(sys.argv[1], as_version=4)
NotebookClient(notebook, timeout=240, kernel_name="python3",
               resources={"metadata": {"path": sys.argv[2]}}).execute()
"""


def test_there_are_four_tutorials() -> None:
    assert [p.stem for p in NOTEBOOKS] == ["01_quickstart", "02_loaders_and_seeds", "03_performance",
                                           "04_when_things_go_wrong"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_matches_its_twin_and_has_no_outputs(path: pathlib.Path) -> None:
    committed = nbformat.read(path, as_version=4)
    expected = notebook_from_twin(path.with_suffix(".py").read_text())
    assert [(c.cell_type, c.source) for c in committed.cells] == [(c.cell_type, c.source) for c in expected.cells]
    assert all(not c.get("outputs") and c.get("execution_count") is None
               for c in committed.cells if c.cell_type == "code")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom_in_a_fresh_kernel_and_leaves_no_temporary_file(path: pathlib.Path) -> None:
    # The kernel's temporary directory: a user's /tmp must not fill up run after run. A short
    # path, not pytest's tmp_path: the sockets torch's workers pass descriptors through live
    # there, and an AF_UNIX path over 107 bytes hangs torch's DataLoader.
    temp = pathlib.Path(tempfile.mkdtemp(prefix="nb-"))
    result = subprocess.run([sys.executable, "-c", _RUN, str(path), str(TUTORIALS)], capture_output=True,
                            text=True, timeout=290,
                            env={**os.environ, "PYDEVD_DISABLE_FILE_VALIDATION": "1", "TMPDIR": str(temp)})
    assert result.returncode == 0, result.stderr[-4000:]
    assert sorted(p.name for p in temp.iterdir()) == []
    temp.rmdir()
