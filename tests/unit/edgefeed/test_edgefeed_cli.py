"""The edgefeed command's surface: help, version, and how bad settings are reported."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from edgefeed import __version__
from edgefeed.cli import app

runner = CliRunner()


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert __version__ in result.output


def test_dev_help_lists_the_subcommands() -> None:
    result = runner.invoke(app, ["dev", "--help"])
    assert result.exit_code == 0
    for command in ("up", "status", "down", "logs"):
        assert command in result.output


def test_invalid_settings_file_exits_2_naming_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "edgefeed.yaml"
    bad.write_text("regions: []\nkafka: {bootstrap_servers: 'x'}\n")
    result = runner.invoke(
        app, ["--settings", str(bad), "dev", "status", "--state-dir", str(tmp_path / "s")]
    )
    assert result.exit_code == 2
    assert "kafka.bootstrap_servers" in result.output
    assert "regions" in result.output


def test_remote_address_is_refused_by_the_local_stack(tmp_path: Path) -> None:
    settings = tmp_path / "edgefeed.yaml"
    settings.write_text(
        "kafka: {bootstrap_servers: 'kafka.prod.example:9092'}\n"
        "regions: [{name: eu-west, redis_url: 'redis://127.0.0.1:6379/0', residency_zone: eu}]\n"
    )
    result = runner.invoke(
        app, ["--settings", str(settings), "dev", "up", "--state-dir", str(tmp_path / "s")]
    )
    assert result.exit_code == 2
    assert "kafka.prod.example:9092" in result.output
    assert "loopback" in result.output


def _lab_settings(tmp_path: Path) -> Path:
    settings = tmp_path / "edgefeed.yaml"
    settings.write_text(
        "kafka: {bootstrap_servers: '127.0.0.1:1'}\n"
        "regions: [{name: eu-west, redis_url: 'redis://127.0.0.1:2/0', residency_zone: eu}]\n"
    )
    return settings


def test_lab_refuses_bad_options_before_starting_anything(tmp_path: Path) -> None:
    settings = _lab_settings(tmp_path)
    state = tmp_path / "s"
    result = runner.invoke(
        app,
        ["--settings", str(settings), "lab", "run", "--requests", "0", "--state-dir", str(state)],
    )
    assert result.exit_code == 2
    assert "requests=0 must be at least 1" in result.output
    result = runner.invoke(
        app,
        ["--settings", str(settings), "lab", "run", "--region", "mars", "--state-dir", str(state)],
    )
    assert result.exit_code == 2
    assert "'mars' not in regions: eu-west" in result.output
    assert not state.exists(), "no service was started"
