"""`edgefeed lag` when nothing answers: every system named, exit 4, no secret shown."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import yaml
from typer.testing import CliRunner

from edgefeed.cli import app

SECRET = "s3cret-pw-never-shown"


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def settings_file(tmp_path: Path) -> Path:
    port = closed_port()  # nothing listens there once the socket is closed
    path = tmp_path / "edgefeed.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "kafka": {"bootstrap_servers": f"127.0.0.1:{port}"},
                "connect": {"url": f"http://127.0.0.1:{port}", "timeout_s": 2, "retries": 0},
                "database": {"host": "127.0.0.1", "port": port, "password": SECRET},
                "regions": [
                    {
                        "name": "eu-west",
                        "redis_url": f"redis://127.0.0.1:{port}/0",
                        "residency_zone": "eu",
                    }
                ],
                "sources": [{"name": "shop", "tables": [{"name": "users", "key": ["id"]}]}],
            }
        )
    )
    return path


def test_unreachable_systems_are_errors_that_say_what_to_check(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(
        app, ["--settings", str(settings_file(tmp_path)), "lag", "--json", "--samples", "1"]
    )
    assert result.exit_code == 4, result.output
    report = json.loads(result.stdout)
    assert report["severity"] == "ERR"
    assert "kafka.bootstrap_servers" in report["kafka"]["error"]
    assert report["cdc_error"].startswith("postgres: cannot read replication slots")
    assert "connect.url" in report["connect_error"]
    assert report["regions"][0]["state"] == "DOWN"
    assert SECRET not in result.output


def test_bad_option_is_a_usage_error(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(
        app, ["--settings", str(settings_file(tmp_path)), "lag", "--window", "1"]
    )
    assert result.exit_code == 2
    assert "window 1 must be at least 2" in result.output
