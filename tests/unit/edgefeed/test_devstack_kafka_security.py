"""`edgefeed dev up` with Kafka SASL settings: a clear refusal, not a stack that cannot talk."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

from edgefeed.cli import app

SECRET = "S3cr3t-kafka-pw"


def test_dev_up_refuses_sasl_because_the_local_broker_cannot_serve_it(tmp_path: Path) -> None:
    settings = tmp_path / "edgefeed.yaml"
    settings.write_text(
        yaml.safe_dump(
            {
                "kafka": {
                    "bootstrap_servers": "127.0.0.1:19092",
                    "security": {
                        "protocol": "SASL_PLAINTEXT",
                        "sasl_mechanism": "SCRAM-SHA-512",
                        "username": "edgefeed",
                        "password": SECRET,
                    },
                },
                "regions": [
                    {
                        "name": "eu-west",
                        "redis_url": "redis://127.0.0.1:16379/0",
                        "residency_zone": "eu",
                    }
                ],
            }
        )
    )
    result = CliRunner().invoke(
        app, ["--settings", str(settings), "dev", "up", "--state-dir", str(tmp_path / "state")]
    )
    assert result.exit_code != 0
    output = " ".join(result.output.split())
    assert "kafka.security.protocol is SASL_PLAINTEXT" in output
    assert "Tansu 0.6.0" in output
    assert SECRET not in result.output
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").rglob("*.pid"))
