"""No secret appears in any output, log or exception of any ``edgefeed`` command.

Every secret setting (the database password inline, from the environment, from
a file; the replication role's password; the Redis URLs' passwords; the Redis
ACL users' passwords; the Connect URL's userinfo; the exporter's bearer token;
the model worker's bearer token, from the environment and from a file) holds
a marker.
Every subcommand runs as a real process against services that are not there
(closed loopback ports), plus the error paths of bad settings files; the marker
must be in no stdout, stderr or served page. Nothing here needs a running stack.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer.main
from click import Command
from typer.testing import CliRunner

from edgefeed.cli import app

# Every secret below contains both fragments; a leak of any part of any secret
# (even a libpq error quoting half a password) shows one of them.
FRAGMENTS = ("S3cr3t", "M4rker")
PG_PASSWORD = "S3cr3t M4rker-pg'\\x"  # a space, a quote and a backslash: must be quoted
REDIS_PASSWORD = "S3cr3t-M4rker-redis"
REDIS_USER_PASSWORD = "S3cr3t M4rker/redis@x"  # needs URL quoting
CONNECT_USERINFO = "admin:S3cr3t-M4rker-connect"
ENV_PASSWORD = "S3cr3t-M4rker-env"
REDIS_READER_PASSWORD = "S3cr3t M4rker-reader"
REDIS_WRITER_PASSWORD = "S3cr3t-M4rker-writer"
EXPORTER_TOKEN = "S3cr3t-M4rker-exporter-token"
REPLICATION_PASSWORD = "S3cr3t M4rker-cdc"
WORKER_TOKEN = "S3cr3t-M4rker-worker-token"  # the model worker's bearer token (env or file)

# Every leaf command: the marker test must know how to run each one.
COMMANDS = {
    "preprocess",
    "lag",
    "exporter",
    "dev up",
    "dev status",
    "dev down",
    "dev logs",
    "dev wan status",
    "dev wan cut",
    "dev wan heal",
    "dev wan set",
    "demo load",
    "demo run",
    "demo sites",
    "connectors plan",
    "connectors apply",
    "connectors status",
    "connectors restart",
    "connectors pause",
    "connectors resume",
    "connectors delete",
    "connectors snapshot",
    "features plan",
    "features apply",
    "features history",
    "features logs summary",
    "features logs join",
    "pipeline run",
    "pipeline verify",
    "cache get",
    "workers serve",
    "workers bench",
    "workers seed-demo",
    "lab run",
    "deploy k8s",
}


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _leaf_commands() -> set[str]:
    found: set[str] = set()

    def walk(command: Command, path: list[str]) -> None:
        # Through click's API, so the root's lazily imported groups are seen too.
        lister = getattr(command, "list_commands", None)
        if lister is not None:
            ctx = typer.Context(command)
            for name in lister(ctx):
                sub = command.get_command(ctx, name)  # type: ignore[attr-defined]
                if sub is not None:
                    walk(sub, [*path, name])
        else:
            found.add(" ".join(path))

    walk(typer.main.get_command(app), [])
    return found


def _leaks(text: str) -> list[str]:
    """The lines of ``text`` holding any part of a secret (also once URL-unquoted)."""
    return [
        line
        for line in text.splitlines()
        if any(
            fragment in candidate for fragment in FRAGMENTS for candidate in (line, unquote(line))
        )
    ]


def _assert_clean(text: str, what: str) -> None:
    leaked = _leaks(text)
    assert not leaked, f"{what} leaked a secret:\n" + "\n".join(leaked)


def _settings_yaml(*, database: str, remote: bool = False) -> str:
    kafka, pg, connect = _closed_port(), _closed_port(), _closed_port()
    redis_a, redis_b, redis_c = _closed_port(), _closed_port(), _closed_port()
    host = "cache.example.invalid" if remote else "127.0.0.1"
    return f"""
