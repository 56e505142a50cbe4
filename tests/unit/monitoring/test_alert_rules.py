"""The alert rules, checked and unit-tested by Prometheus' own promtool.

deploy/prometheus/tests/ holds promtool rule tests (input series, then the alerts
expected at given times); every alert has a case where it fires, with its exact
labels and annotations, and one where it must not (a blip under its ``for:``, an
idle region, a value just under its threshold).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "tests"
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is missing: `make install` (scripts/bootstrap.sh) installs it "
            "with Debian's prometheus package"
        )
    return path


def _rule_test_files() -> list[Path]:
    files = sorted(RULE_TESTS.glob("*.yml"))
    assert files, f"no promtool rule tests in {RULE_TESTS.relative_to(ROOT)}"
    return files


def _promtool(promtool: str, *args: str) -> None:
    done = subprocess.run(
        [promtool, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, (
        f"promtool {' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    )


def test_promtool_checks_the_rules(promtool: str) -> None:
    _promtool(promtool, "check", "rules", str(RULES.relative_to(ROOT)))


def test_promtool_rule_tests_pass(promtool: str) -> None:
    files = [str(f.relative_to(ROOT)) for f in _rule_test_files()]
    _promtool(promtool, "test", "rules", *files)


def _alerts() -> list[str]:
    rules: dict[str, Any] = yaml.safe_load(RULES.read_text())
    return [r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r]


def test_every_alert_has_a_firing_and_a_non_firing_case() -> None:
    """Firing: an ``alert_rule_test`` entry with alerts expected. Not firing: a test
    (one set of input series) in which every entry for the alert expects none."""
    alerts = _alerts()
    firing: dict[str, list[str]] = {a: [] for a in alerts}
    silent: dict[str, list[str]] = {a: [] for a in alerts}
    for path in _rule_test_files():
        doc: dict[str, Any] = yaml.safe_load(path.read_text())
        # The tests must load the real rules, not a copy of them.
        loaded = [(path.parent / f).resolve() for f in doc.get("rule_files", [])]
        assert loaded == [RULES], f"{path.name}: rule_files {doc.get('rule_files')}"
        for case in doc.get("tests", []):
            name = f"{path.name}: {case.get('name', '?')}"
            entries: dict[str, list[bool]] = {}
            for entry in case.get("alert_rule_test", []):
                alert = entry["alertname"]
                # promtool expects nothing of an alert no rule defines: a misspelt
                # name would make every "must not fire" case pass.
                assert alert in firing, f"{name}: no alert {alert!r} in {RULES.name}"
                entries.setdefault(alert, []).append(bool(entry.get("exp_alerts")))
            for alert, fires in entries.items():
                if any(fires):
                    firing[alert].append(name)
                else:
                    silent[alert].append(name)
    missing = [f"{a}: no firing case" for a in alerts if not firing[a]]
    missing += [f"{a}: no case where it must not fire" for a in alerts if not silent[a]]
    assert not missing, "\n".join(missing)


def test_every_alert_names_its_runbook_section_in_operations_md() -> None:
    """An alert names the section of docs/operations.md that says what to do (its
    ``runbook_url``, relative to the repository: a team rewrites the base)."""
    import re

    headings = {
        re.sub(r"[^a-z0-9 -]", "", line[4:].strip().lower()).replace(" ", "-")
        for line in (ROOT / "docs" / "operations.md").read_text().splitlines()
        if line.startswith("### ")
    }
    rules = [
        rule
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    ]
    assert rules
    for rule in rules:
        url = rule["annotations"].get("runbook_url", "")
        path, _, anchor = url.partition("#")
        assert path == "docs/operations.md", (rule["alert"], url)
        assert anchor == rule["alert"].lower() and anchor in headings, (rule["alert"], url)
