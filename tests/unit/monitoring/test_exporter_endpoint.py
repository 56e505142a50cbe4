"""The real ``edgefeed exporter`` process: loopback by default, bearer token, TLS.

Each test starts the command as a user would (a settings file whose services
are not there, so the first collection ends at once with every source down)
and talks HTTP(S) to it. No stack is needed.
"""

from __future__ import annotations

import re
import signal
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

TOKEN = "tok-S3cr3t-M4rker-0123456789abcdef"
EXE = Path(sys.executable).with_name("edgefeed")


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def settings(tmp_path: Path) -> Path:
    port = _closed_port()
    path = tmp_path / "edgefeed.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "kafka": {"bootstrap_servers": f"127.0.0.1:{port}"},
                "connect": {"url": f"http://127.0.0.1:{port}", "timeout_s": 1, "retries": 0},
                "database": {"host": "127.0.0.1", "port": port, "password": "x"},
                "regions": [
                    {
                        "name": "eu-west",
                        "redis_url": f"redis://127.0.0.1:{port}/0",
                        "residency_zone": "eu",
                    }
                ],
                "sources": [{"name": "shop", "tables": [{"name": "users", "key": ["id"]}]}],
            }
        )
    )
    return path


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (openssl, as an operator would)."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
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
    return cert, key


