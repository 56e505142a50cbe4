"""One factory for edgefeed's synchronous Kafka clients (kafka-python).

The synchronous tools (``edgefeed lag``, the exporter's Kafka reads, the snapshot
notifications, topic creation) use kafka-python's ``KafkaAdminClient`` and
``KafkaConsumer``; the asyncio code (Faust's apps, the forwarders) keeps aiokafka
(docs/architecture.md says which part uses which, and why). Both clients take the
same security options, named as ``KafkaSecuritySettings.aiokafka_options()``
returns them (``security_protocol``, ``ssl_context``, ``sasl_mechanism``,
``sasl_plain_username``, ``sasl_plain_password``), so one settings block serves both.

:class:`KafkaClients` builds the clients with the cluster's servers, a client id,
bounded timeouts and those options, and :meth:`KafkaClients.errors` turns what
kafka-python raises into a typed error that names the servers and the setting to
fix, never the password. kafka-python is imported only when a client is built.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from edgefeed_base.errors import EdgefeedError

T = TypeVar("T")

__all__ = [
    "KafkaAuthError",
    "KafkaClientError",
    "KafkaClients",
    "KafkaOptionsError",
    "KafkaUnavailableError",
    "in_daemon_thread",
]

#: The security options of edgefeed's settings (``aiokafka_options()``), which
#: kafka-python names the same way. Anything else is refused: a typo would
#: otherwise be a client that silently talks PLAINTEXT.
SECURITY_OPTIONS = frozenset(
    {
        "security_protocol",
        "ssl_context",
        "sasl_mechanism",
        "sasl_plain_username",
        "sasl_plain_password",
    }
)


class KafkaClientError(EdgefeedError):
    """Base class of the errors of the synchronous Kafka clients. Messages name the
    brokers and the setting to fix, never the password.

    Attributes:
        servers: The bootstrap servers the client was built for.
    """

    def __init__(self, message: str, servers: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.servers = tuple(servers)


class KafkaUnavailableError(KafkaClientError):
    """The brokers could not be reached, timed out, or answered a request with an
    error. Retryable: the same call may succeed once the broker is up."""

    retryable = True


class KafkaAuthError(KafkaClientError):
    """The brokers refused the client's credentials or its TLS handshake (a wrong
    ``kafka.security`` block). Not retryable: fix the settings."""


class KafkaOptionsError(KafkaClientError, ValueError):
    """A client option is not one the factory knows (a misspelt security option),
    or kafka-python refused one. Not retryable: fix the caller or the settings."""


class _Redacted(str):
    """The password, as kafka-python needs it (a ``str``), shown as stars: the admin
    client logs its whole configuration at DEBUG level."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "'**********'"


