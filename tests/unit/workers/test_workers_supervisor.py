"""How many worker processes `edgefeed workers serve` runs, and where it refuses more than one."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from workers import supervisor
from workers.exceptions import WorkerConfigError
from workers.settings import WorkerSettings


def test_the_default_is_one_process_per_core_this_process_may_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(supervisor, "_cgroup_cpus", lambda: None)
    assert WorkerSettings().process_count() == len(os.sched_getaffinity(0))


def test_a_cgroup_quota_caps_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    quota = tmp_path / "cpu.max"
    quota.write_text("150000 100000\n")  # 1.5 CPUs: 2 processes, not one per node core
    assert supervisor._cgroup_cpus(quota) == 2
    quota.write_text("max 100000\n")
    assert supervisor._cgroup_cpus(quota) is None
    assert supervisor._cgroup_cpus(tmp_path / "absent") is None
    monkeypatch.setattr(supervisor, "_cgroup_cpus", lambda: 1)
    assert supervisor.default_processes() == 1


def test_children_share_the_cores_among_their_torch_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """N children on C cores get C // N torch threads each (at least 1), not C each:
    N x C OpenMP threads would wait at every barrier for descheduled siblings."""
    monkeypatch.setattr(supervisor, "default_processes", lambda: 16)
    assert supervisor.threads_per_child(16) == 1
    assert supervisor.threads_per_child(4) == 4
    assert supervisor.threads_per_child(3) == 5
    assert supervisor.threads_per_child(32) == 1
    monkeypatch.setattr(supervisor, "default_processes", lambda: 1)
    assert supervisor.threads_per_child(2) == 1


def test_more_than_one_process_off_linux_is_refused_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(
        WorkerConfigError, match=r"processes 4 needs Linux's SO_REUSEPORT.*--processes 1"
    ):
        WorkerSettings(processes=4).process_count()
    assert WorkerSettings(processes=1).process_count() == 1
    assert supervisor.default_processes() == 1


def test_zero_processes_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="processes"):
        WorkerSettings(processes=0)
    with pytest.raises(WorkerConfigError, match="processes must be at least 1, got 0"):
        supervisor.check_processes(0)