kafka: {{bootstrap_servers: "127.0.0.1:{kafka}", client_id: edgefeed}}
connect: {{url: "http://{CONNECT_USERINFO}@127.0.0.1:{connect}", timeout_s: 2, retries: 0}}
database:
  host: 127.0.0.1
  port: {pg}
  user: postgres
{database}
regions:
  - {{name: eu-west, redis_url: "redis://:{REDIS_PASSWORD}@{host}:{redis_a}/0", residency_zone: eu}}
  - name: us-east
    redis_url: "redis://edge:{quote(REDIS_USER_PASSWORD, safe="")}@127.0.0.1:{redis_b}/0"
    residency_zone: us
  - name: ap-south
    redis_url: "redis://127.0.0.1:{redis_c}/0"
    residency_zone: apac
    reader: {{username: edgefeed-lookup, password: "{REDIS_READER_PASSWORD}"}}
    writer: {{username: edgefeed-writer, password_env: EF_TEST_REDIS_WRITER}}
sources:
  - name: shop
    tables: [{{name: public.users, key: [user_id], home_region_column: home_region,
              replica_identity: full}}]
"""


@dataclass(frozen=True, slots=True)
class Case:
    """One command line; ``until`` a line of output, then SIGINT (long-running commands).

    ``in_process``: run with click's CliRunner instead of a process (the same
    code path as a sibling case that runs as a process; saves its start-up).
    """

    settings: str
    args: tuple[str, ...]
    until: str | None = None
    path: str | None = None
    body: bytes | None = None
    in_process: bool = False
    env: tuple[tuple[str, str], ...] = ()


def _invoke(case: Case, env: dict[str, str]) -> str:
    """Run ``case`` in this process; its output and any traceback."""
    import traceback

    result = CliRunner().invoke(
        app, ["--settings", case.settings, *case.args], env={**env, **dict(case.env)}
    )
    shown = result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        shown += "".join(traceback.format_exception(result.exception))
    return shown


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGEFEED_")}
    env.update(
        EF_TEST_PG_PASSWORD=ENV_PASSWORD,
        EF_TEST_PG_PASSWORD_BY_NAME=ENV_PASSWORD,
        EF_TEST_REDIS_WRITER=REDIS_WRITER_PASSWORD,
        EF_TEST_EXPORTER_TOKEN=EXPORTER_TOKEN,
        EDGEFEED_STATE_DIR=str(tmp / "state"),
        PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")])),
        COLUMNS="200",
    )
    return env


def _run(case: Case, env: dict[str, str], deadline_s: float = 90.0) -> str:
    """Run one case; return everything it printed (and served), whatever its exit."""
    argv = [
        str(Path(sys.executable).with_name("edgefeed")),
        "--settings",
        case.settings,
        *case.args,
    ]
    with subprocess.Popen(
        argv,
        env={**env, **dict(case.env)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as process:
        try:
            if case.until is None:
                output, _ = process.communicate(timeout=deadline_s)
                return output
            assert process.stdout is not None
            lines: list[str] = []
            end = time.monotonic() + deadline_s
            for line in process.stdout:
                lines.append(line)
                if case.until in line:
                    break
                if time.monotonic() > end:
                    break
            served = re.search(r"http://127\.0\.0\.1:(\d+)", lines[-1] if lines else "")
            if case.path is not None and served is not None:
                lines.append(_ask(f"http://127.0.0.1:{served.group(1)}{case.path}", case.body))
            process.send_signal(signal.SIGINT)
            rest, _ = process.communicate(timeout=deadline_s)
            return "".join(lines) + rest
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


def _ask(url: str, body: bytes | None) -> str:
    """The page at ``url`` (POST ``body`` if given), error answers included."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as page:
            return str(page.read().decode())
    except urllib.error.HTTPError as error:
        with error:
            return f"{error.code} {error.read().decode()}"


@pytest.fixture(scope="module")
def settings_files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("secrets")
    secret_file = tmp / "pg-password"
    secret_file.write_text(PG_PASSWORD + "\n")
    variants = {
        "inline": f'  password: "{PG_PASSWORD.replace(chr(92), chr(92) * 2)}"\n'
        f'  replication: {{user: edgefeed_cdc, password: "{REPLICATION_PASSWORD}"}}',
        "env": '  password: "${EF_TEST_PG_PASSWORD}"',
        "file": f"  password_file: {secret_file}",
        "env-name": "  password_env: EF_TEST_PG_PASSWORD_BY_NAME",
    }
    files = {}
    for name, database in variants.items():
        path = tmp / f"{name}.yaml"
        path.write_text(_settings_yaml(database=database))
        files[name] = str(path)
    remote = tmp / "remote.yaml"
    remote.write_text(_settings_yaml(database=variants["inline"], remote=True))
    files["remote"] = str(remote)
    yield files


