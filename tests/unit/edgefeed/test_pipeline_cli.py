"""``edgefeed pipeline run``'s metrics endpoint options: checked before anything
starts, errors that name the option and the fix, never the token; a non-loopback
address without a token is a warning, as for ``edgefeed exporter``. No service is
needed: every case stops before the worker would reach a broker or a database."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from edgefeed.cli import app

TOKEN = "tok-S3cr3t-M4rker-0123456789abcdef"
runner = CliRunner()


@pytest.fixture
def settings(tmp_path: Path) -> Path:
    path = tmp_path / "edgefeed.yaml"
    # Addresses nothing listens on: nothing here may reach them.
    path.write_text(
        "kafka: {bootstrap_servers: '127.0.0.1:1'}\n"
        "database: {host: 127.0.0.1, port: 1, password: pw-pipeline-cli-test}\n"
        "regions: [{name: eu-west, redis_url: 'redis://127.0.0.1:1/0', residency_zone: eu}]\n"
    )
    return path


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--metrics-token-file", "{token}"],
            "--metrics-token-file configure the metrics endpoint: give --metrics-port PORT too",
        ),
        (
            ["--metrics-host", "0.0.0.0", "--metrics-tls-key", "{token}"],
            "--metrics-host, --metrics-tls-key configure the metrics endpoint",
        ),
        (["--metrics-port", "70000"], "--metrics-port 70000 is not a port: give 0..65535"),
        (
            ["--metrics-port", "0", "--metrics-token-file", "{missing}"],
            "point --metrics-token-file at a readable file holding the token",
        ),
        (["--metrics-port", "0", "--metrics-token-file", "{short}"], "use at least 16"),
        (
            ["--metrics-port", "0", "--metrics-tls-cert", "{token}"],
            "TLS needs both --metrics-tls-cert and --metrics-tls-key",
        ),
        (
            [
                "--metrics-port",
                "0",
                "--metrics-tls-cert",
                "{token}",
                "--metrics-tls-key",
                "{token}",
            ],
            "cannot load the TLS certificate",
        ),
    ],
)
def test_bad_metrics_options_exit_2_naming_the_option(
    settings: Path, tmp_path: Path, args: list[str], expected: str
) -> None:
    (tmp_path / "token").write_text(TOKEN)
    (tmp_path / "short").write_text("0123456789")
    names = {
        "token": str(tmp_path / "token"),
        "short": str(tmp_path / "short"),
        "missing": str(tmp_path / "missing"),
    }
    result = runner.invoke(
        app,
        [
            "--settings",
            str(settings),
            "pipeline",
            "run",
            "--region",
            "eu-west",
            *(a.format(**names) for a in args),
        ],
    )
    assert result.exit_code == 2, result.output
    output = " ".join(result.output.split())
    assert expected in output
    assert TOKEN not in output and "Traceback" not in output


def test_an_address_beyond_loopback_without_a_token_is_a_warning(settings: Path) -> None:
    # The forwarder stops at its own check (the region has no site of its own),
    # after the metrics options were checked and before anything listens.
    result = runner.invoke(
        app,
        [
            "--settings",
            str(settings),
            "pipeline",
            "run",
            "--role",
            "forwarder",
            "--region",
            "eu-west",
            "--metrics-port",
            "0",
            "--metrics-host",
            "0.0.0.0",
        ],
    )
    output = " ".join(result.output.split())
    assert "warning: the metrics endpoint listens on 0.0.0.0 without a bearer token" in output
    assert "give --metrics-token-file" in output
    assert result.exit_code == 2 and "shares the central broker" in output
    assert "serving metrics" not in output


def test_the_warning_is_not_given_with_a_token(settings: Path, tmp_path: Path) -> None:
    (tmp_path / "token").write_text(TOKEN)
    result = runner.invoke(
        app,
        [
            "--settings",
            str(settings),
            "pipeline",
            "run",
            "--role",
            "forwarder",
            "--region",
            "eu-west",
            "--metrics-port",
            "0",
            "--metrics-host",
            "0.0.0.0",
            "--metrics-token-file",
            str(tmp_path / "token"),
        ],
    )
    assert "warning" not in result.output and TOKEN not in result.output
    assert result.exit_code == 2 and "shares the central broker" in result.output
