"""The metrics endpoint of the exporter and the pipeline's processes: loopback by
default, optional bearer token and TLS, and optional probe paths.

prometheus_client's ``start_http_server`` can do TLS but not authentication, and
it runs the TLS handshake in its accept loop, so one client that opens a
connection and never finishes the handshake stalls every scrape. Here the
standard library's threading WSGI server serves prometheus_client's WSGI app
behind a token check; the handshake runs in the connection's own thread (which
times out), never in the accept loop.

The exporter also serves its status page (``/status``, ``/status.json``:
monitoring.page) behind the same token. A browser cannot add an ``Authorization:
Bearer`` header to a navigation, so those two paths also take HTTP Basic
credentials with the token as the password (any user name): the browser asks
once and sends them with every reload. ``/metrics`` takes only the bearer token.

Probe paths (``/healthz``, ``/readyz`` for the kubelet) answer without the token,
by design: a kubelet ``httpGet`` probe can send a header only by writing its value
into the pod manifest, which would put the secret where anyone who can read the
manifest sees it. A probe says only whether the process is alive or ready, with a
short reason; the metrics stay behind the token.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import logging
import os
import socket
import ssl
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.registry import CollectorRegistry

from edgefeed_base.tokens import token_problem
from monitoring.exceptions import MonitoringConfigError
from monitoring.page import CONTENT_SECURITY_POLICY, StatusBoard

__all__ = ["EndpointSecurity", "Probe", "is_loopback", "start_endpoint"]

log = logging.getLogger(__name__)

#: Seconds a connection may take to finish its TLS handshake and send a request.
CONNECTION_TIMEOUT_S = 10.0

_StartResponse = Callable[..., Any]
_WsgiApp = Callable[[dict[str, Any], _StartResponse], Iterable[bytes]]

#: A probe: () -> (ok, reason). Called in the endpoint's thread, so it must be
#: thread-safe and quick (it reads state the process keeps, never does I/O).
Probe = Callable[[], tuple[bool, str]]


@dataclass(frozen=True, slots=True)
class EndpointSecurity:
    """Who may scrape, and over what.

    Attributes:
        token: Scrapers must send ``Authorization: Bearer <token>``; None: no auth.
        certfile: PEM certificate chain; with ``keyfile``, the endpoint speaks TLS only.
        keyfile: PEM private key of ``certfile``.
    """

    token: str | None = field(default=None, repr=False)
    certfile: Path | None = None
    keyfile: Path | None = None

    @classmethod
    def load(
        cls,
        *,
        token_file: Path | None = None,
        token_env: str | None = None,
        certfile: Path | None = None,
        keyfile: Path | None = None,
        flag_prefix: str = "--",
    ) -> EndpointSecurity:
        """Read the token from a file or a named environment variable; check the TLS pair.

        Args:
            flag_prefix: How the command names these options, for the messages:
                ``--`` (``--token-file``, ``--tls-cert``: the exporter), or
                ``--metrics-`` (``--metrics-token-file``: ``pipeline run``).

        Raises:
            MonitoringConfigError: both or an empty token source, a missing or
                unreadable file, a token that is not one printable word, a
                certificate without its key (or the reverse).
        """
        if token_file is not None and token_env is not None:
            raise MonitoringConfigError(
                f"give the token by {flag_prefix}token-file or {flag_prefix}token-env, not both"
            )
        token: str | None = None
        if token_file is not None:
            try:
                token = token_file.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
                raise MonitoringConfigError(
                    f"cannot read the token file {token_file} ({reason}); "
                    f"point {flag_prefix}token-file at a readable file holding the token"
                ) from None
            where = f"token file {token_file}"
        elif token_env is not None:
            token = os.environ.get(token_env, "").strip()
            where = f"environment variable {token_env}"
        if token is not None:
            # One policy for every bearer token (edgefeed_base.tokens); the value itself
            # is never shown: it is a secret.
            problem = token_problem(token, f"the {where}")
            if problem is not None:
                raise MonitoringConfigError(problem)
        if (certfile is None) != (keyfile is None):
            raise MonitoringConfigError(
                f"TLS needs both {flag_prefix}tls-cert and {flag_prefix}tls-key "
                "(or neither for plain HTTP)"
            )
        return cls(token=token, certfile=certfile, keyfile=keyfile)

    @property
    def tls(self) -> bool:
        return self.certfile is not None

    def ssl_context(self) -> ssl.SSLContext | None:
        """A server context (TLS 1.2 or newer), or None without TLS.

        Raises:
            MonitoringConfigError: the certificate or key cannot be loaded.
        """
        if self.certfile is None or self.keyfile is None:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise MonitoringConfigError(
                f"cannot load the TLS certificate {self.certfile} with key {self.keyfile} "
                f"({reason}); give a PEM certificate chain and its private key"
            ) from None
        return context


def is_loopback(host: str) -> bool:
    """True when ``host`` names only this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: The paths of the status page (monitoring.page), which also take HTTP Basic auth.
STATUS_PATHS = ("/status", "/status.json")


def _presented_token(authorization: str, *, basic: bool) -> bytes | None:
    """The token an ``Authorization`` header carries: a bearer token, or (``basic``)
    the password of Basic credentials; None when it carries neither."""
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() == "bearer":
        return value.strip().encode("latin-1", "replace")
    if basic and scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True)
        except (binascii.Error, ValueError):
            return None
        _user, colon, password = decoded.partition(b":")
        return password if colon else None
    return None


