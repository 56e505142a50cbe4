"""The local stack: every service edgefeed needs, on loopback, from one settings file.

``DevStack`` is what ``edgefeed dev up|status|down|logs`` and the test fixtures
use. Ports come from the settings (Kafka bootstrap, Connect URL, database port,
each region's Redis URL), so the same file drives the stack and the code that
talks to it. All state (pid files, logs, data) lives under one state folder.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import redis

from connectors.config import worker_provider_properties
from edgefeed.devstack import binaries
from edgefeed.devstack.exceptions import (
    DevStackError,
    NotLoopbackError,
    PortInUseError,
    ServiceStartError,
    UnsupportedLocallyError,
)
from edgefeed.devstack.monitoring import AlertmanagerService, PrometheusService
from edgefeed.devstack.process import port_in_use, read_pid, spawn, stop_pid
from edgefeed.devstack.services import (
    BrokerService,
    ConnectService,
    PostgresService,
    RedisService,
    Service,
    WanService,
    url_port,
)
from edgefeed.settings import EdgefeedSettings

__all__ = ["DevStack", "ServiceState", "ServiceStatus"]

ServiceState = Literal["running", "unhealthy", "stopped"]

_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


@dataclass(frozen=True, slots=True)
class ServiceStatus:
    """What ``dev status`` reports about one service."""

    name: str
    kind: str
    port: int
    state: ServiceState
    pid: int | None
    detail: str
    log: Path

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "kind": self.kind,
            "port": self.port,
            "state": self.state,
            "pid": self.pid,
            "detail": self.detail,
            "log": str(self.log),
        }


def _loopback(host: str, setting: str, value: str) -> None:
    if host not in _LOOPBACK_HOSTS:
        raise NotLoopbackError(
            f"{setting} {value!r} is not on loopback; the local stack listens on 127.0.0.1 "
            "only, so point it at 127.0.0.1 (or run against your own services without "
            "`edgefeed dev`)"
        )


class DevStack:
    """Starts, checks and stops the local services described by the settings.

    Args:
        settings: The deployment settings; their addresses must be on loopback.
        state_dir: Folder for pid files, logs and data (created if missing).
        redis_cluster_ports: Ports of an optional Redis Cluster (three or more
            primaries, no replicas), for code that must work on a cluster.
        with_connect: Whether to run Kafka Connect (the slowest service to start).
        only: Run only the services of these names (default: all).
    """

    def __init__(
        self,
        settings: EdgefeedSettings,
        state_dir: Path,
        *,
        redis_cluster_ports: Sequence[int] = (),
        with_connect: bool = True,
        only: Sequence[str] | None = None,
    ) -> None:
        self.settings = settings
        self.state_dir = Path(state_dir).resolve()
        self.redis_cluster_ports = tuple(redis_cluster_ports)
        if self.redis_cluster_ports and len(self.redis_cluster_ports) < 3:
            ports = list(self.redis_cluster_ports)
            raise DevStackError(f"a Redis Cluster needs at least 3 nodes, got ports {ports}")
        planned = self._plan(with_connect)
        if only is not None:
            names = {service.name for service in planned}
            unknown = sorted(set(only) - names)
            if unknown:
                raise DevStackError(
                    f"unknown service(s) {', '.join(unknown)}; services: {', '.join(sorted(names))}"
                )
            planned = [s for s in planned if s.name in only]
            # A dependency left out must already run elsewhere: do not wait for it here.
            for service in planned:
                service.depends_on = tuple(d for d in service.depends_on if d in only)
        self.services: list[Service] = planned

    # -- planning -------------------------------------------------------------------------

    def _plan(self, with_connect: bool) -> list[Service]:
        settings = self.settings
        services: list[Service] = []
        bootstrap = settings.kafka.bootstrap_servers[0]
        host, _, port = bootstrap.rpartition(":")
        _loopback(host, "kafka.bootstrap_servers", bootstrap)
        if settings.kafka.security.protocol != "PLAINTEXT":
            raise UnsupportedLocallyError(
                f"kafka.security.protocol is {settings.kafka.security.protocol}, but the local "
                "broker (Tansu 0.6.0) cannot authenticate clients or speak TLS (its --cert and "
                "--key cannot be given together; --authentication refuses the command that "
                "creates users); use PLAINTEXT for `edgefeed dev up`, see docs/security.md"
            )
        services.append(
            BrokerService(
                "broker",
                int(port),
                "kafka.bootstrap_servers",
                self._home("broker"),
                start_timeout_s=30,
            )
        )
        for region_name, site in settings.sites.regions.items():
            bhost, _, bport = site.bootstrap_servers[0].rpartition(":")
            setting = f"sites.regions.{region_name}.bootstrap_servers"
            _loopback(bhost, setting, site.bootstrap_servers[0])
            services.append(
                BrokerService(
                    f"broker-{region_name}",
                    int(bport),
                    setting,
                    self._home(f"broker-{region_name}"),
                    start_timeout_s=30,
                )
            )
        db = settings.database
        _loopback(db.host, "database.host", db.host)
        services.append(
            PostgresService(
                "postgres",
                db.port,
                "database.port",
                self._home("postgres"),
                dbname=db.dbname,
                superuser=db.user,
                password=db.password.get_secret_value(),
                start_timeout_s=60,
            )
        )
        for region in settings.regions:
            rhost, rport = url_port(region.redis_url, 6379)
            _loopback(rhost, f"regions[{region.name}].redis_url", region.redis_url)
            services.append(
                RedisService(
                    f"redis-{region.name}",
                    rport,
                    f"regions[{region.name}].redis_url",
                    self._home(f"redis-{region.name}"),
                    start_timeout_s=20,
                )
            )
        for index, cport in enumerate(self.redis_cluster_ports, start=1):
            services.append(
                RedisService(
                    f"redis-cluster-{index}",
                    cport,
                    "redis_cluster_ports",
                    self._home(f"redis-cluster-{index}"),
                    start_timeout_s=20,
                    cluster=True,
                )
            )
        if with_connect:
            chost, cport = url_port(settings.connect.url, 8083)
            _loopback(chost, "connect.url", settings.connect.url)
            services.append(
                ConnectService(
                    "connect",
                    cport,
                    "connect.url",
                    self._home("connect"),
                    start_timeout_s=120,
                    depends_on=("broker",),
                    bootstrap=f"127.0.0.1:{port}",
                    providers=worker_provider_properties(self.settings.database),
                )
            )
        links = settings.sites.link_specs()
        if links:
            services.append(
                WanService(
                    "wan",
                    int(str(links[0]["listen_port"])),
                    "sites",
                    self._home("wan"),
                    start_timeout_s=20,
                    links=links,
                    control=self.wan_control_path,
                )
            )
        services += self._plan_monitoring()
        seen: dict[int, str] = {}
        for link in links[1:]:
            seen[int(str(link["listen_port"]))] = f"sites link {link['name']}"
        for service in services:
            if service.port in seen:
                raise PortInUseError(
                    f"port {service.port} is configured twice: {seen[service.port]} and "
                    f"{service.setting}; give each service its own port"
                )
            seen[service.port] = service.setting
        return services

    def _plan_monitoring(self) -> list[Service]:
        """Prometheus and Alertmanager, where the settings give them ports."""
        monitoring = self.settings.monitoring
        planned: list[Service] = []
        if monitoring.alertmanager_port is not None:
            planned.append(
                AlertmanagerService(
                    "alertmanager",
                    monitoring.alertmanager_port,
                    "monitoring.alertmanager_port",
                    self._home("alertmanager"),
                    start_timeout_s=30,
                )
            )
        if monitoring.prometheus_port is not None:
            planned.append(
                PrometheusService(
                    "prometheus",
                    monitoring.prometheus_port,
                    "monitoring.prometheus_port",
                    self._home("prometheus"),
                    start_timeout_s=60,
                    depends_on=("alertmanager",) if planned else (),
                    alertmanager_port=monitoring.alertmanager_port,
                    scrape_interval_s=monitoring.scrape_interval_s,
                )
            )
        return planned

    def scrape(self, job: str, name: str, port: int, *, token: str | None = None) -> bool:
        """Have the local Prometheus scrape process ``name`` on ``127.0.0.1:port`` in
        ``job`` (one of :data:`~edgefeed.devstack.monitoring.SCRAPE_JOBS`), with the
        bearer ``token`` its /metrics requires (one token per job). False when the
        stack runs no Prometheus (``monitoring.prometheus_port`` unset)."""
        for service in self.services:
            if isinstance(service, PrometheusService):
                service.write_target(job, name, port, token)
                return True
        return False

    def _home(self, name: str) -> Path:
        return self.state_dir / "services" / name

    @property
    def wan_control_path(self) -> Path:
        """The WAN emulator's control socket (``edgefeed dev wan``)."""
        return self.state_dir / "run" / "wan.sock"

    def pid_path(self, name: str) -> Path:
        return self.state_dir / "run" / f"{name}.pid"

    def log_path(self, name: str) -> Path:
        return self.state_dir / "logs" / f"{name}.log"

    def service(self, name: str) -> Service:
        for service in self.services:
            if service.name == name:
                return service
        raise DevStackError(
            f"no service {name!r} in the local stack; services: "
            + ", ".join(s.name for s in self.services)
        )

    # -- up -------------------------------------------------------------------------------

    def up(self, *, timeout_s: float | None = None) -> list[ServiceStatus]:
        """Start every service that is not already running, then wait until all are healthy.

        Idempotent: services already running (and ours) are left as they are;
        stale pid files of crashed services are cleaned up first.

        Raises:
            PortInUseError: a port is held by a process this stack did not start.
            MissingBinaryError: a program or jar is not installed.
            ServiceStartError: a service did not become healthy in time.
        """
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.state_dir.chmod(self.state_dir.stat().st_mode | 0o711)
        # Resolve every binary before starting anything, so a missing one fails fast.
        for service in self.services:
            service.argv()
        started: set[str] = set()
        pending = list(self.services)
        healthy: set[str] = set()
        while pending:
            ready = [s for s in pending if all(dep in healthy for dep in s.depends_on)]
            if not ready:  # pragma: no cover - the plan has no cycles
                raise DevStackError("service dependencies cannot be satisfied")
            for service in ready:
                if self._ensure_started(service):
                    started.add(service.name)
            with ThreadPoolExecutor(max_workers=len(ready)) as pool:
                list(pool.map(lambda s: self._wait_healthy(s, timeout_s), ready))
            for service in ready:
                healthy.add(service.name)
                pending.remove(service)
        self._form_cluster()
        for service in self.services:
            service.after_start()
        return self.status()

    def _ensure_started(self, service: Service) -> bool:
        record = read_pid(self.pid_path(service.name))
        if record is not None and record.alive():
            return False
        self.pid_path(service.name).unlink(missing_ok=True)
        if port_in_use(service.port):
            raise PortInUseError(
                f"port {service.port} ({service.setting}) is already in use by a process the "
                f"local stack did not start; stop that process or choose another port in "
                f"{service.setting}"
            )
        service.prepare()
        spawn(
            service.argv(),
            log_path=self.log_path(service.name),
            pid_path=self.pid_path(service.name),
            env=service.env(),
            cwd=service.home if service.home.exists() else self.state_dir,
            user=service.user(),
        )
        return True

    def _wait_healthy(self, service: Service, timeout_s: float | None) -> None:
        deadline = time.monotonic() + (timeout_s or service.start_timeout_s)
        reason = "not probed"
        while time.monotonic() < deadline:
            record = read_pid(self.pid_path(service.name))
            if record is None or not record.alive():
                raise ServiceStartError(
                    f"{service.name} exited during start-up; last lines of "
                    f"{self.log_path(service.name)}:\n{self.tail(service.name, 15)}"
                )
            reason = service.probe() or ""
            if not reason:
                return
            time.sleep(0.2)
        raise ServiceStartError(
            f"{service.name} did not become healthy in time ({reason}); last lines of "
            f"{self.log_path(service.name)}:\n{self.tail(service.name, 15)}"
        )

    def _form_cluster(self) -> None:
        if not self.redis_cluster_ports:
            return
        first = self.redis_cluster_ports[0]
        if self._cluster_ok(first):
            return
        nodes = [f"127.0.0.1:{port}" for port in self.redis_cluster_ports]
        result = subprocess.run(
            [
                binaries.redis_cli_binary(),
                "--cluster",
                "create",
                *nodes,
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if result.returncode != 0:
            raise ServiceStartError(f"redis-cli --cluster create failed: {result.stdout[-800:]}")
        deadline = time.monotonic() + 30
        while not self._cluster_ok(first):
            if time.monotonic() > deadline:
                raise ServiceStartError("the Redis Cluster did not reach cluster_state:ok in 30 s")
            time.sleep(0.1)

    @staticmethod
    def _cluster_ok(port: int) -> bool:
        with redis.Redis(host="127.0.0.1", port=port, socket_timeout=2) as client:
            info = client.execute_command("CLUSTER", "INFO")
        text = info.decode() if isinstance(info, bytes) else str(info)
        return "cluster_state:ok" in text

    # -- status, down, logs ------------------------------------------------------------------

    def status(self) -> list[ServiceStatus]:
        """The state of every service: running (and healthy), unhealthy, or stopped."""
        statuses = []
        for service in self.services:
            record = read_pid(self.pid_path(service.name))
            if record is None or not record.alive():
                detail = "stale pid file" if record is not None else "not started"
                state: ServiceState = "stopped"
                pid = None
            else:
                pid = record.pid
                problem = service.probe()
                state = "unhealthy" if problem else "running"
                detail = problem or "healthy"
            statuses.append(
                ServiceStatus(
                    service.name,
                    service.kind,
                    service.port,
                    state,
                    pid,
                    detail,
                    self.log_path(service.name),
                )
            )
        return statuses

    # -- applications on top of the stack (pipeline workers, model workers) ------------------

    _APP_PREFIX = "app-"

    def start_app(
        self, name: str, argv: Sequence[str], *, ready: str | None = None, timeout_s: float = 90.0
    ) -> None:
        """Run an edgefeed process (a pipeline or model worker) managed like the services:
        pid file and log in the state folder, stopped by :meth:`down`.

        Args:
            ready: A line fragment its log prints once it is ready; waited for.

        Raises:
            ServiceStartError: it exited, or did not print ``ready`` in time.
        """
        app = f"{self._APP_PREFIX}{name}"
        record = read_pid(self.pid_path(app))
        if record is not None and record.alive():
            return
        log = self.log_path(app)
        offset = log.stat().st_size if log.exists() else 0
        # Run in the state folder: Faust creates its data folder in the working
        # directory, and nothing of a stack may land outside its state folder.
        workdir = self.state_dir / "apps" / name
        workdir.mkdir(parents=True, exist_ok=True)
        record = spawn(argv, log_path=log, pid_path=self.pid_path(app), cwd=workdir)
        if ready is None:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with open(log, "rb") as handle:
                handle.seek(offset)
                if ready.encode() in handle.read():
                    return
            if not record.alive():
                break
            time.sleep(0.2)
        raise ServiceStartError(
            f"{name} did not become ready; last lines of {log}:\n{self._tail_path(log, 15)}"
        )

    def stop_app(self, name: str, sig: signal.Signals = signal.SIGTERM) -> bool:
        """Stop one application started by :meth:`start_app`; True if it was running."""
        path = self.pid_path(f"{self._APP_PREFIX}{name}")
        record = read_pid(path)
        stopped = record is not None and stop_pid(record, sig=sig, timeout_s=30)
        path.unlink(missing_ok=True)
        for service in self.services:
            if isinstance(service, PrometheusService):
                service.remove_targets(name)
        return stopped

    def apps(self) -> list[str]:
        """Names of the applications with a pid file."""
        run = self.state_dir / "run"
        prefix = self._APP_PREFIX
        return (
            sorted(p.stem[len(prefix) :] for p in run.glob(f"{prefix}*.pid"))
            if run.exists()
            else []
        )

    def down(self) -> dict[str, str]:
        """Stop every process this stack started; clean up stale pid files.

        Applications (pipeline and model workers started with :meth:`start_app`)
        stop first, then the services in reverse start order. Only processes
        whose pid and start time match the pid file are signalled, so a pid
        reused by a foreign process after a crash is left alone.

        Returns:
            Per service: "stopped", "not running" or "stale pid file removed".
        """
        outcome: dict[str, str] = {}
        for app in self.apps():
            outcome[f"{self._APP_PREFIX}{app}"] = (
                "stopped" if self.stop_app(app) else "stale pid file removed"
            )
        # Reverse order: Connect before the broker it writes to.
        for service in reversed(self.services):
            path = self.pid_path(service.name)
            record = read_pid(path)
            if record is None:
                outcome[service.name] = "not running"
                path.unlink(missing_ok=True)
                continue
            if stop_pid(record, sig=service.stop_signal):
                outcome[service.name] = "stopped"
            else:
                outcome[service.name] = "stale pid file removed"
            path.unlink(missing_ok=True)
        return outcome

    def tail(self, name: str, lines: int = 50) -> str:
        """The last ``lines`` lines of a service's log."""
        if name.startswith(self._APP_PREFIX):
            return self._tail_path(self.log_path(name), lines)
        self.service(name)
        return self._tail_path(self.log_path(name), lines)

    @staticmethod
    def _tail_path(path: Path, lines: int) -> str:
        if not path.exists():
            return f"(no log yet at {path})"
        with open(path, "rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - 256 * 1024))
            data = handle.read().decode("utf-8", errors="replace")
        return "\n".join(data.splitlines()[-lines:])
