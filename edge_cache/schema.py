"""Feature schemas: which features an entity type has, their dtypes, and their version.

A :class:`FeatureSchema` is shared by the writer (the pipeline) and the reader
(serving code). Versions evolve append-only: version N+1 keeps every feature of
version N, in the same order and with the same dtype, and may add features at
the end. That rule is what lets an older client read a value written by a newer
schema (it reads the prefix it knows) and a newer client read an older value
(the added features are missing), and :meth:`FeatureSchema.evolve` is the way
to make a new version so the rule holds by construction.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from edge_cache.exceptions import SchemaError

__all__ = ["DTYPES", "Dtype", "Feature", "FeatureSchema"]

Dtype = Literal["float32", "float64", "int32", "int64", "bool"]
DTYPES: tuple[Dtype, ...] = get_args(Dtype)

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$")
MAX_FEATURES = 4096
MAX_VERSION = 65535
MAX_SLOTS = 64  # scheduled vectors per value (see FeatureSchema.slots)


@dataclass(frozen=True, slots=True)
class Feature:
    """One feature of an entity type.

    Attributes:
        name: Feature name (letters, digits, ``_ . -``; starts with a letter or ``_``).
        dtype: Stored type. ``float32`` is the packed hot-path type; the others
            are for the small typed fields that must round-trip exactly.
    """

    name: str
    dtype: Dtype = "float32"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise SchemaError(
                f"feature name {self.name!r} is invalid: use letters, digits, '_', '.', '-', "
                "starting with a letter or '_' (at most 128 characters)"
            )
        if self.dtype not in DTYPES:
            raise SchemaError(
                f"feature {self.name!r} has dtype {self.dtype!r}; supported: {', '.join(DTYPES)}"
            )


@dataclass(frozen=True, slots=True)
class FeatureSchema:
    """The features of one entity type at one schema version.

    Attributes:
        entity: Entity type name (``user``, ``item``).
        features: The features, in storage order.
        version: Schema version, 1-65535, bumped by :meth:`evolve`.
        personal: True when the entity is a person whose data is bound to the
            residency zone of its home region: the lookup client then never
            reads it from a region of another zone, even on failover.
        slots: Scheduled vectors each value carries besides the one in force
            (0: none). An entity type with windows read as of the read time stores
            the vector in force when it was written and the next ``slots`` ones,
            each with the time it takes over; the reader picks the one in force at
            its read time (see :mod:`edge_cache.layout`).
        fingerprint: 32-bit hash of entity, version, features and slots; stored
            with every value so a reader can tell two different schemas that
            claim the same version apart.
    """

    entity: str
    features: tuple[Feature, ...]
    version: int = 1
    personal: bool = False
    slots: int = 0
    fingerprint: int = field(init=False, repr=False, compare=False)
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.entity, str) or not _NAME.match(self.entity):
            raise SchemaError(
                f"entity type {self.entity!r} is invalid: use letters, digits, '_', '.', '-', "
                "starting with a letter or '_'"
            )
        features = tuple(self.features)
        object.__setattr__(self, "features", features)
        if not features:
            raise SchemaError(f"entity type {self.entity!r} needs at least one feature")
        if len(features) > MAX_FEATURES:
            raise SchemaError(
                f"entity type {self.entity!r} has {len(features)} features; at most {MAX_FEATURES}"
            )
        if (
            isinstance(self.version, bool)
            or not isinstance(self.version, int)
            or not (1 <= self.version <= MAX_VERSION)
        ):
            raise SchemaError(
                f"schema version {self.version!r} of {self.entity!r} must be an int in "
                f"1..{MAX_VERSION}"
            )
        if (
            isinstance(self.slots, bool)
            or not isinstance(self.slots, int)
            or not (0 <= self.slots <= MAX_SLOTS)
        ):
            raise SchemaError(
                f"slots={self.slots!r} of {self.entity!r} must be an int in 0..{MAX_SLOTS}"
            )
        index: dict[str, int] = {}
        for position, feature in enumerate(features):
            if not isinstance(feature, Feature):
                raise SchemaError(
                    f"features of {self.entity!r} must be Feature objects, got {feature!r}"
                )
            if feature.name in index:
                raise SchemaError(f"feature {feature.name!r} appears twice in {self.entity!r}")
            index[feature.name] = position
        object.__setattr__(self, "_index", index)
        digest = hashlib.blake2b(self._canonical().encode(), digest_size=4).digest()
        object.__setattr__(self, "fingerprint", int.from_bytes(digest, "little"))

    @classmethod
    def of(
        cls,
        entity: str,
        features: Mapping[str, Dtype] | Iterable[str],
        *,
        version: int = 1,
        personal: bool = False,
        slots: int = 0,
    ) -> FeatureSchema:
        """Build a schema from ``{name: dtype}`` or from names (all ``float32``)."""
        if isinstance(features, Mapping):
            items = tuple(Feature(name, dtype) for name, dtype in features.items())
        else:
            items = tuple(Feature(name) for name in features)
        return cls(entity, items, version=version, personal=personal, slots=slots)

    @property
    def names(self) -> tuple[str, ...]:
        """Feature names in storage order."""
        return tuple(feature.name for feature in self.features)

    def position(self, name: str) -> int | None:
        """Storage position of feature ``name``, or None when it is not in the schema."""
        return self._index.get(name)

    def evolve(self, *added: Feature) -> FeatureSchema:
        """The next version: every current feature kept, ``added`` appended.

        Raises:
            SchemaError: an added feature already exists, or the version would overflow.
        """
        if not added:
            raise SchemaError(f"evolving {self.entity!r} needs at least one new feature")
        if self.version >= MAX_VERSION:
            raise SchemaError(f"schema {self.entity!r} is at the last version {MAX_VERSION}")
        return FeatureSchema(
            self.entity, self.features + tuple(added), self.version + 1, self.personal, self.slots
        )

    def is_prefix_of(self, other: FeatureSchema) -> bool:
        """True when ``other`` is this schema or an append-only evolution of it."""
        return (
            self.entity == other.entity
            and len(self.features) <= len(other.features)
            and other.features[: len(self.features)] == self.features
        )

    def _canonical(self) -> str:
        canonical: list[Any] = [
            self.entity,
            self.version,
            [[f.name, f.dtype] for f in self.features],
        ]
        if self.slots:  # absent when 0: the fingerprints of unscheduled schemas never change
            canonical.append(self.slots)
        return json.dumps(canonical, separators=(",", ":"))

    def to_json(self) -> str:
        """The schema as JSON (what the writer publishes in the cache's schema registry)."""
        document: dict[str, Any] = {
            "entity": self.entity,
            "version": self.version,
            "personal": self.personal,
            "features": [[f.name, f.dtype] for f in self.features],
        }
        if self.slots:
            document["slots"] = self.slots
        return json.dumps(document, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> FeatureSchema:
        """Parse :meth:`to_json` output.

        Raises:
            SchemaError: the text is not a schema document.
        """
        try:
            data: Any = json.loads(text)
            features = tuple(Feature(str(name), dtype) for name, dtype in data["features"])
            return cls(
                str(data["entity"]),
                features,
                version=int(data["version"]),
                personal=bool(data["personal"]),
                slots=int(data.get("slots", 0)),
            )
        except SchemaError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise SchemaError(f"not a feature schema document: {exc}") from None
