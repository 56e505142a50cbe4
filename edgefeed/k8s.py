"""The Kubernetes manifests' generated parts, written from the settings file.

deploy/k8s holds a kustomize base per namespace kind (``base/central``,
``base/region``, the shared ``base/common`` component) written by hand, and
the parts that follow from the settings, written here:

- ``base/common/edgefeed.yaml``: the settings file the compose stack reads
  (deploy/edgefeed.compose.yaml), its text kept but for the ``kafka:`` block,
  which takes Kubernetes' Kafka connection (:func:`kubernetes_settings_text`):
  the Strimzi cluster's bootstrap Service and mutual TLS with the certificate
  every Kafka client pod mounts at :data:`KAFKA_CERT_DIR` (the pods read it
  from the ConfigMap ``edgefeed-settings``).
- ``base/central/prometheusrule.yaml`` (deploy/prometheus/alerts.yml as a
  PrometheusRule, for the Prometheus operator), ``base/central/alerts.yml``
  (the same file, as the ConfigMap ``edgefeed-prometheus-rules`` for a
  Prometheus without the operator) and ``base/central/dashboards/edgefeed.json``
  (Grafana).
- ``overlays/central`` and, per region of the settings, ``overlays/<region>``
  (namespace ``edgefeed-<region>``, the region's name in every argument, the
  KEDA trigger's topic and consumer group, ``maxReplicaCount`` = the regional
  topic's partitions, the Redis Service named after the ``redis_url`` host)
  and ``overlays/<region>-gpu`` (the same with the model workers on an NVIDIA
  GPU).
- ``overlays/central/kafkausers.yaml`` and ``overlays/<region>/kafkausers.yaml``:
  a Strimzi ``KafkaUser`` per role that talks to Kafka (mutual TLS, simple
  ACLs), with the topic and group names of the settings: the router alone may
  write the regional topics (:func:`kafka_users`); KEDA's Kafka scaler has its
  own per region, which it presents through the TriggerAuthentication of
  ``overlays/<region>/keda.yaml``.
- ``overlays/central/kafka.yaml``: the ``kafka`` volume of the central Kafka
  clients (their KafkaUser's certificate, key and key store, the cluster CA)
  and Kafka Connect's client settings (``CONNECT_*``: the same mutual TLS,
  from :meth:`KafkaSecuritySettings.java_properties`).

:func:`render` is pure: it maps the inputs to ``{relative path: text}``;
``edgefeed deploy k8s`` writes the files or, with ``--check``, reports the
files that differ (the test suite runs the check, so a region added to the
settings without regenerating fails the build).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from connectors.secrets import is_secret_key, url_secrets
from edgefeed.settings import EdgefeedSettings, SettingsError
from pipeline.settings import KafkaSecuritySettings

__all__ = [
    "CENTRAL_NAMESPACE",
    "GENERATED_NOTE",
    "KAFKA_BOOTSTRAP",
    "KAFKA_CERT_DIR",
    "KAFKA_CLUSTER",
    "KAFKA_FILES",
    "KEDA_KAFKA_AUTH",
    "K8sInputs",
    "connect_env",
    "diff",
    "inline_secrets",
    "kafka_security",
    "kafka_user_name",
    "kafka_users",
    "kubernetes_settings_text",
    "region_namespace",
    "render",
    "write",
]

CENTRAL_NAMESPACE = "edgefeed"
GENERATED_NOTE = "# Written by `edgefeed deploy k8s` from the settings file: do not edit.\n"
#: The Strimzi Kafka cluster (its bootstrap Service is ``<cluster>-kafka-bootstrap``,
#: base/*/externals.yaml) whose User Operator turns the KafkaUsers into ACLs.
KAFKA_CLUSTER = "edgefeed"
#: Where every Kafka client pod finds its certificate, key and the cluster CA
#: (``kafka.security``'s cert_file, key_file and ca_file point here).
KAFKA_CERT_DIR = "/run/secrets/kafka"
#: The Strimzi cluster's bootstrap Service, by a name that resolves from any
#: namespace (KEDA's too) and that Strimzi writes into the brokers' certificates;
#: its TLS listener with client authentication is on 9092, the port the
#: NetworkPolicies open to the ``kafka`` namespace.
KAFKA_BOOTSTRAP = f"{KAFKA_CLUSTER}-kafka-bootstrap.kafka.svc:9092"
#: What the ``kafka`` volume holds, by file name: (Secret, key in it). ``None``
#: names the pod's own KafkaUser Secret (``user.p12`` and ``user.password``:
#: the same certificate and key as a PKCS12 key store, for Kafka Connect).
KAFKA_FILES: dict[str, tuple[str | None, str]] = {
    "user.crt": (None, "user.crt"),
    "user.key": (None, "user.key"),
    "user.p12": (None, "user.p12"),
    "user.password": (None, "user.password"),
    "ca.crt": (f"{KAFKA_CLUSTER}-cluster-ca-cert", "ca.crt"),
}


def kafka_security() -> dict[str, str]:
    """``kafka.security`` of the pods: mutual TLS with the mounted KafkaUser certificate.

    The Python clients present ``user.crt`` and ``user.key``, Kafka Connect the
    same pair as the key store ``user.p12``; all trust the cluster CA.
    """
    return {
        "protocol": "SSL",
        "ca_file": f"{KAFKA_CERT_DIR}/ca.crt",
        "cert_file": f"{KAFKA_CERT_DIR}/user.crt",
        "key_file": f"{KAFKA_CERT_DIR}/user.key",
        "keystore_file": f"{KAFKA_CERT_DIR}/user.p12",
        "keystore_password_file": f"{KAFKA_CERT_DIR}/user.password",
    }


_SETTINGS_NOTE = (
    "# deploy/edgefeed.compose.yaml (the compose stack's settings, PLAINTEXT to its local\n"
    "# broker) with Kubernetes' Kafka connection in `kafka:`: the Strimzi cluster's\n"
    "# bootstrap Service and mutual TLS with the KafkaUser certificate every Kafka\n"
    f'# client pod mounts at {KAFKA_CERT_DIR} (docs/deploy.md, "Kafka ACLs").\n'
)


def kubernetes_settings_text(text: str) -> str:
    """The settings the pods read: ``text`` with its ``kafka:`` block for Kubernetes.

    Everything but the top-level ``kafka:`` block is kept as written (comments
    too); the block keeps its keys but ``bootstrap_servers`` (:data:`KAFKA_BOOTSTRAP`)
    and ``security`` (:func:`kafka_security`, replacing any given).

    Raises:
        SettingsError: the text is no mapping, or its ``kafka:`` block could not
            be told apart from the rest (the result is checked by parsing it).
    """
    raw = yaml.safe_load(text)
    if not isinstance(raw, dict):
        raise SettingsError("the settings file must hold a mapping at the top level")
    given = raw.get("kafka") or {}
    if not isinstance(given, dict):
        raise SettingsError(f"settings key kafka must be a mapping, not {type(given).__name__}")
    kafka = {**given, "bootstrap_servers": KAFKA_BOOTSTRAP, "security": kafka_security()}
    block = yaml.safe_dump({"kafka": kafka}, sort_keys=False, width=100)
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.split(":", 1)[0].rstrip() == "kafka"]
    if starts:
        start = starts[0]
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i][:1] not in ("", " ", "\t", "\n")),
            len(lines),
        )
        body = [*lines[:start], block, "\n" if end < len(lines) else "", *lines[end:]]
    else:
        body = [block, "\n", *lines]
    out = GENERATED_NOTE + _SETTINGS_NOTE + "".join(body)
    if yaml.safe_load(out) != {**raw, "kafka": kafka}:
        raise SettingsError(
            "could not rewrite the settings' top-level kafka: block for Kubernetes; write it "
            "as a block mapping (`kafka:` on a line of its own, its keys indented below)"
        )
    return out


def region_namespace(region: str) -> str:
    """The namespace a region's workers, Redis and exporter live in."""
    return f"edgefeed-{region}"