@contextmanager
def exporter(
    settings: Path, *args: str, env: dict[str, str] | None = None
) -> Iterator[tuple[int, str]]:
    """Run ``edgefeed exporter``; yield its port and ready line; SIGTERM and reap it."""
    import os

    with subprocess.Popen(
        [str(EXE), "--settings", str(settings), "exporter", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    ) as process:
        try:
            assert process.stdout is not None
            seen: list[str] = []  # log lines of the first (failing) collection come first
            match = None
            while match is None and (line := process.stdout.readline()):
                seen.append(line)
                match = re.search(r"serving metrics on \w+://([\d.]+):(\d+)/metrics", line)
            assert match, "".join(seen)
            yield int(match.group(2)), line
            process.send_signal(signal.SIGTERM)
            rest, _ = process.communicate(timeout=60)  # a deadline for a hang, not a bound
            assert TOKEN not in line + rest
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


def _get(url: str, token: str | None = None, **kwargs: object) -> tuple[int, str, dict[str, str]]:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10, **kwargs) as response:  # type: ignore[arg-type]
            return response.status, response.read().decode(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of the listening sockets on ``port`` (from /proc/net/tcp{,6})."""
    found: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                if len(address) == 8:
                    found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
                else:
                    found.add(address)
    return found


def test_exporter_listens_on_loopback_only_by_default(settings: Path) -> None:
    with exporter(settings) as (port, line):
        assert "http://127.0.0.1:" in line
        assert _listening_addresses(port) == {"127.0.0.1"}
        status, body, _ = _get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200 and "edgefeed_up" in body


def test_a_token_is_required_when_configured_and_never_echoed(
    settings: Path, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")  # the trailing newline an editor adds is not part of it
    with exporter(settings, "--token-file", str(token_file)) as (port, line):
        assert "bearer token required" in line
        url = f"http://127.0.0.1:{port}/metrics"
        for presented in (None, "", "wrong", TOKEN[:-1], TOKEN + "x", TOKEN.upper()):
            status, body, headers = _get(url, presented)
            assert status == 401, presented
            assert headers["WWW-Authenticate"].startswith("Bearer")
            assert TOKEN not in body and "edgefeed_up" not in body
        # Another scheme with the right secret is refused too.
        request = urllib.request.Request(url, headers={"Authorization": f"Basic {TOKEN}"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 401
        refused.value.close()
        status, body, _ = _get(url, TOKEN)
        assert status == 200 and "edgefeed_up" in body


def test_the_status_page_takes_the_token_as_the_basic_password(
    settings: Path, tmp_path: Path
) -> None:
    import base64

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with exporter(settings, "--token-file", str(token_file)) as (port, line):
        assert f"the status page on http://127.0.0.1:{port}/status" in line
        url = f"http://127.0.0.1:{port}/status"
        status, body, headers = _get(url)
        assert status == 401 and headers["WWW-Authenticate"].startswith("Basic")
        assert TOKEN not in body
        credentials = base64.b64encode(f"ops:{TOKEN}".encode()).decode()
        request = urllib.request.Request(url, headers={"Authorization": f"Basic {credentials}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            page = response.read().decode()
            assert response.headers["Content-Security-Policy"].startswith("default-src 'none'")
        # Every source is down in these settings: the region is unknown, never healthy.
        assert "eu-west" in page and "DOWN: unknown" in page and TOKEN not in page


def test_the_token_can_come_from_a_named_environment_variable(settings: Path) -> None:
    env = {"SCRAPE_TOKEN": TOKEN}
    with exporter(settings, "--token-env", "SCRAPE_TOKEN", env=env) as (port, _):
        assert _get(f"http://127.0.0.1:{port}/metrics")[0] == 401
        assert _get(f"http://127.0.0.1:{port}/metrics", TOKEN)[0] == 200


def test_tls_serves_https_only_and_a_silent_client_does_not_block_scrapes(
    settings: Path, certificate: tuple[Path, Path]
) -> None:
    cert, key = certificate
    trusted = ssl.create_default_context(cafile=str(cert))
    args = ("--tls-cert", str(cert), "--tls-key", str(key))
    with exporter(settings, *args) as (port, line):
        assert f"https://127.0.0.1:{port}/metrics" in line
        # A client that connects and never starts its handshake holds only its
        # own connection: scrapes beside it are answered.
        with socket.create_connection(("127.0.0.1", port)) as silent:
            status, body, _ = _get(f"https://127.0.0.1:{port}/metrics", context=trusted)
            assert status == 200 and "edgefeed_up" in body
            silent.sendall(b"")
        # Plain HTTP on the TLS port gets no metrics, and the exporter keeps serving.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as plain:
            plain.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = plain.recv(65536)
            assert b"edgefeed_up" not in answer
        # A client that does not trust the certificate refuses it.
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", timeout=10)
        assert _get(f"https://127.0.0.1:{port}/metrics", context=trusted)[0] == 200


def test_tls_and_token_together(
    settings: Path, certificate: tuple[Path, Path], tmp_path: Path
) -> None:
    cert, key = certificate
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    trusted = ssl.create_default_context(cafile=str(cert))
    args = ("--tls-cert", str(cert), "--tls-key", str(key), "--token-file", str(token_file))
    with exporter(settings, *args) as (port, _):
        url = f"https://127.0.0.1:{port}/metrics"
        assert _get(url, context=trusted)[0] == 401
        assert _get(url, TOKEN, context=trusted)[0] == 200


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--tls-cert", "{cert}"), "TLS needs both --tls-cert and --tls-key"),
        (("--tls-cert", "{cert}", "--tls-key", "{cert}"), "cannot load the TLS certificate"),
        (("--token-file", "{missing}"), "cannot read the token file"),
        (("--token-file", "{empty}"), "holds no token"),
        (("--token-env", "EDGEFEED_TEST_NO_SUCH_VARIABLE"), "holds no token"),
        (("--token-file", "{spaced}"), "one word of printable ASCII"),
        # One policy for every bearer token: the worker's minimum holds here too.
        (("--token-file", "{short}"), "has 10 characters; use at least 16"),
        (("--token-file", "{empty}", "--token-env", "X"), "not both"),
    ],
)
def test_bad_security_options_are_clear_errors(
    settings: Path,
    certificate: tuple[Path, Path],
    tmp_path: Path,
    args: Sequence[str],
    expected: str,
) -> None:
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "spaced").write_text(f"{TOKEN} {TOKEN}")
    (tmp_path / "short").write_text("0123456789")
    names = {
        "cert": str(certificate[0]),
        "missing": str(tmp_path / "missing"),
        "empty": str(tmp_path / "empty"),
        "spaced": str(tmp_path / "spaced"),
        "short": str(tmp_path / "short"),
    }
    result = subprocess.run(
        [
            str(EXE),
            "--settings",
            str(settings),
            "exporter",
            "--port",
            "0",
            *(a.format(**names) for a in args),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert expected in " ".join(output.split()), output
    assert TOKEN not in output and "Traceback" not in output
