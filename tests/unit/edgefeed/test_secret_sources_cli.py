"""The CLI's side of strict secret sources (issue 30): each role reads only the
secrets it uses, and a secret it cannot read ends any command with the typed message
(exit 2), never a traceback nor a secret."""

from __future__ import annotations

from pathlib import Path

import pytest
from secret_settings import (
    DB_PASSWORD,
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

from edgefeed.cli import app
from edgefeed.settings import load_settings
from edgefeed_base.errors import EdgefeedError

runner = CliRunner()


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker run in this process registers its metrics in prometheus_client's
    global registry: each run here gets its own, as each process would."""
    import prometheus_client

    monkeypatch.setattr(prometheus_client, "REGISTRY", prometheus_client.CollectorRegistry())


def test_the_regional_worker_needs_its_writer_password_and_not_the_database(
    tmp_path: Path,
) -> None:
    """``pipeline run --region`` reads its region's writer password before it touches
    Kafka, and never the database's: a region's pod mounts only the writer's secret."""
    path = all_files_absent(tmp_path)
    result = runner.invoke(app, ["--settings", str(path), "pipeline", "run", "--region", "us-east"])
    assert result.exit_code == 2, result.output
    message = flat(result.output)
    assert message.startswith("error:regions[us-east].writer.password_file"), message
    assert "redis_writer_password" in message
    assert "database" not in message and "pg_password" not in message


@pytest.mark.usefixtures("fresh_registry")
def test_the_regional_worker_starts_without_the_database_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pipeline.topics

    path = all_files_absent(tmp_path)
    (tmp_path / "run-secrets").mkdir()
    (tmp_path / "run-secrets" / "redis_writer_password").write_text(WRITER_PASSWORD + "\n")

    class ReachedKafka(Exception):
        pass

    def ensure_topics_sync(*args: object, **kwargs: object) -> None:
        raise ReachedKafka

    monkeypatch.setattr(pipeline.topics, "ensure_topics_sync", ensure_topics_sync)
    result = runner.invoke(app, ["--settings", str(path), "pipeline", "run", "--region", "us-east"])
    assert isinstance(result.exception, ReachedKafka), result.output


@pytest.mark.usefixtures("fresh_registry")
def test_a_secret_read_outside_run_reported_still_ends_in_the_message(tmp_path: Path) -> None:
    """The regional worker builds its Kafka clients' options where no ``run_reported``
    wraps them: the root command reports a ``SecretSourceError`` from any command."""
    settings = document()
    security = settings["kafka"]["security"]
    del security["password"]
    security["password_file"] = str(tmp_path / "kafka_password")
    path = write(tmp_path, settings)
    result = runner.invoke(app, ["--settings", str(path), "pipeline", "run", "--region", "eu-west"])
    assert result.exit_code == 2, result.output
    message = flat(result.output)
    assert message.startswith("error:kafka.security.password_file"), message
    assert flat(str(tmp_path / "kafka_password")) in message
    assert "Traceback" not in result.output
    for marker in MARKERS:
        assert marker not in result.output


def test_the_exporter_scopes_need_only_the_secrets_they_read(tmp_path: Path) -> None:
    """A central exporter reads no region cache (no Redis password); a region's reads
    only its own cache (its reader's password, not the database's)."""
    from edgefeed.cli.monitoring import build_config

    settings = load_settings(all_files_absent(tmp_path))
    secrets = tmp_path / "run-secrets"
    with pytest.raises(EdgefeedError) as info:  # central reads the database
        build_config(settings, state_dir=tmp_path, scope="central")
    assert_names(
        info.value, "database", "password_file", str(secrets / "pg_password"), "does not exist"
    )
    secrets.mkdir()
    (secrets / "pg_password").write_text(DB_PASSWORD)
    central = build_config(settings, state_dir=tmp_path, scope="central")
    assert central.read_regions == () and central.database_dsn

    (secrets / "pg_password").unlink()
    with pytest.raises(EdgefeedError) as info:  # a region reads its cache as the reader
        build_config(settings, state_dir=tmp_path, scope="region:us-east")
    assert_names(
        info.value,
        "regions[us-east].reader",
        "password_file",
        str(secrets / "redis_lookup_password"),
        "does not exist",
    )
    (secrets / "redis_lookup_password").write_text(READER_PASSWORD)
    region = build_config(settings, state_dir=tmp_path, scope="region:us-east")
    assert [r.redis_options["password"] for r in region.read_regions] == [READER_PASSWORD]
    assert region.database_dsn is None