@dataclass(frozen=True, slots=True)
class K8sInputs:
    """What the generated files are made of.

    Attributes:
        settings: The parsed settings (regions, partitions, topics, groups).
        settings_text: The settings file's exact text (copied into the ConfigMap).
        alerts_text: deploy/prometheus/alerts.yml.
        dashboard_text: deploy/grafana/dashboards/edgefeed.json.
        image_tag: The edgefeed image's tag (the package version).
    """

    settings: EdgefeedSettings
    settings_text: str
    alerts_text: str
    dashboard_text: str
    image_tag: str


def _dump(*docs: object) -> str:
    return GENERATED_NOTE + "---\n".join(
        yaml.safe_dump(doc, sort_keys=False, width=100) for doc in docs
    )


def _redis_host(region: str, url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or 6379
    if not host or "." in host:
        raise SettingsError(
            f"region {region!r}: redis_url host {host!r} is not a Service name of the region's "
            "namespace; deploy/k8s runs the region's Redis as a Service named after the host "
            "(e.g. redis://redis-eu-west:6379/0)"
        )
    return host, port


def _prometheus_rule(alerts_text: str) -> dict[str, object]:
    rules = yaml.safe_load(alerts_text)
    if not isinstance(rules, dict) or not isinstance(rules.get("groups"), list):
        raise SettingsError("deploy/prometheus/alerts.yml has no `groups:` list of rule groups")
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "edgefeed", "labels": {"release": "prometheus"}},
        "spec": {"groups": rules["groups"]},
    }


