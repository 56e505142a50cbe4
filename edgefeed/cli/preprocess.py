"""`edgefeed preprocess`: commands of the preprocess package."""

from __future__ import annotations

import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    """Add the preprocess commands to the root app."""
