"""`edgefeed workers serve --processes 2`: real children on one port under a supervisor.

What a user relies on: a child killed outright costs only the requests it had in
flight, and is replaced; a scrape of the port sees one worker whose counters are
the sum over the children; readiness speaks for all of them; SIGTERM drains all
and leaves nothing behind (issue 35).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import ssl
import threading
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from worker_process import WorkerProcess, poll, worker_process  # type: ignore[import-not-found]

from workers.cpusched import available, current_slice_us
from workers.exceptions import ModelLoadError
from workers.inputs import NPY_TYPE, encode_npy
from workers.supervisor import ChildSlot, Supervisor, WorkerStartError, threads_per_child

MODEL = "image-classifier"
INFER = f"/v1/models/{MODEL}/infer"


def _children(supervisor: int) -> set[int]:
    """Worker children of ``supervisor`` (multiprocessing's resource tracker aside)."""
    found = set()
    for pid in Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split():
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"spawn_main" in cmdline:
            found.add(int(pid))
    return found


def _peer_ports(pid: int, port: int) -> set[int]:
    """Client ports of the TCP connections process ``pid`` holds on server ``port``."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        parts = line.split()
        local, remote, state, inode = parts[1], parts[2], parts[3], parts[9]
        established = state == "01"
        if established and inode in inodes and int(local.split(":")[1], 16) == port:
            ports.add(int(remote.split(":")[1], 16))
    return ports


def _get(worker: WorkerProcess, path: str) -> tuple[int, dict[str, object]]:
    host, port = worker.host_port
    connection = http.client.HTTPConnection(host, port, timeout=30)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def _body(worker: WorkerProcess) -> bytes:
    _, described = _get(worker, "/v1/models")
    models = described["models"]
    assert isinstance(models, list)
    entry = models[0]["input"]
    return encode_npy(np.zeros((1, *entry["shape"][1:]), dtype=entry["dtype"]))


@dataclass
class _Load:
    """Clients on keep-alive connections, one request in flight each, no retries."""

    worker: WorkerProcess
    body: bytes
    clients: int
    keep_alive: bool = True
    stop: threading.Event = field(default_factory=threading.Event)
    ok: int = 0
    failed_ports: list[int] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for _ in range(self.clients):
            thread = threading.Thread(target=self._client, daemon=True)
            thread.start()
            self.threads.append(thread)

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)

    def done(self) -> int:
        with self.lock:
            return self.ok + len(self.failed_ports)

    def _client(self) -> None:
        host, port = self.worker.host_port
        headers = {"Content-Type": NPY_TYPE}
        if not self.keep_alive:
            headers["Connection"] = "close"
        connection: http.client.HTTPConnection | None = None
        while not self.stop.is_set():
            if connection is None:
                connection = http.client.HTTPConnection(host, port, timeout=30)
            if connection.sock is None:  # new, or closed by the server after an answer
                connection.connect()
            local = connection.sock.getsockname()[1]
            try:
                connection.request("POST", INFER, body=self.body, headers=headers)
                response = connection.getresponse()
                response.read()
                status = response.status
            except (OSError, http.client.HTTPException):
                status = 0
            with self.lock:
                self.statuses[status] += 1
                if status == 200:
                    self.ok += 1
                else:
                    self.failed_ports.append(local)
            if status != 200 or not self.keep_alive:
                connection.close()
                connection = None
            if status != 200:
                # A client backs off after a failure (it does not retry the request);
                # by then a killed child's listening socket is gone with it.
                self.stop.wait(0.5)
        if connection is not None:
            connection.close()


def _pids_of(worker: WorkerProcess) -> set[int]:
    return _children(worker.process.pid)


def test_a_killed_child_is_replaced_and_costs_only_its_requests_in_flight() -> None:
    with worker_process("--model", MODEL, "--processes", "2") as worker:
        first = _pids_of(worker)
        assert len(first) == 2
        # The children share the cores among their torch threads (not all each).
        threads = threads_per_child(2)
        assert f"2 processes, {threads} torch thread" in worker.banner, worker.banner
        # Each child's threads run at the slice the supervisor asked for.
        slices = {
            current_slice_us(int(task.name))
            for child in first
            for task in Path(f"/proc/{child}/task").iterdir()
        }
        assert slices == ({100.0} if available() else {None}), slices
        _, port = worker.host_port
        load = _Load(worker, _body(worker), clients=8)
        load.start()
        try:
            poll(lambda: load.done() >= 200, "200 requests served by both children")
            victim = min(first)
            on_victim = _peer_ports(victim, port)
            assert on_victim, "no client connection reached the child about to be killed"
            os.kill(victim, signal.SIGKILL)

            def replaced() -> bool:
                pids = _pids_of(worker)
                if len(pids) != 2 or victim in pids:
                    return False
                status, body = _get(worker, "/readyz")
                return status == 200 and body["processes"] == {"ready": 2, "expected": 2}

            poll(replaced, "a new child in place of the killed one, both ready", 120)
            after = load.done()
            poll(lambda: load.done() >= after + 200, "200 more requests after the replacement")
        finally:
            load.finish()
        # Each failure was the one request in flight on a connection the killed child held.
        failures = Counter(load.failed_ports)
        assert set(failures) <= on_victim, (failures, on_victim, load.statuses)
        assert all(count == 1 for count in failures.values()), failures
        assert load.ok >= 400
        assert set(load.statuses) <= {0, 200}, load.statuses


def test_keep_alive_connections_spread_evenly_and_reach_a_replaced_child() -> None:
    # Linux hashes each new connection to one child's socket and never moves it: a
    # pool of keep-alive clients stays as uneven as it came out, and a child
    # restarted after a crash would get none of its predecessor's. The children
    # shed their surplus after answers instead; the clients connect again.
    with worker_process("--model", MODEL, "--processes", "2") as worker:
        _, port = worker.host_port
        load = _Load(worker, _body(worker), clients=16)
        load.start()
        try:

            def even() -> bool:
                held = [len(_peer_ports(pid, port)) for pid in _pids_of(worker)]
                return sorted(held) == [8, 8]

            poll(even, "16 keep-alive connections held 8 and 8 by the two children", 60)
            victim = min(_pids_of(worker))
            on_victim = _peer_ports(victim, port)
            os.kill(victim, signal.SIGKILL)

            def replaced_and_even() -> bool:
                pids = _pids_of(worker)
                if len(pids) != 2 or victim in pids:
                    return False
                return sorted(len(_peer_ports(pid, port)) for pid in pids) == [8, 8]

            poll(replaced_and_even, "the new child holding its 8 of 16 connections", 120)
        finally:
            load.finish()
        assert worker.metric("edgefeed_worker_connections_balanced_total") > 0
        # Shedding costs no request: the only failures were in flight on the killed child.
        failures = Counter(load.failed_ports)
        assert set(failures) <= on_victim, (failures, on_victim, load.statuses)
        assert all(count == 1 for count in failures.values()), failures
        assert set(load.statuses) <= {0, 200}, load.statuses


def test_without_balancing_the_children_keep_the_connections_they_got() -> None:
    env = {"EDGEFEED_WORKERS_BALANCE_CONNECTIONS": "false"}
    with worker_process("--model", MODEL, "--processes", "2", env=env) as worker:
        load = _Load(worker, _body(worker), clients=16)
        load.start()
        try:
            poll(lambda: load.done() >= 300, "300 requests served")
        finally:
            load.finish()
        assert worker.metric("edgefeed_worker_connections_balanced_total") == 0
        assert load.failed_ports == [], load.statuses


def _requests_metric(worker: WorkerProcess) -> float:
    return worker.metric("edgefeed_worker_requests_total", model=MODEL, status="200")


def test_a_scrape_during_load_sees_the_sum_over_children_and_sigterm_drains_them() -> None:
    with worker_process("--model", MODEL, "--processes", "2") as worker:
        pids = _pids_of(worker)
        # One connection per request: the kernel spreads them over both children.
        load = _Load(worker, _body(worker), clients=4, keep_alive=False)
        load.start()
        try:
            for _ in range(10):
                before = load.ok
                seen = _requests_metric(worker)
                after = load.ok
                # Counted before the answer leaves: at least what clients had back
                # before the scrape, at most that after it plus one in flight each.
                assert before <= seen <= after + load.clients, (before, seen, after)
        finally:
            load.finish()
        assert load.failed_ports == [], load.statuses
        for _ in range(6):  # each scrape lands on either child: every one sees the sum
            assert _requests_metric(worker) == load.ok
        status, health = _get(worker, "/healthz")
        assert status == 200 and health["processes"] == {"ready": 2, "expected": 2}
        environ = Path(f"/proc/{min(pids)}/environ").read_bytes().split(b"\0")
        (metrics_dir,) = (
            Path(entry.split(b"=", 1)[1].decode())
            for entry in environ
            if entry.startswith(b"PROMETHEUS_MULTIPROC_DIR=")
        )
        assert any(metrics_dir.iterdir())
        worker.process.send_signal(signal.SIGTERM)
        assert worker.process.wait(timeout=60) == 0
        for pid in pids:
            assert _gone(pid), f"child {pid} outlived its supervisor"
        assert not metrics_dir.exists()


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def _dies_at_once(slot: ChildSlot) -> int:
    return 3


def _refuses_its_model(slot: ChildSlot) -> int:
    raise ModelLoadError("model file 'x.pt2' is not a torch.export archive; export it again")


def test_a_child_that_keeps_dying_before_ready_is_a_fatal_error_not_a_crash_loop() -> None:
    supervisor = Supervisor(_dies_at_once, processes=2, backoff_s=0.01)
    with pytest.raises(WorkerStartError, match="died before it was ready 3 times in a row"):
        supervisor.run()
    assert supervisor.restarts >= 2
    assert supervisor.pids() == []
    assert supervisor.metrics_dir is not None and not supervisor.metrics_dir.exists()


def test_a_child_s_error_before_any_is_ready_ends_the_supervisor_with_it() -> None:
    supervisor = Supervisor(_refuses_its_model, processes=2, backoff_s=0.01)
    with pytest.raises(WorkerStartError, match=r"is not a torch\.export archive; export it again"):
        supervisor.run()
    assert supervisor.restarts == 0


def test_token_and_tls_hold_on_every_child(tmp_path: Path) -> None:
    from test_workers_auth_tls import TOKEN, _self_signed  # type: ignore[import-not-found]

    cert, key = _self_signed(tmp_path)
    trusted = ssl.create_default_context(cafile=str(cert))
    args = ("--model", MODEL, "--processes", "2", "--tls-cert", str(cert), "--tls-key", str(key))
    with worker_process(*args, env={"EDGEFEED_WORKERS_AUTH_TOKEN": TOKEN}) as worker:
        assert worker.url.startswith("https://127.0.0.1:")
        body = encode_npy(np.zeros((32, 32, 3), dtype=np.uint8))

        def call(path: str, token: str | None, data: bytes | None = None) -> tuple[int, bytes]:
            headers = {"Content-Type": NPY_TYPE}
            if token is not None:
                headers["Authorization"] = f"Bearer {token}"
            request = urllib.request.Request(f"{worker.url}{path}", data=data, headers=headers)
            try:  # a new connection each: the kernel spreads them over both children
                with urllib.request.urlopen(request, timeout=60, context=trusted) as answer:
                    return answer.status, answer.read()
            except urllib.error.HTTPError as error:
                with error:
                    return error.code, error.read()

        refused = [call(INFER, None, body) for _ in range(6)]
        served = [call(INFER, TOKEN, body) for _ in range(6)]
        metrics_refused = call("/metrics", None)
        metrics = call("/metrics", TOKEN)
    assert [status for status, _ in refused] == [401] * 6
    assert [status for status, _ in served] == [200] * 6
    assert metrics_refused[0] == 401
    text = metrics[1].decode()
    assert 'edgefeed_worker_unauthorized_total{region="local"} 7.0' in text
    assert (
        'edgefeed_worker_requests_total{model="image-classifier",region="local",status="200"} 6.0'
        in text
    )
    for shown in (text, "".join(worker.lines), *(answer.decode() for _, answer in refused)):
        assert TOKEN not in shown and TOKEN[:12] not in shown
