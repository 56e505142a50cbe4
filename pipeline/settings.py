"""Settings of the pipeline: topics, batching, and the features each entity gets.

Features are declared per entity type in edgefeed.yaml::

    pipeline:
      partitions: 4
    entities:
      - name: user
        personal: true              # lives only in its home region's cache
        tables:                     # which tables feed it, and the id column in each
          public.users: user_id
          public.events: user_id
        time_columns: {public.events: occurred_at}
        latest:
          - {name: country_code, table: public.users, column: country_id, dtype: int64}
        aggregates:
          - {name: views_30m, table: public.events, agg: count, where: {kind: view},
             window: {size: 30m}}
          - {name: top_category_1h, table: public.events, agg: top_k, column: category_id,
             n: 3, window: {size: 1h}}
"""

from __future__ import annotations

import re
import ssl
from pathlib import Path
from typing import Any, ClassVar, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from edgefeed_base.secrets import PasswordFields
from pipeline.aggregates import Aggregate, FeatureDtype, aggregate_kind
from pipeline.names import PipelineNames

__all__ = [
    "AggregateFeature",
    "EntitySettings",
    "FeatureReader",
    "KafkaSecuritySettings",
    "KafkaSettings",
    "LatestFeature",
    "PipelineSettings",
    "WindowSettings",
    "parse_duration_ms",
]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def parse_duration_ms(value: str | int | float) -> int:
    """``"30m"`` -> 1_800_000. Numbers are seconds.

    Raises:
        ValueError: not a duration; the message shows the accepted forms.
    """
    if isinstance(value, bool):
        raise ValueError(f"duration {value!r} must be like 500ms, 30s, 30m, 1h or 7d")
    if isinstance(value, int | float):
        ms = int(value * 1000)
    else:
        match = _DURATION.match(value.strip())
        if not match:
            raise ValueError(f"duration {value!r} must be like 500ms, 30s, 30m, 1h or 7d")
        ms = int(float(match.group(1)) * _UNIT_MS[match.group(2)])
    if ms <= 0:
        raise ValueError(f"duration {value!r} must be positive")
    return ms


def _qualified(table: str) -> str:
    return table if "." in table else f"public.{table}"


class WindowSettings(BaseModel):
    """A time window over an entity's change events.

    Windows are read as of the read time t: ``sliding`` covers the event times
    (t - size, t]; ``tumbling`` the bucket of length ``size`` that holds t, up to
    t (a daily count is 0 after midnight).

    Attributes:
        size: Window length (``30m``, ``1h``; numbers are seconds).
        type: ``sliding`` or ``tumbling``.
        time_zone: Where a tumbling window's buckets start (an IANA name such as
            ``Europe/London``; buckets of a day start at local midnight). UTC by
            default; only for tumbling windows.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    size: str | int | float
    type: Literal["sliding", "tumbling"] = "sliding"
    time_zone: str = "UTC"

    @field_validator("size")
    @classmethod
    def _size(cls, value: str | int | float) -> str | int | float:
        parse_duration_ms(value)
        return value

    @field_validator("time_zone")
    @classmethod
    def _zone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(
                f"time_zone {value!r} is not an IANA time zone name (e.g. UTC, Europe/London, "
                "America/New_York)"
            ) from None
        return value

    @model_validator(mode="after")
    def _zone_for_tumbling(self) -> WindowSettings:
        if self.time_zone != "UTC" and self.type != "tumbling":
            raise ValueError(
                f"time_zone {self.time_zone!r} applies to tumbling windows only (a sliding "
                "window covers the same span in every zone); drop it or use type: tumbling"
            )
        return self

    @property
    def size_ms(self) -> int:
        return parse_duration_ms(self.size)

    @property
    def key(self) -> tuple[int, str, str]:
        """``(size_ms, type, time_zone)``: windows with equal keys share accumulators."""
        return (self.size_ms, self.type, self.time_zone)


class LatestFeature(BaseModel):
    """The latest value of a column of the entity's own row."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    table: str
    column: str
    dtype: FeatureDtype = "float32"

    @field_validator("table")
    @classmethod
    def _table(cls, value: str) -> str:
        return _qualified(value)


