"""The schema registry of one region's cache, as ``edgefeed features`` reads and extends it.

The registry is append-only: ``ef:schema:<entity>:<version>`` holds each
version's feature list (set once, by whoever writes first: a worker at start or
``features apply``). Beside it, ``ef:schemadecl:<entity>:<version>`` holds
the declaration the version was made from (opaque text here: the pipeline's),
``ef:backfill:<entity>:<version>`` the tables still to snapshot, and each
worker's marker (``ef:writer:<id>``) the versions it writes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from edge_cache.exceptions import SchemaError
from edge_cache.layout import KeyLayout
from edge_cache.schema import FeatureSchema

__all__ = ["Registry", "marker_value"]


def marker_value(schemas: Mapping[str, int] | Any) -> bytes:
    """A writer marker's value: the schema version of each entity it writes."""
    versions = (
        dict(schemas) if isinstance(schemas, Mapping) else {s.entity: s.version for s in schemas}
    )
    return json.dumps(versions, sort_keys=True).encode()


def _text(value: bytes | str | None) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else value


@dataclass(slots=True)
class Registry:
    """Reads through ``reader`` (SCAN, GET), writes through ``writer`` (SET NX, GET).

    Args:
        reader: A sync redis-py client as the region's reader user.
        writer: A sync redis-py client as the region's writer user (None: read only).
    """

    reader: Any
    writer: Any = None
    layout: KeyLayout = field(default_factory=KeyLayout)

    def versions(self, entity: str) -> dict[int, FeatureSchema]:
        """Every registered version of ``entity``."""
        prefix = self.layout.schema_key(entity, 0)[:-1]
        found: dict[int, FeatureSchema] = {}
        for key in self.reader.scan_iter(match=f"{prefix}*", count=1000):
            version = _text(key)[len(prefix) :]  # type: ignore[index]
            if not version.isdigit():
                continue
            document = self.reader.get(key)
            if document is not None:
                found[int(version)] = FeatureSchema.from_json(document)
        return found

    def latest(self, entity: str) -> FeatureSchema | None:
        """The newest registered version of ``entity`` (None: none)."""
        versions = self.versions(entity)
        return versions[max(versions)] if versions else None

    def declaration(self, entity: str, version: int) -> str | None:
        """The declaration ``version`` was registered with (None: unknown)."""
        return _text(self.reader.get(self.layout.declaration_key(entity, version)))

    def backfill(self, entity: str, version: int) -> list[str] | None:
        """Tables ``version`` still has to snapshot (None: no record)."""
        text = _text(self.reader.get(self.layout.backfill_key(entity, version)))
        return None if text is None else [str(t) for t in json.loads(text)]

    def writers(self) -> list[dict[str, int]]:
        """The versions each live worker writes (its marker; ``{}`` for an older worker)."""
        found: list[dict[str, int]] = []
        for key in self.reader.scan_iter(match=self.layout.writer_marker_pattern(), count=1000):
            text = _text(self.reader.get(key))
            try:
                value = json.loads(text) if text else {}
            except ValueError:
                value = {}
            found.append(
                {str(k): int(v) for k, v in value.items()} if isinstance(value, dict) else {}
            )
        return found

    def register(self, schema: FeatureSchema, declaration: str, backfill: list[str]) -> None:
        """Register ``schema`` with its declaration and the tables to snapshot.

        Idempotent for the same schema and declaration.

        Raises:
            SchemaError: the version already holds another schema or declaration.
        """
        if self.writer is None:
            raise SchemaError("the registry was opened read-only; give it a writer client")
        key = self.layout.schema_key(schema.entity, schema.version)
        if not self.writer.set(key, schema.to_json(), nx=True):
            stored = self.writer.get(key)
            if stored is None or FeatureSchema.from_json(stored).fingerprint != schema.fingerprint:
                raise SchemaError(
                    f"{key!r} already holds a different {schema.entity!r} version "
                    f"{schema.version}; a changed feature set needs a new version"
                )
        key = self.layout.declaration_key(schema.entity, schema.version)
        if not self.writer.set(key, declaration, nx=True) and _text(self.writer.get(key)) != (
            declaration
        ):
            raise SchemaError(
                f"{key!r} already holds another declaration of {schema.entity!r} version "
                f"{schema.version}: two meanings under one version; bump the version"
            )
        self.writer.set(
            self.layout.backfill_key(schema.entity, schema.version), json.dumps(backfill), nx=True
        )

    def backfilled(self, entity: str, version: int) -> None:
        """Record that the tables of ``version`` were snapshotted."""
        self.writer.set(self.layout.backfill_key(entity, version), "[]")
