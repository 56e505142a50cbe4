"""Write the JSON schemas the manifest tests validate custom resources against.

kubernetes-validate ships the schemas of Kubernetes' own kinds only. The custom
resources deploy/k8s uses (KEDA's ScaledObject, the Prometheus operator's
PrometheusRule and ServiceMonitor) are validated against schemas derived from
the cloudcoil model packages on PyPI, which are generated from those projects'
CRDs (KEDA 2.16, prometheus-operator 0.80). The schemas are made strict: an
object with declared properties accepts no other (as the API server prunes
unknown fields, a misspelt field would otherwise vanish without a word).

Run in a throwaway venv (the packages are not project dependencies):

    python3 -m venv /tmp/crd && /tmp/crd/bin/pip install \
        cloudcoil-models-keda==2.16.1.0 cloudcoil-models-prometheus-operator==0.80.1.0
    /tmp/crd/bin/python scripts/k8s_crd_schemas.py deploy/k8s/schemas
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
        name = f"{api_version.replace('/', '_')}_{kind}.json"
        (out / name).write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
        print(out / name)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "deploy/k8s/schemas")
