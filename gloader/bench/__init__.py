"""Side-by-side benchmark of gloader and torch.utils.data.DataLoader: `python -m gloader.bench`.

`run` measures the workloads (`rounds`, on the loaders of `workloads`), `report` formats them as
Markdown, `plot` draws a chart; see `gloader.bench.cli` for the workloads and the method.
"""
from .cli import main, run
from .reporting import plot, report

__all__ = ["main", "plot", "report", "run"]
