"""Debezium PostgreSQL connector configs and the Kafka Connect REST client."""

from __future__ import annotations

from connectors.settings import ConnectSettings, DatabaseSettings

__all__ = ["ConnectSettings", "DatabaseSettings"]
