"""The code a newcomer copies first runs as written: the README's quickstart and the docs'."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_blocks(path: str) -> list[str]:
    with open(os.path.join(ROOT, path), encoding="utf-8") as page:
        return re.findall(r"```python\n(.*?)```", page.read(), flags=re.S)


@pytest.mark.parametrize("path, index", [("README.md", 0), ("docs/quickstart.md", 0)])
def test_the_first_code_block_of_the_page_runs_as_written(path: str, index: int, tmp_path) -> None:
    code = _python_blocks(path)[index]
    assert "DataLoader(" in code
    script = tmp_path / "quickstart.py"
    script.write_text("if __name__ == '__main__':\n" + "".join(f"    {line}\n" for line in code.splitlines()))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_every_page_the_site_lists_exists_and_every_page_is_listed() -> None:
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as config:
        listed = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", config.read(), flags=re.M))
    pages = {os.path.relpath(os.path.join(folder, name), os.path.join(ROOT, "docs"))
             for folder, _, names in os.walk(os.path.join(ROOT, "docs")) for name in names if name.endswith(".md")}
    assert listed == pages
