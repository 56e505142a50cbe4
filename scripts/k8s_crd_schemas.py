"""Write the JSON schemas the manifest tests validate custom resources against.

kubernetes-validate ships the schemas of Kubernetes' own kinds only. The custom
resources deploy/k8s uses (KEDA's ScaledObject and TriggerAuthentication, the
Prometheus operator's PrometheusRule and ServiceMonitor) are validated against
schemas derived from the cloudcoil model packages on PyPI, generated from those projects'
CRDs (KEDA 2.16, prometheus-operator 0.80). Strimzi's KafkaUser
(kafka.strimzi.io/v1beta2) comes from the npm package
``@kubernetes-models/strimzi-kafka-operator`` 1.0.1 (generated from Strimzi
0.49.0's CRDs): its ``_schemas/*.js`` are compiled validators, not JSON, so its
TypeScript declaration of the kind is turned into a JSON schema by
``ts-json-schema-generator`` (a node step, below) and read here with
``--strimzi``. The schemas are made strict: an object with declared properties
accepts no other (as the API server prunes unknown fields, a misspelt field
would otherwise vanish without a word).

Run in a throwaway venv (the packages are not project dependencies):

    python3 -m venv /tmp/crd && /tmp/crd/bin/pip install \
        cloudcoil-models-keda==2.16.1.0 cloudcoil-models-prometheus-operator==0.80.1.0
    /tmp/crd/bin/python scripts/k8s_crd_schemas.py deploy/k8s/schemas

KafkaUser (Node 20 or newer; npm warns that the models package asks for 22,
only its runtime needs it; nothing is installed in the repository):

    mkdir /tmp/strimzi && cd /tmp/strimzi && npm init -y && npm i \
        @kubernetes-models/strimzi-kafka-operator@1.0.1 ts-json-schema-generator@2.4.0 typescript@5
    npx ts-json-schema-generator --no-type-check --type IKafkaUser -o KafkaUser.json --path \
        node_modules/@kubernetes-models/strimzi-kafka-operator/kafka.strimzi.io/v1beta2/KafkaUser.d.ts
    cd - && python3 scripts/k8s_crd_schemas.py deploy/k8s/schemas \
        --strimzi /tmp/strimzi/KafkaUser.json
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path
from typing import Any

KINDS = {
    ("keda.sh/v1alpha1", "ScaledObject"): (
        "cloudcoil.models.keda.v1alpha1",
        "cloudcoil.models.keda",
    ),
    ("keda.sh/v1alpha1", "TriggerAuthentication"): (
        "cloudcoil.models.keda.v1alpha1",
        "cloudcoil.models.keda",
    ),
    ("monitoring.coreos.com/v1", "PrometheusRule"): (
        "cloudcoil.models.prometheus_operator.v1",
        "cloudcoil.models.prometheus_operator",
    ),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): (
        "cloudcoil.models.prometheus_operator.v1",
        "cloudcoil.models.prometheus_operator",
    ),
}


def _strict(node: Any) -> Any:
    if isinstance(node, dict):
        out = {key: _strict(value) for key, value in node.items()}
        if out.get("type") == "object" and "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(node, list):
        return [_strict(value) for value in node]
    return node


#: The kinds read from ts-json-schema-generator's output (--strimzi): its type name.
STRIMZI = {("kafka.strimzi.io/v1beta2", "KafkaUser"): "IKafkaUser"}
STRIMZI_SOURCE = "@kubernetes-models/strimzi-kafka-operator 1.0.1 (Strimzi 0.49.0's CRDs)"


def _write(out: Path, api_version: str, kind: str, schema: dict[str, Any]) -> None:
    name = f"{api_version.replace('/', '_')}_{kind}.json"
    (out / name).write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
    print(out / name)


def strimzi(out: Path, generated: Path) -> None:
    """The Strimzi kinds from a draft-07 schema with ``definitions`` (the node step)."""
    raw = json.loads(generated.read_text())
    for (api_version, kind), type_name in STRIMZI.items():
        # The draft-07 ``#/definitions/...`` references resolve as JSON pointers in
        # the 2020-12 validator the tests use; the root is the kind's definition.
        schema = _strict({**raw["definitions"][type_name], "definitions": raw["definitions"]})
        schema["$comment"] = (
            f"{api_version} {kind}, from {STRIMZI_SOURCE} by ts-json-schema-generator "
            "(scripts/k8s_crd_schemas.py)"
        )
        _write(out, api_version, kind, schema)


def main(folder: str) -> None:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for (api_version, kind), (module, dist) in KINDS.items():
        model = getattr(__import__(module, fromlist=[kind]), kind)
        schema = _strict(model.model_json_schema(by_alias=True))
        schema["$comment"] = (
            f"{api_version} {kind}, from {dist} {importlib.metadata.version(dist)} "
            "(scripts/k8s_crd_schemas.py)"
        )
        _write(out, api_version, kind, schema)


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--strimzi" in args:
        at = args.index("--strimzi")
        strimzi(Path(args[0] if at else "deploy/k8s/schemas"), Path(args[at + 1]))
    else:
        main(args[0] if args else "deploy/k8s/schemas")
