"""Secret sources are read when a component needs them, and strictly (issue 30).

Loading the settings never reads a secret: a process that does not use one starts
without it (a pod mounts only the secrets its role reads). A component that does
need one (the database, the replication role, Kafka SASL, a region's Redis reader
or writer) gets a typed error, never a silently empty password, when its
``password_file`` is missing, unreadable or empty, or its ``password_env`` is unset
or empty. The error names the setting's dotted path and the file or variable, and
never a value. The CLI's side: test_secret_sources_cli.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from secret_settings import (
    AS_ROOT,
    ENV,
    IN_FILE,
    MARKERS,
    READER_PASSWORD,
    WRITER_PASSWORD,
    all_files_absent,
    assert_names,
    document,
    flat,
    write,
)
from typer.testing import CliRunner

from connectors.database import prepare_replication_role
from edgefeed.cli import app
from edgefeed.settings import EdgefeedSettings, load_settings
from edgefeed_base.errors import EdgefeedError

runner = CliRunner()


@dataclass(frozen=True)
class Kind:
    """One secret setting: where it sits in the file and what makes a component read it."""

    setting: str
    fields: Callable[[dict[str, Any]], dict[str, Any]]
    use: Callable[[EdgefeedSettings], object]


KINDS = {
    "database": Kind("database", lambda d: d["database"], lambda s: s.database.dsn()),
    "replication": Kind(
        "database.replication",
        lambda d: d["database"]["replication"],
        # creates the role with this password: it needs it before any connection
        lambda s: prepare_replication_role(s.database, s.sources),
    ),
    "kafka": Kind(
        "kafka.security",
        lambda d: d["kafka"]["security"],
        lambda s: s.kafka.security.aiokafka_options(),
    ),
    "redis-reader": Kind(
        "regions[eu-west].reader",
        lambda d: d["regions"][0]["reader"],
        lambda s: s.region("eu-west").redis_options("reader"),
    ),
    "redis-writer": Kind(
        "regions[us-east].writer",
        lambda d: d["regions"][1]["writer"],
        lambda s: s.region("us-east").redis_options("writer"),
    ),
}

Failure = Callable[[Path, pytest.MonkeyPatch], tuple[str, str, str]]


def _missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, str]:
    return "password_file", str(tmp_path / "secrets" / "absent"), "does not exist"


def _directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, str]:
    path = tmp_path / "secrets"
    path.mkdir()
    return "password_file", str(path), "is a directory"


def _no_permission(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, str]:
    path = tmp_path / "pw"
    path.write_text(IN_FILE + "\n")
    path.chmod(0)
    if AS_ROOT:
        # root reads a mode-000 file: the kernel's answer to another user, then.
        read_text = Path.read_text

        def refused(self: Path, *args: Any, **kwargs: Any) -> str:
            if self == path:
                raise PermissionError(13, "Permission denied", str(self))
            return read_text(self, *args, **kwargs)

        monkeypatch.setattr(Path, "read_text", refused)
    return "password_file", str(path), "permission denied"


def _empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, str]:
    path = tmp_path / "pw"
    path.write_text(" \n")
    return "password_file", str(path), "is empty"


def _not_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, str]:
    path = tmp_path / "pw"
    path.write_bytes(b"\xff\xfe" + IN_FILE.encode())
    return "password_file", str(path), "not UTF-8 text"


def _env_unset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, str]:
    monkeypatch.delenv(ENV, raising=False)
    return "password_env", ENV, "is not set"


def _env_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, str]:
    monkeypatch.setenv(ENV, "")
    return "password_env", ENV, "is empty"


FAILURES: dict[str, Failure] = {
    "file-missing": _missing,
    "file-is-a-directory": _directory,
    "file-unreadable": _no_permission,
    "file-empty": _empty,
    "file-not-utf8": _not_text,
    "env-unset": _env_unset,
    "env-empty": _env_empty,
}


def _failures() -> list[Any]:
    return [pytest.param(make, id=name) for name, make in FAILURES.items()]


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
@pytest.mark.parametrize("failure", _failures())
def test_an_unreadable_secret_source_is_a_typed_error_at_first_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: Kind, failure: Failure
) -> None:
    field, source, why = failure(tmp_path, monkeypatch)
    settings_document = document()
    fields = kind.fields(settings_document)
    del fields["password"]
    fields[field] = source
    settings = load_settings(write(tmp_path, settings_document))  # loading reads no secret
    with pytest.raises(EdgefeedError) as info:
        kind.use(settings)
    assert_names(info.value, kind.setting, field, source, why)


def test_the_error_is_a_bad_input_error_of_the_project() -> None:
    from edgefeed_base.secrets import SecretSourceError

    assert issubclass(SecretSourceError, EdgefeedError) and issubclass(
        SecretSourceError, ValueError
    )
    assert not SecretSourceError.retryable


def test_a_mode_000_file_is_unreadable_unless_root(tmp_path: Path) -> None:
    """As root the chmod case above has the refusal a non-root user would get made
    for it (root reads a mode-000 file): this says which one ran."""
    path = tmp_path / "pw"
    path.write_text("x")
    path.chmod(0)
    assert os.access(path, os.R_OK) == AS_ROOT


@pytest.mark.parametrize("use", ["aiokafka", "faust", "java"])
def test_every_kafka_client_resolves_the_password_the_same_way(tmp_path: Path, use: str) -> None:
    settings_document = document()
    security = settings_document["kafka"]["security"]
    del security["password"]
    security["password_file"] = str(tmp_path / "kafka")
    kafka = load_settings(write(tmp_path, settings_document)).kafka.security
    calls: dict[str, Callable[[], object]] = {
        "aiokafka": kafka.aiokafka_options,
        "faust": kafka.faust_credentials,
        "java": kafka.java_properties,
    }
    with pytest.raises(EdgefeedError) as info:
        calls[use]()
    assert_names(
        info.value, "kafka.security", "password_file", str(tmp_path / "kafka"), "does not exist"
    )
    # A Connect worker given a provider reference reads the file itself: edgefeed need not.
    reference = "${dir:/run/secrets:kafka}"
    assert reference in kafka.java_properties(password_reference=reference)["sasl.jaas.config"]


def test_readable_sources_still_give_the_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings_document = document()
    reader = settings_document["regions"][0]["reader"]
    del reader["password"]
    reader["password_file"] = str(tmp_path / "reader")
    (tmp_path / "reader").write_text(READER_PASSWORD + "\n")
    writer = settings_document["regions"][0]["writer"]
    del writer["password"]
    writer["password_env"] = ENV
    monkeypatch.setenv(ENV, WRITER_PASSWORD)
    region = load_settings(write(tmp_path, settings_document)).region("eu-west")
    assert region.redis_options("reader")["password"] == READER_PASSWORD
    assert region.redis_options("writer")["password"] == WRITER_PASSWORD


def test_a_database_without_any_password_source_connects_without_one(tmp_path: Path) -> None:
    """No source at all is not an error (trust, peer or .pgpass authentication)."""
    from psycopg.conninfo import conninfo_to_dict

    settings_document = document()
    del settings_document["database"]["password"]
    dsn = load_settings(write(tmp_path, settings_document)).database.dsn()
    assert "password" not in conninfo_to_dict(dsn)


def test_settings_naming_unmounted_secrets_load_and_mask_only_what_is_readable(
    tmp_path: Path,
) -> None:
    settings = load_settings(all_files_absent(tmp_path))
    assert settings.database.secrets() == []  # masking needs no secret either
    (tmp_path / "run-secrets").mkdir()
    (tmp_path / "run-secrets" / "pg_password").write_text("pg-readable\n")
    assert settings.database.secrets() == ["pg-readable"]


def test_the_default_setting_path_names_the_class_when_none_is_known() -> None:
    from edgefeed_base.secrets import PasswordFields, SecretSourceError

    class Orphan(PasswordFields):
        pass

    with pytest.raises(SecretSourceError, match=r"^Orphan\.password_env names"):
        Orphan(password_env="EF_TEST_SECRET_NEVER_SET").secret()


def test_a_cli_command_that_needs_a_missing_secret_exits_2_with_the_message(
    tmp_path: Path,
) -> None:
    settings_document = document()
    reader = settings_document["regions"][0]["reader"]
    del reader["password"]
    reader["password_file"] = str(tmp_path / "absent")
    args = ["--settings", str(write(tmp_path, settings_document)), "cache", "get", "user", "1"]
    result = runner.invoke(app, [*args, "--region", "eu-west", "--timeout-s", "0.2"])
    assert result.exit_code == 2, result.output  # an uncaught exception exits 1
    message = flat(result.output)
    assert message.startswith("error:regions[eu-west].reader.password_file"), message
    assert flat(str(tmp_path / "absent")) in message
    assert "Traceback" not in result.output
    for marker in MARKERS:
        assert marker not in result.output