def _require_token(app: _WsgiApp, token: str, *, basic: bool = False) -> _WsgiApp:
    expected = token.encode("ascii")

    def guarded(environ: dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
        presented = _presented_token(environ.get("HTTP_AUTHORIZATION", ""), basic=basic)
        # compare_digest: the time taken does not depend on how much of the token matched.
        if presented is not None and hmac.compare_digest(presented, expected):
            return app(environ, start_response)
        if basic:
            body = (
                b"401 Unauthorized: give the exporter's token as the password "
                b"(any user name), or send Authorization: Bearer <token>\n"
            )
            challenge = 'Basic realm="edgefeed status", charset="UTF-8"'
        else:
            body = b"401 Unauthorized: send Authorization: Bearer <token>\n"
            challenge = 'Bearer realm="edgefeed-exporter"'
        start_response(
            "401 Unauthorized",
            [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("Content-Length", str(len(body))),
                ("WWW-Authenticate", challenge),
                ("Cache-Control", "no-store"),
                ("X-Content-Type-Options", "nosniff"),
            ],
        )
        return [body]

    return guarded


def _status_app(board: StatusBoard) -> _WsgiApp:
    """``/status`` (HTML) and ``/status.json`` from the board's latest report."""

    def app(environ: dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            body = b"405 Method Not Allowed\n"
            start_response(
                "405 Method Not Allowed",
                [("Content-Type", "text/plain; charset=utf-8"), ("Allow", "GET, HEAD")],
            )
            return [body]
        if environ.get("PATH_INFO") == "/status.json":
            body, kind = board.json().encode(), "application/json"
        else:
            body, kind = board.html().encode(), "text/html; charset=utf-8"
        start_response(
            "200 OK",
            [
                ("Content-Type", kind),
                ("Content-Length", str(len(body))),
                ("Content-Security-Policy", CONTENT_SECURITY_POLICY),
                ("X-Content-Type-Options", "nosniff"),
                ("Cache-Control", "no-store"),
                ("Referrer-Policy", "no-referrer"),
                ("X-Frame-Options", "DENY"),
            ],
        )
        return [] if environ.get("REQUEST_METHOD") == "HEAD" else [body]

    return app


def _with_status(app: _WsgiApp, status: _WsgiApp) -> _WsgiApp:
    def routed(environ: dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "") in STATUS_PATHS:
            return status(environ, start_response)
        return app(environ, start_response)

    return routed


class _Handler(WSGIRequestHandler):
    timeout = CONNECTION_TIMEOUT_S  # a slow or silent client frees its thread

    def log_message(self, format: str, *args: Any) -> None:
        pass  # no access log (prometheus_client's server keeps none either)


def _server_class(host: str, context: ssl.SSLContext | None) -> type[WSGIServer]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = family

        def get_request(self) -> tuple[socket.socket, Any]:
            sock, addr = self.socket.accept()
            if context is not None:
                # The handshake happens on the first read, in the connection's thread.
                sock.settimeout(CONNECTION_TIMEOUT_S)
                sock = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            return sock, addr

        def handle_error(self, request: Any, client_address: Any) -> None:
            # A failed handshake, a plain-HTTP client on the TLS port, a client
            # gone mid-request: the client's problem, not a traceback on stderr.
            log.debug("connection from %s failed", client_address, exc_info=True)

    return Server


def _with_probes(app: _WsgiApp, probes: Mapping[str, Probe]) -> _WsgiApp:
    """Answer the probe paths (no token: see the module docstring), the rest with ``app``."""

    def routed(environ: dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
        probe = probes.get(environ.get("PATH_INFO", ""))
        if probe is None:
            return app(environ, start_response)
        try:
            ok, reason = probe()
        except Exception as exc:  # a bug in the probe: not ready, never a traceback page
            log.exception("probe %s failed", environ.get("PATH_INFO"))
            ok, reason = False, f"probe failed: {type(exc).__name__}"
        body = f"{reason}\n".encode("utf-8", "replace")
        start_response(
            "200 OK" if ok else "503 Service Unavailable",
            [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("Content-Length", str(len(body))),
                ("Cache-Control", "no-store"),
            ],
        )
        return [] if environ.get("REQUEST_METHOD") == "HEAD" else [body]

    return routed


def start_endpoint(
    registry: CollectorRegistry,
    *,
    host: str,
    port: int,
    security: EndpointSecurity,
    probes: Mapping[str, Probe] | None = None,
    flag_prefix: str = "--",
    status: StatusBoard | None = None,
) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``registry`` on ``/metrics`` (and ``/``) from a daemon thread.

    Args:
        registry: What ``/metrics`` serves (behind the token when ``security`` has one).
        host: Address to listen on.
        port: TCP port (0: any free one; the bound one is ``server.server_address[1]``).
        security: Bearer token and TLS.
        probes: Path (``/healthz``, ``/readyz``) -> a probe: ``200`` with its reason
            when it says ok, ``503`` with its reason when not, as ``text/plain``.
            Unauthenticated whatever ``security`` says (module docstring); over TLS
            when the endpoint speaks TLS.
        flag_prefix: How the command names ``host`` and ``port``, for the messages
            (``--`` or ``--metrics-``).
        status: Serve this board's status page on ``/status`` and ``/status.json``,
            behind the same token (bearer, or Basic with the token as the password).

    Raises:
        MonitoringConfigError: the address cannot be bound, or the TLS files are bad.
    """
    context = security.ssl_context()
    app: _WsgiApp = make_wsgi_app(registry)
    if security.token is not None:
        app = _require_token(app, security.token)
    if status is not None:
        page = _status_app(status)
        if security.token is not None:
            page = _require_token(page, security.token, basic=True)
        app = _with_status(app, page)
    if probes:
        app = _with_probes(app, dict(probes))
    try:
        server = make_server(host, port, app, _server_class(host, context), _Handler)
    except OSError as exc:
        raise MonitoringConfigError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); "
            f"pick another {flag_prefix}host/{flag_prefix}port"
        ) from None
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return server, thread
