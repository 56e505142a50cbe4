"""deploy/k8s, checked by machine: no cluster runs here, so these are the proof.

Every overlay is rendered by ``kubectl kustomize`` (the machine image ships
kubectl 1.32) and then:

- every object validates against the Kubernetes 1.32 schema (kubernetes-validate,
  strict: an unknown field fails), and KEDA's, the Prometheus operator's and
  Strimzi's custom resources against the schemas shipped in deploy/k8s/schemas;
- checkov passes, with the checks it skips justified below or in the
  manifest's own ``checkov.io/skip`` annotations;
- the invariants that matter are read from the rendered objects: no regional
  worker beyond its topic's partitions, each Redis reachable only from its own
  region (the NetworkPolicies evaluated as a graph), every container confined
  and bounded, no secret in plain text, every command line accepted by the
  CLI it runs, the router the only principal the Kafka ACLs (Strimzi
  KafkaUsers) let write a regional topic, and each Kafka client pod with the
  certificate of exactly one KafkaUser;
- the settings file drives both the manifests (``edgefeed deploy k8s``) and
  docker-compose.yml: a region added to it and not to them fails here.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import typer
import yaml

from edgefeed import __version__ as VERSION
from edgefeed import k8s
from edgefeed.cli import app
from edgefeed.settings import (
    EdgefeedSettings,
    SettingsError,
    load_settings,
    settings_from_mapping,
)

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy" / "k8s"
SETTINGS = ROOT / "deploy" / "edgefeed.compose.yaml"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "edgefeed.json"
CHECKOV = ROOT / ".venv-checkov" / "bin" / "checkov"
#: The Kubernetes version the objects are validated against (kubectl's here).
KUBERNETES_VERSION = "1.32.0"
#: checkov's checks skipped for every object, and why (per-object skips are
#: annotations on the object itself, with their reason).
SKIPPED_CHECKS = {
    # Images by digest: the digest of the edgefeed image exists only once a
    # release pipeline has built it, which then pins it in the overlay
    # (`kustomize edit set image edgefeed=REGISTRY/edgefeed@sha256:...`,
    # docs/deploy.md); the third-party images' digests cannot be looked up
    # offline. Every image is pinned by an exact version tag instead (checked
    # in test_images_are_pinned).
    "CKV_K8S_43",
}
#: Containers allowed a writable root filesystem (Debezium's image writes its config).
WRITABLE_ROOT = {("edgefeed", "connect")}


def _inputs(settings_text: str | None = None) -> k8s.K8sInputs:
    text = SETTINGS.read_text(encoding="utf-8") if settings_text is None else settings_text
    return k8s.K8sInputs(
        settings=load_settings(_write_temp(text)),
        settings_text=text,
        alerts_text=ALERTS.read_text(encoding="utf-8"),
        dashboard_text=DASHBOARD.read_text(encoding="utf-8"),
        image_tag=VERSION,
    )


_TEMP: list[Path] = []


def _write_temp(text: str) -> Path:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False, encoding="utf-8") as handle:
        handle.write(text)
    path = Path(handle.name)
    _TEMP.append(path)
    return path


@pytest.fixture(scope="module", autouse=True)
def _cleanup() -> Iterator[None]:
    yield
    for path in _TEMP:
        path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def settings() -> EdgefeedSettings:
    return load_settings(SETTINGS)


def overlay_names(settings: EdgefeedSettings) -> list[str]:
    regions = list(settings.region_names)
    return ["central", *regions, *(f"{r}-gpu" for r in regions)]


@pytest.fixture(scope="module")
def rendered(settings: EdgefeedSettings) -> dict[str, list[dict[str, Any]]]:
    """Every overlay as ``kubectl kustomize`` renders it: overlay -> objects."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render deploy/k8s (the machine image ships 1.32)"
    out = {}
    for name in overlay_names(settings):
        done = subprocess.run(
            [kubectl, "kustomize", str(K8S / "overlays" / name)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, f"kubectl kustomize overlays/{name}: {done.stderr}"
        out[name] = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    return out


def objects(rendered: Mapping[str, list[dict[str, Any]]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for overlay, docs in rendered.items():
        for doc in docs:
            yield overlay, doc


def pod_specs(doc: dict[str, Any]) -> dict[str, Any] | None:
    kind = doc["kind"]
    if kind in {"Deployment", "StatefulSet", "DaemonSet", "Job"}:
        spec: dict[str, Any] = doc["spec"]["template"]["spec"]
        return spec
    return None


def find(docs: Sequence[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} objects"
    return matches[0]


def mounted_files(
    docs: Sequence[dict[str, Any]], spec: Mapping[str, Any], container: Mapping[str, Any]
) -> dict[str, tuple[str, str, str]]:
    """Every file a container's volumes provide: path -> (kind, object name, key).

    Secrets and ConfigMaps, whole or by items, alone or projected; a ConfigMap
    mounted whole provides each key of the rendered object.
    """
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    out: dict[str, tuple[str, str, str]] = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"], {})
        sources = list(volume.get("projected", {}).get("sources", []))
        if "secret" in volume:
            sources.append({"secret": {**volume["secret"], "name": volume["secret"]["secretName"]}})
        if "configMap" in volume:
            sources.append({"configMap": volume["configMap"]})
        for source in sources:
            for kind, ref in source.items():
                items = ref.get("items")
                if items is None and kind == "configMap":
                    (config,) = [
                        d
                        for d in docs
                        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == ref["name"]
                    ]
                    items = [{"key": key, "path": key} for key in config.get("data", {})]
                for item in items or []:
                    out[f"{mount['mountPath']}/{item['path']}"] = (kind, ref["name"], item["key"])
    return out


def container_settings(
    docs: Sequence[dict[str, Any]], spec: Mapping[str, Any], container: Mapping[str, Any]
) -> EdgefeedSettings:
    """The settings an edgefeed container reads: the mounted file $EDGEFEED_SETTINGS names."""
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    overrides = sorted(n for n in env if n.startswith("EDGEFEED_") and n != "EDGEFEED_SETTINGS")
    # Settings from the environment would bypass this check: none are expected.
    assert not overrides, f"{container['name']}: settings from the environment {overrides}"
    kind, name, key = mounted_files(docs, spec, container)[env["EDGEFEED_SETTINGS"]]
    assert kind == "configMap", f"{container['name']}: settings from a {kind}"
    (config,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name]
    return settings_from_mapping(yaml.safe_load(config["data"][key]), source=name)


def pod_settings_of(docs: Sequence[dict[str, Any]]) -> EdgefeedSettings:
    """The settings the router or a region's feature workers read in an overlay."""
    for doc in docs:
        if doc["kind"] == "Deployment" and doc["metadata"]["name"] in {"router", "feature-worker"}:
            spec = doc["spec"]["template"]["spec"]
            return container_settings(docs, spec, spec["containers"][0])
    raise AssertionError("no router or feature worker in the overlay")


# -- generated from the settings ---------------------------------------------------


def test_generated_files_match_the_settings() -> None:
    problems = k8s.diff(K8S, k8s.render(_inputs()))
    assert not problems, (
        "deploy/k8s is out of date with the settings; run "
        "`edgefeed --settings deploy/edgefeed.compose.yaml deploy k8s`:\n" + "\n".join(problems)
    )


def _with_region(text: str, name: str) -> str:
    data = yaml.safe_load(text)
    data["regions"].append(
        {
            "name": name,
            "redis_url": f"redis://redis-{name}:6379/0",
            "residency_zone": "sa",
        }
    )
    return yaml.safe_dump(data, sort_keys=False)


def test_a_region_added_to_the_settings_fails_until_regenerated() -> None:
    files = k8s.render(_inputs(_with_region(SETTINGS.read_text(encoding="utf-8"), "sa-east")))
    problems = k8s.diff(K8S, files)
    assert "missing: overlays/sa-east/kustomization.yaml" in problems
    assert "missing: overlays/sa-east-gpu/kustomization.yaml" in problems
    assert "differs: base/common/edgefeed.yaml" in problems
    # ...and docker-compose.yml lacks its worker and Redis.
    assert compose_problems(
        load_settings(_write_temp(_with_region(SETTINGS.read_text(), "sa-east")))
    )


def test_a_region_removed_from_the_settings_is_reported_stale(tmp_path: Path) -> None:
    files = k8s.render(_inputs())
    k8s.write(tmp_path, {**files, "overlays/gone/kustomization.yaml": "x"})
    assert k8s.diff(tmp_path, files) == [
        "stale (no such region in the settings): overlays/gone/kustomization.yaml"
    ]
    k8s.write(tmp_path, files)
    assert k8s.diff(tmp_path, files) == []
    assert not (tmp_path / "overlays" / "gone").exists()


def test_a_redis_url_that_is_no_service_name_is_refused() -> None:
    data = yaml.safe_load(SETTINGS.read_text(encoding="utf-8"))
    data["regions"][0]["redis_url"] = "redis://cache.eu-west.example.com:6379/0"
    with pytest.raises(Exception, match=r"cache\.eu-west\.example\.com") as info:
        k8s.render(_inputs(yaml.safe_dump(data, sort_keys=False)))
    assert "Service name" in str(info.value)


def compose_problems(settings: EdgefeedSettings) -> list[str]:
    """Where docker-compose.yml disagrees with the settings' regions."""
    from urllib.parse import urlsplit

    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    problems = []
    for region in settings.region_names:
        host = urlsplit(settings.region(region).redis_url).hostname
        if host not in services:
            problems.append(f"no Redis service {host} for region {region}")
        worker = services.get(f"worker-{region}")
        if worker is None or worker.get("command", [])[:4] != [
            "pipeline",
            "run",
            "--region",
            region,
        ]:
            problems.append(f"no worker-{region} service running --region {region}")
    known = set(settings.region_names)
    for name in services:
        if name.startswith("worker-") and name.removeprefix("worker-") not in known:
            problems.append(f"service {name} runs a region the settings do not have")
    return problems


def test_compose_runs_every_region_of_the_settings(settings: EdgefeedSettings) -> None:
    assert compose_problems(settings) == []


# -- schemas and checkov ------------------------------------------------------------


def _crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for path in (K8S / "schemas").glob("*.json"):
        group_version, kind = path.stem.rsplit("_", 1)
        out[(group_version.replace("_", "/"), kind)] = json.loads(path.read_text())
    return out


def validation_errors(doc: dict[str, Any]) -> list[str]:
    key = (doc.get("apiVersion", ""), doc.get("kind", ""))
    schema = _crd_schemas().get(key)
    if schema is not None:
        validator = jsonschema.Draft202012Validator(schema)
        return [
            f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(doc)
        ]
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'/'.join(map(str, exc.path))}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [f"no schema for {key} (ship one in deploy/k8s/schemas): {exc}"]
    return []


def test_every_object_validates(rendered: dict[str, list[dict[str, Any]]]) -> None:
    kinds = set()
    for overlay, doc in objects(rendered):
        kinds.add(doc["kind"])
        errors = validation_errors(doc)
        assert not errors, f"{overlay}: {doc['kind']}/{doc['metadata']['name']}: {errors}"
    assert {
        "ScaledObject",
        "PrometheusRule",
        "ServiceMonitor",
        "NetworkPolicy",
        "KafkaUser",
        "TriggerAuthentication",
    } <= kinds


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        (
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": "x"},
                "spec": {
                    "replica": 2,
                    "selector": {"matchLabels": {"a": "b"}},
                    "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": []}},
                },
            },
            "replica",
        ),
        (
            {
                "apiVersion": "keda.sh/v1alpha1",
                "kind": "ScaledObject",
                "metadata": {"name": "x"},
                "spec": {"scaleTargetRef": {"name": "x"}, "maxReplicas": 4, "triggers": []},
            },
            "maxReplicas",
        ),
        (
            {
                "apiVersion": "keda.sh/v1alpha1",
                "kind": "ScaledObject",
                "metadata": {"name": "x"},
                "spec": {
                    "scaleTargetRef": {"name": "x"},
                    "triggers": [{"type": "kafka", "metadata": {"lagThreshold": 5}}],
                },
            },
            "lagThreshold",
        ),
        (
            {
                "apiVersion": "kafka.strimzi.io/v1beta2",
                "kind": "KafkaUser",
                "metadata": {"name": "x"},
                "spec": {
                    "authentication": {"type": "tls"},
                    "authorization": {
                        "type": "simple",
                        "acls": [
                            {
                                "resource": {"type": "topic", "name": "t", "patterType": "prefix"},
                                "operations": ["Write"],
                            }
                        ],
                    },
                },
            },
            "patterType",
        ),
        (
            {
                "apiVersion": "kafka.strimzi.io/v1beta2",
                "kind": "KafkaUser",
                "metadata": {"name": "x"},
                "spec": {
                    "authentication": {"type": "tls"},
                    "authorization": {
                        "type": "simple",
                        "acls": [{"resource": {"type": "topic"}, "operations": ["Wrote"]}],
                    },
                },
            },
            "Wrote",
        ),
        (
            {
                "apiVersion": "keda.sh/v1alpha1",
                "kind": "TriggerAuthentication",
                "metadata": {"name": "x"},
                "spec": {"secretTargetRefs": [{"parameter": "ca", "name": "s", "key": "ca.crt"}]},
            },
            "secretTargetRefs",
        ),
        (
            {
                "apiVersion": "keda.sh/v1alpha1",
                "kind": "TriggerAuthentication",
                "metadata": {"name": "x"},
                "spec": {"secretTargetRef": [{"paramter": "ca", "name": "s", "key": "ca.crt"}]},
            },
            "paramter",
        ),
    ],
)
def test_the_validation_catches_a_wrong_field(doc: dict[str, Any], field: str) -> None:
    errors = validation_errors(doc)
    assert errors and any(field in e for e in errors), errors