class AggregateFeature(BaseModel):
    """An aggregate over the rows of a table that belong to the entity.

    Attributes:
        agg: count, sum, mean, min, max, distinct_count, last_n (the ``n``
            newest values, newest first) or top_k (the ``n`` most frequent
            values, most frequent first).
        column: The aggregated column (not for ``count``).
        where: Only rows whose columns equal these values count.
        window: The time window (required, except for ``last_n``).
        n: For last_n and top_k: how many values (one feature each,
            named ``<name>.1`` .. ``<name>.<n>``).
        dtype: Stored type (default: int64 for counts, ids and last_n/top_k,
            float32 otherwise).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    table: str
    agg: str
    column: str | None = None
    where: dict[str, str | int | float | bool] = Field(default_factory=dict)
    window: WindowSettings | None = None
    n: int | None = Field(default=None, ge=1, le=64)
    dtype: FeatureDtype | None = None

    @field_validator("table")
    @classmethod
    def _table(cls, value: str) -> str:
        return _qualified(value)

    @field_validator("agg")
    @classmethod
    def _agg(cls, value: str) -> str:
        aggregate_kind(value)  # pipeline.aggregates: the one list of aggregates
        return value

    @property
    def kind(self) -> Aggregate:
        """What this aggregate is and does (pipeline.aggregates)."""
        return aggregate_kind(self.agg)

    @model_validator(mode="after")
    def _shape(self) -> AggregateFeature:
        kind = self.kind
        if kind.needs_column and not self.column:
            raise ValueError(f"aggregate {self.name!r} ({self.agg}) needs a column")
        if kind.takes_n and self.n is None:
            raise ValueError(f"aggregate {self.name!r} ({self.agg}) needs n (how many values)")
        if not kind.takes_n and self.n is not None:
            raise ValueError(f"aggregate {self.name!r} ({self.agg}) takes no n")
        if self.window is None and kind.needs_window:
            raise ValueError(
                f"aggregate {self.name!r} ({self.agg}) needs a window, e.g. window: {{size: 30m}}: "
                "an unbounded aggregate would keep every event forever"
            )
        return self

    @property
    def effective_dtype(self) -> FeatureDtype:
        if self.dtype is not None:
            return self.dtype
        return self.kind.default_dtype

    @property
    def feature_names(self) -> list[str]:
        if self.kind.takes_n and self.n is not None:
            return [f"{self.name}.{i}" for i in range(1, self.n + 1)]
        return [self.name]


class EntitySettings(BaseModel):
    """One entity type and its feature vector.

    Attributes:
        name: Entity type (``user``, ``item``).
        personal: True when its data is personal: the lookup client never reads
            it from a region outside its residency zone.
        version: Schema version of the vector (bump when the features change).
        tables: Table -> the column holding this entity's id in that table.
        time_columns: Table -> the column giving a row's event time (default:
            the source commit time).
        latest: Latest values of columns of the entity's own row.
        aggregates: Windowed aggregates over the entity's rows.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    personal: bool = False
    version: int = Field(default=1, ge=1, le=65535)
    tables: dict[str, str] = Field(min_length=1)
    time_columns: dict[str, str] = Field(default_factory=dict)
    latest: list[LatestFeature] = Field(default_factory=list)
    aggregates: list[AggregateFeature] = Field(default_factory=list)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(f"entity name {value!r} must be letters, digits and underscores")
        return value

    @field_validator("tables", "time_columns")
    @classmethod
    def _qualify(cls, value: dict[str, str]) -> dict[str, str]:
        return {_qualified(table): column for table, column in value.items()}

    @model_validator(mode="after")
    def _consistent(self) -> EntitySettings:
        if not self.latest and not self.aggregates:
            raise ValueError(f"entity {self.name!r} declares no features (latest or aggregates)")
        names: list[str] = [f.name for f in self.latest]
        for aggregate in self.aggregates:
            names.extend(aggregate.feature_names)
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"entity {self.name!r}: feature(s) {', '.join(dupes)} declared twice")
        known = sorted(self.tables)
        declared: list[LatestFeature | AggregateFeature] = [*self.latest, *self.aggregates]
        for feature in declared:
            if feature.table not in self.tables:
                raise ValueError(
                    f"entity {self.name!r}: feature {feature.name!r} reads table "
                    f"{feature.table}, which is not in its tables: {', '.join(known)}"
                )
        for table in self.time_columns:
            if table not in self.tables:
                raise ValueError(
                    f"entity {self.name!r}: time_columns names {table}, not in its tables: "
                    f"{', '.join(known)}"
                )
        return self

    @property
    def feature_names(self) -> list[str]:
        names = [f.name for f in self.latest]
        for aggregate in self.aggregates:
            names.extend(aggregate.feature_names)
        return names


