"""Creating the pipeline's topics explicitly (never relying on broker auto-creation)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

__all__ = ["ensure_topics"]


async def ensure_topics(
    bootstrap: Sequence[str],
    topics: Mapping[str, int],
    *,
    replication_factor: int = 1,
    client_options: Mapping[str, Any] | None = None,
) -> list[str]:
    """Create the topics that do not exist yet; returns the names created.

    Args:
        topics: Topic name -> partitions.
        client_options: More aiokafka options (``KafkaSecuritySettings.aiokafka_options``).
    """
    admin = AIOKafkaAdminClient(
        bootstrap_servers=list(bootstrap), client_id="edgefeed-admin", **(client_options or {})
    )
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [
            NewTopic(name=name, num_partitions=partitions, replication_factor=replication_factor)
            for name, partitions in topics.items()
            if name not in existing
        ]
        if missing:
            # Created meanwhile by another process: fine.
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics(missing)
        return [topic.name for topic in missing]
    finally:
        await admin.close()
