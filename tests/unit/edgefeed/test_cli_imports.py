"""`edgefeed --help` and every group's help start without the heavy domain libraries.

Each case runs the installed console script's entry point (``edgefeed.cli:main``,
looked up through the package metadata as the ``edgefeed`` script does) in a fresh
interpreter, then reads ``sys.modules``: a module imported once stays there.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import edgefeed.cli
from edgefeed.cli import app

ROOT = Path(__file__).resolve().parents[3]

# What a help screen must not pay for (seconds of import time, GPU runtimes, clients).
HEAVY = ("faust", "mode", "torch", "aiohttp", "psycopg", "numpy", "redis", "aiokafka")

_PROBE = """
import json, sys
from importlib.metadata import entry_points

(script,) = entry_points(group="console_scripts", name="edgefeed")
sys.argv = ["edgefeed", *json.loads(sys.argv[1])]
try:
    script.load()()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print(json.dumps({"code": code, "imported": sorted(set(sys.modules) & set(HEAVY))}))
"""


def _run_help(args: list[str]) -> dict[str, object]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    code = f"HEAVY = {HEAVY!r}\n{_PROBE}"
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--help"],
        ["dev", "--help"],
        ["dev", "up", "--help"],
        ["demo", "--help"],
        ["demo", "run", "--help"],
        ["demo", "sites", "--help"],
        ["connectors", "--help"],
        ["connectors", "apply", "--help"],
        ["pipeline", "--help"],
        ["pipeline", "run", "--help"],
        ["cache", "--help"],
        ["cache", "get", "--help"],
        ["preprocess", "--help"],
        ["workers", "--help"],
        ["workers", "serve", "--help"],
        ["workers", "bench", "--help"],
        ["workers", "seed-demo", "--help"],
        ["lag", "--help"],
        ["exporter", "--help"],
    ],
    ids=lambda args: " ".join(args) or "no-args",
)
def test_help_imports_no_heavy_library(args: list[str]) -> None:
    result = _run_help(args)
    assert result["code"] in (0, 2)  # bare `edgefeed` shows the help and exits 2 (click)
    assert result["imported"] == [], f"`edgefeed {' '.join(args)}` imported {result['imported']}"


def test_root_help_lists_every_command_with_its_own_help(monkeypatch: pytest.MonkeyPatch) -> None:
    # The root help is drawn from short help texts kept in edgefeed/cli/__init__.py, so
    # the modules are not imported; it must read exactly as when the commands are loaded.
    runner = CliRunner()
    lazy = runner.invoke(app, ["--help"], terminal_width=200)
    monkeypatch.setattr(edgefeed.cli.LazyGroup, "help_without_import", False)
    loaded = runner.invoke(app, ["--help"], terminal_width=200)
    assert lazy.exit_code == loaded.exit_code == 0
    assert lazy.output == loaded.output
    for name in edgefeed.cli.COMMANDS:
        assert f" {name} " in lazy.output


def test_every_registered_command_is_listed() -> None:
    # A command a module registers but COMMANDS does not name could not be invoked.
    registered: set[str] = set()
    for module in {lazy.module for lazy in edgefeed.cli.COMMANDS.values()}:
        holder = typer.Typer()
        importlib.import_module(module).register(holder)
        registered |= set(typer.main.get_group(holder).commands)
    assert registered == set(edgefeed.cli.COMMANDS)


def test_unknown_command_is_a_usage_error() -> None:
    result = CliRunner().invoke(app, ["nosuch"])
    assert result.exit_code == 2
    assert "nosuch" in result.output
