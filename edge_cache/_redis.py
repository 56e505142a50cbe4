"""Small redis-py helpers shared by the writer and the client."""

from __future__ import annotations

import redis

__all__ = ["close_client"]


def close_client(client: redis.Redis | redis.RedisCluster) -> None:
    """Close a client and every connection it opened.

    ``RedisCluster.close()`` in redis-py 8.1 leaves a node connection open (a
    ResourceWarning at garbage collection), so the node pools are disconnected
    explicitly.
    """
    if isinstance(client, redis.RedisCluster):
        nodes = [*client.get_nodes(), *client.nodes_manager.startup_nodes.values()]  # type: ignore[no-untyped-call]
        client.close()
        for node in nodes:
            if node.redis_connection is not None:
                node.redis_connection.connection_pool.disconnect()
        return
    client.close()
