"""Bearer-token auth and TLS of a real worker process (`edgefeed workers serve`).

* no token, a wrong token, another scheme: 401 with ``WWW-Authenticate: Bearer``;
  the right token: 200; the probes stay open unless asked otherwise;
* the token never appears in the worker's log nor in any answer;
* TLS with a self-signed certificate made here by the openssl CLI: the client
  that trusts it gets answers, one that does not is refused, plain HTTP fails;
* bad settings (a token file that is missing or too short, a certificate
  without its key) stop the worker with a message naming the setting.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from worker_process import WorkerProcess, worker_process  # type: ignore[import-not-found]

from workers.client import WorkerClient
from workers.exceptions import WorkerResponseError
from workers.inputs import NPY_TYPE, encode_npy

pytestmark = pytest.mark.integration

TOKEN = "S3cr3t-M4rker-worker-token-0123456789"
INFER = "/v1/models/image-classifier/infer"
IMAGE = np.zeros((32, 32, 3), dtype=np.uint8)
EDGEFEED = str(Path(sys.executable).with_name("edgefeed"))


def _call(
    worker: WorkerProcess,
    path: str,
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
    context: ssl.SSLContext | None = None,
) -> tuple[int, bytes, dict[str, str]]:
    sent = {"Content-Type": NPY_TYPE, **(headers or {})}
    request = urllib.request.Request(f"{worker.url}{path}", data=body, headers=sent)
    try:
        with urllib.request.urlopen(request, timeout=60, context=context) as answer:
            return answer.status, answer.read(), dict(answer.headers)
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.read(), dict(error.headers)


def _assert_token_nowhere(worker: WorkerProcess, *texts: bytes | str) -> None:
    fragments = (TOKEN, TOKEN[:12], TOKEN[-12:])
    for text in (*texts, "".join(worker.lines)):
        shown = text.decode() if isinstance(text, bytes) else text
        assert not any(f in shown for f in fragments), f"token leaked in: {shown[:500]}"


def test_token_is_required_on_every_endpoint_but_the_probes() -> None:
    body = encode_npy(IMAGE)
    env = {"EDGEFEED_WORKERS_AUTH_TOKEN": TOKEN}
    with worker_process("--model", "image-classifier", env=env) as worker:
        missing = _call(worker, INFER, body=body)
        wrong = _call(worker, INFER, {"Authorization": "Bearer " + TOKEN[:-1] + "x"}, body)
        basic = _call(worker, INFER, {"Authorization": "Basic " + TOKEN}, body)
        right = _call(worker, INFER, {"Authorization": f"Bearer {TOKEN}"}, body)
        metrics_closed = _call(worker, "/metrics")
        models_closed = _call(worker, "/v1/models")
        health = _call(worker, "/healthz")
        ready = _call(worker, "/readyz")
        metrics = _call(worker, "/metrics", {"Authorization": f"Bearer {TOKEN}"})

    for status, answer, headers in (missing, wrong, basic, metrics_closed, models_closed):
        assert status == 401
        assert headers["WWW-Authenticate"].startswith('Bearer realm="edgefeed-worker"')
        error = json.loads(answer)["error"]
        assert error["type"] == "UnauthorizedError"
        assert error["retryable"] is False
        assert "Authorization: Bearer <token>" in error["message"]
    assert "error=" not in missing[2]["WWW-Authenticate"]  # RFC 6750: no token, no error code
    assert 'error="invalid_token"' in wrong[2]["WWW-Authenticate"]
    assert right[0] == 200
    assert len(json.loads(right[1])["predictions"]) == 1
    assert health[0] == 200 and ready[0] == 200
    assert metrics[0] == 200
    assert b"edgefeed_worker_unauthorized_total" in metrics[1]
    refused = [line for line in metrics[1].decode().splitlines() if "unauthorized_total{" in line]
    assert refused and float(refused[0].rsplit(" ", 1)[1]) == 5.0
    _assert_token_nowhere(worker, *(a for _, a, _ in (missing, wrong, basic, right, metrics)))


def test_a_refused_request_does_not_hold_its_connection_open_for_its_body() -> None:
    """A client that sends a request without the token, announcing a body it keeps
    sending slowly, gets its 401 and the connection closed, instead of the worker
    reading the body it refused for 10 s (aiohttp's lingering close; issue 30)."""
    import socket
    import time

    with worker_process(
        "--model", "image-classifier", env={"EDGEFEED_WORKERS_AUTH_TOKEN": TOKEN}
    ) as worker:
        host, port = worker.url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(
                f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Type: {NPY_TYPE}\r\n"
                "Content-Length: 100000000\r\n\r\n".encode()
            )
            answer = b""
            while b"\r\n\r\n" not in answer:
                answer += conn.recv(65536)
            assert answer.startswith(b"HTTP/1.1 401")
            started = time.monotonic()
            closed = False
            while time.monotonic() - started < 8:  # the body trickles in, 1 KB per 50 ms
                try:
                    conn.sendall(b"x" * 1024)
                    conn.settimeout(0.05)
                    if conn.recv(65536) == b"":
                        closed = True
                        break
                except TimeoutError:
                    continue
                except OSError:  # reset: closed while the client still sent
                    closed = True
                    break
        took = time.monotonic() - started
    assert closed, "the worker still read the refused body after 8 s"
    assert took < 8  # aiohttp's default read it for 10 s


def test_token_from_a_file_and_probes_protected_on_request(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")  # a trailing newline, as editors write it
    env = {"EDGEFEED_WORKERS_AUTH_PROTECT_PROBES": "true"}
    with worker_process(
        "--model", "image-classifier", "--auth-token-file", str(token_file), env=env
    ) as worker:
        health = _call(worker, "/healthz")
        health_ok = _call(worker, "/healthz", {"Authorization": f"Bearer {TOKEN}"})
        answer = _call(worker, INFER, {"Authorization": f"Bearer {TOKEN}"}, encode_npy(IMAGE))
    assert health[0] == 401
    assert health_ok[0] == 200
    assert answer[0] == 200
    _assert_token_nowhere(worker, health[1], answer[1])


async def test_the_client_sends_the_token_and_reports_a_refusal() -> None:
    env = {"EDGEFEED_WORKERS_AUTH_TOKEN": TOKEN}
    with worker_process("--model", "image-classifier", env=env) as worker:
        async with WorkerClient(worker.url, token=TOKEN) as client:
            answer = await client.classify("image-classifier", IMAGE)
            models = await client.models()
        async with WorkerClient(worker.url, token="not-the-token-at-all") as stranger:
            with pytest.raises(WorkerResponseError) as refused:
                await stranger.classify("image-classifier", IMAGE)
    assert len(answer.body["predictions"]) == 1
    assert [m["name"] for m in models["models"]] == ["image-classifier"]
    assert refused.value.status == 401
    assert refused.value.error_type == "UnauthorizedError"
    assert not refused.value.retryable
    _assert_token_nowhere(worker, str(refused.value))


def _self_signed(folder: Path) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("the openssl CLI is needed to make the test certificate (apt install openssl)")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=edgefeed-test-worker",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


async def test_tls_with_a_self_signed_certificate(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    env = {"EDGEFEED_WORKERS_AUTH_TOKEN": TOKEN}
    args = ("--model", "image-classifier", "--tls-cert", str(cert), "--tls-key", str(key))
    with worker_process(*args, env=env) as worker:
        assert worker.url.startswith("https://127.0.0.1:")
        async with WorkerClient(worker.url, token=TOKEN, ca_file=cert) as client:
            answer = await client.classify("image-classifier", IMAGE)
            assert await client.ready()
        # A client that does not trust the certificate never gets to send the request.
        async with WorkerClient(worker.url, token=TOKEN) as untrusting:
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await untrusting.classify("image-classifier", IMAGE)
        # Plain HTTP to the TLS port gets no answer.
        plain = worker.url.replace("https://", "http://")
        async with WorkerClient(plain, token=TOKEN, timeout_s=10) as cleartext:
            with pytest.raises((aiohttp.ClientError, asyncio.TimeoutError)):
                await cleartext.classify("image-classifier", IMAGE)
        # The CLI's bench talks TLS and sends the token from a file too.
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN)
        bench = subprocess.run(
            [
                EDGEFEED,
                "workers",
                "bench",
                "--model",
                "image-classifier",
                "--url",
                worker.url,
                "--requests",
                "4",
                "--concurrency",
                "2",
                "--json",
                "--auth-token-file",
                str(token_file),
                "--ca-file",
                str(cert),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env={**os.environ, "COLUMNS": "300"},
        )
    assert len(answer.body["predictions"]) == 1
    assert bench.returncode == 0, bench.stderr
    assert json.loads(bench.stdout)["errors"] == {}
    _assert_token_nowhere(worker, bench.stdout, bench.stderr)


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (("--auth-token-file", "/nonexistent/token"), {}, "auth token file '/nonexistent/token'"),
        ((), {"EDGEFEED_WORKERS_AUTH_TOKEN": "S3cr3t-M4rker"}, "use at least 16"),
        (("--tls-cert", "{cert}"), {}, "tls_cert_file and tls_key_file go together"),
        (
            ("--auth-token-file", "{token}"),
            {"EDGEFEED_WORKERS_AUTH_TOKEN": TOKEN},
            "the auth token is given twice",
        ),
    ],
)
def test_bad_security_settings_stop_the_worker_with_a_clear_message(
    tmp_path: Path, args: tuple[str, ...], env: dict[str, str], expected: str
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    cert = tmp_path / "cert.pem"
    cert.write_text("not a certificate")
    argv = [a.format(cert=cert, token=token_file) for a in args]
    done = subprocess.run(
        [
            EDGEFEED,
            "workers",
            "serve",
            "--model",
            "image-classifier",
            "--region",
            "local",
            "--port",
            "0",
            "--device",
            "cpu",
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("EDGEFEED_WORKERS_")},
            "COLUMNS": "300",
            **env,
        },
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert expected in " ".join(output.split()), output
    assert "Traceback" not in output
    assert "S3cr3t" not in output and "M4rker" not in output
