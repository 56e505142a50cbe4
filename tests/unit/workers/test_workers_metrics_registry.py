"""Metrics rule: components take a registry, the composition root supplies it,
nothing registers at import."""

from __future__ import annotations

import subprocess
import sys

from prometheus_client import CollectorRegistry, generate_latest
from workers_doubles import GatedDouble  # type: ignore[import-not-found]

from workers.models import TensorModel
from workers.server import InferenceServer


def test_importing_the_workers_registers_no_worker_series_globally() -> None:
    code = (
        "import prometheus_client, workers.server, workers.metrics, workers.models\n"
        "names = [n for n in prometheus_client.REGISTRY._names_to_collectors "
        "if n.startswith('edgefeed_worker')]\n"
        "print(names)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_server_registers_on_the_registry_it_is_given() -> None:
    registry = CollectorRegistry()
    model = TensorModel("double", GatedDouble(), (4,), "float32")
    server = InferenceServer([model], registry=registry)
    assert server.metrics.registry is registry
    assert b"edgefeed_worker_requests" in generate_latest(registry)
    # A second server on its own registry does not collide with the first.
    other = InferenceServer([model])
    assert other.metrics.registry is not registry
