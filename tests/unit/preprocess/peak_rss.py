"""Peak RSS of preprocess calls, each measured in a process of its own.

One helper process imports NumPy, Pillow and preprocess once, then forks a
child per call. The child resets its peak (``/proc/self/clear_refs``, 5), runs
the call and reports how far ``VmHWM`` rose above the ``VmRSS`` it started
from: the call's own peak, with nothing left over from earlier calls (a freed
heap that the next call would reuse without its RSS growing). Linux only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import asdict, dataclass, field

_HELPER = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    import numpy
    from preprocess import (
        Limits, PreprocessError, decode_image, get_profile, preprocess_image,
    )

    def status(key):
        text = Path("/proc/self/status").read_text()
        return int(text.split(key + ":")[1].split()[0]) * 1024

    def run(job):
        data = Path(job["path"]).read_bytes()
        limits = Limits(**job["limits"])
        Path("/proc/self/clear_refs").write_text("5")
        base = status("VmRSS")
        started = time.perf_counter()
        try:
            if job["call"] == "decode":
                result = list(decode_image(data, limits=limits).shape)
            else:
                profile = get_profile(job["profile"])
                out = preprocess_image(data, profile, limits=limits, fast=job["call"] == "fast")
                result = list(out.shape)
        except PreprocessError as exc:
            result = f"{type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - started
        return {"grown": status("VmHWM") - base, "seconds": seconds, "result": result}

    for line in sys.stdin:
        job = json.loads(line)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            os.write(write, json.dumps(run(job)).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            answer = pipe.read()
        os.waitpid(pid, 0)
        print(answer, flush=True)
    """
)


@dataclass(frozen=True, slots=True)
class Job:
    """One call: ``decode`` (decode_image), ``reference`` or ``fast`` (preprocess_image)."""

    path: str
    call: str
    profile: str = "imagenet-224"
    limits: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Peak:
    """What a call cost: peak RSS growth in bytes, seconds, and its shape or error."""

    grown: int
    seconds: float
    result: list[int] | str


def measure(jobs: list[Job]) -> list[Peak]:
    """Run each job in a forked child of one fresh helper process."""
    stdin = "".join(json.dumps(asdict(job)) + "\n" for job in jobs)
    run = subprocess.run(
        [sys.executable, "-P", "-c", _HELPER],  # -P: the installed preprocess, not the cwd
        input=stdin,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return [Peak(**json.loads(line)) for line in run.stdout.splitlines()]