def _acl(
    kind: str, name: str, operations: list[str], pattern: str = "literal"
) -> dict[str, object]:
    return {
        "resource": {"type": kind, "name": name, "patternType": pattern},
        "operations": list(operations),  # a copy: no YAML anchors in the output
        "host": "*",
    }


def _kafka_user(name: str, role: str, acls: list[dict[str, object]]) -> dict[str, object]:
    return {
        "apiVersion": "kafka.strimzi.io/v1beta2",
        "kind": "KafkaUser",
        "metadata": {
            "name": name,
            "labels": {"strimzi.io/cluster": KAFKA_CLUSTER, "app.kubernetes.io/component": role},
        },
        "spec": {
            "authentication": {"type": "tls"},
            "authorization": {"type": "simple", "acls": acls},
        },
    }


#: What a Faust app does to a topic of its own (its changelogs, its assignor's topic).
_OWN = ["Read", "Write", "Create", "Describe", "DescribeConfigs"]
#: What a producer that may create its topic does.
_PRODUCE = ["Write", "Create", "Describe"]
_CONSUME = ["Read", "Describe"]


def kafka_users(settings: EdgefeedSettings, region: str | None = None) -> list[dict[str, object]]:
    """The KafkaUsers of the central namespace (``region=None``) or of a region's.

    One principal (``User:CN=<name>``) per role whose pods talk to Kafka, and
    one per region for KEDA's Kafka scaler (Describe on the region's group and
    topic). The router's is the only one with Write on the regional topics; a
    region's workers read their region's topic only and write their own
    changelog, assignor topic and dead letters (literal names: a prefix would
    reach a region named ``eu-west-2`` from ``eu-west``).
    """
    names = settings.pipeline.names
    sources = [f"{source.effective_topic_prefix}." for source in settings.sources]
    regional = f"{names.region_topic_prefix}."
    for prefix in sources:
        if prefix.startswith(regional) or regional.startswith(prefix):
            # Connect's Write on its source topics would cover the regional topics.
            raise SettingsError(
                f"a source's topic prefix {prefix[:-1]!r} overlaps the regional topics' "
                f"{names.region_topic_prefix!r}: Kafka Connect could write a region's topic"
            )
    if region is None:
        router = [
            *(_acl("topic", prefix, _CONSUME, "prefix") for prefix in sources),
            _acl("topic", f"{names.region_topic_prefix}.", _PRODUCE, "prefix"),
            _acl("topic", names.dead_letter_topic, _PRODUCE),
            _acl("topic", f"{names.dead_letter_topic}.", _PRODUCE, "prefix"),
            _acl("topic", f"{names.router_group}-", _OWN, "prefix"),
            _acl("group", names.router_group, _CONSUME),
        ]
        connect = [
            _acl("topic", "_edgefeed_connect_", _OWN, "prefix"),
            _acl("group", "edgefeed-connect", _CONSUME),
            *(_acl("topic", prefix, _PRODUCE, "prefix") for prefix in sources),
            *(
                _acl("topic", f"__debezium-heartbeat.{source.effective_topic_prefix}", _PRODUCE)
                for source in settings.sources
            ),
        ]
        exporter = [
            # Lag: every group's committed offsets and every topic's end offsets; the
            # records at the committed offsets of the router's and the regions'
            # groups (their timestamps); the central dead letters' reasons.
            _acl("group", f"{settings.pipeline.app_prefix}-", ["Describe"], "prefix"),
            _acl("topic", "*", ["Describe"]),
            *(_acl("topic", prefix, ["Read"], "prefix") for prefix in sources),
            _acl("topic", f"{names.region_topic_prefix}.", ["Read"], "prefix"),
            _acl("topic", names.dead_letter_topic, ["Read"]),
        ]
        return [
            _kafka_user("edgefeed-router", "router", router),
            _kafka_user("edgefeed-connect", "connect", connect),
            _kafka_user("edgefeed-exporter", "exporter", exporter),
        ]
    group = names.region_group(region)
    topic = names.region_topic(region)
    dead = names.region_dead_letter_topic(region)
    worker = [
        _acl("topic", topic, _CONSUME),
        _acl("group", group, _CONSUME),
        _acl("topic", names.changelog_topic(region), _OWN),
        _acl("topic", f"{group}-__assignor-__leader", _OWN),
        _acl("topic", dead, _PRODUCE),
    ]
    exporter = [
        # Its region's lag (own group, own topic's records) and the router's
        # progress on the source topics (offsets only: they hold every region's rows).
        _acl("group", group, ["Describe"]),
        _acl("group", names.router_group, ["Describe"]),
        _acl("topic", topic, _CONSUME),
        _acl("topic", dead, _CONSUME),
        *(_acl("topic", prefix, ["Describe"], "prefix") for prefix in sources),
    ]
    keda = [
        # KEDA's Kafka scaler: the group's committed offsets and the topic's
        # partitions and end offsets. Reads no record, writes nothing.
        _acl("group", group, ["Describe"]),
        _acl("topic", topic, ["Describe"]),
    ]
    return [
        _kafka_user(kafka_user_name("feature-worker", region), "feature-worker", worker),
        _kafka_user(kafka_user_name("exporter", region), "exporter", exporter),
        _kafka_user(kafka_user_name("keda", region), "keda", keda),
    ]


