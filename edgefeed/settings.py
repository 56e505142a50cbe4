"""The edgefeed settings file: YAML with ${ENV} expansion, validated into typed models.

One file (``edgefeed.yaml``) describes the whole deployment: the Kafka brokers, the
Kafka Connect cluster, the source database and the regions. Each subsystem owns
its own model (``connectors.settings``, ``edge_cache.settings``); this module
composes them, expands environment references and turns validation failures
into :class:`SettingsError` messages that name the key, the bad value and what
is allowed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from connectors.secrets import is_secret_key, redact, redact_urls, url_secrets
from connectors.settings import ConnectSettings, DatabaseSettings, SourceSettings, TableSettings
from edge_cache.settings import RegionSettings
from edgefeed.errors import EdgefeedError
from edgefeed.sites import SitesSettings
from pipeline.settings import EntitySettings, FeatureReader, KafkaSettings, PipelineSettings
from workers.featurelog import FeatureLogSettings

__all__ = [
    "EdgefeedSettings",
    "KafkaSettings",
    "MonitoringSettings",
    "SettingsError",
    "WorkersFileSettings",
    "expand_env",
    "load_settings",
    "secrets_of",
]

DEFAULT_SETTINGS_FILE = "edgefeed.yaml"
SETTINGS_ENV_VAR = "EDGEFEED_SETTINGS"


class SettingsError(EdgefeedError, ValueError):
    """The settings file is missing, unreadable or invalid. Not retryable: fix the file."""


class MonitoringSettings(BaseModel):
    """Prometheus and Alertmanager of the local stack (``edgefeed dev up``).

    Without ports, the local stack runs neither. Production runs its own
    (docker-compose.yml, deploy/k8s); these settings do not reach it.

    Attributes:
        prometheus_port: Loopback port of the local Prometheus (None: none runs).
        alertmanager_port: Loopback port of the local Alertmanager (None: none runs;
            Prometheus then evaluates the rules but sends the alerts nowhere).
        scrape_interval_s: How often Prometheus scrapes and evaluates the rules:
            shorter than production's 15 s, so that a local fault shows quickly.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    prometheus_port: int | None = Field(default=None, ge=1, le=65535)
    alertmanager_port: int | None = Field(default=None, ge=1, le=65535)
    scrape_interval_s: float = Field(default=5.0, ge=1.0, le=60.0)


