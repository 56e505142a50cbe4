"""Creating the pipeline's topics explicitly (never relying on broker auto-creation).

A synchronous tool: kafka-python's ``KafkaAdminClient``, built by the shared
factory (edgefeed_base.kafkaclients). :func:`ensure_topics_sync` is the work;
:func:`ensure_topics` awaits it from asyncio code (the forwarder) in a thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from edgefeed_base.kafkaclients import KafkaClients, KafkaUnavailableError, in_daemon_thread

__all__ = ["ensure_topics", "ensure_topics_sync"]

#: CreateTopics' TOPIC_ALREADY_EXISTS: created meanwhile by another process, fine.
_TOPIC_ALREADY_EXISTS = 36


async def ensure_topics(
    bootstrap: Sequence[str],
    topics: Mapping[str, int],
    *,
    replication_factor: int = 1,
    client_options: Mapping[str, Any] | None = None,
    request_timeout_ms: int = 30_000,
) -> list[str]:
    """:func:`ensure_topics_sync`, awaited from asyncio code (a thread does the work)."""
    return await in_daemon_thread(
        ensure_topics_sync,
        bootstrap,
        topics,
        replication_factor=replication_factor,
        client_options=client_options,
        request_timeout_ms=request_timeout_ms,
    )


def ensure_topics_sync(
    bootstrap: Sequence[str],
    topics: Mapping[str, int],
    *,
    replication_factor: int = 1,
    client_options: Mapping[str, Any] | None = None,
    request_timeout_ms: int = 30_000,
) -> list[str]:
    """Create the topics that do not exist yet; returns the names created.

    Args:
        topics: Topic name -> partitions.
        client_options: Security options (``KafkaSecuritySettings.aiokafka_options``).

    Raises:
        KafkaUnavailableError: the brokers could not be reached, or refused to
            create a topic (the message names it and the broker's reason).
        KafkaAuthError: the brokers refused the credentials.
    """
    clients = KafkaClients(
        tuple(bootstrap),
        client_id="edgefeed-admin",
        request_timeout_ms=request_timeout_ms,
        options=client_options or {},
    )
    admin = clients.admin()
    try:
        with clients.errors("create topics"):
            existing = set(admin.list_topics())
            missing = {
                name: {"num_partitions": partitions, "replication_factor": replication_factor}
                for name, partitions in topics.items()
                if name not in existing
            }
            if not missing:
                return []
            answer = admin.create_topics(missing, raise_errors=False)
    finally:
        admin.close()
    refused = [
        f"{t['name']} ({t.get('error_message') or 'error ' + str(t['error_code'])})"
        for t in answer.get("topics", ())
        if t.get("error_code", 0) not in (0, _TOPIC_ALREADY_EXISTS)
    ]
    if refused:
        raise KafkaUnavailableError(
            f"brokers {clients.servers} refused to create topic(s): {', '.join(refused)}",
            clients.bootstrap_servers,
        )
    return list(missing)
