"""docker-compose.yml, the Prometheus rules and the Grafana dashboard agree with the code."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import pytest
import typer
import yaml
from jsonschema import Draft202012Validator

from connectors.config import worker_provider_properties
from edgefeed.cli import app
from edgefeed.settings import EdgefeedSettings, load_settings
from monitoring import METRIC_NAMES

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = ROOT / "docker-compose.yml"
SCHEMA = ROOT / "tests" / "data" / "compose-spec" / "compose-spec.json"
_VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<rest>[^}]*)\}")


def env_example() -> dict[str, str]:
    pairs = {}
    for line in (ROOT / ".env.example").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            pairs[key.strip()] = value.strip()
    return pairs


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


@pytest.fixture(scope="module")
def settings() -> EdgefeedSettings:
    return load_settings(ROOT / "deploy" / "edgefeed.compose.yaml", env=env_example())


def test_compose_file_is_valid_against_the_compose_specification(
    compose: dict[str, Any],
) -> None:
    schema = json.loads(SCHEMA.read_text())
    errors = sorted(Draft202012Validator(schema).iter_errors(compose), key=str)
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_no_secret_inline_and_every_variable_in_env_example(compose: dict[str, Any]) -> None:
    text = COMPOSE.read_text()
    example = env_example()
    for match in _VAR.finditer(text):
        rest = match.group("rest")
        if rest.startswith(":") and not rest.startswith((":-", ":?")):
            continue  # a Connect config-provider reference, ${env:NAME}, not compose's
        if not rest.startswith(":-"):
            assert match.group("name") in example, f"${{{match.group('name')}}} not in .env.example"
    for name, service in compose["services"].items():
        for key, value in (service.get("environment") or {}).items():
            if any(word in key.upper() for word in ("PASSWORD", "SECRET", "TOKEN")):
                # a secret is a file under /run/secrets (Compose secrets), never a value
                assert key.endswith("FILE") and str(value).startswith("/run/secrets/"), (
                    f"{name}: {key} is not a Compose secret file"
                )


def test_every_bind_mount_and_build_file_exists(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
    dockerfile = (ROOT / "deploy" / "edgefeed.Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"


def test_every_service_has_a_healthcheck_or_is_a_one_shot_and_waits_on_conditions(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    for name, service in services.items():
        for dep, condition in (service.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            wanted = condition["condition"]
            if wanted == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits on {dep}'s health"
    for infra in ("kafka", "postgres", "connect", "redis-eu-west", "exporter", "prometheus"):
        assert "healthcheck" in services[infra]


def test_settings_agree_with_the_services(
    compose: dict[str, Any], settings: EdgefeedSettings
) -> None:
    services = compose["services"]
    kafka_env = services["kafka"]["environment"]
    assert kafka_env["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft, no ZooKeeper
    advertised = kafka_env["KAFKA_ADVERTISED_LISTENERS"].split("//", 1)[1]
    assert settings.kafka.bootstrap_servers == [advertised]
    assert services["connect"]["environment"]["BOOTSTRAP_SERVERS"] == advertised
    connect = urlsplit(settings.connect.url)
    assert connect.hostname == "connect" and connect.port == 8083
    pg = services["postgres"]
    assert "wal_level=logical" in pg["command"]
    assert settings.database.host == "postgres" and settings.database.port == 5432
    assert pg["environment"]["POSTGRES_DB"] == settings.database.dbname
    assert pg["environment"]["POSTGRES_USER"] == settings.database.user
    # Passwords are Compose secrets: the admin's for PostgreSQL itself; Connect
    # reads only the replication role's, through an allow-listed provider.
    assert settings.database.password_file == Path("/run/secrets/pg_password")
    assert pg["environment"]["POSTGRES_PASSWORD_FILE"] == "/run/secrets/pg_password"
    assert settings.database.replication is not None
    assert services["connect"]["secrets"] == ["cdc_password"]
    connect_env = services["connect"]["environment"]
    for key, value in worker_provider_properties(settings.database).items():
        assert connect_env["CONNECT_" + key.upper().replace(".", "_")] == value
    for region in settings.regions:
        url = urlsplit(region.redis_url)
        assert url.hostname == f"redis-{region.name}" and url.port == 6379
        assert url.hostname in services
        worker = services[f"worker-{region.name}"]
        assert worker["command"][:4] == ["pipeline", "run", "--region", region.name]
        assert f"redis-{region.name}" in worker["depends_on"]
        assert worker["environment"]["EDGEFEED_SETTINGS"] == "/etc/edgefeed/edgefeed.yaml"
        # its entity states on a volume of its own, where the settings put them
        assert f"state-{region.name}:/var/lib/edgefeed/state" in worker["volumes"]
    assert services["router"]["command"][:4] == ["pipeline", "run", "--role", "router"]
    gpu = services["model-worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert "gpu" in gpu["capabilities"]


def test_compose_settings_run_the_shop_example_pipeline(settings: EdgefeedSettings) -> None:
    from edgefeed.pipeline_config import pipeline_config

    example = load_settings(ROOT / "examples" / "edgefeed.yaml", env={})
    assert settings.sources == example.sources
    assert settings.entities == example.entities
    # The same pipeline, its state on the workers' volume with a budget under the
    # containers' mem_limit (docker-compose.yml).
    assert (
        settings.pipeline.model_copy(update={"state_dir": "state", "state_memory_mb": 1024})
        == example.pipeline
    )
    assert settings.pipeline.state_dir == "/var/lib/edgefeed/state"
    config = pipeline_config(settings, check_database=False)  # what router and workers build
    assert [r.name for r in config.regions] == ["eu-west", "us-east", "ap-southeast"]


def test_prometheus_scrapes_the_exporter_where_it_listens(compose: dict[str, Any]) -> None:
    exporter = compose["services"]["exporter"]
    command = exporter["command"]
    port = command[command.index("--port") + 1]
    assert any(p.endswith(f":{port}") for p in exporter["ports"])
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = prometheus["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == [f"exporter:{port}"]


def _option(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def _k8s_jobs() -> set[str]:
    found = set()
    for path in (ROOT / "deploy" / "k8s" / "base").rglob("*.yaml"):
        found |= set(re.findall(r"edgefeed\.io/job: (\S+)", path.read_text()))
    return found


def test_prometheus_scrapes_every_edgefeed_process_with_its_token(
    compose: dict[str, Any],
) -> None:
    """The router, every regional worker and the model worker serve /metrics behind a
    bearer token; the compose Prometheus scrapes each of them where it listens, with
    the token of a secret both mount, over a network they share, under the job name
    the Kubernetes ServiceMonitors give the same process (the rules and the dashboard
    read the same series in both). Without this the freshness SLO's burn-rate alerts
    and the serving alerts have no series in compose (they read the workers' own
    histograms)."""
    services = compose["services"]
    prometheus_yml = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prometheus_yml["scrape_configs"]}
    scraper = services["prometheus"]
    # service -> (job, the port its command serves /metrics on, the token file)
    expected: dict[str, tuple[str, str | None, str | None]] = {}
    for name, service in services.items():
        command = service.get("command") or []
        if command[:2] == ["pipeline", "run"]:
            job = "edgefeed-router" if "--role" in command else "edgefeed-feature-worker"
            assert _option(command, "--metrics-host") == "0.0.0.0", name
            port, token = (
                _option(command, "--metrics-port"),
                _option(command, "--metrics-token-file"),
            )
            expected[name] = (job, port, token)
        elif command[:2] == ["workers", "serve"]:
            port, token = _option(command, "--port"), _option(command, "--auth-token-file")
            expected[name] = ("edgefeed-model-worker", port, token)
    assert {job for job, _p, _t in expected.values()} == {
        "edgefeed-router",
        "edgefeed-feature-worker",
        "edgefeed-model-worker",
    }
    assert set(jobs) - {"alertmanager"} <= _k8s_jobs(), sorted(set(jobs) - _k8s_jobs())
    for name, (job, port, token) in expected.items():
        assert port is not None and token is not None, f"{name}: /metrics without a token"
        assert token.startswith("/run/secrets/"), name
        secret = token.removeprefix("/run/secrets/")
        assert secret in services[name]["secrets"] and secret in scraper["secrets"], name
        assert set(services[name]["networks"]) & set(scraper["networks"]), name
        config = jobs[job]
        # By DNS: every container of a scaled service (`--scale worker-eu-west=4`).
        (dns,) = config["dns_sd_configs"]
        assert dns["type"] == "A" and str(dns["port"]) == port, (name, dns)
        assert name in dns["names"], (name, job, dns["names"])
        assert config["authorization"]["credentials_file"] == token, name
    secrets = set(compose["secrets"])
    made = (ROOT / "scripts" / "make-secrets.sh").read_text()
    for secret in scraper["secrets"]:
        assert secret in secrets and secret in made, secret


def test_prometheus_sends_alerts_to_the_alertmanager_and_its_config_is_valid(
    compose: dict[str, Any],
) -> None:
    """Alerts leave Prometheus: it sends them to the compose Alertmanager, which runs
    deploy/alertmanager/alertmanager.yml, checked by Alertmanager's own amtool."""
    prometheus_yml = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    (manager,) = prometheus_yml["alerting"]["alertmanagers"]
    (target,) = manager["static_configs"][0]["targets"]
    host, _, port = target.partition(":")
    alertmanager = compose["services"][host]
    assert any(str(p).endswith(f":{port}") for p in alertmanager["ports"])
    assert set(alertmanager["networks"]) & set(compose["services"]["prometheus"]["networks"])
    assert "alertmanager" in compose["services"]["prometheus"]["depends_on"]
    config = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
    assert (
        f"./{config.relative_to(ROOT)}:/etc/alertmanager/alertmanager.yml:ro"
        in (alertmanager["volumes"])
    )
    amtool = shutil.which("amtool")
    if amtool is None:
        pytest.fail(
            "amtool is missing: `make install` (scripts/bootstrap.sh) installs it with "
            "Debian's prometheus-alertmanager package"
        )
    done = subprocess.run(
        [amtool, "check-config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # Every alert routes to a receiver by its severity: critical pages, the rest tickets.
    routes = yaml.safe_load(config.read_text())["route"]
    assert routes["receiver"] == "edgefeed-tickets"
    assert [r["receiver"] for r in routes["routes"]] == ["edgefeed-pages"]
    assert routes["routes"][0]["matchers"] == ['severity="critical"']


def _resolves(args: list[str]) -> bool:
    command: Any = typer.main.get_command(app)
    ctx = click.Context(command)
    for arg in args:
        # typer vendors its own click: a group is whatever has sub-commands.
        if not hasattr(command, "get_command") or arg.startswith("-"):
            break
        sub = command.get_command(ctx, arg)
        if sub is None:
            return False
        command = sub
    params = {opt for p in command.params for opt in getattr(p, "opts", [])}
    return all(a in params for a in args if a.startswith("--"))


def _edgefeed_services() -> list[Any]:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    cases = []
    for name, service in sorted(services.items()):
        if str(service.get("image", "")).startswith("${EDGEFEED_IMAGE"):
            cases.append(pytest.param(name, service["command"], id=name))
    return cases


@pytest.mark.parametrize(("name", "command"), _edgefeed_services())
def test_every_edgefeed_service_runs_a_real_command(name: str, command: list[str]) -> None:
    assert _resolves(command), f"{name}: `edgefeed {' '.join(command)}` is not a CLI command"


def _metric_names(expr: str) -> set[str]:
    import promql_parser

    promql_parser.parse(expr)  # raises on a query Prometheus would reject
    return set(re.findall(r"\b((?:kafka|edgefeed)_[a-z0-9_]+)\b", expr))


def _pipeline_metric_names() -> set[str]:
    """The series the pipeline's workers serve on --metrics-port (histograms with
    their _bucket, _count and _sum)."""
    from prometheus_client import CollectorRegistry

    from pipeline.metrics import PipelineMetrics

    registry = CollectorRegistry()
    PipelineMetrics.create(registry)
    names = set()
    for family in registry.collect():
        names.add(family.name)
        names |= {f"{family.name}{suffix}" for suffix in ("_bucket", "_count", "_sum", "_total")}
    return names


def _model_worker_metric_names() -> set[str]:
    """The series the model workers serve at /metrics (counters with _total)."""
    from prometheus_client import CollectorRegistry

    from workers.metrics import WorkerMetrics

    registry = CollectorRegistry()
    WorkerMetrics("eu-west", registry)
    names = set()
    for family in registry.collect():
        names |= {f"{family.name}{suffix}" for suffix in ("_bucket", "_count", "_sum", "_total")}
    return names


def test_alert_rules_and_dashboard_use_metrics_the_exporter_emits() -> None:
    """The alert rules and the dashboard read what the exporter emits; the freshness
    SLO's recording rules read the workers' own histogram (scraped from the workers),
    and the serving alerts the model workers' series."""
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    serving = [r for g in rules["groups"] if g["name"] == "edgefeed-serving" for r in g["rules"]]
    assert {r["alert"] for r in serving} == {
        "EdgefeedServingErrors",
        "EdgefeedServiceLatencyHigh",
    }
    from_model_workers: set[str] = set()
    for rule in serving:
        from_model_workers |= _metric_names(rule["expr"])
    assert from_model_workers <= _model_worker_metric_names(), sorted(from_model_workers)
    assert {
        "edgefeed_worker_requests_total",
        "edgefeed_worker_latency_seconds_bucket",
    } <= from_model_workers
    alerts = {
        r["alert"]: r
        for g in rules["groups"]
        if g["name"] != "edgefeed-serving"
        for r in g["rules"]
        if "alert" in r
    }
    recorded = [r for g in rules["groups"] for r in g["rules"] if "record" in r]
    from_workers: set[str] = set()
    for rule in recorded:
        from_workers |= _metric_names(rule["expr"])
    assert from_workers and from_workers <= _pipeline_metric_names(), sorted(from_workers)
    for wanted in (
        "EdgefeedConsumerLagGrowing",
        "EdgefeedFreshnessOverBudget",
        "EdgefeedReplicationSlotWalOverBound",
        "EdgefeedConnectorTaskFailed",
        "EdgefeedDeadLettersRising",
        "EdgefeedLinkCut",
        "EdgefeedRegionBehind",
    ):
        assert wanted in alerts
    used = set()
    for rule in alerts.values():
        used |= _metric_names(rule["expr"])
    dashboard = json.loads(
        (ROOT / "deploy" / "grafana" / "dashboards" / "edgefeed.json").read_text()
    )
    from_processes: set[str] = set()  # the workers' own, scraped where they run
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            names = _metric_names(target["expr"])
            own = names - set(METRIC_NAMES)
            assert own <= _pipeline_metric_names() | _model_worker_metric_names(), sorted(own)
            from_processes |= own
            used |= names - own
    assert used, "no metric referenced"
    assert used <= set(METRIC_NAMES), sorted(used - set(METRIC_NAMES))
    # The dashboard shows what only the processes know: commit -> Redis from the
    # workers' histogram, the time the state's budget held them, T_service.
    assert {
        "edgefeed_pipeline_freshness_seconds_bucket",
        "edgefeed_pipeline_backpressure_seconds_total",
        "edgefeed_worker_latency_seconds_bucket",
        "edgefeed_worker_requests_total",
    } <= from_processes, sorted(from_processes)
    recorded_names = {r["record"] for r in recorded}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\bedgefeed:[a-z0-9_:]+", target["expr"]):
                assert name in recorded_names, name
    provider = yaml.safe_load(
        (ROOT / "deploy" / "grafana" / "provisioning" / "dashboards" / "edgefeed.yml").read_text()
    )
    grafana = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]
    mounted = {v.split(":")[1] for v in grafana["volumes"]}
    assert provider["providers"][0]["options"]["path"] in mounted


def test_the_dashboard_and_alerts_show_the_sites_links_and_regions_behind() -> None:
    dashboard = json.loads(
        (ROOT / "deploy" / "grafana" / "dashboards" / "edgefeed.json").read_text()
    )
    shown = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            shown |= _metric_names(target["expr"])
    for wanted in (
        "edgefeed_link_up",
        "edgefeed_link_observed_delay_seconds",
        "edgefeed_link_bytes_per_second",
        "edgefeed_region_behind_seconds",
    ):
        assert wanted in shown, f"no dashboard panel shows {wanted}"
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert "edgefeed_link_up" in _metric_names(alerts["EdgefeedLinkCut"]["expr"])
    assert "edgefeed_region_behind_seconds" in _metric_names(alerts["EdgefeedRegionBehind"]["expr"])


def test_alert_rules_join_the_budget_through_an_aggregation() -> None:
    """Every exporter that judges a region emits the budget, so a rule that joins it
    with `on ()` must aggregate it first (one series on its side of the join)."""
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    budget = 0
    for group in rules["groups"]:
        for rule in group["rules"]:
            for match in re.finditer(r"edgefeed_freshness_budget_seconds", rule["expr"]):
                budget += 1
                before = rule["expr"][: match.start()]
                assert before.endswith(("max(", "max (", "min(", "min (")), rule["alert"]
    assert budget == 2  # EdgefeedFreshnessOverBudget, EdgefeedRegionBehind