def kafka_user_name(role: str, region: str | None = None) -> str:
    """A role's KafkaUser, also the name of the Secret with its certificate."""
    return f"edgefeed-{role}" if region is None else f"edgefeed-{region}-{role}"


def _kafka_volume(user: str) -> dict[str, object]:
    """The ``kafka`` volume: the KafkaUser's certificate, key and key store, the cluster CA."""
    sources: dict[str, list[dict[str, str]]] = {}
    for path, (secret, key) in KAFKA_FILES.items():
        sources.setdefault(secret or user, []).append({"key": key, "path": path})
    return {
        "name": "kafka",
        "projected": {
            "sources": [
                {"secret": {"name": name, "items": items}} for name, items in sources.items()
            ]
        },
    }


def _kafka_volume_patch(
    name: str, user: str, container_env: tuple[str, list[dict[str, object]]] | None = None
) -> dict[str, object]:
    spec: dict[str, object] = {"volumes": [_kafka_volume(user)]}
    if container_env is not None:
        container, env = container_env
        spec["containers"] = [{"name": container, "env": env}]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {"template": {"spec": spec}},
    }


def connect_env() -> list[dict[str, object]]:
    """Kafka Connect's client settings, as the Debezium image takes them.

    The image writes ``CONNECT_<KEY>`` (``_`` for ``.``) into the worker's
    properties; ``BOOTSTRAP_SERVERS`` is its own. The worker, its producers
    (the connectors' records), consumers and admin client (topic creation) all
    use mutual TLS with the key store of :func:`kafka_security`; its password
    is a ``${dir:...}`` reference the worker's DirectoryConfigProvider resolves
    from the mounted file (base/central/connect.yaml allows ``/run/secrets``).
    """
    props = KafkaSecuritySettings.model_validate(kafka_security()).java_properties()
    env: list[dict[str, object]] = [{"name": "BOOTSTRAP_SERVERS", "value": KAFKA_BOOTSTRAP}]
    for key, value in props.items():
        env.append({"name": "CONNECT_" + key.upper().replace(".", "_"), "value": value})
    return env


