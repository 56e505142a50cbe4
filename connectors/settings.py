"""Settings of the CDC source database and the Kafka Connect cluster."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

__all__ = ["ConnectSettings", "DatabaseSettings"]


class ConnectSettings(BaseModel):
    """Where the Kafka Connect REST API listens.

    Attributes:
        url: Base URL of the Connect REST API, e.g. ``http://127.0.0.1:8083``.
        timeout_s: Timeout of one REST call, in seconds.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = "http://127.0.0.1:8083"
    timeout_s: float = Field(default=10.0, gt=0)

    @field_validator("url")
    @classmethod
    def _http(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"connect url {value!r} must start with http:// or https://")
        return value.rstrip("/")


class DatabaseSettings(BaseModel):
    """The PostgreSQL database whose changes Debezium captures.

    The password is a secret: it never appears in ``repr``, logs or errors.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=5432, ge=1, le=65535)
    dbname: str = "edgefeed"
    user: str = "postgres"
    password: SecretStr = SecretStr("")

    def dsn(self) -> str:
        """A libpq connection string (contains the password: never log it)."""
        parts = [
            f"host={self.host}",
            f"port={self.port}",
            f"dbname={self.dbname}",
            f"user={self.user}",
        ]
        if self.password.get_secret_value():
            parts.append(f"password={self.password.get_secret_value()}")
        return " ".join(parts)
