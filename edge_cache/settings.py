"""Settings of the per-region edge caches."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from edgefeed_base.secrets import PasswordFields

__all__ = ["RedisRole", "RedisTLSSettings", "RedisUserSettings", "RegionSettings"]

#: Who connects: the lookup client (and the monitor, ``verify``) read; the pipeline writes.
RedisRole = Literal["reader", "writer"]


class RedisUserSettings(PasswordFields):
    """A Redis ACL user (``AUTH username password``).

    The password is a secret (never in ``repr``, logs or errors); give it one
    way: ``password`` (usually ``${ENV}``-expanded), ``password_env`` (the name
    of an environment variable) or ``password_file`` (a file holding just the
    password, such as a Compose or Kubernetes secret).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    username: str = Field(min_length=1)

    @model_validator(mode="after")
    def _one_password_source(self) -> RedisUserSettings:
        given = self.password_sources()
        if len(given) != 1:
            raise ValueError(
                f"Redis user {self.username!r} needs exactly one of password, password_env, "
                f"password_file (got {', '.join(given) or 'none'})"
            )
        return self


class RedisTLSSettings(BaseModel):
    """TLS options of a ``rediss://`` URL (redis-py's ``ssl_*`` options).

    Attributes:
        ca_file: PEM bundle that signed the server's certificate (None: the
            system's trust store).
        cert_file: Client certificate, when the server asks for one
            (``tls-auth-clients yes``).
        key_file: The client certificate's private key.
        check_hostname: Check the server's name against its certificate.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    check_hostname: bool = True

    @model_validator(mode="after")
    def _pair(self) -> RedisTLSSettings:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("tls needs both cert_file and key_file (or neither)")
        return self


_REGION_NAME = re.compile(r"^[a-z][a-z0-9-]{0,62}$")


class RegionSettings(BaseModel):
    """One serving region and its Redis edge cache.

    Attributes:
        name: Region name, lowercase letters, digits and dashes (``eu-west``).
        redis_url: ``redis://host:port/db`` of the region's cache.
        residency_zone: Data-residency zone (``eu``, ``us``, ``apac``). Personal
            data of an entity whose home region is here may be served only by
            regions of the same zone.
        failover: Regions to fall back to, in order, when this one is down.
        cluster: True when ``redis_url`` names one node of a Redis Cluster (the
            client discovers the others); False for a single server.
        reader: ACL user of the readers (lookup client, monitor, ``verify``):
            read-only in a hardened deployment.
        writer: ACL user of the pipeline's cache writer.
        tls: Certificates for a ``rediss://`` URL.

    Credentials in the URL (``redis://user:pass@host``) serve both roles; give
    either those or ``reader``/``writer``, not both.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    redis_url: str
    residency_zone: str
    failover: list[str] = Field(default_factory=list)
    cluster: bool = False
    reader: RedisUserSettings | None = None
    writer: RedisUserSettings | None = None
    tls: RedisTLSSettings | None = None

    @field_validator("name")
    @classmethod
    def _name_shape(cls, value: str) -> str:
        if not _REGION_NAME.match(value):
            raise ValueError(
                f"region name {value!r} must be lowercase letters, digits and dashes, "
                "starting with a letter (e.g. 'eu-west')"
            )
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url {value!r} must start with redis://, rediss:// or unix://")
        return value

    @model_validator(mode="after")
    def _credentials_one_way(self) -> RegionSettings:
        url = urlsplit(self.redis_url)
        if (self.reader or self.writer) and (url.username or url.password):
            raise ValueError(
                f"region {self.name!r} has credentials in redis_url and reader/writer users; "
                "give them one way (drop the userinfo from the URL)"
            )
        if self.tls is not None and url.scheme != "rediss":
            raise ValueError(
                f"region {self.name!r} has tls options but its redis_url is not rediss://; "
                "use rediss://host:port/db"
            )
        return self

    def redis_options(self, role: RedisRole) -> dict[str, Any]:
        """redis-py keyword options for ``role``: its ACL user and, for rediss://, TLS.

        Pass them with the URL: ``redis.Redis.from_url(region.redis_url,
        **region.redis_options("reader"))``. The result holds the password:
        never log it. The password is read from its source now, when a client is
        built: only the roles a process uses need their secret.

        Raises:
            SecretSourceError: the role's ``password_file`` or ``password_env``
                gives no password (named as ``regions[NAME].ROLE.password_file``).
        """
        options: dict[str, Any] = {}
        user = self.reader if role == "reader" else self.writer
        if user is not None:
            options["username"] = user.username
            options["password"] = user.secret(f"regions[{self.name}].{role}")
        if self.tls is not None:
            tls = self.tls
            options["ssl_check_hostname"] = tls.check_hostname
            if tls.ca_file is not None:
                options["ssl_ca_certs"] = str(tls.ca_file)
            if tls.cert_file is not None and tls.key_file is not None:
                options["ssl_certfile"] = str(tls.cert_file)
                options["ssl_keyfile"] = str(tls.key_file)
        return options
