"""Async client of the inference server; measures the full latency budget per request.

The client times each round trip and subtracts the server's own time (sent in
headers) to get T_network, so every answer carries all four terms::

    async with WorkerClient("http://127.0.0.1:8080") as client:
        answer = await client.classify("image-classifier", images)
        print(answer.latency.total_s, answer.latency.network_s)
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

try:
    import aiohttp
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("the model workers need aiohttp: pip install 'edgefeed[workers]'") from exc

from pydantic import SecretStr

from workers.exceptions import WorkerResponseError
from workers.inputs import NPY_TYPE, encode_npy
from workers.security import client_tls_context
from workers.timing import HEADER_DEADLINE_MS, LatencyBreakdown, ServerTiming

__all__ = ["InferenceAnswer", "WorkerClient"]


@dataclass(frozen=True, slots=True)
class InferenceAnswer:
    """One successful answer.

    Attributes:
        body: The decoded JSON body.
        latency: T_network, T_data, T_model, T_service of this request.
        batch_rows: Rows in the batch the request rode in.
        phases_ms: T_service by phase, in ms, when asked for (request header
            ``X-Edgefeed-Timing-Detail: 1``); else empty.
        round_trip_s: The client's own clock from sending the request to the
            last byte of the answer (what the four terms of ``latency`` add up to
            unless the worker reported more time than that).
    """

    body: dict[str, Any]
    latency: LatencyBreakdown
    batch_rows: int
    phases_ms: Mapping[str, float] = field(default_factory=dict)
    round_trip_s: float = 0.0


class WorkerClient:
    """Talks to one worker over HTTP or HTTPS (keep-alive connections, one session).

    Args:
        base_url: ``http://host:port`` or ``https://host:port`` of the worker.
        session: An aiohttp session to reuse (else one is created and owned).
        timeout_s: Total timeout per request.
        token: The worker's bearer token, sent as ``Authorization: Bearer`` on
            every request (never logged nor put in an error).
        ca_file: For ``https``: a PEM certificate or CA to trust besides the
            system's (a worker's self-signed certificate).
        ssl_context: For ``https``: the TLS context to use instead (overrides ``ca_file``).
    """

    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession | None = None,
        timeout_s: float = 30.0,
        *,
        token: str | SecretStr | None = None,
        ca_file: Path | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._session = session
        self._owned = session is None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        secret = token if isinstance(token, SecretStr) or token is None else SecretStr(token)
        self._token = secret
        self._tls: ssl.SSLContext | None = ssl_context
        if self._tls is None and ca_file is not None:
            self._tls = client_tls_context(ca_file)

    def _auth(self) -> dict[str, str]:
        if self._token is None:
            return {}
        return {"Authorization": f"Bearer {self._token.get_secret_value()}"}

    async def __aenter__(self) -> WorkerClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout,
                connector=aiohttp.TCPConnector(
                    limit=0, ssl=self._tls if self._tls is not None else True
                ),
            )
        return self._session

    async def aclose(self) -> None:
        """Close the session if this client created it."""
        if self._owned and self._session is not None:
            await self._session.close()
            self._session = None

    async def infer(
        self,
        model: str,
        body: bytes,
        content_type: str,
        *,
        deadline_ms: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> InferenceAnswer:
        """Send one raw request to ``/v1/models/{model}/infer``.

        Raises:
            WorkerResponseError: any non-200 answer; carries status, server
                error type, retryable and Retry-After.
        """
        sent = {"Content-Type": content_type, **self._auth(), **(headers or {})}
        if deadline_ms is not None:
            sent[HEADER_DEADLINE_MS] = f"{deadline_ms:g}"
        start = time.perf_counter()
        async with self._http().post(
            f"{self.base_url}/v1/models/{model}/infer", data=body, headers=sent
        ) as response:
            payload = await response.read()
            round_trip = time.perf_counter() - start
            if response.status != 200:
                raise _error_of(response.status, payload, response.headers)
            server = ServerTiming.from_headers(response.headers)
        if server is None:
            server = ServerTiming(0.0, 0.0, 0.0)
        return InferenceAnswer(
            json.loads(payload),
            LatencyBreakdown.from_round_trip(round_trip, server),
            server.batch_rows,
            {name: seconds * 1e3 for name, seconds in server.phases},
            round_trip,
        )

    async def classify(
        self, model: str, images: np.ndarray, *, deadline_ms: float | None = None
    ) -> InferenceAnswer:
        """Classify uint8 ``(H, W, 3)`` or ``(n, H, W, 3)`` images (sent as ``.npy``)."""
        return await self.infer(model, encode_npy(images), NPY_TYPE, deadline_ms=deadline_ms)

    async def rank(
        self,
        model: str,
        user_id: str,
        item_ids: Sequence[str],
        *,
        on_missing: str = "reject",
        deadline_ms: float | None = None,
    ) -> InferenceAnswer:
        """Score ``item_ids`` for ``user_id``; features come from the worker's edge cache."""
        body = json.dumps(
            {"user_id": user_id, "item_ids": list(item_ids), "on_missing": on_missing}
        ).encode()
        return await self.infer(model, body, "application/json", deadline_ms=deadline_ms)

    async def models(self) -> dict[str, Any]:
        """``GET /v1/models``."""
        async with self._http().get(f"{self.base_url}/v1/models", headers=self._auth()) as response:
            if response.status != 200:
                raise _error_of(response.status, await response.read(), response.headers)
            data: dict[str, Any] = await response.json()
            return data

    async def ready(self) -> bool:
        """True when ``/readyz`` answers 200."""
        try:
            async with self._http().get(
                f"{self.base_url}/readyz", headers=self._auth()
            ) as response:
                return response.status == 200
        except aiohttp.ClientError:
            return False


def _error_of(status: int, payload: bytes, headers: Mapping[str, str]) -> WorkerResponseError:
    try:
        error = json.loads(payload)["error"]
        message, kind, retryable = (
            str(error["message"]),
            str(error["type"]),
            bool(error["retryable"]),
        )
    except (ValueError, KeyError, TypeError):
        message = payload[:200].decode("utf-8", "replace") or f"HTTP {status}"
        kind, retryable = "HTTPError", status in (429, 503)
    retry_after: float | None = None
    if "Retry-After" in headers:
        try:
            retry_after = float(headers["Retry-After"])
        except ValueError:
            retry_after = None
    return WorkerResponseError(
        f"HTTP {status} {kind}: {message}",
        status=status,
        error_type=kind,
        retryable=retryable,
        retry_after_s=retry_after,
    )
