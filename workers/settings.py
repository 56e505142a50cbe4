"""Settings of a model worker (environment prefix ``EDGEFEED_WORKERS_``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from workers.batcher import BatchingConfig
from workers.exceptions import WorkerConfigError
from workers.runtime import CompileMode, RuntimeConfig
from workers.security import read_token_file
from workers.server import ServerConfig

__all__ = ["WorkerSettings"]


class WorkerSettings(BaseSettings):
    """Everything tunable about one worker process.

    Attributes mirror :class:`BatchingConfig`, :class:`RuntimeConfig` and
    :class:`ServerConfig`, in milliseconds where people think in them. The bearer
    token comes from ``EDGEFEED_WORKERS_AUTH_TOKEN`` or from the file named by
    ``auth_token_file`` (``EDGEFEED_WORKERS_AUTH_TOKEN_FILE``, ``--auth-token-file``),
    not both.

    ``max_batch_size`` left unset takes the served model's
    :attr:`~workers.models.base.ServedModel.default_max_batch_size` (32 rows; 256
    for the ranker, whose rows are a few hundred bytes of features each).
    ``event_loop``: ``auto`` runs the server on uvloop when it is installed (it
    is a dependency of the ``workers`` extra on Linux and macOS), else on asyncio's
    own loop; ``uvloop`` insists on it; ``asyncio`` never uses it.
    ``coalesce_lookups`` and ``coalesce_turns``: the ranker's feature lookups
    asked for within ``coalesce_turns`` event loop turns share one lookup per
    entity (:class:`~workers.features.EdgeCacheFeatureSource`); fewer turns favour
    the median at moderate load, more favour throughput and tails.
    ``processes``: worker processes serving the port (None: one per core this
    process may use, :func:`~workers.supervisor.default_processes`); 1 is one
    process with no supervisor.
    ``sched_slice_us``: the scheduler time slice the worker's threads ask for
    (:mod:`workers.cpusched`; Linux 6.12+): a short one lets the event loop run
    soon after each wait when other work keeps the cores busy; 0 leaves the
    kernel's default. 100 to 100,000 otherwise.
    """

    model_config = SettingsConfigDict(env_prefix="EDGEFEED_WORKERS_", extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    device: str = "auto"
    precision: str = "auto"
    compile: CompileMode = "auto"
    cpu_threads: int | None = Field(default=None, ge=1)
    max_batch_size: int | None = Field(default=None, ge=1, le=4096)
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_ms: float = Field(default=2.0, ge=0)
    adaptive_delay: bool = True
    max_queue_size: int = Field(default=256, ge=1)
    default_deadline_ms: float | None = Field(default=None, gt=0)
    max_payload_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    drain_timeout_s: float = Field(default=30.0, ge=0)
    header_timeout_s: float = Field(default=10.0, gt=0)
    body_timeout_s: float = Field(default=30.0, gt=0)
    max_connections: int = Field(default=1000, ge=1)
    keepalive_timeout_s: float = Field(default=15.0, gt=0)
    balance_connections: bool = True
    inline_forward_ms: float = Field(default=1.0, ge=0)
    gc_freeze: bool = True
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    coalesce_lookups: bool = True
    coalesce_turns: int = Field(default=4, ge=0, le=64)
    auth_token: SecretStr | None = None
    auth_token_file: Path | None = None
    auth_protect_probes: bool = False
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    processes: int | None = Field(default=None, ge=1, le=1024)
    sched_slice_us: float = Field(default=100.0, ge=0, le=100_000)

    @field_validator("sched_slice_us")
    @classmethod
    def _slice_in_range(cls, value: float) -> float:
        from workers.cpusched import SLICE_MIN_US

        if 0 < value < SLICE_MIN_US:
            raise ValueError(
                f"Linux takes a slice of {SLICE_MIN_US} us at least; use 0 for the kernel's default"
            )
        return value

    def apply_sched_slice(self) -> str:
        """Ask for ``sched_slice_us`` for this process's threads (and those it starts
        later); what the start line says of it."""
        from workers.cpusched import request_slice

        if not self.sched_slice_us:
            return "scheduler slice: the kernel's"
        applied = request_slice(self.sched_slice_us)
        if applied is None:
            return "scheduler slice: the kernel's (none of its own here: needs Linux 6.12+)"
        return f"scheduler slice {applied / 1e3:g} ms"

    def process_count(self) -> int:
        """Worker processes to run: the setting, else one per available core.

        Raises:
            WorkerConfigError: more than one off Linux (see :func:`check_processes`).
        """
        from workers.supervisor import check_processes, default_processes

        return check_processes(self.processes or default_processes())

    def for_child(self, processes: int) -> WorkerSettings:
        """These settings as one of ``processes`` children on one port runs them: the
        cores shared among their torch threads unless ``cpu_threads`` is set (see
        :func:`~workers.supervisor.threads_per_child`)."""
        if self.cpu_threads is not None:
            return self
        from workers.supervisor import threads_per_child

        return self.model_copy(update={"cpu_threads": threads_per_child(processes)})

    def batch_rows(self, model_default: int = 32) -> int:
        """Rows per forward pass: the setting, else the served model's default."""
        return self.max_batch_size if self.max_batch_size is not None else model_default

    def batching(self, model_default: int = 32) -> BatchingConfig:
        """The batcher's view (``model_default``: the served model's batch rows)."""
        return BatchingConfig(
            max_batch_size=self.batch_rows(model_default),
            preferred_batch_sizes=tuple(self.preferred_batch_sizes),
            max_queue_delay_s=self.max_queue_delay_ms / 1e3,
            adaptive_delay=self.adaptive_delay,
            max_queue_size=self.max_queue_size,
            inline_forward_s=self.inline_forward_ms / 1e3,
            default_deadline_s=(
                self.default_deadline_ms / 1e3 if self.default_deadline_ms is not None else None
            ),
        )

    def runtime(self, model_default: int = 32) -> RuntimeConfig:
        """The runner's view (``model_default``: the served model's batch rows)."""
        return RuntimeConfig(
            device=self.device,
            precision=self.precision,
            compile=self.compile,
            max_batch_rows=self.batch_rows(model_default),
            cpu_threads=self.cpu_threads,
        )

    def token(self) -> SecretStr | None:
        """The bearer token, from the environment or the token file (None: no auth).

        Raises:
            WorkerConfigError: both are given, or the file cannot be read.
        """
        if self.auth_token is not None and self.auth_token_file is not None:
            raise WorkerConfigError(
                "the auth token is given twice (EDGEFEED_WORKERS_AUTH_TOKEN and "
                f"auth_token_file {str(self.auth_token_file)!r}); keep one"
            )
        if self.auth_token_file is not None:
            return read_token_file(self.auth_token_file)
        return self.auth_token

    def server(self, region: str) -> ServerConfig:
        """The HTTP server's view.

        Raises:
            WorkerConfigError: see :meth:`token`; a TLS file without its pair.
        """
        return ServerConfig(
            host=self.host,
            port=self.port,
            region=region,
            max_payload_bytes=self.max_payload_bytes,
            drain_timeout_s=self.drain_timeout_s,
            header_timeout_s=self.header_timeout_s,
            body_timeout_s=self.body_timeout_s,
            max_connections=self.max_connections,
            keepalive_timeout_s=self.keepalive_timeout_s,
            balance_connections=self.balance_connections,
            gc_freeze=self.gc_freeze,
            auth_token=self.token(),
            auth_protect_probes=self.auth_protect_probes,
            tls_cert_file=self.tls_cert_file,
            tls_key_file=self.tls_key_file,
        )