@dataclass(frozen=True, slots=True)
class KafkaClients:
    """Builds kafka-python clients for one Kafka cluster.

    Attributes:
        bootstrap_servers: ``host:port`` of the brokers (``kafka.bootstrap_servers``).
        client_id: The id the brokers log and quota by.
        request_timeout_ms: How long one request, and the first connection, may take.
        options: Security options (``KafkaSecuritySettings.aiokafka_options()``);
            they hold the password, so they are never shown.
        setting: The setting that names the servers, for the messages.
    """

    bootstrap_servers: tuple[str, ...]
    client_id: str = "edgefeed"
    request_timeout_ms: int = 10_000
    options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    setting: str = "kafka.bootstrap_servers"

    def __post_init__(self) -> None:
        servers: object = self.bootstrap_servers
        if isinstance(servers, str) or not self.bootstrap_servers:
            raise KafkaOptionsError(
                f"{self.setting} must list at least one host:port, got {self.bootstrap_servers!r}"
            )
        unknown = sorted(set(self.options) - SECURITY_OPTIONS)
        if unknown:
            raise KafkaOptionsError(
                f"unknown Kafka client option(s) {', '.join(unknown)}; the factory takes "
                f"{', '.join(sorted(SECURITY_OPTIONS))} (KafkaSecuritySettings.aiokafka_options)",
                self.bootstrap_servers,
            )
        if self.request_timeout_ms <= 0:
            raise KafkaOptionsError(
                f"request timeout {self.request_timeout_ms} ms must be positive",
                self.bootstrap_servers,
            )

    @property
    def servers(self) -> str:
        """The servers, as one comma-separated string (for messages)."""
        return ",".join(self.bootstrap_servers)

    def _common(self) -> dict[str, Any]:
        options = dict(self.options)
        if options.get("sasl_plain_password") is not None:
            options["sasl_plain_password"] = _Redacted(options["sasl_plain_password"])
        return {
            "bootstrap_servers": list(self.bootstrap_servers),
            "client_id": self.client_id,
            "request_timeout_ms": self.request_timeout_ms,
            # The first connection waits no longer than a request (kafka-python's
            # default is 30 s): an unreachable broker fails within the timeout.
            "bootstrap_timeout_ms": self.request_timeout_ms,
            **options,
        }

    def admin(self) -> Any:
        """A connected ``kafka.KafkaAdminClient`` (the caller closes it).

        Raises:
            KafkaUnavailableError, KafkaAuthError, KafkaOptionsError: see :meth:`errors`.
        """
        return self._build(_admin_class(), "connect an admin client", self._common())

    def consumer(self, **overrides: Any) -> Any:
        """A group-less ``kafka.KafkaConsumer`` that commits nothing (the caller
        closes it); ``overrides`` are more kafka-python consumer options
        (``fetch_max_wait_ms``, ``max_partition_fetch_bytes``, ...).

        Raises:
            KafkaUnavailableError, KafkaAuthError, KafkaOptionsError: see :meth:`errors`.
        """
        from kafka import KafkaConsumer

        secret = SECURITY_OPTIONS & set(overrides)
        if secret:
            raise KafkaOptionsError(
                f"security option(s) {', '.join(sorted(secret))} come from the factory's "
                "options (kafka.security), not from a consumer's overrides",
                self.bootstrap_servers,
            )
        config: dict[str, Any] = {
            "group_id": None,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            **self._common(),
            **overrides,
        }
        return self._build(KafkaConsumer, "connect a consumer", config)

    def _build(self, make: Callable[..., Any], doing: str, config: dict[str, Any]) -> Any:
        from kafka.net.compat import KafkaNetClient

        _close_refused_sockets()

        built: list[Any] = []

        def net_client(**kwargs: Any) -> Any:
            client = KafkaNetClient(**kwargs)
            built.append(client)
            return client

        try:
            with self.errors(doing):
                made = make(kafka_client=net_client, **config)
        except BaseException:
            # kafka-python 3.0 starts its IO thread before it connects, and an admin
            # client that cannot connect leaves that thread running: a monitor
            # retrying every round against a down broker would gather them.
            for client in built:
                _shut(client)
            raise
        _close_sockets_on_close(made, built)
        return made

    @contextmanager
    def errors(self, doing: str) -> Iterator[None]:
        """Turn kafka-python's errors inside the block into edgefeed's.

        Args:
            doing: What the block does, for the message ("read offsets").

        Raises:
            KafkaAuthError: the brokers refused the credentials or the TLS handshake.
            KafkaOptionsError: kafka-python refused a client option.
            KafkaUnavailableError: the brokers could not be reached or answered an error.
        """
        import ssl

        from kafka import errors as kafka_errors

        servers = self.servers
        try:
            yield
        except (kafka_errors.SaslAuthenticationFailedError, ssl.SSLError) as exc:
            raise KafkaAuthError(
                f"cannot {doing} (brokers {servers} refused the client: "
                f"{_describe(exc)}); check kafka.security (protocol, username, the password "
                "source, ca_file)",
                self.bootstrap_servers,
            ) from None
        except kafka_errors.AuthorizationError as exc:
            raise KafkaAuthError(
                f"cannot {doing} (brokers {servers}: not authorized, {_describe(exc)}); grant "
                "kafka.security.username the ACLs docs/operations.md lists",
                self.bootstrap_servers,
            ) from None
        except kafka_errors.KafkaConfigurationError as exc:
            raise KafkaOptionsError(
                f"cannot {doing} (brokers {servers}): kafka-python refused an option "
                f"({_describe(exc)})",
                self.bootstrap_servers,
            ) from None
        except kafka_errors.KafkaError as exc:
            raise KafkaUnavailableError(
                f"cannot {doing} (brokers {servers}: {_describe(exc)}); is the broker running "
                f"and {self.setting} right?",
                self.bootstrap_servers,
            ) from None
        except OSError as exc:
            raise KafkaUnavailableError(
                f"cannot {doing} (brokers {servers}: {exc.strerror or type(exc).__name__}); is the "
                f"broker running and {self.setting} right?",
                self.bootstrap_servers,
            ) from None


