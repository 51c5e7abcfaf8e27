"""The package type-checks strictly (mypy --strict, configured in mypy.ini), lints clean
(ruff: pyflakes, isort, bugbear; ruff.toml), and its imports run one way: each module imports
only modules on layers below its own, so there is no import circle."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# gloader's modules from the bottom up; a module may import only from layers before its own.
# The caller-side core reads top-down: loader -> _serving -> _iterator -> _engine -> _backends ->
# _schedule/_options -> _pool -> _worker -> _fetch -> _rows -> the supporting modules.
LAYERS = [
    {"_checks", "_math", "_mppool", "_pooldir", "_protocol", "_seed", "_segment", "_waits", "_snapshot", "_tree", "_stats"},
    {"_admission", "_mpclasses", "_registry", "_caller_slots", "_worker_slots", "_plans", "sampler", "_device"},
    {"batchify", "dataset", "_payload", "_process_setup", "_rows", "_task", "_sizing", "_datapipes", "_tuning"},
    {"_fetch"},
    {"_worker"},
    {"_deaths"},
    {"_pool", "_ray"},
    {"_shared_pool"},
    {"_options", "_schedule"},
    {"_backends", "_attributes"},
    {"_engine"},
    {"_iterator"},
    {"_serving"},
    {"loader"},
    {"__init__"},
    {"bench"},
]


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


def _imports_of(path: str, package_module: bool) -> set[str]:
    """gloader modules that the file at `path` imports (top level and inside functions)."""
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and node.module.startswith("gloader"):
                parts = node.module.split(".")
                found.add(parts[1] if len(parts) > 1 else "__init__")
            elif node.level == 1 and not package_module:
                found.update([node.module] if node.module else [alias.name for alias in node.names])
    return found


def test_modules_import_only_from_layers_below_their_own() -> None:
    layer_of = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    package = os.path.join(ROOT, "gloader")
    modules = {name[:-3] for name in os.listdir(package) if name.endswith(".py")}
    assert modules | {"bench"} == set(layer_of), "every module has a layer"
    upward = []
    for name in modules:
        for target in _imports_of(os.path.join(package, name + ".py"), False) - {name}:
            if layer_of.get(target, -1) >= layer_of[name]:
                upward.append(f"{name} imports {target}")
    bench = os.path.join(package, "bench")
    for name in os.listdir(bench):
        if name.endswith(".py"):
            for target in _imports_of(os.path.join(bench, name), True):
                if target.startswith("_"):
                    upward.append(f"bench/{name} imports the private gloader.{target}")
    assert upward == []