def _container_patch(kind: str, name: str, container: str, command_line: str) -> dict[str, object]:
    args = command_line.split()
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": {"name": name},
        "spec": {"template": {"spec": {"containers": [{"name": container, "args": args}]}}},
    }


def _region_files(inputs: K8sInputs, region: str) -> dict[str, str]:
    settings = inputs.settings
    pipeline = settings.pipeline
    names = pipeline.names
    namespace = region_namespace(region)
    host, port = _redis_host(region, settings.region(region).redis_url)
    # KEDA's operator resolves the name from its own namespace: the full Service name.
    bootstrap = ",".join(settings.sites.bootstrap_of(region) or [KAFKA_BOOTSTRAP])
    partitions = pipeline.partitions
    base = f"overlays/{region}"
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": namespace,
        "resources": ["../../base/region", "redis-service.yaml", "kafkausers.yaml", "keda.yaml"],
        "labels": [{"pairs": {"edgefeed.io/region": region}, "includeSelectors": False}],
        "images": [{"name": "edgefeed", "newName": "edgefeed", "newTag": inputs.image_tag}],
        "patches": [{"path": "region.yaml"}],
    }
    redis_service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": host, "labels": {"app.kubernetes.io/name": "redis"}},
        "spec": {
            "selector": {"app.kubernetes.io/name": "redis"},
            "ports": [{"name": "redis", "port": port, "targetPort": "redis"}],
        },
    }
    serving = {"edgefeed.io/serving-region": region}
    patches: list[dict[str, object]] = [
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": "edgefeed-region", "labels": {"edgefeed.io/region": region}},
        },
        _container_patch(
            "Deployment",
            "feature-worker",
            "worker",
            f"pipeline run --region {region} --metrics-host 0.0.0.0 --metrics-port 9100 "
            "--metrics-token-file /run/secrets/metrics_token",
        ),
        _container_patch(
            "Deployment",
            "model-worker",
            "worker",
            f"workers serve --model ranker --region {region} --device auto --host 0.0.0.0 "
            "--port 8000 --auth-token-file /run/secrets/model_token",
        ),
        _container_patch(
            "Deployment",
            "exporter",
            "exporter",
            f"exporter --scope region:{region} --host 0.0.0.0 --port 9308 --interval 15 "
            "--token-file /run/secrets/metrics_token",
        ),
        _kafka_volume_patch("feature-worker", kafka_user_name("feature-worker", region)),
        _kafka_volume_patch("exporter", kafka_user_name("exporter", region)),
        {
            "apiVersion": "keda.sh/v1alpha1",
            "kind": "ScaledObject",
            "metadata": {"name": "feature-worker"},
            "spec": {
                # More consumers than partitions would sit idle.
                "maxReplicaCount": partitions,
                "triggers": [
                    {
                        "type": "kafka",
                        "authenticationRef": {"name": KEDA_KAFKA_AUTH},
                        "metadata": {
                            "bootstrapServers": bootstrap,
                            "consumerGroup": names.region_group(region),
                            "topic": pipeline.region_topic(region),
                            "lagThreshold": "2000",
                            "offsetResetPolicy": "earliest",
                            "allowIdleConsumers": "false",
                            "scaleToZeroOnInvalidOffset": "false",
                        },
                    }
                ],
            },
        },
        {
            "apiVersion": "keda.sh/v1alpha1",
            "kind": "ScaledObject",
            "metadata": {"name": "model-worker"},
            "spec": {"triggers": _model_triggers(namespace)},
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "redis"},
            "spec": {
                "ingress": [
                    {
                        "from": [
                            {"podSelector": {"matchLabels": {"edgefeed.io/redis-client": "true"}}},
                            {"namespaceSelector": {"matchLabels": serving}},
                        ],
                        "ports": [{"protocol": "TCP", "port": 6379}],
                    }
                ]
            },
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "model-worker"},
            "spec": {
                "ingress": [
                    {
                        "from": [{"namespaceSelector": {"matchLabels": serving}}],
                        "ports": [{"protocol": "TCP", "port": 8000}],
                    }
                ]
            },
        },
    ]
    gpu = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [f"../{region}"],
        "components": ["../../components/gpu"],
    }
    return {
        f"{base}/kustomization.yaml": _dump(kustomization),
        f"{base}/redis-service.yaml": _dump(redis_service),
        f"{base}/region.yaml": _dump(*patches),
        f"{base}/kafkausers.yaml": _dump(*kafka_users(settings, region)),
        f"{base}/keda.yaml": _dump(*_keda_auth(region)),
        f"overlays/{region}-gpu/kustomization.yaml": _dump(gpu),
    }


