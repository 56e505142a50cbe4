"""Keeping secrets out of output, logs and exceptions."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["MASK", "is_secret_key", "mask_config", "redact"]

MASK = "********"
_SECRET_WORDS = ("password", "secret", "token", "credential", "sasl.jaas.config", "ssl.key")


def is_secret_key(key: str) -> bool:
    """True for connector config keys whose values must never be shown."""
    lowered = key.lower()
    return any(word in lowered for word in _SECRET_WORDS)


def mask_config(config: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``config`` with secret values masked (provider references stay visible)."""
    return {
        key: (value if value.startswith("${") or not value else MASK)
        if is_secret_key(key)
        else value
        for key, value in config.items()
    }


def redact(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every non-empty secret replaced by the mask."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    return text
