"""Redis ACL rules for edgefeed's two users: what each one's commands really need.

The reader (lookup client, near cache listener, monitor, ``edgefeed pipeline
verify``) reads vectors, schema documents and freshness records; the writer
(the pipeline's cache writer, ``workers seed-demo``) runs the write script and
records freshness and schemas. Neither may run FLUSHALL, CONFIG, KEYS, DEBUG,
MODULE, SHUTDOWN, ACL or anything else not named here, and both are confined
to the keys under the layout's namespace.

Commands are listed, not categories (``+@read`` grows with each Redis
release); one test per user runs the real clients against a real
redis-server loaded with these rules (tests/integration/edge_cache/test_redis_acl.py).
"""

from __future__ import annotations

import hashlib

from edge_cache.layout import KeyLayout
from edge_cache.settings import RedisRole

__all__ = ["COMMANDS", "acl_rule"]

# What every redis-py connection sends on connect, and what a cluster client
# needs to learn the slots and the commands' key positions. Not CLIENT SETINFO:
# Redis 7.0 does not know it (an unknown command makes the whole ACL file fail
# to load) and redis-py ignores its refusal.
_CONNECTION = (
    "auth",
    "hello",
    "ping",
    "select",
    "client|setname",
    "command",
    "cluster|slots",
    "cluster|shards",
    "cluster|nodes",
    "readonly",
)

#: The commands each user may run.
COMMANDS: dict[RedisRole, tuple[str, ...]] = {
    "reader": (
        *_CONNECTION,
        # LookupCore's reads: one GET, MGET + EXISTS in one round trip, TYPE to
        # name a key holding another type; schema documents by GET.
        "get",
        "mget",
        "exists",
        "type",
        # the near cache's invalidation connection
        "client|id",
        "client|tracking",
        # the monitor's freshness records, sampled vector headers and quarantine
        # list; verify's key scan
        "scan",
        "hgetall",
        "getrange",
        "hlen",
        "hscan",
    ),
    "writer": (
        *_CONNECTION,
        # the write script (edge_cache/lua/write.lua) and what it calls
        "evalsha",
        "script|load",
        "get",
        "set",
        # freshness records; the schema registry (SET NX, then GET to compare)
        "hset",
        # the pipeline's quarantine list (HSET / HDEL) and its check that the
        # cache kept its data (EXISTS on the registry, EXPIRE on its marker key)
        "hdel",
        "exists",
        "expire",
    ),
}


def acl_rule(role: RedisRole, username: str, password: str, layout: KeyLayout | None = None) -> str:
    """One ``user`` line of a Redis ACL file (also ``ACL SETUSER``'s arguments).

    The password is stored as its SHA-256 (``#<hex>``), so the file or the
    command line that carries the rule does not hold the password itself.
    """
    layout = layout or KeyLayout()
    digest = hashlib.sha256(password.encode("utf-8")).hexdigest()
    commands = " ".join(f"+{command}" for command in COMMANDS[role])
    return (
        f"user {username} reset on #{digest} ~{layout.namespace}:* resetchannels -@all {commands}"
    )
