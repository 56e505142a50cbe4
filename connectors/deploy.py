"""Plan and apply: the difference between declared and deployed connectors, and
applying it all-or-nothing."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from connectors.client import ConnectClient, ConnectorStatus
from connectors.config import CONNECTOR_CLASS, render_connector_config
from connectors.database import check_sources, prepare_database, prepare_replication_role
from connectors.exceptions import (
    ConnectorFailedError,
    ConnectorInvalidError,
    ConnectorsError,
    ConnectUnavailableError,
)
from connectors.secrets import MASK, is_secret_key
from connectors.settings import DatabaseSettings, SourceSettings

__all__ = ["MANAGED_PREFIX", "ConnectorChange", "apply", "plan", "wait_running"]

MANAGED_PREFIX = "edgefeed-"
Action = Literal["create", "update", "unchanged", "delete"]
_IGNORED_KEYS = frozenset({"name"})


def _shown(key: str, value: str | None) -> str | None:
    if value is None or not is_secret_key(key) or value.startswith("${"):
        return value
    return MASK


@dataclass(frozen=True, slots=True)
class ConnectorChange:
    """What applying would do to one connector.

    Attributes:
        changed: ``{key: (deployed, desired)}`` with secret values masked.
        desired: The full desired config (secrets in clear: never print it).
    """

    name: str
    action: Action
    changed: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)
    desired: dict[str, str] | None = None
    deployed: dict[str, str] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "action": self.action,
            "changed": {k: {"deployed": d, "desired": w} for k, (d, w) in self.changed.items()},
        }


def _diff(
    deployed: dict[str, str], desired: dict[str, str]
) -> dict[str, tuple[str | None, str | None]]:
    keys = (set(deployed) | set(desired)) - _IGNORED_KEYS
    return {
        key: (_shown(key, deployed.get(key)), _shown(key, desired.get(key)))
        for key in sorted(keys)
        if deployed.get(key) != desired.get(key)
    }


def plan(
    client: ConnectClient, database: DatabaseSettings, sources: Sequence[SourceSettings]
) -> list[ConnectorChange]:
    """Compare the declared sources with the connectors deployed on the cluster.

    Connectors named ``edgefeed-*`` that no source declares are planned for
    deletion (applied only with ``prune``).
    """
    deployed = client.configs()
    changes: list[ConnectorChange] = []
    declared = set()
    for source in sources:
        name = source.connector_name
        declared.add(name)
        desired = render_connector_config(database, source)
        current = deployed.get(name)
        if current is None:
            changes.append(ConnectorChange(name, "create", _diff({}, desired), desired, None))
            continue
        diff = _diff(current, desired)
        action: Action = "update" if diff else "unchanged"
        changes.append(ConnectorChange(name, action, diff, desired, current))
    for name in sorted(deployed):
        if name.startswith(MANAGED_PREFIX) and name not in declared:
            changes.append(ConnectorChange(name, "delete", {}, None, deployed[name]))
    return changes


def apply(
    client: ConnectClient,
    database: DatabaseSettings,
    sources: Sequence[SourceSettings],
    *,
    prune: bool = False,
    wait_s: float | None = None,
) -> list[ConnectorChange]:
    """Validate everything, then create, update (and with ``prune`` delete) connectors.

    All-or-nothing: if any config is invalid, nothing is applied; if a request
    fails midway, the connectors already changed are put back as they were.

    Raises:
        SourceValidationError: a declared table or column does not exist.
        ConnectorInvalidError: Connect's validation rejected a config.
        ConnectorFailedError: with ``wait_s``, a connector or task failed to start.
    """
    changes = plan(client, database, sources)
    pending = [
        (change, change.desired)
        for change in changes
        if change.action in ("create", "update") and change.desired is not None
    ]
    if database.replication is not None and pending:
        # Connect's validation logs in as the replication role: it must exist first.
        check_sources(database, sources)
        prepare_replication_role(database, sources)
    errors: dict[str, dict[str, list[str]]] = {}
    for change, desired in pending:
        found = client.validate(CONNECTOR_CLASS, {**desired, "name": change.name})
        if found:
            errors[change.name] = found
    if errors:
        lines = [
            f"{name}: {field_}: {'; '.join(messages)}"
            for name, fields in errors.items()
            for field_, messages in fields.items()
        ]
        raise ConnectorInvalidError(
            "Kafka Connect rejected the connector config (nothing was applied):\n  "
            + "\n  ".join(lines),
            errors,
        )
    check_sources(database, sources)
    prepare_database(database, sources)
    done: list[ConnectorChange] = []
    try:
        for change, desired in pending:
            client.put_config(change.name, desired)
            done.append(change)
        if prune:
            for change in changes:
                if change.action == "delete":
                    client.delete(change.name)
                    done.append(change)
    except ConnectorsError:
        _roll_back(client, done)
        raise
    if wait_s is not None:
        for source in sources:
            wait_running(client, source.connector_name, timeout_s=wait_s)
    return changes


def _roll_back(client: ConnectClient, done: Sequence[ConnectorChange]) -> None:
    for change in reversed(done):
        try:
            if change.action == "create":
                client.delete(change.name)
            elif change.deployed is not None:
                previous = {k: v for k, v in change.deployed.items() if k not in _IGNORED_KEYS}
                client.put_config(change.name, previous)
        except ConnectorsError:
            continue  # best effort: the original error is the one to report


def wait_running(client: ConnectClient, name: str, *, timeout_s: float) -> ConnectorStatus:
    """Poll until the connector and all its tasks run.

    Raises:
        ConnectorFailedError: it (or a task) FAILED; the message has the cause.
        ConnectUnavailableError: it was not running within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    status: ConnectorStatus | None = None
    while time.monotonic() < deadline:
        status = client.status(name)
        if status is not None:
            if status.running:
                return status
            if status.failed:
                raise ConnectorFailedError(
                    f"connector {name} failed: {status.failure()}; fix the cause, then "
                    f"`edgefeed connectors restart {name}`"
                )
        time.sleep(0.2)
    state = status.state if status else "absent"
    raise ConnectUnavailableError(
        f"connector {name} not RUNNING after {timeout_s}s (state {state}); "
        "see `edgefeed connectors status` and the Connect log"
    )
