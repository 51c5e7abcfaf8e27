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


def _pages() -> list[str]:
    return ["README.md"] + sorted(os.path.relpath(os.path.join(folder, name), ROOT)
                                  for folder, _, names in os.walk(os.path.join(ROOT, "docs"))
                                  for name in names if name.endswith(".md"))


_BLOCKS = [(path, index) for path in _pages() for index in range(len(_python_blocks(path)))]


@pytest.mark.parametrize("path, index", _BLOCKS)
def test_every_python_block_runs_as_pasted_or_says_it_is_a_fragment(path: str, index: int, tmp_path) -> None:
    """A newcomer pastes a block and runs it: it runs, or its first line says it is a fragment
    (`# fragment: ...`, naming what is the reader's), and then it is at least valid Python."""
    code = _python_blocks(path)[index]
    if code.startswith("# fragment:"):
        compile(code, f"{path} block {index}", "exec")
        return
    script = tmp_path / "pasted.py"  # as a script, whose main block spawned workers do not rerun
    script.write_text("if __name__ == '__main__':\n" + "".join(f"    {line}\n" for line in code.splitlines()))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert done.returncode == 0, f"{path}, python block {index}:\n{done.stderr[-3000:]}"


def test_the_readme_and_the_quickstart_open_with_whole_examples() -> None:
    for path in ("README.md", "docs/quickstart.md"):
        first = _python_blocks(path)[0]
        assert "DataLoader(" in first and not first.startswith("# fragment:")


def test_every_page_the_site_lists_exists_and_every_page_is_listed() -> None:
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as config:
        listed = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", config.read(), flags=re.M))
    pages = {os.path.relpath(os.path.join(folder, name), os.path.join(ROOT, "docs"))
             for folder, _, names in os.walk(os.path.join(ROOT, "docs")) for name in names if name.endswith(".md")}
    assert listed == pages