#: The TriggerAuthentication of each region's Kafka trigger, and the ConfigMap
#: that gives it ``tls: enable`` (TriggerAuthentication takes no literal values).
KEDA_KAFKA_AUTH = "feature-worker-kafka"


def _keda_auth(region: str) -> list[dict[str, object]]:
    """KEDA's mutual TLS to Kafka: its region's KafkaUser certificate and the cluster CA."""
    user = kafka_user_name("keda", region)
    ca_secret, ca_key = KAFKA_FILES["ca.crt"]
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": KEDA_KAFKA_AUTH},
            "data": {"tls": "enable"},
        },
        {
            "apiVersion": "keda.sh/v1alpha1",
            "kind": "TriggerAuthentication",
            "metadata": {"name": KEDA_KAFKA_AUTH},
            "spec": {
                "configMapTargetRef": [{"parameter": "tls", "name": KEDA_KAFKA_AUTH, "key": "tls"}],
                "secretTargetRef": [
                    {"parameter": "ca", "name": ca_secret, "key": ca_key},
                    {"parameter": "cert", "name": user, "key": "user.crt"},
                    {"parameter": "key", "name": user, "key": "user.key"},
                ],
            },
        },
    ]


def _model_triggers(namespace: str) -> list[dict[str, object]]:
    server = "http://prometheus-operated.monitoring.svc:9090"
    return [
        {
            "type": "prometheus",
            "metadata": {
                "serverAddress": server,
                "query": f'sum(edgefeed_worker_queue_depth{{namespace="{namespace}"}})',
                "threshold": "16",
                "metricType": "AverageValue",
            },
        },
        {
            "type": "prometheus",
            "metadata": {
                "serverAddress": server,
                "query": (
                    "histogram_quantile(0.99, sum by (le) (rate(edgefeed_worker_latency_seconds_"
                    f'bucket{{namespace="{namespace}", term="service"}}[2m])))'
                ),
                "threshold": "0.005",
                "metricType": "Value",
            },
        },
    ]


