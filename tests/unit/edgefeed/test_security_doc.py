"""docs/security.md makes one current statement (issue 30: its old "Not covered yet"
said the exporter had no auth and Redis no ACL users while the sections above
described both). The claims a test can check are checked here or where named."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from edgefeed_base.tokens import MIN_TOKEN_CHARS
from monitoring.exporter import serve

DOC = (Path(__file__).resolve().parents[3] / "docs" / "security.md").read_text()


def test_one_list_of_what_is_not_covered_and_it_comes_last() -> None:
    sections = re.findall(r"^## (.+)$", DOC, flags=re.MULTILINE)
    assert [s for s in sections if s.startswith("Not covered yet")] == [sections[-1]]


def test_the_exporter_and_token_claims_hold() -> None:
    assert "listens on 127.0.0.1 unless `--host`" in DOC
    assert inspect.signature(serve).parameters["host"].default == "127.0.0.1"
    assert f"at least {MIN_TOKEN_CHARS} characters" in DOC
    not_covered = DOC[DOC.index("## Not covered yet") :]
    for stale in ("0.0.0.0", "Authentication and TLS for the exporter", "Redis ACL users**"):
        assert stale not in not_covered
