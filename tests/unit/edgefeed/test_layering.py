"""The arrows between packages: domain packages never import the composition root.

The root error lives in ``edgefeed_base`` (the bottom layer, which imports nothing of
the project); ``edgefeed.errors`` re-exports it, so ``except EdgefeedError`` still
catches every package's errors whichever name the caller imported.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import edgefeed.errors
import edgefeed_base
from edgefeed_base.errors import EdgefeedError

ROOT = Path(__file__).resolve().parents[3]
DOMAIN_PACKAGES = ("connectors", "pipeline", "edge_cache", "preprocess", "workers", "monitoring")
PROJECT_PACKAGES = ("edgefeed", *DOMAIN_PACKAGES)


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports, at any depth, with its line number.

    Covers ``import x``, ``from x import y`` (also as ``x.y``, which may be a
    module) and ``importlib.import_module("x")`` with a literal name.
    """
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(f"{package}.")


def _modules(package: str) -> list[Path]:
    modules = sorted((ROOT / package).rglob("*.py"))
    assert modules, f"no modules found under {ROOT / package}"
    return modules


@pytest.mark.parametrize("package", DOMAIN_PACKAGES)
def test_domain_package_imports_nothing_of_the_composition_root(package: str) -> None:
    offending = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in _modules(package)
        for line, name in _imports(path)
        if _within(name, "edgefeed")
    ]
    assert offending == []


def test_base_package_imports_nothing_of_the_project() -> None:
    offending = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in _modules("edgefeed_base")
        for line, name in _imports(path)
        if any(_within(name, package) for package in PROJECT_PACKAGES)
    ]
    assert offending == []


def test_the_scan_sees_an_import_of_the_root(tmp_path: Path) -> None:
    # The scan itself can fail: each spelling of an upward import is reported.
    module = tmp_path / "m.py"
    module.write_text(
        "import edgefeed\n"
        "from edgefeed.errors import EdgefeedError\n"
        "def f():\n"
        "    import edgefeed.settings\n"
        "    importlib.import_module('edgefeed.cli')\n"
        "from edgefeed_base import errors\n"
    )
    names = [name for _, name in _imports(module) if _within(name, "edgefeed")]
    assert names == [
        "edgefeed",
        "edgefeed.errors",
        "edgefeed.errors.EdgefeedError",
        "edgefeed.settings",
        "edgefeed.cli",
    ]


def test_one_root_error_under_both_names() -> None:
    assert edgefeed.errors.EdgefeedError is EdgefeedError
    assert edgefeed_base.EdgefeedError is EdgefeedError


@pytest.mark.parametrize(
    ("module", "root"),
    [
        ("connectors.exceptions", "ConnectorsError"),
        ("pipeline.exceptions", "PipelineError"),
        ("edge_cache.exceptions", "EdgeCacheError"),
        ("preprocess.exceptions", "PreprocessError"),
        ("workers.exceptions", "WorkersError"),
        ("monitoring.exceptions", "MonitoringError"),
        ("edgefeed.settings", "SettingsError"),
    ],
)
def test_every_package_error_is_caught_as_edgefeed_error(module: str, root: str) -> None:
    error_class = getattr(importlib.import_module(module), root)
    with pytest.raises(edgefeed.errors.EdgefeedError):
        raise error_class("boom")