def inline_secrets(tree: Any, key: str = "") -> list[str]:
    """The keys of a parsed settings tree that hold a secret other than as a file.

    A secret value (``password: ...``), a secret from the environment
    (``password_env``: the pods get their secrets as files only) or a URL with
    a password. Returns the keys' dotted paths, never the values.
    """
    found: list[str] = []
    if isinstance(tree, Mapping):
        for name, value in tree.items():
            found += inline_secrets(value, f"{key}.{name}" if key else str(name))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            found += inline_secrets(value, f"{key}[{i}]")
    elif tree is not None:
        leaf = key.rsplit(".", 1)[-1].split("[", 1)[0]
        if (is_secret_key(leaf) and not leaf.endswith("_file")) or (
            isinstance(tree, str) and url_secrets(tree)
        ):
            found.append(key)
    return found


def render(inputs: K8sInputs) -> dict[str, str]:
    """Every generated file under deploy/k8s, by path relative to it.

    Raises:
        SettingsError: the settings hold a secret other than as a file (it
            would land in a ConfigMap), a region's Redis host cannot be a
            Service name, a source's topics would fall under the regional
            topics' prefix, the settings' ``kafka:`` block cannot be rewritten
            for Kubernetes (:func:`kubernetes_settings_text`), or the alert
            rules have no groups.
    """
    secrets = inline_secrets(yaml.safe_load(inputs.settings_text))
    if secrets:
        raise SettingsError(
            f"the settings hold secrets inline or from the environment ({', '.join(secrets)}); "
            "the manifests copy the settings into a ConfigMap and mount secrets as files: "
            "name each one by its *_file key (e.g. password_file: /run/secrets/pg_password)"
        )
    json.loads(inputs.dashboard_text)  # a broken dashboard fails here, not in Grafana
    files = {
        "base/common/edgefeed.yaml": kubernetes_settings_text(inputs.settings_text),
        "base/central/dashboards/edgefeed.json": inputs.dashboard_text,
        "base/central/prometheusrule.yaml": _dump(_prometheus_rule(inputs.alerts_text)),
        "base/central/alerts.yml": inputs.alerts_text,
        "overlays/central/kustomization.yaml": _dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namespace": CENTRAL_NAMESPACE,
                "resources": ["../../base/central", "kafkausers.yaml"],
                "images": [{"name": "edgefeed", "newName": "edgefeed", "newTag": inputs.image_tag}],
                "patches": [{"path": "kafka.yaml"}],
            }
        ),
        "overlays/central/kafkausers.yaml": _dump(*kafka_users(inputs.settings)),
        "overlays/central/kafka.yaml": _dump(
            _kafka_volume_patch("router", kafka_user_name("router")),
            _kafka_volume_patch("exporter", kafka_user_name("exporter")),
            _kafka_volume_patch("connect", kafka_user_name("connect"), ("connect", connect_env())),
        ),
    }
    for region in inputs.settings.region_names:
        files.update(_region_files(inputs, region))
    return files


def _generated_on_disk(root: Path) -> set[str]:
    """Region overlays on disk (a region removed from the settings leaves one)."""
    overlays = root / "overlays"
    if not overlays.is_dir():
        return set()
    found = set()
    for path in overlays.rglob("*"):
        if path.is_file() and path.relative_to(overlays).parts[0] != "central":
            found.add(path.relative_to(root).as_posix())
    return found


def diff(root: Path, files: Mapping[str, str]) -> list[str]:
    """The paths under ``root`` that differ from ``files``: changed, missing or stale."""
    problems = []
    for rel, text in sorted(files.items()):
        path = root / rel
        if not path.is_file():
            problems.append(f"missing: {rel}")
        elif path.read_text(encoding="utf-8") != text:
            problems.append(f"differs: {rel}")
    for rel in sorted(_generated_on_disk(root) - set(files)):
        problems.append(f"stale (no such region in the settings): {rel}")
    return problems


def write(root: Path, files: Mapping[str, str]) -> list[str]:
    """Write ``files`` under ``root`` and remove stale region overlays; the paths changed."""
    changed = diff(root, files)
    for rel in sorted(_generated_on_disk(root) - set(files)):
        (root / rel).unlink()
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
    for folder in sorted((root / "overlays").rglob("*"), reverse=True):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    return changed