def test_every_command_is_covered() -> None:
    assert _leaf_commands() == COMMANDS


def test_no_command_prints_a_secret_against_unreachable_services(
    settings_files: dict[str, str], tmp_path: Path
) -> None:
    inline, env_file, remote = (
        settings_files["inline"],
        settings_files["env"],
        settings_files["remote"],
    )
    state = ("--state-dir", str(tmp_path / "state"))
    bench_url = f"http://127.0.0.1:{_closed_port()}"
    token_file = tmp_path / "worker-token"
    token_file.write_text(WORKER_TOKEN + "\n")
    token_env = (("EDGEFEED_WORKERS_AUTH_TOKEN", WORKER_TOKEN),)
    spine = tmp_path / "spine.parquet"
    stamps = pa.array([0], pa.timestamp("us", tz="UTC"))
    pq.write_table(pa.table({"user_id": [1], "timestamp": stamps}), spine)  # on to the database
    history = ("--spine", str(spine), "--out", str(tmp_path / "train.parquet"))
    join = ("--labels", str(spine), "--out", str(tmp_path / "joined.parquet"))
    cases = [
        Case(inline, ("lag", "--samples", "1", "--interval", "0.1")),
        Case(env_file, ("lag", "--json", "--samples", "1", "--interval", "0.1")),
        Case(inline, ("lag", "--watch", "--json", "--interval", "0.2"), until="{"),
        Case(
            inline,
            ("exporter", "--host", "127.0.0.1", "--port", "0"),
            until="serving",
            path="/metrics",
        ),
        Case(
            inline,
            ("exporter", "--port", "0", "--token-env", "EF_TEST_EXPORTER_TOKEN"),
            until="serving",
            path="/metrics",  # answered 401: the body must not echo the token
        ),
        Case(
            inline,
            ("workers", "serve", "--model", "ranker", "--region", "eu-west", "--port", "0"),
            until="serving",
            path="/v1/models/ranker/infer",
            body=b'{"user_id": "u1", "item_ids": ["i1", "i2"]}',
        ),
        # The worker's bearer token: a refused request, a token given twice, a bench client.
        Case(
            inline,
            (
                "workers",
                "serve",
                "--model",
                "image-classifier",
                "--region",
                "eu-west",
                "--port",
                "0",
                "--device",
                "cpu",
            ),
            until="serving",
            path="/v1/models/image-classifier/infer",
            body=b"{}",
            env=token_env,
        ),
        Case(
            inline,
            (
                "workers",
                "serve",
                "--model",
                "image-classifier",
                "--region",
                "eu-west",
                "--auth-token-file",
                str(token_file),
            ),
            env=token_env,
            in_process=True,
        ),
        Case(
            inline,
            (
                "workers",
                "bench",
                "--url",
                bench_url,
                "--requests",
                "1",
                "--auth-token-file",
                str(token_file),
            ),
            in_process=True,
        ),
        Case(inline, ("connectors", "plan")),
        Case(settings_files["file"], ("connectors", "plan", "--json"), in_process=True),
        Case(
            settings_files["env-name"],
            ("connectors", "apply", "--json", "--wait", "0"),
            in_process=True,
        ),
        Case(inline, ("connectors", "status"), in_process=True),
        Case(inline, ("connectors", "status", "--json"), in_process=True),
        Case(inline, ("connectors", "restart"), in_process=True),
        Case(inline, ("connectors", "pause"), in_process=True),
        Case(inline, ("connectors", "resume"), in_process=True),
        Case(inline, ("connectors", "delete", "--yes"), in_process=True),
        Case(
            inline,
            ("connectors", "snapshot", "--table", "public.users", "--filter", "segment = 1"),
            in_process=True,
        ),
        Case(inline, ("features", "plan")),
        Case(inline, ("deploy", "k8s", "--out", str(tmp_path / "k8s"))),
        Case(remote, ("deploy", "k8s", "--check", "--out", str(tmp_path / "k8s"))),
        Case(env_file, ("features", "apply", "--json", "--wait", "0"), in_process=True),
        Case(env_file, ("features", "history", "--entity", "user", *history), in_process=True),
        Case(inline, ("features", "logs", "summary", str(tmp_path / "logs"))),
        Case(
            env_file,
            ("features", "logs", "join", str(tmp_path / "logs"), *join),
            in_process=True,
        ),
        Case(inline, ("demo", "load", "--duration", "1")),
        Case(env_file, ("demo", "load", "--duration", "1"), in_process=True),
        Case(remote, ("demo", "run", *state)),
        Case(inline, ("demo", "sites", *state), in_process=True),
        Case(remote, ("dev", "up", *state), in_process=True),
        Case(inline, ("dev", "status", "--json", *state), in_process=True),
        Case(inline, ("dev", "down", *state), in_process=True),
        Case(inline, ("dev", "logs", *state), in_process=True),
        Case(inline, ("dev", "wan", "status", "--json", *state), in_process=True),
        Case(inline, ("dev", "wan", "cut", "central-eu-west", *state), in_process=True),
        Case(inline, ("dev", "wan", "heal", "central-eu-west", *state), in_process=True),
        Case(inline, ("dev", "wan", "set", "x", "--delay-ms", "1", *state), in_process=True),
        Case(inline, ("cache", "get", "user", "1", "--region", "eu-west", "--timeout-s", "1")),
        Case(
            inline, ("cache", "get", "user", "1", "--region", "us-east", "--json"), in_process=True
        ),
        Case(inline, ("workers", "seed-demo", "--region", "eu-west")),
        Case(inline, ("workers", "seed-demo", "--region", "us-east"), in_process=True),
        Case(inline, ("workers", "bench", "--url", bench_url, "--requests", "1")),
        Case(inline, ("pipeline", "run", "--role", "router")),
        Case(inline, ("pipeline", "run", "--region", "eu-west")),
        Case(inline, ("pipeline", "run", "--role", "forwarder", "--region", "eu-west")),
        Case(inline, ("pipeline", "verify", "--json")),
        Case(inline, ("preprocess", str(tmp_path / "missing.jpg"), "--out", str(tmp_path))),
        Case(
            inline,
            ("lab", "run", "--no-start-stack", "--report", str(tmp_path / "lab.html"), *state),
        ),
        Case(remote, ("lab", "run", "--report", str(tmp_path / "lab.html"), *state)),
    ]
    assert {_command_of(c.args) for c in cases} == COMMANDS
    env = _env(tmp_path)
    outputs: dict[Case, str] = {}
    with ThreadPoolExecutor(max_workers=4) as pool:
        running = {case: pool.submit(_run, case, env) for case in cases if not case.in_process}
        # Meanwhile, in this thread (the pool's threads only wait on processes):
        for case in cases:
            if case.in_process:
                outputs[case] = _invoke(case, env)
        outputs.update({case: future.result() for case, future in running.items()})
    leaked = {" ".join(case.args): lines for case in cases if (lines := _leaks(outputs[case]))}
    assert not leaked, "secrets leaked:\n" + "\n".join(
        f"{command}:\n    " + "\n    ".join(lines) for command, lines in leaked.items()
    )


