"""monitoring.endpoint's probe paths: /healthz and /readyz answer without the token
that /metrics requires (a kubelet probe cannot carry a secret), 200 or 503 with the
probe's reason, over TLS when the endpoint speaks TLS."""

from __future__ import annotations

import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter

from monitoring.endpoint import EndpointSecurity, Probe, start_endpoint
from monitoring.exceptions import MonitoringConfigError

TOKEN = "tok-S3cr3t-M4rker-0123456789abcdef"


@contextmanager
def endpoint(security: EndpointSecurity, probes: Mapping[str, Probe]) -> Iterator[int]:
    registry = CollectorRegistry()
    Counter("edgefeed_test_events", "Events", registry=registry).inc()
    server, thread = start_endpoint(
        registry, host="127.0.0.1", port=0, security=security, probes=probes
    )
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def get(
    url: str, token: str | None = None, method: str = "GET", **kwargs: object
) -> tuple[int, str, Mapping[str, str]]:
    request = urllib.request.Request(url, method=method)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10, **kwargs) as response:  # type: ignore[arg-type]
            return response.status, response.read().decode(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode(), dict(exc.headers)


class Flag:
    """A probe the test flips."""

    def __init__(self) -> None:
        self.state = (False, "recovering partitions")

    def __call__(self) -> tuple[bool, str]:
        return self.state


def test_probes_answer_without_the_token_that_metrics_requires() -> None:
    ready = Flag()
    probes = {"/healthz": lambda: (True, "alive"), "/readyz": ready}
    with endpoint(EndpointSecurity(token=TOKEN), probes) as port:
        base = f"http://127.0.0.1:{port}"
        status, body, _ = get(f"{base}/metrics")
        assert status == 401 and "edgefeed_test_events" not in body
        assert get(f"{base}/metrics", "wrong-token-0123456789")[0] == 401
        status, body, _ = get(f"{base}/metrics", TOKEN)
        assert status == 200 and "edgefeed_test_events_total 1.0" in body

        assert get(f"{base}/healthz")[:2] == (200, "alive\n")
        status, body, headers = get(f"{base}/readyz")
        assert (status, body) == (503, "recovering partitions\n")
        assert headers["Content-Type"].startswith("text/plain")
        ready.state = (True, "ready: caught up on 4 partitions")
        assert get(f"{base}/readyz")[:2] == (200, "ready: caught up on 4 partitions\n")
        # A token sent to a probe changes nothing, and a probe never shows metrics.
        assert get(f"{base}/readyz", TOKEN)[0] == 200
        assert "edgefeed_test_events" not in get(f"{base}/healthz", TOKEN)[1]
        # Other paths are still the metrics, behind the token.
        assert get(f"{base}/healthz/x")[0] == 401
        assert get(f"{base}/")[0] == 401


def test_head_requests_get_the_status_without_a_body() -> None:
    with endpoint(EndpointSecurity(), {"/readyz": lambda: (False, "behind: 42.0 s")}) as port:
        status, body, _ = get(f"http://127.0.0.1:{port}/readyz", method="HEAD")
        assert (status, body) == (503, "")


def test_a_probe_that_raises_is_not_ready_and_shows_no_traceback() -> None:
    def broken() -> tuple[bool, str]:
        raise KeyError("secret internals")

    with endpoint(EndpointSecurity(), {"/readyz": broken}) as port:
        status, body, _ = get(f"http://127.0.0.1:{port}/readyz")
        assert (status, body) == (503, "probe failed: KeyError\n")


def test_without_probes_every_path_is_the_metrics() -> None:
    with endpoint(EndpointSecurity(), {}) as port:
        status, body, _ = get(f"http://127.0.0.1:{port}/healthz")
        assert status == 200 and "edgefeed_test_events" in body


def test_probes_are_served_over_tls_with_the_metrics(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    trusted = ssl.create_default_context(cafile=str(cert))
    security = EndpointSecurity(token=TOKEN, certfile=cert, keyfile=key)
    with endpoint(security, {"/healthz": lambda: (True, "alive")}) as port:
        assert get(f"https://127.0.0.1:{port}/healthz", context=trusted)[:2] == (200, "alive\n")
        assert get(f"https://127.0.0.1:{port}/metrics", context=trusted)[0] == 401


def test_the_messages_name_the_commands_own_options(tmp_path: Path) -> None:
    with pytest.raises(MonitoringConfigError, match="point --metrics-token-file at"):
        EndpointSecurity.load(token_file=tmp_path / "missing", flag_prefix="--metrics-")
    with pytest.raises(MonitoringConfigError, match="--metrics-tls-cert and --metrics-tls-key"):
        EndpointSecurity.load(certfile=tmp_path / "cert.pem", flag_prefix="--metrics-")
    with (
        endpoint(EndpointSecurity(), {}) as port,
        pytest.raises(MonitoringConfigError, match="pick another --metrics-host/--metrics-port"),
    ):
        start_endpoint(
            CollectorRegistry(),
            host="127.0.0.1",
            port=port,
            security=EndpointSecurity(),
            flag_prefix="--metrics-",
        )