async def in_daemon_thread(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``function(*args, **kwargs)`` in a thread of its own, awaited from asyncio.

    Not ``asyncio.to_thread``: the default executor's threads are joined when the
    event loop closes, so Ctrl-C on ``edgefeed lag --watch`` would wait for a
    client still bootstrapping against a silent broker (as long as the request
    timeout). A daemon thread lets the process leave at once; the call, once
    cancelled, finishes (and closes its clients) on its own.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return  # cancelled meanwhile
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(cast(T, result))

    def run() -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = function(*args, **kwargs)
        except BaseException as exc:  # handed to the awaiting task
            error = exc
        with suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    name = f"edgefeed-{getattr(function, '__name__', 'call')}"
    threading.Thread(target=run, name=name, daemon=True).start()
    return await future


_ADMIN_CLASS: list[type[Any]] = []


def _admin_class() -> type[Any]:
    """kafka-python's ``KafkaAdminClient``, reading the operations a broker reports as
    authorized the way Kafka's Java client does: codes it does not know are skipped.

    kafka-python 3.0.12 asks DescribeGroups (and Metadata) for the authorized
    operations and turns each bit into its ``ACLOperation`` enum, which stops at
    14. Tansu answers every bit set (``authorized_operations={0, 1, ..., 31}`` for
    ``DescribeGroupsRequest(version=5, groups=['g'], include_authorized_operations=True)``),
    so ``describe_groups`` raised ``ValueError: 15 is not a valid ACLOperation``
    and no group's state or members could be read: a stopped worker's group would
    never read as STOP. edgefeed reads no authorized operations.
    """
    if _ADMIN_CLASS:
        return _ADMIN_CLASS[0]
    from kafka import KafkaAdminClient
    from kafka.admin import ACLOperation

    known = {int(op) for op in ACLOperation} - {0, 1, 2}  # UNKNOWN, ANY, ALL: filters only

    class AdminClient(KafkaAdminClient):  # type: ignore[misc]  # kafka-python is untyped
        def _process_acl_operations(self, obj: dict[str, Any]) -> dict[str, Any]:
            codes = obj.get("authorized_operations")
            if codes is not None:
                obj["authorized_operations"] = [
                    ACLOperation(code).name for code in sorted(codes) if code in known
                ]
            return obj

    _ADMIN_CLASS.append(AdminClient)
    return AdminClient


def _close_refused_sockets() -> None:
    """Make kafka-python close the socket of a connection that fails.

    kafka-python 3.0.12's ``KafkaNetSocket.connect`` drops the socket unclosed
    when the connection is refused or times out (CPython closes it when it is
    freed, with a ResourceWarning): an exporter polling a down broker would leave
    them to the garbage collector. The same steps as the original, closing the
    socket on failure. Applied once; proxies (their own ``connect``) keep theirs.
    """
    from kafka.net.inet import KafkaNetSocket

    if getattr(KafkaNetSocket, "_edgefeed_closes_refused", False):
        return

    async def connect(
        self: Any,
        net: Any,
        addrinfo: tuple[Any, ...],
        socket_options: Sequence[tuple[Any, ...]] = (),
        timeout_at: float | None = None,
    ) -> Any:
        family, sock_type, proto, _canonname, sockaddr = addrinfo
        sock = self.socket(family, sock_type, proto)
        _SOCKETS.setdefault(net, weakref.WeakSet()).add(sock)
        try:
            sock.setblocking(False)
            for option in socket_options:
                sock.setsockopt(*option)
            return await self.sock_connect(net, sock, sockaddr, timeout_at=timeout_at)
        except BaseException:
            sock.close()
            raise

    KafkaNetSocket.connect = connect
    KafkaNetSocket._edgefeed_closes_refused = True


# Each kafka-python event loop (a KafkaNetClient's ``_net``) -> the sockets its
# connections opened: what :func:`_close_sockets_on_close` closes after the client.
_SOCKETS: weakref.WeakKeyDictionary[Any, weakref.WeakSet[Any]] = weakref.WeakKeyDictionary()


def _close_sockets_on_close(client: Any, built: Sequence[Any]) -> None:
    """Make ``client.close()`` also close every socket its connections opened.

    kafka-python 3.0.12 closes the connections it holds, but a connection still
    being set up when the client closes (its connect coroutine never resumed once
    the IO loop stopped) drops its connected socket unclosed: CPython closes it when
    it is freed, with a ResourceWarning, in whatever code runs then (found by the
    test suite, which turns that warning into an error). Closing a socket twice is
    harmless.
    """
    close = client.close

    def close_all(*args: Any, **kwargs: Any) -> Any:
        try:
            return close(*args, **kwargs)
        finally:
            for net_client in built:
                with suppress(TypeError):  # no loop, or one that takes no weak reference
                    opened = list(_SOCKETS.get(net_client._net, ()))
                    for sock in opened:
                        with suppress(OSError):
                            sock.close()

    client.close = close_all


def _shut(client: Any) -> None:
    """Stop a KafkaNetClient that its Kafka client never got to own (as
    ``KafkaAdminClient.close`` does: the connections, then the IO thread)."""
    with suppress(Exception):
        client.close()
    with suppress(Exception):
        client._net.stop(timeout_ms=5000)


def _describe(exc: BaseException) -> str:
    # kafka-python's errors already start with their class name.
    text = str(exc)
    name = type(exc).__name__
    return text if text.startswith(name) else f"{name}: {text}" if text else name
