"""Build each tutorial notebook (.ipynb, without outputs) from its plain-text twin (.py).

The .py files are the source: readable diffs. Cells start with `# %%`; markdown cells with
`# %% [markdown]`, their lines commented with `# `. Run `python tutorials/sync.py` after
editing a twin; the tests fail when a notebook and its twin disagree.
"""
from __future__ import annotations

import pathlib
import sys

import nbformat

HERE = pathlib.Path(__file__).resolve().parent


def notebook_from_twin(text: str) -> nbformat.NotebookNode:
    """Return the notebook that a `# %%` twin describes."""
    cells = []
    for chunk in text.split("# %%")[1:]:
        header, _, body = chunk.partition("\n")
        body = body.strip("\n")
        if header.strip() == "[markdown]":
            lines = [line[2:] if line.startswith("# ") else line.lstrip("#") for line in body.splitlines()]
            cells.append(nbformat.v4.new_markdown_cell("\n".join(lines)))
        else:
            cells.append(nbformat.v4.new_code_cell(body))
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for index, cell in enumerate(notebook.cells):
        cell["id"] = f"cell-{index}"
    return notebook


def main() -> int:
    for twin in sorted(HERE.glob("[0-9]*.py")):
        nbformat.write(notebook_from_twin(twin.read_text()), twin.with_suffix(".ipynb"))
        sys.stdout.write(f"wrote {twin.with_suffix('.ipynb').name}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