def test_checkov_passes(rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    assert CHECKOV.is_file(), (
        "checkov's venv is missing: `make install` (scripts/bootstrap.sh) makes it"
    )
    for overlay, docs in rendered.items():
        (tmp_path / f"{overlay}.yaml").write_text(yaml.safe_dump_all(docs))
    done = subprocess.run(
        [
            str(CHECKOV), "--quiet", "--compact", "--skip-download", "--framework", "kubernetes",
            "--directory", str(tmp_path), "--skip-check", ",".join(sorted(SKIPPED_CHECKS)),
            "--output", "json",
        ],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE"},
    )  # fmt: skip
    reports = json.loads(done.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = [
        f"{c['check_id']} {c['resource']} ({c['file_path']})"
        for r in reports
        for c in r.get("results", {}).get("failed_checks", [])
    ]
    assert not failed, "checkov failed:\n" + "\n".join(failed)
    assert sum(r.get("summary", {}).get("passed", 0) for r in reports) > 500
    for r in reports:
        for c in r.get("results", {}).get("skipped_checks", []):
            reason = (c.get("check_result") or {}).get("suppress_comment") or ""
            assert c["check_id"] in SKIPPED_CHECKS or len(reason) > 20, (
                f"{c['check_id']} skipped for {c['resource']} without a reason"
            )


# -- invariants ---------------------------------------------------------------------


def test_no_feature_worker_beyond_its_topics_partitions(
    rendered: dict[str, list[dict[str, Any]]], settings: EdgefeedSettings
) -> None:
    partitions = settings.pipeline.partitions
    for region in settings.region_names:
        for overlay in (region, f"{region}-gpu"):
            docs = rendered[overlay]
            deployment = find(docs, "Deployment", "feature-worker")
            scaled = find(docs, "ScaledObject", "feature-worker")
            assert deployment["spec"]["replicas"] <= partitions
            spec = scaled["spec"]
            assert spec["scaleTargetRef"]["name"] == "feature-worker"
            assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"] <= partitions
            (trigger,) = spec["triggers"]
            meta = trigger["metadata"]
            assert trigger["type"] == "kafka"
            assert meta["topic"] == settings.pipeline.region_topic(region)
            assert meta["consumerGroup"] == settings.pipeline.names.region_group(region)
            assert meta["allowIdleConsumers"] == "false"
            assert find(docs, "Namespace", k8s.region_namespace(region))


def test_feature_workers_keep_their_states_on_a_writable_volume(
    rendered: dict[str, list[dict[str, Any]]], settings: EdgefeedSettings
) -> None:
    """pipeline.state_dir is a mounted volume (the root filesystem is read-only),
    and the memory limit leaves room beside the states' budget."""
    state_dir = settings.pipeline.state_dir
    assert state_dir is not None and state_dir.startswith("/")
    for region in settings.region_names:
        deployment = find(rendered[region], "Deployment", "feature-worker")
        spec = deployment["spec"]["template"]["spec"]
        (worker,) = spec["containers"]
        mounts = {m["mountPath"]: m for m in worker["volumeMounts"]}
        assert state_dir in mounts and not mounts[state_dir].get("readOnly", False)
        volume = next(v for v in spec["volumes"] if v["name"] == mounts[state_dir]["name"])
        assert "emptyDir" in volume or "persistentVolumeClaim" in volume
        limit = worker["resources"]["limits"]["memory"]
        limit_mb = int(limit[:-2]) * (1024 if limit.endswith("Gi") else 1)
        budget = settings.pipeline.state_memory_mb + settings.pipeline.state_cache_mb
        assert limit_mb >= budget + 512, f"{region}: {limit} leaves no room beside {budget} MB"


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def test_every_container_is_confined_and_bounded(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for overlay, doc in objects(rendered):
        spec = pod_specs(doc)
        if spec is None:
            continue
        where = f"{overlay}: {doc['kind']}/{doc['metadata']['name']}"
        assert spec.get("automountServiceAccountToken") is False, where
        pod_security = spec.get("securityContext", {})
        for c in _containers(spec):
            here = f"{where} container {c['name']}"
            security = {**pod_security, **c.get("securityContext", {})}
            assert security.get("runAsNonRoot") is True, here
            assert security.get("runAsUser", 0) >= 1000, here
            assert security.get("allowPrivilegeEscalation") is False, here
            assert security.get("capabilities", {}).get("drop") == ["ALL"], here
            assert "add" not in security.get("capabilities", {}), here
            assert security.get("seccompProfile", {}).get("type") == "RuntimeDefault", here
            if (doc["metadata"].get("namespace"), doc["metadata"]["name"]) not in WRITABLE_ROOT:
                assert security.get("readOnlyRootFilesystem") is True, here
            resources = c.get("resources", {})
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(bound, {})), f"{here}: {bound}"
            if doc["kind"] != "Job":
                assert "readinessProbe" in c and "livenessProbe" in c, here


def test_gpu_overlays_ask_for_a_gpu_on_gpu_nodes(
    rendered: dict[str, list[dict[str, Any]]], settings: EdgefeedSettings
) -> None:
    for region in settings.region_names:
        cpu = find(rendered[region], "Deployment", "model-worker")["spec"]["template"]["spec"]
        gpu = find(rendered[f"{region}-gpu"], "Deployment", "model-worker")["spec"]["template"][
            "spec"
        ]
        assert "nvidia.com/gpu" not in cpu["containers"][0]["resources"]["limits"]
        assert gpu["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert gpu["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


def test_images_are_pinned(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for overlay, doc in objects(rendered):
        spec = pod_specs(doc)
        for c in _containers(spec) if spec else []:
            image = c["image"]
            name, _, tag = image.rpartition(":")
            assert name and tag and tag != "latest" and "/" not in tag, f"{overlay}: {image}"
            if name == "edgefeed":
                assert tag == VERSION, f"{overlay}: {image} is not this release ({VERSION})"


_SECRETISH = re.compile(r"(?i)(password|passwd|secret|token|api[_-]?key)")
#: A Kafka config provider reference to a mounted secret file (Connect resolves
#: it when it starts; the manifest and the properties file hold no secret).
_PROVIDER_REFERENCE = re.compile(r"^\$\{dir:(/run/secrets(?:/[^:}]+)?):([^:}/]+)\}$")


def test_no_secret_in_plain_text(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for overlay, doc in objects(rendered):
        where = f"{overlay}: {doc['kind']}/{doc['metadata']['name']}"
        assert doc["kind"] != "Secret", f"{where}: Secrets are created outside the manifests"
        spec = pod_specs(doc)
        for c in _containers(spec) if spec else []:
            for env in c.get("env", []):
                if _SECRETISH.search(env["name"]) and not _PROVIDER_REFERENCE.match(
                    env.get("value", "")
                ):
                    assert "value" not in env, f"{where}: {env['name']} in plain text"
            for i, arg in enumerate(c.get("args", [])):
                # A secret on the command line shows in `ps` and the pod spec.
                if arg.startswith("--") and _SECRETISH.search(arg):
                    assert arg.endswith("-file"), f"{where}: {arg}"
                    assert c["args"][i + 1].startswith("/run/secrets/"), f"{where}: {arg}"
        if doc["kind"] == "ConfigMap":
            for key, text in doc.get("data", {}).items():
                if key.endswith((".yaml", ".yml")):
                    _assert_no_inline_secret(yaml.safe_load(text), f"{where} {key}")


def _assert_no_inline_secret(node: Any, where: str) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(key, str) and _SECRETISH.search(key) and not key.endswith("_file"):
                assert not isinstance(value, str) or not value, f"{where}: {key} holds a value"
            _assert_no_inline_secret(value, where)
    elif isinstance(node, list):
        for value in node:
            _assert_no_inline_secret(value, where)


def test_every_secret_file_the_settings_name_is_mounted(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """A pod that runs edgefeed finds each password file its role reads under /run/secrets."""
    needs = {
        "router": {"pg_password"},
        "connectors-apply": {"pg_password", "cdc_password"},
        "connect": {"cdc_password"},
        "feature-worker": {"redis_writer_password", "metrics_token"},
        "model-worker": {"redis_lookup_password", "model_token"},
        "redis": {"redis_lookup_password", "redis_writer_password"},
    }
    for overlay, doc in objects(rendered):
        spec = pod_specs(doc)
        name = doc["metadata"]["name"]
        if spec is None or name not in needs:
            continue
        mounted = {
            item["path"]
            for volume in spec.get("volumes", [])
            for source in volume.get("projected", {}).get("sources", [])
            for item in source.get("secret", {}).get("items", [])
        }
        assert needs[name] <= mounted, f"{overlay}: {name} lacks {needs[name] - mounted}"


class CommandLineError(Exception):
    """The CLI refused a command line (the parser's own message)."""


def _subcommand_args(argv: Sequence[str]) -> None:
    """Parse ``argv`` as the edgefeed CLI would, without running it.

    Raises:
        CommandLineError: an unknown command or option, or a bad value.
    """
    command: Any = typer.main.get_command(app)  # typer's own click: duck-typed here
    try:
        ctx = command.make_context("edgefeed", list(argv))
        while hasattr(command, "list_commands"):
            rest = [*ctx._protected_args, *ctx.args]
            sub = command.get_command(ctx, rest[0])
            if sub is None:
                raise CommandLineError(f"no command {rest[0]!r}")
            command, ctx = sub, sub.make_context(rest[0], rest[1:], parent=ctx)
    except Exception as exc:
        if isinstance(exc, CommandLineError) or not hasattr(exc, "format_message"):
            raise
        raise CommandLineError(exc.format_message()) from None


def test_the_command_line_check_refuses_a_bad_option() -> None:
    with pytest.raises(CommandLineError, match="--bogus"):
        _subcommand_args(["pipeline", "run", "--region", "eu-west", "--bogus", "1"])
    with pytest.raises(CommandLineError, match="nosuch"):
        _subcommand_args(["nosuch"])
    _subcommand_args(["workers", "serve", "--model", "ranker", "--region", "eu-west"])


def test_every_command_line_is_one_the_cli_accepts(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    seen = set()
    for overlay, doc in objects(rendered):
        spec = pod_specs(doc)
        for c in _containers(spec) if spec else []:
            if c["image"].startswith("edgefeed:"):
                try:
                    _subcommand_args(c["args"])
                except CommandLineError as exc:
                    pytest.fail(f"{overlay}: {doc['metadata']['name']}: {c['args']}: {exc}")
                seen.add(doc["metadata"]["name"])
    assert {"router", "feature-worker", "model-worker", "exporter", "connectors-apply"} <= seen


# -- the network, as a graph --------------------------------------------------------


@dataclass(frozen=True)
class Pod:
    namespace: str
    name: str
    labels: tuple[tuple[str, str], ...]
    ports: tuple[tuple[str, int], ...] = ()

    @property
    def label_map(self) -> dict[str, str]:
        return dict(self.labels)


def _selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    if selector is None:
        return True
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


class Network:
    """NetworkPolicy semantics (networking.k8s.io/v1) over a set of pods and namespaces."""

    def __init__(
        self,
        pods: Sequence[Pod],
        namespaces: Mapping[str, Mapping[str, str]],
        policies: Sequence[dict[str, Any]],
    ) -> None:
        self.pods = pods
        self.namespaces = {
            ns: {**labels, "kubernetes.io/metadata.name": ns} for ns, labels in namespaces.items()
        }
        self.policies = policies

    def _policies_for(self, pod: Pod, kind: str) -> list[dict[str, Any]]:
        return [
            p
            for p in self.policies
            if p["metadata"]["namespace"] == pod.namespace
            and kind in p["spec"].get("policyTypes", ["Ingress"])
            and _selects(p["spec"]["podSelector"], pod.label_map)
        ]

    def _peer_matches(self, peer: Mapping[str, Any], policy_ns: str, other: Pod) -> bool:
        if "ipBlock" in peer:
            return False  # pods are addressed by selectors here; ipBlocks are outside
        ns_selector, pod_selector = peer.get("namespaceSelector"), peer.get("podSelector")
        if ns_selector is None:
            in_ns = other.namespace == policy_ns
        else:
            in_ns = _selects(ns_selector, self.namespaces.get(other.namespace, {}))
        return in_ns and _selects(pod_selector, other.label_map)

    @staticmethod
    def _port_matches(rule: Mapping[str, Any], target: Pod, port: int) -> bool:
        ports = rule.get("ports")
        if not ports:
            return True
        named = dict(target.ports)
        for p in ports:
            wanted = p.get("port")
            if wanted is None or wanted == port or named.get(str(wanted)) == port:
                return True
        return False

    def _allowed(self, pod: Pod, other: Pod, port: int, kind: str, target: Pod) -> bool:
        policies = self._policies_for(pod, kind)
        if not policies:
            return True
        rules_key, peers_key = ("ingress", "from") if kind == "Ingress" else ("egress", "to")
        for policy in policies:
            for rule in policy["spec"].get(rules_key, []):
                peers = rule.get(peers_key)
                peer_ok = not peers or any(
                    self._peer_matches(peer, pod.namespace, other) for peer in peers
                )
                if peer_ok and self._port_matches(rule, target, port):
                    return True
        return False

    def connects(self, source: Pod, target: Pod, port: int) -> bool:
        return self._allowed(source, target, port, "Egress", target) and self._allowed(
            target, source, port, "Ingress", target
        )


@pytest.fixture(scope="module")
def network(rendered: dict[str, list[dict[str, Any]]], settings: EdgefeedSettings) -> Network:
    """The whole cluster: central and every region (CPU overlays), plus the outside."""
    pods: list[Pod] = []
    namespaces: dict[str, dict[str, str]] = {
        "kube-system": {},
        "kafka": {},
        "postgres": {},
        "monitoring": {},
        "default": {},
    }
    policies = []
    for overlay in ["central", *settings.region_names]:
        for doc in rendered[overlay]:
            if doc["kind"] == "Namespace":
                namespaces[doc["metadata"]["name"]] = doc["metadata"].get("labels", {})
            elif doc["kind"] == "NetworkPolicy":
                policies.append(doc)
            elif (spec := pod_specs(doc)) is not None:
                labels = doc["spec"]["template"]["metadata"]["labels"]
                ports = tuple(
                    (p["name"], p["containerPort"])
                    for c in spec["containers"]
                    for p in c.get("ports", [])
                    if "name" in p
                )
                pods.append(
                    Pod(
                        doc["metadata"]["namespace"],
                        doc["metadata"]["name"],
                        tuple(sorted(labels.items())),
                        ports,
                    )
                )
    # The outside: serving code of each region, Prometheus, the brokers, and a
    # stranger in a namespace that serves no region.
    for region in settings.region_names:
        ns = f"shop-{region}"
        namespaces[ns] = {"edgefeed.io/serving-region": region}
        pods.append(Pod(ns, "serving", (("app", "shop"),)))
    pods += [
        Pod("monitoring", "prometheus", (("app.kubernetes.io/name", "prometheus"),)),
        Pod("kafka", "broker", (("strimzi.io/kind", "Kafka"),), (("kafka", 9092),)),
        Pod("postgres", "db", (("cnpg.io/cluster", "edgefeed-db"),), (("postgres", 5432),)),
        Pod("kube-system", "dns", (("k8s-app", "kube-dns"),), (("dns", 53),)),
        Pod("default", "stranger", (("app", "curious"),)),
    ]
    return Network(pods, namespaces, policies)


def _pod(network: Network, namespace: str, name: str) -> Pod:
    (pod,) = [p for p in network.pods if p.namespace == namespace and p.name == name]
    return pod


def test_each_redis_is_reachable_only_from_its_region(
    network: Network, settings: EdgefeedSettings
) -> None:
    for region in settings.region_names:
        ns = k8s.region_namespace(region)
        redis = _pod(network, ns, "redis")
        reach = {
            (p.namespace, p.name)
            for p in network.pods
            if p != redis and network.connects(p, redis, 6379)
        }
        assert reach == {
            (ns, "feature-worker"),
            (ns, "model-worker"),
            (ns, "exporter"),
            (f"shop-{region}", "serving"),
        }, f"{region}: {sorted(reach)}"
        # ...and the Redis itself reaches nothing but DNS.
        for other in network.pods:
            if other.name != "dns" and other != redis:
                assert not network.connects(redis, other, 6379), f"{region} Redis -> {other}"


def test_the_pipeline_can_still_talk(network: Network, settings: EdgefeedSettings) -> None:
    """The policies deny the rest, not the paths the system needs."""
    broker, db = _pod(network, "kafka", "broker"), _pod(network, "postgres", "db")
    prometheus = _pod(network, "monitoring", "prometheus")
    central = k8s.CENTRAL_NAMESPACE
    connect = _pod(network, central, "connect")
    assert network.connects(_pod(network, central, "router"), broker, 9092)
    assert network.connects(connect, broker, 9092) and network.connects(connect, db, 5432)
    apply = _pod(network, central, "connectors-apply")
    assert network.connects(apply, connect, 8083) and network.connects(apply, db, 5432)
    assert not network.connects(_pod(network, central, "router"), connect, 8083)
    for name, port in [("router", 9100), ("exporter", 9308)]:
        assert network.connects(prometheus, _pod(network, central, name), port)
    for region in settings.region_names:
        ns = k8s.region_namespace(region)
        worker, model = _pod(network, ns, "feature-worker"), _pod(network, ns, "model-worker")
        assert network.connects(worker, broker, 9092)
        assert network.connects(prometheus, worker, 9100)
        assert network.connects(prometheus, model, 8000)
        assert network.connects(_pod(network, f"shop-{region}", "serving"), model, 8000)
        assert not network.connects(_pod(network, "default", "stranger"), model, 8000)
        for other in settings.region_names:
            if other != region:
                assert not network.connects(_pod(network, f"shop-{other}", "serving"), model, 8000)


def test_the_hosts_the_settings_name_are_services_where_they_are_used(
    rendered: dict[str, list[dict[str, Any]]], settings: EdgefeedSettings
) -> None:
    from urllib.parse import urlsplit

    def services(overlay: str) -> set[str]:
        return {d["metadata"]["name"] for d in rendered[overlay] if d["kind"] == "Service"}

    central = services("central")
    assert {settings.database.host, urlsplit(settings.connect.url).hostname} <= central
    for region in settings.region_names:
        host = urlsplit(settings.region(region).redis_url).hostname
        assert host in services(region), region
    # Kafka by the bootstrap Service's full name (in the brokers' certificates), in
    # the namespace the NetworkPolicies let Kafka clients reach on that port.
    for overlay in rendered:
        for server in pod_settings_of(rendered[overlay]).kafka.bootstrap_servers:
            host, _, port = server.rpartition(":")
            assert host.endswith(".kafka.svc") and port == "9092", (overlay, server)


def test_the_image_holds_every_package_and_runs_as_nobody() -> None:
    """deploy/edgefeed.Dockerfile, the one image of every role."""
    import tomllib

    dockerfile = (ROOT / "deploy" / "edgefeed.Dockerfile").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = project["tool"]["mypy"]["packages"]
    copied = set(re.findall(r"^COPY (\S+) \1$", dockerfile, re.MULTILINE))
    assert set(packages) <= copied, f"not copied into the image: {set(packages) - copied}"
    users = re.findall(r"^USER (\S+)$", dockerfile, re.MULTILINE)
    assert users and users[-1].isdigit() and int(users[-1]) > 0


def test_scraped_series_carry_the_job_names_the_alerts_use(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    alerts = ALERTS.read_text()
    for overlay, docs in rendered.items():
        monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
        assert monitors, overlay
        for monitor in monitors:
            label = monitor["spec"]["jobLabel"]
            selector = monitor["spec"]["selector"]
            for service in (d for d in docs if d["kind"] == "Service"):
                labels = service["metadata"].get("labels", {})
                if all(labels.get(k) == v for k, v in selector["matchLabels"].items()):
                    assert label in labels, f"{overlay}: Service/{service['metadata']['name']}"
                    if labels["app.kubernetes.io/name"] == "exporter":
                        assert f'job="{labels[label]}"' in alerts


def test_the_deploy_command_writes_then_checks(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    runner = CliRunner()
    base = ["--settings", str(SETTINGS), "deploy", "k8s", "--out", str(tmp_path / "k8s")]
    base += ["--alerts", str(ALERTS), "--dashboard", str(DASHBOARD)]
    stale = runner.invoke(app, [*base, "--check"])
    assert stale.exit_code == 1
    assert "missing: overlays/eu-west/kustomization.yaml" in stale.output
    wrote = runner.invoke(app, base)
    assert wrote.exit_code == 0, wrote.output
    assert (tmp_path / "k8s" / "base" / "common" / "edgefeed.yaml").read_text() == (
        k8s.kubernetes_settings_text(SETTINGS.read_text())
    )
    fresh = runner.invoke(app, [*base, "--check"])
    # (rich wraps at the console's width: a long tmp path may break the phrase's line)
    assert fresh.exit_code == 0 and "up to date" in " ".join(fresh.output.split())


# -- Kafka ACLs: the router is the only writer of the regional topics -------------

#: Operations that imply another (Kafka's authorizer: Read, Write, Delete or Alter
#: imply Describe; AlterConfigs implies DescribeConfigs; All implies everything).
_IMPLIES = {
    "Describe": {"Read", "Write", "Delete", "Alter"},
    "DescribeConfigs": {"AlterConfigs"},
}


def _acl_matches(acl: Mapping[str, Any], kind: str, name: str, operation: str) -> bool:
    resource = acl["resource"]
    if resource["type"] != kind:
        return False
    wanted = resource.get("name", "*")
    if resource.get("patternType", "literal") == "prefix":
        named = name.startswith(wanted)
    else:
        named = wanted in {name, "*"}
    ops = set(acl.get("operations", [])) | ({acl["operation"]} if "operation" in acl else set())
    return named and bool(ops & {operation, "All", *_IMPLIES.get(operation, set())})


def kafka_allows(user: Mapping[str, Any], kind: str, name: str, operation: str) -> bool:
    """Whether a KafkaUser's simple ACLs let it do ``operation`` on a resource, as
    Kafka's StandardAuthorizer decides: a matching deny wins, else a matching allow."""
    acls = user["spec"].get("authorization", {}).get("acls", [])
    hits = [a for a in acls if _acl_matches(a, kind, name, operation)]
    return bool(hits) and not any(a.get("type", "allow") == "deny" for a in hits)


def kafka_users(rendered: Mapping[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Every KafkaUser of the cluster (central and the CPU overlays), by principal name."""
    out: dict[str, dict[str, Any]] = {}
    for overlay, docs in rendered.items():
        if overlay.endswith("-gpu"):
            continue  # the same namespace and objects as its CPU overlay
        for doc in docs:
            if doc["kind"] == "KafkaUser":
                name = doc["metadata"]["name"]
                assert name not in out, f"two KafkaUsers {name}: one principal, two roles"
                out[name] = doc
    return out


def kafka_identities(
    rendered: Mapping[str, list[dict[str, Any]]],
) -> dict[tuple[str, str, str], set[str]]:
    """(overlay, namespace, workload) -> the KafkaUsers whose Secret its pods mount."""
    users = {
        (d["metadata"]["namespace"], d["metadata"]["name"])
        for docs in rendered.values()
        for d in docs
        if d["kind"] == "KafkaUser"
    }
    out: dict[tuple[str, str, str], set[str]] = {}
    for overlay, doc in objects(rendered):
        spec = pod_specs(doc)
        if spec is None:
            continue
        ns = doc["metadata"]["namespace"]
        mounted = set()
        for volume in spec.get("volumes", []):
            sources = [{"secret": volume["secret"]}] if "secret" in volume else []
            sources += volume.get("projected", {}).get("sources", [])
            for source in sources:
                secret = source.get("secret", {})
                name = secret.get("name") or secret.get("secretName")
                if (ns, name) in users:
                    mounted.add(name)
        out[(overlay, ns, doc["metadata"]["name"])] = mounted
    return out


def regional_writers(
    rendered: Mapping[str, list[dict[str, Any]]], settings: EdgefeedSettings
) -> dict[str, set[str]]:
    """Region -> the workloads whose principal may Write its regional topic."""
    users = kafka_users(rendered)
    identities = {
        (ns, name): found
        for (overlay, ns, name), found in kafka_identities(rendered).items()
        if not overlay.endswith("-gpu")
    }
    out = {}
    for region in settings.region_names:
        topic = settings.pipeline.region_topic(region)
        principals = {n for n, u in users.items() if kafka_allows(u, "topic", topic, "Write")}
        workloads = {
            f"{ns}/{name}" for (ns, name), found in identities.items() if found & principals
        }
        # A principal no pod mounts still counts: anyone holding its certificate writes.
        out[region] = workloads | {
            f"KafkaUser/{n}" for n in principals - set().union(*identities.values())
        }
    return out


def test_the_router_alone_writes_the_regional_topics(
    rendered: dict[str, list[dict[str, Any]]], settings: EdgefeedSettings
) -> None:
    writers = regional_writers(rendered, settings)
    assert set(writers) == set(settings.region_names)
    for region, found in writers.items():
        assert found == {"edgefeed/router"}, f"{settings.pipeline.region_topic(region)}: {found}"


def test_the_writers_check_sees_a_prefix_acl(
    rendered: dict[str, list[dict[str, Any]]], settings: EdgefeedSettings
) -> None:
    """A worker given Write on the topics' shared prefix becomes a writer of every region."""
    region = settings.region_names[0]
    loose = {k: yaml.safe_load(yaml.safe_dump(v)) for k, v in rendered.items()}
    worker = next(
        d for d in loose[region] if d["kind"] == "KafkaUser" and "worker" in d["metadata"]["name"]
    )
    worker["spec"]["authorization"]["acls"].append(
        {
            "resource": {"type": "topic", "name": "edgefeed.", "patternType": "prefix"},
            "operations": ["All"],
        }
    )
    writers = regional_writers(loose, settings)
    for other in settings.region_names:
        assert f"edgefeed-{region}/feature-worker" in writers[other]
    # A deny on the same topics takes it back (Kafka: deny wins).
    deny = {"type": "topic", "name": "edgefeed.region.", "patternType": "prefix"}
    worker["spec"]["authorization"]["acls"].append(
        {"type": "deny", "resource": deny, "operations": ["Write"]}
    )
    assert regional_writers(loose, settings) == regional_writers(rendered, settings)


def test_a_region_reads_only_its_own_topic(
    rendered: dict[str, list[dict[str, Any]]], settings: EdgefeedSettings
) -> None:
    """Every principal of a region's namespace (its workers', its exporter's) reads its
    own regional topic at most; the feature workers read it and their group."""
    users = {
        d["metadata"]["name"]: (d["metadata"]["namespace"], d)
        for region in settings.region_names
        for d in rendered[region]
        if d["kind"] == "KafkaUser"
    }
    names = settings.pipeline.names
    for region in settings.region_names:
        ns = k8s.region_namespace(region)
        mine = {n: u for n, (where, u) in users.items() if where == ns}
        assert mine, region
        for other in settings.region_names:
            topic = names.region_topic(other)
            for name, user in mine.items():
                if other != region:
                    assert not kafka_allows(user, "topic", topic, "Read"), (name, topic)
                    assert not kafka_allows(user, "group", names.region_group(other), "Read")
                assert not kafka_allows(user, "topic", topic, "Write"), (name, topic)
        worker = mine[k8s.kafka_user_name("feature-worker", region)]
        assert kafka_allows(worker, "topic", names.region_topic(region), "Read")
        assert kafka_allows(worker, "group", names.region_group(region), "Read")
        assert kafka_allows(worker, "topic", names.changelog_topic(region), "Write")
        assert kafka_allows(worker, "topic", names.region_dead_letter_topic(region), "Write")
        # No state or dead letter of another region, not even the central dead letters.
        assert not kafka_allows(worker, "topic", names.dead_letter_topic, "Write")
        for other in set(settings.region_names) - {region}:
            assert not kafka_allows(worker, "topic", names.changelog_topic(other), "Read")
            assert not kafka_allows(worker, "topic", names.region_dead_letter_topic(other), "Read")


def test_the_roles_have_what_they_need(
    rendered: dict[str, list[dict[str, Any]]], settings: EdgefeedSettings
) -> None:
    users = kafka_users(rendered)
    names = settings.pipeline.names
    router = users[k8s.kafka_user_name("router")]
    topics = settings.topic_of_table().values()  # the Debezium topics the router reads
    assert topics
    for topic in topics:
        assert kafka_allows(router, "topic", topic, "Read"), topic
        assert kafka_allows(users[k8s.kafka_user_name("connect")], "topic", topic, "Write")
        assert not kafka_allows(router, "topic", topic, "Write"), topic
    for topic in [
        names.homes_changelog_topic,
        names.history_topic,
        *names.dead_letter_topics(settings.region_names),
    ]:
        assert kafka_allows(router, "topic", topic, "Write"), topic
    assert kafka_allows(router, "group", names.router_group, "Read")
    exporter = users[k8s.kafka_user_name("exporter")]
    assert kafka_allows(exporter, "group", names.region_group(settings.region_names[0]), "Describe")
    assert not any(
        kafka_allows(user, "cluster", "kafka-cluster", op)
        for user in users.values()
        for op in ("Alter", "AlterConfigs", "ClusterAction")
    )


def test_every_kafka_client_mounts_one_certificate(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """Pods labelled as Kafka clients mount the Secret of exactly one KafkaUser of their
    namespace, at the one path the settings' kafka.security names; no other pod mounts
    one; every KafkaUser has its pods (no certificate made for nobody)."""
    identities = kafka_identities(rendered)
    used = set()
    for overlay, doc in objects(rendered):
        spec = pod_specs(doc)
        if spec is None:
            continue
        key = (overlay, doc["metadata"]["namespace"], doc["metadata"]["name"])
        labels = doc["spec"]["template"]["metadata"]["labels"]
        found = identities[key]
        if labels.get("edgefeed.io/kafka-client") != "true":
            assert not found, f"{key}: mounts {found} but is no Kafka client"
            continue
        assert len(found) == 1, f"{key}: {found}"
        used |= {(key[1], name) for name in found}
        mounts = {
            m["mountPath"]: m["name"] for c in spec["containers"] for m in c.get("volumeMounts", [])
        }
        volume = mounts.get(k8s.KAFKA_CERT_DIR)
        assert volume, f"{key}: nothing at {k8s.KAFKA_CERT_DIR}"
        (vol,) = [v for v in spec["volumes"] if v["name"] == volume]
        paths = {
            item["path"]
            for source in vol["projected"]["sources"]
            for item in source["secret"]["items"]
        }
        assert paths == set(k8s.KAFKA_FILES), key
    # KEDA's principals have no pod: their certificates go to KEDA's operator.
    used |= {
        (d["metadata"]["namespace"], ref["name"])
        for docs in rendered.values()
        for d in docs
        if d["kind"] == "TriggerAuthentication"
        for ref in d["spec"].get("secretTargetRef", [])
        if ref["parameter"] == "cert"
    }
    declared = {
        (d["metadata"]["namespace"], d["metadata"]["name"])
        for docs in rendered.values()
        for d in docs
        if d["kind"] == "KafkaUser"
    }
    assert declared == used


@pytest.mark.parametrize("prefix", ["edgefeed.region", "edgefeed.region.shop", "edgefeed"])
def test_a_source_prefix_over_the_regional_topics_is_refused(prefix: str) -> None:
    """Connect's Write on its source topics' prefix would make it a regional writer."""
    text = SETTINGS.read_text(encoding="utf-8")
    source = "  - name: shop "
    assert source in text
    text = text.replace(source, f"  - topic_prefix: {prefix}\n    name: shop ", 1)
    with pytest.raises(SettingsError, match="overlaps the regional topics"):
        k8s.render(_inputs(text))


# -- every Kafka client connects with mutual TLS, as shipped -------------------------

#: Connect's Kafka clients: the worker itself, the connectors' producers, the
#: sink consumers, the admin client that creates topics.
_CONNECT_CLIENTS = ("", "producer.", "consumer.", "admin.")


def _connect_properties(container: Mapping[str, Any]) -> dict[str, str]:
    """The worker properties the Debezium image writes from ``CONNECT_*`` (``_`` -> ``.``);
    a value from a Secret reads ``secretKeyRef:<name>/<key>``."""
    props = {}
    for env in container.get("env", []):
        if env["name"].startswith("CONNECT_"):
            key = env["name"].removeprefix("CONNECT_").lower().replace("_", ".")
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            props[key] = f"secretKeyRef:{ref['name']}/{ref['key']}" if ref else env["value"]
    return props


def _edgefeed_tls_problems(
    where: str, docs: Sequence[dict[str, Any]], spec: dict[str, Any], container: dict[str, Any]
) -> list[str]:
    security = container_settings(docs, spec, container).kafka.security
    files = mounted_files(docs, spec, container)
    problems = []
    if not security.protocol.endswith("SSL") or None in (
        security.ca_file,
        security.cert_file,
        security.key_file,
    ):
        problems.append(f"{where}: connects without TLS client auth ({security.protocol})")
    for field in ("ca_file", "cert_file", "key_file", "keystore_file", "keystore_password_file"):
        path = getattr(security, field)
        if path is not None and str(path) not in files:
            problems.append(
                f"{where}: kafka.security.{field} {path}: no mounted volume provides it"
            )
    return problems


def _connect_tls_problems(
    where: str, docs: Sequence[dict[str, Any]], spec: dict[str, Any], container: dict[str, Any]
) -> list[str]:
    props = _connect_properties(container)
    files = mounted_files(docs, spec, container)
    allowed = []
    if "dir" in props.get("config.providers", "").split(","):
        allowed = props.get("config.providers.dir.param.allowed.paths", "").split(",")
    problems = []
    for prefix in _CONNECT_CLIENTS:
        client = f"{where} ({prefix or 'worker.'}*)"
        if props.get(f"{prefix}security.protocol") != "SSL":
            problems.append(f"{client}: connects without TLS")
        for store in ("keystore", "truststore"):
            location = props.get(f"{prefix}ssl.{store}.location")
            if location not in files:
                problems.append(f"{client}: {store} {location}: no mounted volume provides it")
        password = props.get(f"{prefix}ssl.keystore.password", "")
        reference = _PROVIDER_REFERENCE.match(password)
        if password.startswith("secretKeyRef:"):
            continue
        if reference is None:
            problems.append(f"{client}: the key store password is no reference to a file")
        elif not any(Path(reference[1]).is_relative_to(a) for a in allowed if a):
            problems.append(f"{client}: {reference[1]} is no folder the dir provider may read")
        elif f"{reference[1]}/{reference[2]}" not in files:
            problems.append(f"{client}: {password}: no mounted volume provides it")
    return problems


def kafka_tls_problems(docs: Sequence[dict[str, Any]]) -> list[str]:
    """Why a Kafka client pod of an overlay would not connect with a client certificate:
    its settings (edgefeed's image) or its worker properties (Connect's) lack mutual TLS,
    or name a certificate, key, key store or password that no mounted volume provides."""
    problems = []
    for doc in docs:
        spec = pod_specs(doc)
        labels = doc["spec"]["template"]["metadata"]["labels"] if spec else {}
        if spec is None or labels.get("edgefeed.io/kafka-client") != "true":
            continue
        for container in _containers(spec):
            where = f"{doc['kind']}/{doc['metadata']['name']} container {container['name']}"
            image = container["image"]
            if image.startswith("edgefeed:"):
                problems += _edgefeed_tls_problems(where, docs, spec, container)
            elif image.startswith("quay.io/debezium/connect:"):
                problems += _connect_tls_problems(where, docs, spec, container)
            else:
                problems.append(f"{where}: a Kafka client of unknown kind ({image})")
    return problems


def test_every_kafka_client_presents_its_certificate(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    seen = 0
    for overlay, docs in rendered.items():
        assert kafka_tls_problems(docs) == [], overlay
        seen += sum(
            1
            for d in docs
            if pod_specs(d)
            and d["spec"]["template"]["metadata"]["labels"].get("edgefeed.io/kafka-client")
        )
    assert seen >= 3 + 2 * 6  # router, Connect, exporter; per region overlay workers, exporter


def test_only_the_labelled_kafka_clients_reach_the_brokers(network: Network) -> None:
    """The pods the TLS check reads (labelled Kafka clients) are every pod the
    NetworkPolicies let reach the brokers: none escapes it by a missing label."""
    broker = _pod(network, "kafka", "broker")
    reaching = {
        (p.namespace, p.name)
        for p in network.pods
        if p.namespace.startswith("edgefeed") and network.connects(p, broker, 9092)
    }
    labelled = {
        (p.namespace, p.name)
        for p in network.pods
        if p.label_map.get("edgefeed.io/kafka-client") == "true"
    }
    assert reaching == labelled
    assert {("edgefeed", "router"), ("edgefeed", "connect")} <= reaching


def _set_security(docs: list[dict[str, Any]], **security: Any) -> None:
    for doc in docs:
        if doc["kind"] == "ConfigMap" and "edgefeed.yaml" in doc.get("data", {}):
            data = yaml.safe_load(doc["data"]["edgefeed.yaml"])
            data["kafka"]["security"] = security
            doc["data"]["edgefeed.yaml"] = yaml.safe_dump(data)


def _connect_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    container: dict[str, Any] = find(docs, "Deployment", "connect")["spec"]["template"]["spec"][
        "containers"
    ][0]
    return container


def _drop_env(docs: list[dict[str, Any]], name: str) -> None:
    container = _connect_container(docs)
    container["env"] = [e for e in container["env"] if e["name"] != name]


def _set_env(docs: list[dict[str, Any]], name: str, value: str) -> None:
    for env in _connect_container(docs)["env"]:
        if env["name"] == name:
            env["value"] = value


def _drop_item(docs: list[dict[str, Any]], path: str) -> None:
    spec = find(docs, "Deployment", "connect")["spec"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "kafka"]
    for source in volume["projected"]["sources"]:
        source["secret"]["items"] = [i for i in source["secret"]["items"] if i["path"] != path]


_TLS = k8s.kafka_security()


@pytest.mark.parametrize(
    ("break_it", "expected"),
    [
        (lambda d: _set_security(d), "router container router: connects without TLS client"),
        (
            lambda d: _set_security(d, protocol="SSL", ca_file=_TLS["ca_file"]),
            "exporter container exporter: connects without TLS client auth (SSL)",
        ),
        (
            lambda d: _set_security(d, **{**_TLS, "cert_file": "/run/secrets/kafka/tls.crt"}),
            "kafka.security.cert_file /run/secrets/kafka/tls.crt: no mounted volume",
        ),
        (
            lambda d: _drop_env(d, "CONNECT_PRODUCER_SECURITY_PROTOCOL"),
            "connect (producer.*): connects without TLS",
        ),
        (
            lambda d: _drop_env(d, "CONNECT_ADMIN_SSL_KEYSTORE_LOCATION"),
            "connect (admin.*): keystore None",
        ),
        (lambda d: _drop_item(d, "user.p12"), "connect (worker.*): keystore /run/secrets/kafka"),
        (
            lambda d: _set_env(d, "CONNECT_CONSUMER_SSL_KEYSTORE_PASSWORD", "changeit"),
            "connect (consumer.*): the key store password is no reference",
        ),
        (
            lambda d: _set_env(d, "CONNECT_CONFIG_PROVIDERS_DIR_PARAM_ALLOWED_PATHS", "/run/x"),
            "is no folder the dir provider may read",
        ),
    ],
    ids=[
        "plaintext",
        "tls-without-certificate",
        "certificate-not-mounted",
        "connect-producer-plaintext",
        "connect-admin-no-keystore",
        "connect-keystore-not-mounted",
        "connect-password-in-plain-text",
        "connect-provider-may-not-read",
    ],
)
def test_the_tls_check_sees_a_client_without_its_certificate(
    rendered: dict[str, list[dict[str, Any]]], break_it: Any, expected: str
) -> None:
    docs = copy.deepcopy(rendered["central"])
    break_it(docs)
    problems = kafka_tls_problems(docs)
    assert any(expected in problem for problem in problems), problems


def test_connect_presents_its_key_store_and_its_connectors_use_the_workers_clients(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """Connect's worker, producers, consumers and admin client present the PKCS12 key
    store of Connect's KafkaUser; the connectors cannot override them, and the
    Debezium connector's config names no Kafka client setting of its own (the
    PostgreSQL connector keeps no schema history topic; its records, heartbeats and
    snapshot notifications go through the worker's producer)."""
    from connectors.config import render_connector_config

    docs = rendered["central"]
    container = _connect_container(list(docs))
    props = _connect_properties(container)
    files = mounted_files(
        docs, find(docs, "Deployment", "connect")["spec"]["template"]["spec"], container
    )
    for prefix in _CONNECT_CLIENTS:
        assert props[f"{prefix}ssl.keystore.type"] == "PKCS12"
        location = props[f"{prefix}ssl.keystore.location"]
        assert files[location] == ("secret", k8s.kafka_user_name("connect"), "user.p12")
        password = _PROVIDER_REFERENCE.match(props[f"{prefix}ssl.keystore.password"])
        assert password is not None
        assert files[f"{password[1]}/{password[2]}"] == (
            "secret",
            k8s.kafka_user_name("connect"),
            "user.password",
        )
        assert files[props[f"{prefix}ssl.truststore.location"]][1] == "edgefeed-cluster-ca-cert"
    assert props["connector.client.config.override.policy"] == "None"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["BOOTSTRAP_SERVERS"] == k8s.KAFKA_BOOTSTRAP
    settings = pod_settings_of(docs)
    assert settings.sources
    for source in settings.sources:
        config = render_connector_config(settings.database, source)
        kafka_keys = [
            key
            for key in config
            if key.startswith(("producer.", "consumer.", "admin.", "schema.history"))
            or "ssl." in key
            or key in {"bootstrap.servers", "security.protocol"}
        ]
        assert kafka_keys == [], source.name


def test_the_compose_stack_stays_plaintext(settings: EdgefeedSettings) -> None:
    """The Kubernetes settings take mutual TLS; the compose file they come from does
    not (docker-compose.yml runs Apache Kafka with a PLAINTEXT listener)."""
    assert settings.kafka.security.protocol == "PLAINTEXT"
    kafka = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["kafka"]
    assert "PLAINTEXT://kafka:9092" in kafka["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    assert settings.kafka.bootstrap_servers == ["kafka:9092"]


# -- KEDA's Kafka scaler: its own principal, offsets only ----------------------------


def test_keda_reads_the_lag_with_its_own_certificate(
    rendered: dict[str, list[dict[str, Any]]], settings: EdgefeedSettings
) -> None:
    for region in settings.region_names:
        for overlay in (region, f"{region}-gpu"):
            docs = rendered[overlay]
            (trigger,) = find(docs, "ScaledObject", "feature-worker")["spec"]["triggers"]
            auth = find(docs, "TriggerAuthentication", trigger["authenticationRef"]["name"])
            spec = auth["spec"]
            (tls,) = spec["configMapTargetRef"]
            assert tls["parameter"] == "tls"
            assert find(docs, "ConfigMap", tls["name"])["data"][tls["key"]] == "enable"
            refs = {r["parameter"]: (r["name"], r["key"]) for r in spec["secretTargetRef"]}
            user = k8s.kafka_user_name("keda", region)
            assert refs == {
                "ca": ("edgefeed-cluster-ca-cert", "ca.crt"),
                "cert": (user, "user.crt"),
                "key": (user, "user.key"),
            }, overlay
            keda = find(docs, "KafkaUser", user)
            assert keda["spec"]["authentication"] == {"type": "tls"}
            # KEDA's operator runs in its own namespace: a name that resolves from there.
            assert trigger["metadata"]["bootstrapServers"] == k8s.KAFKA_BOOTSTRAP
            assert pod_settings_of(docs).kafka.bootstrap_servers == [k8s.KAFKA_BOOTSTRAP]


def test_keda_reads_offsets_only_and_writes_nothing(
    rendered: dict[str, list[dict[str, Any]]], settings: EdgefeedSettings
) -> None:
    users = kafka_users(rendered)
    names = settings.pipeline.names
    operations = [
        "Read", "Write", "Create", "Delete", "Alter", "AlterConfigs", "DescribeConfigs",
        "IdempotentWrite",
    ]  # fmt: skip
    for region in settings.region_names:
        keda = users[k8s.kafka_user_name("keda", region)]
        topic, group = names.region_topic(region), names.region_group(region)
        assert kafka_allows(keda, "topic", topic, "Describe")
        assert kafka_allows(keda, "group", group, "Describe")
        for other in settings.region_names:
            resources = [
                ("topic", names.region_topic(other)),
                ("group", names.region_group(other)),
                ("topic", names.changelog_topic(other)),
                ("topic", names.region_dead_letter_topic(other)),
            ]
            for kind, name in resources:
                for operation in operations:
                    assert not kafka_allows(keda, kind, name, operation), (region, name, operation)
                if other != region:
                    assert not kafka_allows(keda, kind, name, "Describe"), (region, name)
        for topic in [names.dead_letter_topic, *settings.topic_of_table().values()]:
            assert not kafka_allows(keda, "topic", topic, "Describe"), (region, topic)
        assert not any(
            kafka_allows(keda, "cluster", "kafka-cluster", op)
            for op in ("Alter", "AlterConfigs", "ClusterAction", "IdempotentWrite", "Create")
        )


@pytest.mark.parametrize(
    "text",
    [
        "regions:\n  - {name: eu, redis_url: 'redis://redis-eu:6379/0'}\n",
        "# top\nregions:\n  - {name: eu, redis_url: 'redis://redis-eu:6379/0'}\n"
        "kafka:\n  client_id: x  # kept\n  security: {protocol: SASL_SSL}\n",
        "kafka: {client_id: x}\n# about the regions\nregions:\n"
        "  - {name: eu, redis_url: 'redis://redis-eu:6379/0'}\n",
    ],
    ids=["no-kafka-block", "kafka-block-last", "flow-kafka-block"],
)
def test_the_kubernetes_settings_keep_the_file_but_its_kafka_connection(text: str) -> None:
    out = k8s.kubernetes_settings_text(text)
    before, after = yaml.safe_load(text), yaml.safe_load(out)
    assert after["kafka"]["security"] == k8s.kafka_security()
    assert after["kafka"]["bootstrap_servers"] == k8s.KAFKA_BOOTSTRAP
    assert after["kafka"].get("client_id") == (before.get("kafka") or {}).get("client_id")
    assert {k: v for k, v in after.items() if k != "kafka"} == {
        k: v for k, v in before.items() if k != "kafka"
    }
    for line in text.splitlines():
        if line.startswith("#"):
            assert line in out.splitlines()
