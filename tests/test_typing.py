"""The package type-checks strictly (mypy --strict, configured in mypy.ini)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(300)
def test_package_passes_mypy_strict() -> None:
    result = subprocess.run([sys.executable, "-m", "mypy", "--config-file", os.path.join(ROOT, "mypy.ini"),
                             os.path.join(ROOT, "gloader")], capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout + result.stderr