class WorkersFileSettings(BaseModel):
    """``workers:`` in edgefeed.yaml: what every model worker of the deployment shares.

    The rest of a worker's settings are its own (``EDGEFEED_WORKERS_*``,
    ``edgefeed workers serve`` options: :class:`workers.settings.WorkerSettings`).

    Attributes:
        feature_log: Log what the models that read features were fed (None: no
            log); see :class:`workers.featurelog.FeatureLogSettings`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    feature_log: FeatureLogSettings | None = None


class EdgefeedSettings(BaseSettings):
    """Everything edgefeed needs to know about one deployment.

    Environment variables with the ``EDGEFEED_`` prefix override the file
    (nested keys joined by ``__``: ``EDGEFEED_KAFKA__CLIENT_ID``).
    """

    model_config = SettingsConfigDict(
        env_prefix="EDGEFEED_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    connect: ConnectSettings = Field(default_factory=ConnectSettings)
    database: DatabaseSettings = Field(default_factory=DatabaseSettings)
    regions: list[RegionSettings] = Field(min_length=1)
    sources: list[SourceSettings] = Field(default_factory=list)
    pipeline: PipelineSettings = Field(default_factory=PipelineSettings)
    entities: list[EntitySettings] = Field(default_factory=list)
    models: list[FeatureReader] = Field(default_factory=list)
    sites: SitesSettings = Field(default_factory=SitesSettings)
    monitoring: MonitoringSettings = Field(default_factory=MonitoringSettings)
    workers: WorkersFileSettings = Field(default_factory=WorkersFileSettings)

    @model_validator(mode="after")
    def _regions_consistent(self) -> EdgefeedSettings:
        names = [region.name for region in self.regions]
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise ValueError(f"region {name!r} is declared twice; region names must be unique")
            seen.add(name)
        for region in self.regions:
            for other in region.failover:
                if other not in seen:
                    raise ValueError(
                        f"region {region.name!r} fails over to {other!r}, which is not a "
                        f"declared region: {', '.join(names)}"
                    )
                if other == region.name:
                    raise ValueError(f"region {region.name!r} lists itself in its failover")
        captured = {table.name for source in self.sources for table in source.tables}
        entity_names = [entity.name for entity in self.entities]
        for entity in self.entities:
            if entity_names.count(entity.name) > 1:
                raise ValueError(f"entity {entity.name!r} is declared twice")
            for table in entity.tables:
                if table not in captured:
                    raise ValueError(
                        f"entity {entity.name!r} reads table {table}, which no source captures; "
                        f"captured tables: {', '.join(sorted(captured)) or '(none)'}"
                    )
        for region_name in self.sites.regions:
            if region_name not in seen:
                raise ValueError(
                    f"sites.regions names {region_name!r}, which is not a declared region: "
                    f"{', '.join(names)}"
                )
        source_names = [source.name for source in self.sources]
        for name in set(source_names):
            if source_names.count(name) > 1:
                raise ValueError(f"source {name!r} is declared twice; source names must be unique")
        return self

    def source(self, name: str) -> SourceSettings:
        """The source called ``name``.

        Raises:
            SettingsError: no such source; the message lists the declared ones.
        """
        for source in self.sources:
            if source.name == name:
                return source
        declared = ", ".join(s.name for s in self.sources) or "(none)"
        raise SettingsError(f"source {name!r} not in sources: {declared}")

    def region(self, name: str) -> RegionSettings:
        """The region called ``name``.

        Raises:
            SettingsError: no such region; the message lists the declared ones.
        """
        for region in self.regions:
            if region.name == name:
                return region
        raise SettingsError(
            f"region {name!r} not in regions: {', '.join(r.name for r in self.regions)}"
        )

    def region_kafka(self, name: str) -> KafkaSettings:
        """The Kafka settings of region ``name``'s own site: its broker when
        ``sites.regions`` names one, else the central ``kafka`` settings.

        Raises:
            SettingsError: no such region.
        """
        self.region(name)
        bootstrap = self.sites.bootstrap_of(name)
        if bootstrap is None:
            return self.kafka
        return self.kafka.model_copy(update={"bootstrap_servers": bootstrap})

    def tables(self) -> dict[str, TableSettings]:
        """Every captured table, by ``schema.table``."""
        return {table.name: table for source in self.sources for table in source.tables}

    def topic_of_table(self) -> dict[str, str]:
        """The Debezium change topic of every captured table."""
        return {t.name: s.topic_for(t.name) for s in self.sources for t in s.tables}

    @property
    def region_names(self) -> list[str]:
        return [region.name for region in self.regions]


_ENV_REF = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>[^}]*))?\}")


def expand_env(value: Any, env: Mapping[str, str] | None = None) -> Any:
    """Expand ``${VAR}`` and ``${VAR:-default}`` in every string of a parsed YAML tree.

    Raises:
        SettingsError: a referenced variable is unset and has no default.
    """
    environ = os.environ if env is None else env
    if isinstance(value, str):

        def substitute(match: re.Match[str]) -> str:
            name, default = match.group("name"), match.group("default")
            if name in environ:
                return environ[name]
            if default is not None:
                return default
            raise SettingsError(
                f"environment variable {name!r} is referenced in the settings file but not "
                f"set; export it or write ${{{name}:-default}}"
            )

        return _ENV_REF.sub(substitute, value)
    if isinstance(value, list):
        return [expand_env(item, environ) for item in value]
    if isinstance(value, dict):
        return {key: expand_env(item, environ) for key, item in value.items()}
    return value


def secrets_of(data: Any, key: str = "") -> set[str]:
    """Every secret value in a parsed settings tree (valid or not).

    The values of secret keys (``password``, ``token``, ...) and the passwords
    of every URL, raw and percent-decoded, so an error message can be redacted
    of them whatever validator produced it.
    """
    found: set[str] = set()
    if isinstance(data, Mapping):
        for name, value in data.items():
            found |= secrets_of(value, str(name))
    elif isinstance(data, list | tuple):
        for value in data:
            found |= secrets_of(value, key)
    elif isinstance(data, str):
        found.update(url_secrets(data))
        if is_secret_key(key) and not key.endswith(("_env", "_file")):
            found.add(data)
    elif data is not None and is_secret_key(key):
        found.add(str(data))
    return {value for value in found if value}


def _describe(error: Mapping[str, Any]) -> str:
    key = ".".join(str(part) for part in error.get("loc", ())) or "(top level)"
    message = str(error.get("msg", "invalid"))
    if error.get("type") == "extra_forbidden":
        return f"{key}: unknown key; remove it or check its spelling"
    if error.get("type") == "missing":
        return f"{key}: required key is missing"
    bad = error.get("input")
    if isinstance(bad, dict | list):
        return f"{key}: {message}"
    if is_secret_key(key):
        return f"{key}: {message} (value hidden)"
    return f"{key}: {message} (got {bad!r})"


def settings_from_mapping(data: Mapping[str, Any], source: str = "settings") -> EdgefeedSettings:
    """Validate an already-parsed settings mapping.

    Raises:
        SettingsError: listing every invalid key with its bad value; secret
            values (passwords, URL userinfo) are never part of the message.
    """
    try:
        return EdgefeedSettings(**dict(data))
    except ValidationError as exc:
        problems = "\n  ".join(_describe(err) for err in exc.errors())
        message = redact(redact_urls(problems), secrets_of(data))
        raise SettingsError(f"{source} is invalid:\n  {message}") from None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """Where and what the YAML error is, without the offending line (it may hold a secret)."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return type(exc).__name__
    parts = []
    if exc.context:
        where = exc.context_mark
        parts.append(exc.context + (f" at line {where.line + 1}" if where else ""))
    problem = exc.problem or "syntax error"
    mark = exc.problem_mark
    parts.append(problem + (f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""))
    return ", ".join(parts)


