"""Bearer-token authentication and TLS of the inference server.

Both are optional and off by default (the worker binds loopback). Turn them on
when the worker is reachable from other hosts, or put it behind a proxy that
does (docs/security.md, "Model worker: token, TLS, proxy").

* :class:`TokenAuth` checks ``Authorization: Bearer <token>`` on every request
  but the probes (``/healthz``, ``/readyz``) unless ``protect_probes``. Both
  sides are hashed with SHA-256 before a constant-time compare
  (:func:`hmac.compare_digest`), so neither the content nor the length of the
  token shows in the timing. A refusal is ``401`` with ``WWW-Authenticate:
  Bearer`` (RFC 6750); the token is never logged, echoed or put in an error.
* :func:`server_tls_context` builds the listener's TLS context from a PEM
  certificate chain and key (TLS 1.2 or later, the ``ssl`` module's defaults
  otherwise); :func:`client_tls_context` the client's, trusting a CA file
  (e.g. a self-signed certificate) besides the system's.

The token itself is read by :class:`~workers.settings.WorkerSettings` from
``EDGEFEED_WORKERS_AUTH_TOKEN`` or the file named by ``auth_token_file``, never
from a command-line argument (other local users see a process's arguments).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web
from pydantic import SecretStr

from edgefeed_base.tokens import token_problem
from workers.exceptions import UnauthorizedError, WorkerConfigError

__all__ = [
    "PROBE_PATHS",
    "TokenAuth",
    "client_tls_context",
    "read_token_file",
    "server_tls_context",
]

#: Paths a load balancer probes; open without a token unless ``protect_probes``.
PROBE_PATHS = frozenset({"/healthz", "/readyz"})

_REALM = "edgefeed-worker"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def read_token_file(path: Path) -> SecretStr:
    """The token in ``path`` (surrounding whitespace stripped).

    Raises:
        WorkerConfigError: the file cannot be read or holds no token (the
            message names the path, never the content).
    """
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkerConfigError(
            f"auth token file {str(path)!r} cannot be read ({type(exc).__name__}); "
            "point auth_token_file at a readable UTF-8 file holding the token"
        ) from None
    if not token:
        raise WorkerConfigError(f"auth token file {str(path)!r} is empty; write the token in it")
    return SecretStr(token)


class TokenAuth:
    """aiohttp middleware: a request needs ``Authorization: Bearer <token>``.

    Args:
        token: The shared secret (at least 16 characters).
        protect_probes: Also require it on ``/healthz`` and ``/readyz``.
        on_refused: Called once per refused request (a metric).
    """

    def __init__(
        self,
        token: SecretStr,
        *,
        protect_probes: bool = False,
        on_refused: Callable[[], None] = lambda: None,
    ) -> None:
        secret = token.get_secret_value()
        problem = token_problem(secret, "the worker's auth token")
        if problem is not None:  # one policy for every bearer token (edgefeed_base.tokens)
            raise WorkerConfigError(problem)
        self._digest = hashlib.sha256(secret.encode()).digest()
        self.protect_probes = protect_probes
        self._on_refused = on_refused

    def allows(self, authorization: str | None) -> bool:
        """True when ``authorization`` (the header's value) carries the token."""
        scheme, _, credentials = (authorization or "").partition(" ")
        given = hashlib.sha256(credentials.strip().encode()).digest()
        # Compare even for a wrong scheme: the time taken must not tell why it failed.
        same = hmac.compare_digest(given, self._digest)
        return same and scheme.lower() == "bearer"

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Refuse (401) a request without the token, before any of it is read."""
        if not self.protect_probes and request.path in PROBE_PATHS:
            return await handler(request)
        authorization = request.headers.get("Authorization")
        if self.allows(authorization):
            return await handler(request)
        self._on_refused()
        given = authorization is not None
        error = UnauthorizedError(
            "wrong bearer token; send the worker's token in 'Authorization: Bearer <token>'"
            if given
            else "this worker needs a bearer token: send 'Authorization: Bearer <token>'"
        )
        challenge = f'Bearer realm="{_REALM}"' + (', error="invalid_token"' if given else "")
        body = {"error": {"type": type(error).__name__, "message": str(error), "retryable": False}}
        response = web.Response(
            text=json.dumps(body),
            status=error.http_status,
            content_type="application/json",
            headers={"WWW-Authenticate": challenge},
        )
        # The body of an unauthenticated request is never read: close instead of draining it.
        response.force_close()
        return response


def server_tls_context(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """The listener's TLS context from PEM files (TLS 1.2 or later).

    Raises:
        WorkerConfigError: a file is missing or the pair does not load.
    """
    for what, path in (("certificate", cert_file), ("key", key_file)):
        if not path.is_file():
            raise WorkerConfigError(
                f"TLS {what} file {str(path)!r} does not exist; give a PEM file "
                "(tls_cert_file and tls_key_file go together)"
            )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_file, key_file)
    except (ssl.SSLError, OSError) as exc:
        raise WorkerConfigError(
            f"TLS certificate {str(cert_file)!r} and key {str(key_file)!r} do not load "
            f"({type(exc).__name__}: {exc.args[-1] if exc.args else ''}); give a PEM "
            "certificate chain and its unencrypted private key"
        ) from None
    return context


def client_tls_context(ca_file: Path | None = None) -> ssl.SSLContext:
    """A client context verifying the server, trusting ``ca_file`` besides the system CAs.

    Raises:
        WorkerConfigError: ``ca_file`` does not load.
    """
    context = ssl.create_default_context()
    if ca_file is not None:
        try:
            context.load_verify_locations(cafile=ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise WorkerConfigError(
                f"CA file {str(ca_file)!r} does not load ({type(exc).__name__}); "
                "give the PEM certificate (or CA) the worker serves"
            ) from None
    return context