class FeatureReader(BaseModel):
    """A deployed model version and the features it reads (``models:`` in the settings).

    ``edgefeed features plan`` refuses to drop a feature a deployed model still
    reads. A ranker checkpoint's feature lists (``RankerConfig.user_features``,
    ``item_features``) are what its entry declares; ``edgefeed features plan
    --model PATH`` reads them from the checkpoint instead.

    Attributes:
        name: The model (``shop-ranker``).
        version: Its deployed version.
        reads: Entity -> the feature names it reads.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    version: str = "1"
    reads: dict[str, list[str]] = Field(default_factory=dict)


class PipelineSettings(BaseModel):
    """Topics and batching of the Faust pipeline.

    Attributes:
        app_prefix: Prefix of the Faust app ids and consumer groups
            (``<prefix>-router``, ``<prefix>-region-<region>``).
        region_topic_prefix: Regional change topics are ``<prefix>.<region>``.
        dead_letter_topic: Where undecodable or invalid events go, with the reason.
        partitions: Partitions of each regional change topic; a region scales to
            this many worker processes.
        replication_factor: Replication factor of the topics the pipeline creates.
        batch_max: Most events a worker handles (and writes to Redis) at once.
        batch_within_ms: Age at which a batch closes when the worker keeps up (it
            has taken every message its partitions held as its consumer last
            heard).
        batch_catch_up: While the worker is behind (a partition holds messages
            after the last one it took), a batch also stays open until it is this
            many times as old as the last flush took: a worker that falls behind
            takes bigger batches. Higher values favour throughput, lower ones
            freshness; a worker that keeps up is not held by it.
        snapshot_lane_ms: How long a worker holds the vectors of entities that
            only snapshot reads changed (an incremental snapshot, a history
            rebuild, a feature backfill) before writing them: once per this
            much, however many of their rows came, so that a snapshot costs
            streamed changes little. Their messages are acked after the write.
        commit_interval_s: How often consumed offsets are committed.
        checkpoint_interval_s: How often a regional worker writes the entity
            states it changed to the changelog topic, and only then acks the
            events behind them. Redis is written every batch regardless; this
            bounds what a restarted worker replays (at most this much) and makes
            a hot entity cost one changelog record per interval, not per batch.
        rebuild: What the router does when the stream's history does not cover the
            windows (the broker lost its topics, retention shorter than a window, a
            new deployment over recent rows): ``auto`` rebuilds the missing rows by a
            paced incremental snapshot while streaming goes on; ``off`` logs the gap
            as an error naming the command to run (pipeline.history).
        gc_full_interval_s: How often the pipeline processes run a full garbage
            collection; in between, long-lived objects are frozen out of the
            collector's sight (see pipeline.gctune): full collections of a big
            state paused a worker for hundreds of milliseconds.
        state_dir: Where regional workers keep their entity states on local disk
            (pipeline.localstore: one RocksDB per changelog partition, with the
            changelog offset it reflects), so that a worker holds only its hot
            entities in memory and a restart reads only the changelog's tail.
            Each worker takes a folder of its own under ``<state_dir>/<app id>``.
            None: every state in memory, recovered whole from the changelog
            (a small region, or tests).
        state_memory_mb: With ``state_dir``: the estimated memory of the entity
            states a worker keeps in memory (the least recently used clean ones
            are dropped beyond it, and read again from disk when needed).
        state_cache_mb: With ``state_dir``: RocksDB's block cache, per worker (its
            tables' data and index blocks); the memtables of all its partitions
            share half as much again (at least 16 MB). RocksDB's memory is these
            two whatever the number of entities.
        ready_max_behind_s: How far behind its change topic a regional worker may
            be and still answer ``/readyz`` with 200 (``pipeline run
            --metrics-port``; pipeline.probes). A worker with nothing waiting is
            ready however old its last change (an idle region).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    app_prefix: str = "edgefeed"
    region_topic_prefix: str = "edgefeed.region"
    dead_letter_topic: str = "edgefeed.deadletter"
    partitions: int = Field(default=4, ge=1, le=1024)
    replication_factor: int = Field(default=1, ge=1)
    batch_max: int = Field(default=5000, ge=1, le=100_000)
    batch_within_ms: int = Field(default=20, ge=1, le=10_000)
    batch_catch_up: float = Field(default=2.0, ge=0.0, le=20.0)
    snapshot_lane_ms: int = Field(default=1000, ge=1, le=60_000)
    commit_interval_s: float = Field(default=1.0, gt=0)
    checkpoint_interval_s: float = Field(default=1.0, gt=0, le=60)
    gc_full_interval_s: float = Field(default=600.0, ge=10)
    ready_max_behind_s: float = Field(default=30.0, gt=0)
    state_dir: str | None = None
    state_memory_mb: int = Field(default=1024, ge=16, le=1_048_576)
    state_cache_mb: int = Field(default=64, ge=8, le=65_536)
    rebuild: Literal["auto", "off"] = "auto"

    @property
    def names(self) -> PipelineNames:
        """The topic and group names these settings give (pipeline.names)."""
        return PipelineNames(self.app_prefix, self.region_topic_prefix, self.dead_letter_topic)

    def region_topic(self, region: str) -> str:
        return self.names.region_topic(region)

    @property
    def router_app_id(self) -> str:
        return self.names.router_group

    def region_app_id(self, region: str) -> str:
        return self.names.region_group(region)


