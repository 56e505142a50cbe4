"""What both demos (``edgefeed demo run`` and ``demo sites``) do alike on the local
stack: free ports, the exporter started and scraped, where Prometheus and
Alertmanager are."""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from edgefeed.cli._common import console, run_reported

if TYPE_CHECKING:
    from edgefeed.devstack import DevStack
    from edgefeed.settings import EdgefeedSettings

__all__ = ["free_port", "print_monitoring_urls", "start_exporter"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_exporter(stack: DevStack, base: list[str], settings: EdgefeedSettings) -> None:
    """Start the exporter on a free port (a previous demo's stopped first), have the
    local Prometheus scrape it, and print where to look."""
    exporter_port = free_port()
    stack.stop_app("exporter")  # a previous demo's, on another port
    run_reported(
        lambda: stack.start_app(
            "exporter",
            # Apps run in their own folder under the stack's: name the stack's
            # folder, whose WAN emulator reports the sites' links.
            [
                *base,
                "exporter",
                "--port",
                str(exporter_port),
                "--state-dir",
                str(stack.state_dir.resolve()),
            ],
            ready="serving metrics on",
            timeout_s=60,
        )
    )
    stack.scrape("edgefeed-exporter", "exporter", exporter_port)
    console.print(f"  exporter: http://127.0.0.1:{exporter_port}/metrics (Prometheus)")
    print_monitoring_urls(settings)


def print_monitoring_urls(settings: EdgefeedSettings) -> None:
    monitoring = settings.monitoring
    if monitoring.prometheus_port is not None:
        console.print(
            f"  prometheus: http://127.0.0.1:{monitoring.prometheus_port}/alerts "
            "(rules: deploy/prometheus/alerts.yml)"
        )
    if monitoring.alertmanager_port is not None:
        console.print(f"  alertmanager: http://127.0.0.1:{monitoring.alertmanager_port}/")
