"""Keeping secrets out of output, logs and exceptions.

Two tools, used together wherever text may reach a person:

- :func:`redact_url` / :func:`redact_urls`: the userinfo of a URL
  (``http://user:pass@host``) becomes ``***``, whatever the secret is, so a URL
  can be shown (``http://***@host``) without knowing which part is secret.
- :func:`redact`: every known secret value (a database password, and each URL
  password in its raw and percent-decoded forms, see :func:`url_secrets`) is
  replaced by the mask, for text that quotes a secret outside a URL (a libpq
  message, a connector trace).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from urllib.parse import unquote

__all__ = [
    "MASK",
    "URL_MASK",
    "is_secret_key",
    "mask_config",
    "redact",
    "redact_url",
    "redact_urls",
    "url_secrets",
]

MASK = "********"
URL_MASK = "***"
_SECRET_WORDS = ("password", "secret", "token", "credential", "sasl.jaas.config", "ssl.key")
# scheme://userinfo@ : the userinfo runs to the last "@" of the word, so a
# password with an unquoted "@" or "/" is masked whole (a path holding an "@"
# is masked too: showing too little is the safe side).
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^\s'\"<>]*)@")


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
    """``text`` with every non-empty secret replaced by the mask (longest first)."""
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


def redact_url(url: str) -> str:
    """``url`` with its userinfo replaced: ``redis://:pw@h:6379/0`` -> ``redis://***@h:6379/0``."""
    return redact_urls(url)


def redact_urls(text: str) -> str:
    """``text`` with the userinfo of every URL in it replaced by ``***``."""
    return _USERINFO.sub(lambda m: f"{m.group('scheme')}{URL_MASK}@", text)


def url_secrets(text: str) -> tuple[str, ...]:
    """The userinfo secrets of every URL in ``text``, as written and percent-decoded.

    For ``redis://user:pw@host`` that is ``pw`` and ``user:pw``; a userinfo
    without ``:`` (``https://TOKEN@host``) is a secret whole.
    """
    found: set[str] = set()
    for match in _USERINFO.finditer(text):
        userinfo = match.group("userinfo")
        _, colon, password = userinfo.partition(":")
        for secret in (userinfo, password if colon else ""):
            if secret:
                found.update((secret, unquote(secret)))
    return tuple(sorted(found))
