"""A real model worker process (`edgefeed workers serve`) for hostile-input tests.

The worker runs as its own process so that what a test measures (peak RSS,
open sockets, log lines) is the worker's, not the test's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

EDGEFEED = str(Path(sys.executable).with_name("edgefeed"))


@dataclass
class WorkerProcess:
    """A started worker: its URL, process and the stderr lines read so far."""

    url: str
    process: subprocess.Popen[str]
    banner: str
    lines: list[str] = field(default_factory=list)

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.url.split("://", 1)[1].rsplit(":", 1)
        return host, int(port)

    def peak_rss_bytes(self) -> int:
        """VmHWM: the process's peak resident set since it started."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM in /proc status")

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels`` (0 when absent)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            text = response.read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )

    def post(
        self, path: str, body: bytes, content_type: str
    ) -> tuple[int, dict[str, object], dict[str, str]]:
        request = urllib.request.Request(
            f"{self.url}{path}", data=body, method="POST", headers={"Content-Type": content_type}
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read()), dict(response.headers)
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read()), dict(error.headers)


def seed_demo(settings: Path, region: str) -> str:
    """`edgefeed --settings S workers seed-demo --region R`: its stdout; fails on an error."""
    seeded = subprocess.run(
        [EDGEFEED, "--settings", str(settings), "workers", "seed-demo", "--region", region],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert seeded.returncode == 0, seeded.stderr
    return seeded.stdout


@contextmanager
def worker_process(
    *args: str,
    env: dict[str, str] | None = None,
    settings: Path | None = None,
    region: str = "local",
) -> Iterator[WorkerProcess]:
    """Start `edgefeed [--settings S] workers serve ARGS --region R --port 0 --device cpu`;
    stop it (SIGTERM) after, unless the test stopped it.

    One process (``--processes 1``, today's worker) unless ``args`` say how many.
    ``banner`` is the worker's first stderr line (where it serves, what it loaded).
    """
    processes = () if "--processes" in args else ("--processes", "1")
    where = ("--settings", str(settings)) if settings is not None else ()
    process = subprocess.Popen(
        [
            EDGEFEED,
            *where,
            "workers",
            "serve",
            *args,
            *processes,
            "--region",
            region,
            "--port",
            "0",
            "--device",
            "cpu",
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "COLUMNS": "300", **(env or {})},
    )
    assert process.stderr is not None
    first = process.stderr.readline()
    if " at http" not in first:
        process.kill()
        rest = process.stderr.read()
        process.wait()
        process.stderr.close()
        raise AssertionError(f"worker did not start: {first}{rest}")
    url = first.split(" at ", 1)[1].split()[0]
    worker = WorkerProcess(url=url, process=process, banner=first)
    stream = process.stderr

    def pump() -> None:
        for line in stream:
            worker.lines.append(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        yield worker
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        reader.join(timeout=10)
        stream.close()


def poll(condition: object, what: str, timeout_s: float = 60.0) -> None:
    """Poll ``condition()`` until true; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.02)
