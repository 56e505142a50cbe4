"""A Kafka Connect REST API client (requests).

Retries with exponential backoff on 409 (a rebalance is in progress), 5xx and
refused connections come from urllib3's ``Retry``; once retries are spent,
Connect's own error message is surfaced verbatim. Secrets known to the client
are redacted from every message it raises.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import quote

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from connectors.exceptions import (
    ConnectorInvalidError,
    ConnectRequestError,
    ConnectUnavailableError,
)
from connectors.secrets import redact, redact_url, url_secrets

__all__ = ["ConnectClient", "ConnectorStatus", "TaskStatus"]

State = Literal["RUNNING", "PAUSED", "STOPPED", "FAILED", "UNASSIGNED", "RESTARTING"]


@dataclass(frozen=True, slots=True)
class TaskStatus:
    """One task of a connector."""

    id: int
    state: str
    worker_id: str
    trace: str | None

    @property
    def cause(self) -> str | None:
        """The most specific line of the trace ("Caused by: ..."), if any."""
        if not self.trace:
            return None
        causes = [line.strip() for line in self.trace.splitlines() if "Caused by:" in line]
        return causes[-1] if causes else self.trace.splitlines()[0].strip()


@dataclass(frozen=True, slots=True)
class ConnectorStatus:
    """A connector's state and its tasks' states."""

    name: str
    state: str
    worker_id: str
    trace: str | None
    tasks: tuple[TaskStatus, ...]

    @property
    def running(self) -> bool:
        return (
            self.state == "RUNNING"
            and bool(self.tasks)
            and all(task.state == "RUNNING" for task in self.tasks)
        )

    @property
    def failed(self) -> bool:
        return self.state == "FAILED" or any(task.state == "FAILED" for task in self.tasks)

    def failure(self) -> str | None:
        """Why it failed, from the connector's or first failed task's trace."""
        for task in self.tasks:
            if task.state == "FAILED":
                return task.cause or f"task {task.id} FAILED"
        if self.state == "FAILED":
            lines = (self.trace or "").splitlines()
            causes = [line.strip() for line in lines if "Caused by:" in line]
            return causes[-1] if causes else (lines[0] if lines else "connector FAILED")
        return None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state,
            "worker_id": self.worker_id,
            "failure": self.failure(),
            "tasks": [
                {"id": t.id, "state": t.state, "worker_id": t.worker_id, "cause": t.cause}
                for t in self.tasks
            ],
        }

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> ConnectorStatus:
        connector = body.get("connector", {})
        return cls(
            name=str(body.get("name", "")),
            state=str(connector.get("state", "UNKNOWN")),
            worker_id=str(connector.get("worker_id", "")),
            trace=connector.get("trace"),
            tasks=tuple(
                TaskStatus(
                    id=int(task.get("id", 0)),
                    state=str(task.get("state", "UNKNOWN")),
                    worker_id=str(task.get("worker_id", "")),
                    trace=task.get("trace"),
                )
                for task in body.get("tasks", [])
            ),
        )


class ConnectClient:
    """Talks to one Kafka Connect cluster.

    Args:
        url: Base URL of the REST API.
        timeout_s: Timeout of each HTTP request.
        retries: Retries on 409, 5xx and connection errors (exponential backoff).
        secrets: Values redacted from every error message. The password of
            ``url`` (``http://user:pass@host``, sent as basic auth) is one
            already, and the URL is only ever shown as ``http://***@host``.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 10.0,
        retries: int = 5,
        backoff_s: float = 0.25,
        secrets: Iterable[str] = (),
    ) -> None:
        self.url = url.rstrip("/")
        self.shown_url = redact_url(self.url)
        self.timeout_s = timeout_s
        self._secrets = tuple(s for s in (*secrets, *url_secrets(self.url)) if s)
        retry = Retry(
            total=retries,
            connect=retries,
            read=0,
            status=retries,
            backoff_factor=backoff_s,
            backoff_max=5.0,
            status_forcelist=(409, 500, 502, 503, 504),
            allowed_methods=None,  # Connect's PUT/POST/DELETE are safe to repeat
            raise_on_status=False,
            respect_retry_after_header=True,
        )
        self._session = requests.Session()
        self._session.mount("http://", HTTPAdapter(max_retries=retry))
        self._session.mount("https://", HTTPAdapter(max_retries=retry))
        self._session.headers.update({"Accept": "application/json"})

    def close(self) -> None:
        self._session.close()

    def __enter__(self) -> ConnectClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ------------------------------------------------------------------------

    def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        ok: tuple[int, ...] = (200, 201, 202, 204),
    ) -> requests.Response:
        url = f"{self.url}{path}"
        try:
            response = self._session.request(
                method, url, json=json, params=params, timeout=self.timeout_s
            )
        except requests.ConnectionError as exc:
            raise ConnectUnavailableError(
                f"cannot reach Kafka Connect at {self.shown_url} ({type(exc).__name__}); is it "
                "running? start it (`edgefeed dev up` locally) or fix connect.url"
            ) from None
        except requests.Timeout:
            raise ConnectUnavailableError(
                f"Kafka Connect at {self.shown_url} did not answer {method} {path} within "
                f"{self.timeout_s}s; raise connect.timeout_s or check the cluster"
            ) from None
        if response.status_code in ok:
            return response
        message = self._connect_message(response)
        if response.status_code == 409 or response.status_code >= 500:
            raise ConnectUnavailableError(
                f"Kafka Connect kept answering {response.status_code} to {method} {path}: {message}"
            )
        raise ConnectRequestError(
            f"Kafka Connect refused {method} {path} ({response.status_code}): {message}",
            status=response.status_code,
            connect_message=message,
        )

    def _connect_message(self, response: requests.Response) -> str:
        try:
            body = response.json()
            message = str(body.get("message", body))
        except ValueError:
            message = response.text.strip()[:2000]
        return redact(message, self._secrets)

    # -- the API -------------------------------------------------------------------------

    def version(self) -> dict[str, Any]:
        """Connect's version and Kafka cluster id (``GET /``)."""
        result: dict[str, Any] = self._request("GET", "/").json()
        return result

    def list_connectors(self) -> list[str]:
        """Names of every connector on the cluster."""
        return sorted(self._request("GET", "/connectors").json())

    def configs(self) -> dict[str, dict[str, str]]:
        """Every connector's config in one call (``?expand=info``)."""
        body = self._request("GET", "/connectors", params={"expand": "info"}).json()
        return {name: dict(entry["info"]["config"]) for name, entry in body.items()}

    def get_config(self, name: str) -> dict[str, str] | None:
        """A connector's config, or None if there is no such connector."""
        response = self._request("GET", f"/connectors/{quote(name)}/config", ok=(200, 404))
        if response.status_code == 404:
            return None
        return dict(response.json())

    def validate(self, connector_class: str, config: Mapping[str, str]) -> dict[str, list[str]]:
        """Connect's validation of ``config``; ``{field: [errors]}``, empty when valid."""
        plugin = connector_class.rsplit(".", 1)[-1]
        body = self._request(
            "PUT", f"/connector-plugins/{quote(plugin)}/config/validate", json=dict(config)
        ).json()
        errors: dict[str, list[str]] = {}
        for entry in body.get("configs", []):
            value = entry.get("value", {})
            messages = [redact(str(m), self._secrets) for m in value.get("errors", [])]
            if messages:
                errors[str(value.get("name"))] = messages
        return errors

    def validate_or_raise(self, name: str, connector_class: str, config: Mapping[str, str]) -> None:
        errors = self.validate(connector_class, config)
        if errors:
            lines = [f"{field}: {'; '.join(msgs)}" for field, msgs in errors.items()]
            raise ConnectorInvalidError(
                f"connector {name} is invalid:\n  " + "\n  ".join(lines), {name: errors}
            )

    def put_config(self, name: str, config: Mapping[str, str]) -> bool:
        """Create or update a connector idempotently; True if it was created."""
        response = self._request("PUT", f"/connectors/{quote(name)}/config", json=dict(config))
        return response.status_code == 201

    def status(self, name: str) -> ConnectorStatus | None:
        """A connector's and its tasks' states, or None if there is no such connector."""
        response = self._request("GET", f"/connectors/{quote(name)}/status", ok=(200, 404))
        if response.status_code == 404:
            return None
        return ConnectorStatus.from_json(response.json())

    def pause(self, name: str) -> None:
        self._request("PUT", f"/connectors/{quote(name)}/pause")

    def resume(self, name: str) -> None:
        self._request("PUT", f"/connectors/{quote(name)}/resume")

    def stop(self, name: str) -> None:
        """Stop the connector and its tasks, keeping its config and offsets (Connect 3.5+)."""
        self._request("PUT", f"/connectors/{quote(name)}/stop")

    def restart(self, name: str, *, include_tasks: bool = True, only_failed: bool = True) -> None:
        params = {
            "includeTasks": str(include_tasks).lower(),
            "onlyFailed": str(only_failed).lower(),
        }
        self._request("POST", f"/connectors/{quote(name)}/restart", params=params)

    def delete(self, name: str) -> bool:
        """Delete a connector; False if there was none."""
        response = self._request("DELETE", f"/connectors/{quote(name)}", ok=(200, 204, 404))
        return response.status_code != 404

    def offsets(self, name: str) -> list[dict[str, Any]]:
        """The connector's source offsets (Connect 3.5+)."""
        body = self._request("GET", f"/connectors/{quote(name)}/offsets").json()
        return list(body.get("offsets", []))
