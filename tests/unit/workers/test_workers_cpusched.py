"""The worker's scheduler slice (workers.cpusched): asked for without privilege,
inherited by the threads and processes started after it, the thread's nice value
kept, bad values refused with the fix. Each case runs in a child process, so the
test process keeps its own scheduling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from pydantic import ValidationError

from workers.cpusched import available, request_slice
from workers.settings import WorkerSettings


def _kernel_has_slices() -> bool:
    major, minor = (int(part) for part in os.uname().release.split(".")[:2])
    return sys.platform == "linux" and (major, minor) >= (6, 12)


def _in_child(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip()


def test_a_slice_is_taken_kept_with_the_nice_value_and_inherited() -> None:
    out = _in_child(
        """
        import os, threading, json
        from workers.cpusched import current_slice_us, request_slice
        os.nice(3)
        # A known slice first: this process inherits the test process's, which an
        # in-process CLI test may have set already.
        before = request_slice(5000)
        go, earlier = threading.Event(), []
        waiting = threading.Thread(target=lambda: (go.wait(), earlier.append(current_slice_us())))
        waiting.start()  # a thread already running when the slice is asked for
        applied = request_slice(100)
        go.set(); waiting.join()
        seen = []
        thread = threading.Thread(target=lambda: seen.append(current_slice_us()))
        thread.start(); thread.join()
        pid = os.fork()
        if pid == 0:
            os._exit(0 if current_slice_us() == applied else 1)
        _, status = os.waitpid(pid, 0)
        print(json.dumps([before, applied, seen[0], earlier[0], os.nice(0),
                          os.waitstatus_to_exitcode(status)]))
        """
    )
    before, applied, thread, earlier, nice, child = json.loads(out)
    assert nice == 3, "the thread's nice value changed"
    assert available() == _kernel_has_slices()
    if not _kernel_has_slices():  # the worker runs at the kernel's default, as before
        assert applied is None
        return
    assert before == 5000.0
    assert applied == 100.0
    assert thread == 100.0, "a thread started afterwards keeps the slice of before"
    assert earlier == 100.0, "a thread started before keeps the slice of before"
    assert child == 0, "a forked child does not keep the slice"


def test_the_settings_apply_the_slice_and_say_so() -> None:
    out = _in_child(
        """
        from workers.settings import WorkerSettings
        from workers.cpusched import current_slice_us
        print(WorkerSettings().apply_sched_slice(), current_slice_us(), sep="|")
        print(WorkerSettings(sched_slice_us=2000).apply_sched_slice(), current_slice_us(), sep="|")
        print(WorkerSettings(sched_slice_us=0).apply_sched_slice(), current_slice_us(), sep="|")
        """
    )
    lines = [line.split("|") for line in out.splitlines()]
    if not _kernel_has_slices():
        assert all("the kernel's" in said for said, _ in lines)
        return
    assert lines[0] == ["scheduler slice 0.1 ms", "100.0"]
    assert lines[1] == ["scheduler slice 2 ms", "2000.0"]
    assert lines[2] == ["scheduler slice: the kernel's", "2000.0"]  # 0 asks for nothing


@pytest.mark.parametrize("bad", [1, 50, 99.9, 100_001, -1])
def test_a_slice_linux_refuses_is_a_typed_error_naming_it(bad: float) -> None:
    with pytest.raises(ValidationError) as caught:
        WorkerSettings(sched_slice_us=bad)
    assert "sched_slice_us" in str(caught.value)
    with pytest.raises(ValueError, match=r"100 to 100000 us.*0 for the kernel's default"):
        request_slice(bad)
