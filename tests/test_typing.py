"""The package type-checks strictly (mypy --strict, configured in mypy.ini), lints clean
(ruff: pyflakes, isort, bugbear; ruff.toml), its imports run one way (no import circle), and
its folders say where their code runs: a worker-side module never imports a caller-side one."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The rooms, by side: what runs in a worker (and the wire both sides read) never imports what runs
# only in the caller; the data side (datasets, samplers, batchify) imports nothing that starts a
# process or touches CUDA.
WORKER_SIDE = ("_worker", "_wire", "_datasets")
CALLER_SIDE = ("_caller", "_places", "loader", "integrations")
DATA_SIDE = ("_sampling", "_datasets", "sampler", "dataset", "batchify")
STARTS_PROCESSES = ("_pool", "_places", "_worker", "_caller", "loader", "integrations")
# At most this many modules directly under gloader/: the rest is in the folders that say where it runs.
MOST_TOP_MODULES = 12


@pytest.mark.timeout(300)
def test_package_passes_mypy_strict() -> None:
    result = subprocess.run([sys.executable, "-m", "mypy", "--config-file", os.path.join(ROOT, "mypy.ini"),
                             os.path.join(ROOT, "gloader")], capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(120)
def test_code_passes_ruff() -> None:
    paths = [os.path.join(ROOT, name) for name in ("gloader", "tests", "examples", "tutorials", "setup.py")]
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--config", os.path.join(ROOT, "ruff.toml"),
                             *paths], capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stdout + result.stderr


def _module_of(path: str) -> str:
    """'_caller.engine' for gloader/_caller/engine.py, '_caller' for its __init__.py."""
    name = os.path.relpath(path, os.path.join(ROOT, "gloader"))[:-3].replace(os.sep, ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _imports_of(path: str) -> set[str]:
    """gloader modules (and packages) that the file at `path` imports, top level and inside functions."""
    module = _module_of(path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 0:
            if node.module and node.module.startswith("gloader"):
                rest = node.module.partition(".")[2]
                found.update([rest] if rest else [alias.name for alias in node.names])
            continue
        base = package.split(".") if package and package != "__init__" else []
        base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
        prefix = [*base, *([node.module] if node.module else [])]
        if node.module:
            found.add(".".join(prefix))
        for alias in node.names:
            candidate = ".".join([*prefix, alias.name])
            if os.path.exists(os.path.join(ROOT, "gloader", *candidate.split(".")) + ".py"):
                found.add(candidate)
    return {name for name in found if name and name != module}


def _graph() -> dict[str, set[str]]:
    graph = {}
    for folder, _, names in os.walk(os.path.join(ROOT, "gloader")):
        for name in names:
            if name.endswith(".py") and "bench" not in os.path.relpath(folder, ROOT).split(os.sep):
                path = os.path.join(folder, name)
                graph[_module_of(path)] = _imports_of(path)
    known = set(graph)

    def known_as(target: str) -> str:
        while target not in known and "." in target:
            target = target.rpartition(".")[0]
        return target if target in known else ""

    return {module: {known_as(t) for t in targets} - {"", module} for module, targets in graph.items()}


def _on(module: str, sides: tuple[str, ...]) -> bool:
    return any(module == side or module.startswith(side + ".") for side in sides)


def test_imports_run_one_way_with_no_circle() -> None:
    graph, layers = _graph(), []
    remaining = dict(graph)
    while remaining:
        layer = {module for module, targets in remaining.items() if not targets & set(remaining)}
        assert layer, f"import circle among {sorted(remaining)}"
        layers.append(layer)
        remaining = {module: targets for module, targets in remaining.items() if module not in layer}


def test_worker_side_never_imports_the_caller_and_the_data_side_starts_no_process() -> None:
    crossing = [f"{module} imports {target}" for module, targets in _graph().items() for target in targets
                if (_on(module, WORKER_SIDE) and _on(target, CALLER_SIDE))
                or (_on(module, DATA_SIDE) and module != "_sampling.schedule" and _on(target, STARTS_PROCESSES))]
    assert crossing == []


def test_a_newcomer_finds_few_modules_at_the_top_and_the_rest_in_folders_by_side() -> None:
    top = sorted(name for name in os.listdir(os.path.join(ROOT, "gloader")) if name.endswith(".py"))
    assert len(top) <= MOST_TOP_MODULES, top
    folders = {name for name in os.listdir(os.path.join(ROOT, "gloader"))
               if os.path.isdir(os.path.join(ROOT, "gloader", name)) and not name.startswith("__")}
    assert folders == {"_caller", "_worker", "_wire", "_pool", "_places", "_sampling", "_datasets", "bench",
                       "integrations"}


def test_the_benchmark_uses_gloaders_public_api_only() -> None:
    bench = os.path.join(ROOT, "gloader", "bench")
    private = [f"bench/{name} imports gloader.{target}" for name in sorted(os.listdir(bench)) if name.endswith(".py")
               for target in _imports_of(os.path.join(bench, name))
               if target.startswith("_") and not target.startswith("bench")]
    assert private == []
