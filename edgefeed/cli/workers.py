"""`edgefeed workers`: commands of the workers package."""

from __future__ import annotations

import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    """Add the workers commands to the root app."""