def _jaas_quoted(value: str) -> str:
    """A JAAS config string literal (Kafka's parser honours backslash escapes)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


KafkaProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]


class KafkaSecuritySettings(PasswordFields):
    """How every Kafka client of edgefeed authenticates and encrypts.

    The same settings reach the Faust apps (router, regional workers), the
    aiokafka admin and monitor clients, and the Kafka Connect worker's config
    (:meth:`java_properties`). The password is a secret, given one way:
    ``password`` (usually ``${ENV}``-expanded), ``password_env`` or
    ``password_file``; it is read when a client's options are built, and a source
    that gives none raises ``edgefeed_base.secrets.SecretSourceError`` naming
    ``kafka.security.password_file`` (or ``_env``).

    Attributes:
        protocol: Kafka's ``security.protocol``.
        sasl_mechanism: PLAIN (only over TLS in production) or SCRAM.
        username: SASL user.
        ca_file: PEM bundle that signed the brokers' certificates (None: the
            system's trust store).
        cert_file: Client certificate for mutual TLS; ``key_file`` its key.
        keystore_file: The same certificate and key as a PKCS12 key store, for
            the Java clients (Kafka Connect): Kafka's Java client reads its
            certificate from a key store, not from two PEM files (Strimzi's
            KafkaUser Secret holds it as ``user.p12``). The Python clients use
            ``cert_file`` and ``key_file``.
        keystore_password_file: The file holding the key store's password
            (Strimzi's ``user.password``); the Java properties name it by a
            config provider reference, never by its value.
        check_hostname: Check the broker's name against its certificate.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    setting_path: ClassVar[str | None] = "kafka.security"

    protocol: KafkaProtocol = "PLAINTEXT"
    sasl_mechanism: SaslMechanism | None = None
    username: str | None = None
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    keystore_file: Path | None = None
    keystore_password_file: Path | None = None
    check_hostname: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> KafkaSecuritySettings:
        sasl = self.protocol.startswith("SASL")
        tls = self.protocol.endswith("SSL")
        given = self.password_sources()
        if sasl and (self.sasl_mechanism is None or not self.username or len(given) != 1):
            raise ValueError(
                f"kafka.security.protocol {self.protocol} needs sasl_mechanism, username and "
                "exactly one of password, password_env, password_file"
            )
        if not sasl and (self.sasl_mechanism or self.username or given):
            raise ValueError(
                f"kafka.security has SASL credentials but protocol {self.protocol}; "
                "use SASL_SSL (or SASL_PLAINTEXT)"
            )
        tls_files = (self.ca_file, self.cert_file, self.key_file, self.keystore_file)
        if not tls and any(tls_files):
            raise ValueError(
                f"kafka.security has TLS files but protocol {self.protocol}; use SSL or SASL_SSL"
            )
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("kafka.security needs both cert_file and key_file (or neither)")
        if (self.keystore_file is None) != (self.keystore_password_file is None):
            raise ValueError(
                "kafka.security needs both keystore_file and keystore_password_file (or neither)"
            )
        return self

    def ssl_context(self) -> ssl.SSLContext | None:
        """The client TLS context (None without TLS)."""
        if not self.protocol.endswith("SSL"):
            return None
        context = ssl.create_default_context(
            cafile=str(self.ca_file) if self.ca_file is not None else None
        )
        context.check_hostname = self.check_hostname
        if self.cert_file is not None and self.key_file is not None:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context

    def aiokafka_options(self) -> dict[str, Any]:
        """Keyword options of aiokafka's clients (holds the password: never log it)."""
        if self.protocol == "PLAINTEXT":
            return {}
        options: dict[str, Any] = {"security_protocol": self.protocol}
        context = self.ssl_context()
        if context is not None:
            options["ssl_context"] = context
        if self.sasl_mechanism is not None:
            options["sasl_mechanism"] = self.sasl_mechanism
            options["sasl_plain_username"] = self.username
            options["sasl_plain_password"] = self.secret()
        return options

    def faust_credentials(self) -> Any:
        """``faust.App(broker_credentials=...)``, or None for PLAINTEXT."""
        if self.protocol == "PLAINTEXT":
            return None
        import faust  # the pipeline's dependency; settings stay importable without it

        context = self.ssl_context()
        if self.sasl_mechanism is None:
            return faust.SSLCredentials(context)
        return faust.SASLCredentials(
            username=self.username,
            password=self.secret(),
            ssl_context=context,
            mechanism=self.sasl_mechanism,
        )

    def java_properties(self, password_reference: str | None = None) -> dict[str, str]:
        """Java client properties (the Kafka Connect worker and its connectors' clients).

        With ``keystore_file`` the client presents that PKCS12 key store, its
        password given as ``${dir:<folder>:<file>}`` of ``keystore_password_file``:
        the worker needs the DirectoryConfigProvider ``dir`` allowed that folder
        (the properties hold no secret).

        Args:
            password_reference: What the JAAS config holds for the password: a
                config provider reference (``${dir:/run/secrets:kafka}``) so the
                properties file holds no secret; by default the password itself.
        """
        if self.protocol == "PLAINTEXT":
            return {}
        props: dict[str, str] = {"security.protocol": self.protocol}
        if self.protocol.endswith("SSL"):
            if self.ca_file is not None:
                props["ssl.truststore.type"] = "PEM"
                props["ssl.truststore.location"] = str(self.ca_file)
            if self.keystore_file is not None and self.keystore_password_file is not None:
                password_file = self.keystore_password_file
                props["ssl.keystore.type"] = "PKCS12"
                props["ssl.keystore.location"] = str(self.keystore_file)
                props["ssl.keystore.password"] = (
                    f"${{dir:{password_file.parent}:{password_file.name}}}"
                )
            elif self.cert_file is not None and self.key_file is not None:
                # Kafka reads a PEM key store as one file: certificate chain then key.
                props["ssl.keystore.type"] = "PEM"
                props["ssl.keystore.location"] = str(self.cert_file)
            if not self.check_hostname:
                props["ssl.endpoint.identification.algorithm"] = ""
        if self.sasl_mechanism is not None:
            module = (
                "org.apache.kafka.common.security.plain.PlainLoginModule"
                if self.sasl_mechanism == "PLAIN"
                else "org.apache.kafka.common.security.scram.ScramLoginModule"
            )
            password = password_reference or self.secret()
            props["sasl.mechanism"] = self.sasl_mechanism
            props["sasl.jaas.config"] = (
                f"{module} required username={_jaas_quoted(self.username or '')} "
                f"password={_jaas_quoted(password)};"
            )
        # Connect's worker, its producers (source connectors) and its admin client.
        return {
            f"{prefix}{key}": value
            for prefix in ("", "producer.", "consumer.", "admin.")
            for key, value in props.items()
        }


class KafkaSettings(BaseModel):
    """The Kafka cluster the pipeline reads from and writes to.

    Attributes:
        bootstrap_servers: ``host:port`` of one or more brokers.
        session_timeout_ms: Consumer group session timeout. Tansu (the local
            broker) answers a new group's join after about half of it, so keep
            it at 6-10 s in development.
        fetch_max_wait_ms: How long a fetch waits for data while changes flow. Keep
            it short (10-50 ms): the freshness budget is counted in milliseconds,
            and Tansu (the local broker) answers a fetch of several partitions
            only after a part of this wait even when data arrives sooner.
        idle_fetch_max_wait_ms: The fetch wait once a worker has seen no message
            for 2 s (back to ``fetch_max_wait_ms`` with the first one): an idle
            worker then asks the broker a few times a second instead of 50, which
            is most of its idle CPU and of the broker's. The first change after
            a quiet spell may wait up to this long on Tansu (a Kafka broker answers
            a waiting fetch as soon as data arrives). 0 keeps the short wait.
        linger_ms: How long a producer holds records to send them together.
            A few milliseconds turns hundreds of tiny produce requests a second
            into a few larger ones (less work for the pipeline and the broker).
        security: SASL and TLS of every Kafka client (see KafkaSecuritySettings).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    bootstrap_servers: list[str] = Field(default_factory=lambda: ["127.0.0.1:9092"], min_length=1)
    client_id: str = "edgefeed"
    session_timeout_ms: int = Field(default=10_000, ge=1_000)
    fetch_max_wait_ms: int = Field(default=20, ge=0, le=500)
    idle_fetch_max_wait_ms: int = Field(default=500, ge=0, le=5000)
    linger_ms: int = Field(default=5, ge=0, le=1000)
    security: KafkaSecuritySettings = Field(default_factory=KafkaSecuritySettings)

    @field_validator("bootstrap_servers", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("bootstrap_servers")
    @classmethod
    def _host_port(cls, value: list[str]) -> list[str]:
        for server in value:
            host, sep, port = server.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"bootstrap server {server!r} must be host:port")
        return value

    @model_validator(mode="after")
    def _idle_wait(self) -> KafkaSettings:
        idle = self.idle_fetch_max_wait_ms
        if idle and idle < self.fetch_max_wait_ms:
            raise ValueError(
                f"idle_fetch_max_wait_ms {idle} is shorter than fetch_max_wait_ms "
                f"{self.fetch_max_wait_ms}: make it longer, or 0 to keep the short wait"
            )
        return self
