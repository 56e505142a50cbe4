"""One policy for every bearer token edgefeed accepts (model workers, the exporter).

A token is a shared secret sent in an HTTP header: one word of printable ASCII, at
least :data:`MIN_TOKEN_CHARS` characters (``secrets.token_urlsafe(32)`` gives 43).
"""

from __future__ import annotations

__all__ = ["MIN_TOKEN_CHARS", "token_problem"]

MIN_TOKEN_CHARS = 16
_MAKE_ONE = "e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'"


def token_problem(token: str, where: str) -> str | None:
    """Why ``token`` (found in ``where``: "the token file /run/x", ...) is refused, or
    None when it is acceptable. The text names the place, never the value."""
    if not token:
        return f"{where} holds no token; put one there ({_MAKE_ONE})"
    if not all(33 <= ord(c) < 127 for c in token):
        return (
            f"the token in {where} must be one word of printable ASCII "
            "(it travels in an HTTP header)"
        )
    if len(token) < MIN_TOKEN_CHARS:
        return (
            f"the token in {where} has {len(token)} characters; use at least "
            f"{MIN_TOKEN_CHARS} ({_MAKE_ONE})"
        )
    return None