_GROUPS = {"dev", "demo", "connectors", "features", "pipeline", "cache", "workers", "lab", "deploy"}
_SUBGROUPS = {("dev", "wan"), ("features", "logs")}


def _command_of(args: tuple[str, ...]) -> str:
    if tuple(args[:2]) in _SUBGROUPS:
        return " ".join(args[:3])
    return " ".join(args[:2]) if args[0] in _GROUPS else args[0]


BAD_SETTINGS = {
    "bad-yaml": 'database:\n  password: "{pw}\n  host: [unclosed\n',
    "bad-yaml-plain": "database:\n  password: {pw}: x\n  port: 5432\n",
    "redis-scheme": 'regions: [{{name: eu, redis_url: "http://:{pw}@h:1/0",'
    " residency_zone: eu}}]\n",
    "redis-type": 'regions: [{{name: eu, redis_url: "redis://:{pw}@h:1/0", residency_zone: 3}}]\n'
    'database: {{password: ["{pw}"]}}\n',
    "connect-url": 'connect: {{url: "ftp://admin:{pw}@h:1"}}\n'
    'regions: [{{name: eu, redis_url: "redis://h:1/0", residency_zone: eu}}]\n',
    "connect-timeout": 'connect: {{url: "http://admin:{pw}@h:1", timeout_s: -1}}\n'
    'regions: [{{name: eu, redis_url: "redis://h:1/0", residency_zone: eu}}]\n',
    "password-twice": 'database: {{password: "{pw}", password_env: X}}\n'
    'regions: [{{name: eu, redis_url: "redis://h:1/0", residency_zone: eu}}]\n',
    "extra-key": 'database: {{password: "{pw}", pasword: "{pw}"}}\n'
    'regions: [{{name: eu, redis_url: "redis://h:1/0", residency_zone: eu}}]\n',
    "failover": 'regions: [{{name: eu, redis_url: "redis://:{pw}@h:1/0", residency_zone: eu,'
    ' failover: ["redis://:{pw}@h"]}}]\n',
}

