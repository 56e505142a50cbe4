"""A secret given one of three ways: inline, by environment variable, or in a file.

Every secret setting of edgefeed (the database's and the replication role's
passwords, the Redis ACL users', the Kafka SASL password) offers the same three
fields, validated and resolved here once, by one rule:

- Loading the settings reads no secret. A process reads a secret when a component
  that needs it is built (a lookup client, a cache writer, a database connection,
  a Kafka client), so a process that never uses a secret starts without it: a
  Kubernetes pod or a Compose container mounts only the secrets of its role.
- Then the source must give a password. A ``password_file`` that is missing,
  unreadable, not UTF-8 or empty, or a ``password_env`` that is unset or empty, is a
  :class:`SecretSourceError` naming the setting (``regions[eu-west].reader
  .password_file``) and the file or variable, never the value; never an empty
  password that fails later as an authentication error naming nothing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, SecretStr

from edgefeed_base.errors import EdgefeedError

__all__ = ["PasswordFields", "SecretSourceError"]


class SecretSourceError(EdgefeedError, ValueError):
    """A secret's ``password_file`` or ``password_env`` gives no password.

    Raised when a component needs the secret, not when the settings load. The
    message names the setting's dotted path and the file or variable, and the fix;
    never the value. Not retryable: mount the file, set the variable, or fix the
    setting.
    """


class PasswordFields(BaseModel):
    """``password`` (inline: never in ``repr``, logs or errors), ``password_env`` (the
    name of an environment variable that holds it) or ``password_file`` (a file
    holding just the password, such as a Compose or Kubernetes secret)."""

    #: Where these fields sit in the settings file, as errors name them; a caller that
    #: knows better (a region's Redis user) passes ``setting=`` to :meth:`secret`.
    setting_path: ClassVar[str | None] = None

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

    def secret(self, setting: str | None = None) -> str:
        """The password, read from its source now (a rotated file is read afresh).

        Args:
            setting: The dotted path of these fields in the settings file, for the
                error (default: the class's :attr:`setting_path`).

        Returns:
            The password; "" only when no source is configured at all (a database
            reached by trust, peer or ``.pgpass`` authentication).

        Raises:
            SecretSourceError: ``password_env`` names a variable that is unset or
                empty, or ``password_file`` a file that is missing, not a file,
                unreadable, not UTF-8 or empty.
        """
        where = setting or self.setting_path or type(self).__name__
        if self.password_env:
            return _from_env(f"{where}.password_env", self.password_env)
        if self.password_file:
            return _from_file(f"{where}.password_file", self.password_file)
        return self.password.get_secret_value()

    def secret_for_redaction(self) -> str:
        """The password if its source can be read now, else "": only to mask it in
        output (a process that never uses a secret need not have it). Never use it
        to authenticate: that is :meth:`secret`, which says why a source fails."""
        try:
            return self.secret()
        except SecretSourceError:
            return ""


def _from_env(field: str, name: str) -> str:
    value = os.environ.get(name)
    if value is None:
        raise SecretSourceError(
            f"{field} names the environment variable {name}, which is not set in this "
            f"process; set {name} to the password (or give the password another way)"
        )
    if not value.strip():
        raise SecretSourceError(
            f"{field} names the environment variable {name}, which is empty; "
            f"set {name} to the password"
        )
    return value


def _from_file(field: str, path: Path) -> str:
    shown = repr(str(path))
    fix = f"mount the secret there or point {field} at the file that holds the password"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SecretSourceError(f"{field} is {shown}, which does not exist; {fix}") from None
    except IsADirectoryError:
        raise SecretSourceError(
            f"{field} is {shown}, which is a directory, not a file; {fix}"
        ) from None
    except PermissionError:
        raise SecretSourceError(
            f"{field} is {shown}, which this process (uid {os.geteuid()}) cannot read: "
            "permission denied; make it readable by the process's user "
            "(its owner, or the secret volume's mode)"
        ) from None
    except UnicodeDecodeError:
        # The error would quote a byte of the file: say only what is wrong.
        raise SecretSourceError(
            f"{field} is {shown}, which is not UTF-8 text; write the password there as UTF-8"
        ) from None
    except OSError as exc:
        raise SecretSourceError(
            f"{field} is {shown}, which cannot be read ({exc.strerror or type(exc).__name__}); "
            f"{fix}"
        ) from None
    password = text.strip()
    if not password:
        raise SecretSourceError(
            f"{field} is {shown}, which is empty; write the password into it (one line)"
        )
    return password
