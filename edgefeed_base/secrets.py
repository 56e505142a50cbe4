"""A secret given one of three ways: inline, by environment variable, or in a file.

Every secret setting of edgefeed (the database's and the replication role's
passwords, the Redis ACL users', the Kafka SASL password) offers the same three
fields, validated and resolved here once.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, SecretStr

__all__ = ["PasswordFields"]


class PasswordFields(BaseModel):
    """``password`` (inline: never in ``repr``, logs or errors), ``password_env`` (the
    name of an environment variable that holds it) or ``password_file`` (a file
    holding just the password, such as a Compose or Kubernetes secret)."""

    password: SecretStr = SecretStr("")
    password_env: str | None = None
    password_file: Path | None = None

    def password_sources(self) -> list[str]:
        """The names of the fields that give the password (one is expected)."""
        return [
            name
            for name, value in (
                ("password", self.password.get_secret_value()),
                ("password_env", self.password_env),
                ("password_file", self.password_file),
            )
            if value
        ]

    def secret(self) -> str:
        """The password itself, from wherever it is configured ("" for none, or when
        its variable is unset or its file unreadable)."""
        if self.password_env:
            return os.environ.get(self.password_env, "")
        if self.password_file:
            try:
                return self.password_file.read_text(encoding="utf-8").strip()
            except OSError:
                return ""
        return self.password.get_secret_value()