def resolve_settings_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The settings file to use: the argument, else $EDGEFEED_SETTINGS, else ./edgefeed.yaml."""
    if path is not None:
        return Path(path)
    return Path(os.environ.get(SETTINGS_ENV_VAR, DEFAULT_SETTINGS_FILE))


def load_settings(
    path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> EdgefeedSettings:
    """Read, expand and validate a settings file.

    Raises:
        SettingsError: the file is missing, not YAML, or invalid.
    """
    settings_path = resolve_settings_path(path)
    try:
        text = settings_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SettingsError(
            f"settings file {str(settings_path)!r} not found; pass --settings PATH, set "
            f"{SETTINGS_ENV_VAR}, or copy examples/edgefeed.yaml"
        ) from None
    except OSError as exc:
        raise SettingsError(
            f"cannot read settings file {str(settings_path)!r}: {exc.strerror}"
        ) from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SettingsError(
            f"settings file {str(settings_path)!r} is not valid YAML: {_yaml_problem(exc)}; "
            "fix the file there (the line itself is not shown, it may hold a secret)"
        ) from None
    if not isinstance(raw, dict):
        raise SettingsError(
            f"settings file {str(settings_path)!r} must hold a mapping at the top level "
            "(kafka:, connect:, database:, regions:)"
        )
    return settings_from_mapping(
        expand_env(raw, env), source=f"settings file {str(settings_path)!r}"
    )
