"""One to_dict/from_dict for the models' frozen dataclass configs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any, Self, cast

__all__ = ["PlainConfig"]


class PlainConfig:
    """Mixin for a frozen dataclass config saved inside a checkpoint.

    Tuples travel as lists, so a checkpoint holds plain types only and loads
    with ``torch.load(weights_only=True)``.
    """

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (tuples become lists)."""
        return {
            key: list(value) if isinstance(value, tuple) else value
            for key, value in asdict(cast(Any, self)).items()
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """Inverse of :meth:`to_dict` (lists become tuples)."""
        fields = {
            key: tuple(value) if isinstance(value, list) else value for key, value in data.items()
        }
        return cast(Self, cast(Any, cls)(**fields))
