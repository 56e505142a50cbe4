"""Settings files for the secret-source tests (test_secret_sources*.py): a whole
deployment whose every secret is an inline marker, and the check of their errors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from edgefeed_base.errors import EdgefeedError

# Each inline secret is a marker no message may hold, whichever source fails.
DB_PASSWORD = "db-M4rker-inline-pw"
CDC_PASSWORD = "cdc-M4rker-inline-pw"
KAFKA_PASSWORD = "kafka-M4rker-inline-pw"
READER_PASSWORD = "reader-M4rker-inline-pw"
WRITER_PASSWORD = "writer-M4rker-inline-pw"
IN_FILE = "file-M4rker-content-pw"  # what an unreadable or undecodable file holds
MARKERS = (DB_PASSWORD, CDC_PASSWORD, KAFKA_PASSWORD, READER_PASSWORD, WRITER_PASSWORD, IN_FILE)
ENV = "EF_TEST_SECRET_SOURCE"
AS_ROOT = os.geteuid() == 0


def document() -> dict[str, Any]:
    """A whole deployment whose every secret is inline (nothing listens at its addresses)."""
    return {
        "kafka": {
            "bootstrap_servers": "127.0.0.1:1",
            "security": {
                "protocol": "SASL_PLAINTEXT",
                "sasl_mechanism": "SCRAM-SHA-256",
                "username": "edgefeed",
                "password": KAFKA_PASSWORD,
            },
        },
        "connect": {"url": "http://127.0.0.1:1"},
        "database": {
            "host": "127.0.0.1",
            "port": 1,
            "password": DB_PASSWORD,
            "replication": {"user": "edgefeed_cdc", "password": CDC_PASSWORD},
        },
        "regions": [
            {
                "name": name,
                "redis_url": f"redis://127.0.0.1:1/{index}",
                "residency_zone": zone,
                "reader": {"username": "edgefeed-lookup", "password": READER_PASSWORD},
                "writer": {"username": "edgefeed-writer", "password": WRITER_PASSWORD},
            }
            for index, (name, zone) in enumerate([("eu-west", "eu"), ("us-east", "us")])
        ],
        "sources": [{"name": "shop", "tables": [{"name": "public.users", "key": ["user_id"]}]}],
        "entities": [
            {
                "name": "user",
                "personal": False,
                "tables": {"public.users": "user_id"},
                "latest": [{"name": "segment", "table": "public.users", "column": "segment"}],
            }
        ],
    }


def write(tmp_path: Path, settings: dict[str, Any]) -> Path:
    path = tmp_path / "edgefeed.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def all_files_absent(tmp_path: Path) -> Path:
    """Settings naming a file under ``tmp_path/run-secrets`` for every secret (Kafka is
    PLAINTEXT), none of them there yet."""
    settings = document()
    secrets = tmp_path / "run-secrets"
    for fields, name in [
        (settings["database"], "pg_password"),
        (settings["database"]["replication"], "cdc_password"),
        *[(region["reader"], "redis_lookup_password") for region in settings["regions"]],
        *[(region["writer"], "redis_writer_password") for region in settings["regions"]],
    ]:
        del fields["password"]
        fields["password_file"] = str(secrets / name)
    settings["kafka"]["security"] = {}
    return write(tmp_path, settings)


def flat(text: str) -> str:
    """``text`` without whitespace: the console folds long lines, paths included."""
    return "".join(text.split())


def assert_names(error: BaseException, setting: str, field: str, source: str, why: str) -> None:
    """``error`` is the typed secret error naming ``setting.field`` and ``source``, with
    ``why``, and holding none of the settings' secrets."""
    assert type(error).__name__ == "SecretSourceError", repr(error)
    assert isinstance(error, EdgefeedError) and isinstance(error, ValueError)
    assert not error.retryable
    text = f"{error} {error!r} {error.args}"
    assert f"{setting}.{field}" in text
    assert source in text
    assert why in text
    for marker in MARKERS:
        assert marker not in text