SETTINGS_COMMANDS = [
    ("lag", "--samples", "1"),
    ("lag", "--json", "--watch"),
    ("exporter",),
    ("dev", "up"),
    ("dev", "status", "--json"),
    ("demo", "load"),
    ("demo", "run"),
    ("demo", "sites"),
    ("connectors", "plan", "--json"),
    ("connectors", "apply"),
    ("connectors", "status", "--json"),
    ("connectors", "restart"),
    ("connectors", "delete", "--yes"),
    ("connectors", "snapshot", "--table", "users"),
    ("features", "plan"),
    ("pipeline", "run", "--role", "router"),
    ("pipeline", "verify"),
    ("cache", "get", "user", "1", "--region", "eu"),
    ("workers", "seed-demo", "--region", "eu"),
    ("lab", "run", "--region", "eu"),
    ("deploy", "k8s", "--check"),
]


@pytest.mark.parametrize("variant", sorted(BAD_SETTINGS))
def test_bad_settings_files_never_echo_a_secret(variant: str, tmp_path: Path) -> None:
    path = tmp_path / "edgefeed.yaml"
    path.write_text(BAD_SETTINGS[variant].format(pw=REDIS_USER_PASSWORD.replace(" ", "-")))
    runner = CliRunner()
    for args in SETTINGS_COMMANDS:
        result = runner.invoke(
            app,
            ["--settings", str(path), *args],
            env={"EDGEFEED_STATE_DIR": str(tmp_path / "state")},
        )
        shown = result.output
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            import traceback

            shown += "".join(traceback.format_exception(result.exception))
        assert result.exit_code == 2, f"{args}: exit {result.exit_code}\n{shown}"
        _assert_clean(shown, f"{variant}: {' '.join(args)}")


def test_bad_yaml_in_a_real_process_names_the_place_but_not_the_line(tmp_path: Path) -> None:
    path = tmp_path / "edgefeed.yaml"
    path.write_text(f"database:\n  password: {REDIS_PASSWORD}: x\n")
    output = _run(Case(str(path), ("lag",)), _env(tmp_path))
    _assert_clean(output, "lag with bad YAML")
    assert "not valid YAML" in output and "line" in output


def test_demo_load_reports_an_unreachable_database_as_an_error(
    settings_files: dict[str, str],
) -> None:
    result = CliRunner().invoke(app, ["--settings", settings_files["inline"], "demo", "load"])
    # A typed error and exit 1, not a traceback of psycopg's exception.
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1, result.output
    said = " ".join(result.output.split())
    assert "cannot create the demo tables in the database postgres@127.0.0.1:" in said
    assert "is PostgreSQL running" in said
    _assert_clean(result.output, "demo load")
