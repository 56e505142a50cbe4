"""The exporter's status page (monitoring.page) and its routes (monitoring.endpoint):
what it shows from a report, escaping, the sparkline, the JSON, auth and headers.

The page is read back with the same cell parser the browser test uses on
Chromium's DOM (tests/chromium.py), so both check the same cells."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from chromium import table_rows

from monitoring.endpoint import EndpointSecurity, start_endpoint
from monitoring.exporter import ReportCollector, make_registry
from monitoring.model import (
    ConnectorReport,
    GroupReport,
    KafkaReport,
    LinkReport,
    PartitionLag,
    RegionReport,
    Report,
    SlotReport,
    SnapshotReport,
    SnapshotTable,
    TaskReport,
)
from monitoring.page import (
    CONTENT_SECURITY_POLICY,
    FreshnessHistory,
    StatusBoard,
    render_status,
    sparkline_points,
)

TOKEN = "tok-S3cr3t-M4rker-0123456789abcdef"
NOW = 1_800_000_000.0
HOSTILE = "<script>alert('x')</script>"


def _link(name: str, state: str = "UP", cut_for: float | None = None) -> LinkReport:
    return LinkReport(
        name=name,
        state=state,  # type: ignore[arg-type]
        severity="OK" if state == "UP" else "ERR",
        reachable=state == "UP",
        cut_for_s=cut_for,
        delay_ms=100.0,
        observed_delay_ms=101.0,
        bytes_per_s_up=2048.0,
        bytes_per_s_down=300.0,
        bytes_up=1,
        bytes_down=1,
        connections=2,
    )


def _group(name: str, region: str, status: str = "OK", lag_s: float = 0.5) -> GroupReport:
    part = PartitionLag("edgefeed.region.x", 0, 10, 14, 4, lag_s, status, "ok")  # type: ignore[arg-type]
    return GroupReport(name, region, "Stable", 1, status, "OK", (part,))  # type: ignore[arg-type]


def report(at: float = NOW, *, kafka_error: str | None = None) -> Report:
    """Every kind of row the page shows: a healthy region, one behind a cut link, one
    whose Redis cannot be read, a running snapshot, dead letters, a failed task."""
    regions = (
        RegionReport(
            "eu-west", "STALE", "WARN", 42.0, 120, (), behind_seconds=40.0, link="central-eu-west"
        ),
        RegionReport("us-east", "OK", "OK", 0.8, 3, (), behind_seconds=0.3, link="central-us-east"),
        RegionReport(
            "ap-southeast", "DOWN", "ERR", None, None, (), error="redis refused the connection"
        ),
    )
    groups = (
        _group("edgefeed-forward-eu-west", "eu-west", "WARN", 41.5),
        _group("edgefeed-forward-us-east", "us-east"),
        _group("edgefeed-router", None),  # type: ignore[arg-type]
    )
    kafka = KafkaReport(
        groups,
        (),
        1,
        "edgefeed.deadletter",
        3,
        1,
        error=kafka_error,
        deadletters_by_topic=(("edgefeed.deadletter", 2), ("edgefeed.deadletter.eu-west", 1)),
        deadletters_by_reason=(
            ("edgefeed.deadletter", "unknown-region", 2),
            ("edgefeed.deadletter.eu-west", "missing-key", 1),
        ),
    )
    return Report(
        at=at,
        kafka=kafka,
        regions=regions,
        slots=(
            SlotReport(
                "edgefeed_shop",
                "pgoutput",
                "logical",
                "shop",
                True,
                3 * 1024 * 1024,
                10,
                "reserved",
                "shop",
                "OK",
                "active",
            ),
        ),
        connectors=(
            ConnectorReport(
                "edgefeed-shop",
                "RUNNING",
                (TaskReport(0, "FAILED", "w:8083", "boom"),),
                "task 0 FAILED: boom",
                "ERR",
            ),
        ),
        severity="ERR",
        problems=("link central-eu-west CUT for 40 s",),
        snapshots=(
            SnapshotReport(
                "edgefeed-shop",
                "s1",
                "RUNNING",
                (
                    SnapshotTable("public.users", 2000, "SUCCEEDED"),
                    SnapshotTable("public.events", None, "RUNNING"),
                ),
                "public.events",
                "[1500]",
                "[6000]",
                int(NOW * 1000),
            ),
        ),
        links=(_link("central-eu-west", "CUT", 40.0), _link("central-us-east")),
    )


def page(r: Report | None = None, **options: float) -> str:
    history = FreshnessHistory()
    history.add(r or report())
    return render_status(
        r or report(),
        history,
        budget_s=options.get("budget_s", 5.0),
        refresh_s=options.get("refresh_s", 15.0),
        now=options.get("now", NOW + 1),
    )


def text(fragment: str) -> str:
    return " ".join(re.sub(r"<[^>]+>", " ", fragment).split())


def test_every_region_row_shows_freshness_lag_burrow_status_and_its_link() -> None:
    rows = {row["region"]: row for row in table_rows(page(), "regions")}
    assert sorted(rows) == ["ap-southeast", "eu-west", "us-east"]
    eu = rows["eu-west"]
    assert eu["state"] == "STALE"
    assert eu["freshness"] == "42.0 s"
    assert eu["lag-seconds"] == "41.5 s"
    assert eu["lag-messages"] == "120"
    assert eu["burrow"] == "WARN edgefeed-forward-eu-west"
    assert eu["link"] == "central-eu-west: CUT for 40 s (behind 40.0 s)"
    assert rows["us-east"]["link"] == "central-us-east: UP (behind 0.3 s)"
    assert rows["us-east"]["burrow"] == "OK edgefeed-forward-us-east"


def test_a_region_it_cannot_read_is_unknown_never_healthy() -> None:
    html = page()
    ap = {row["region"]: row for row in table_rows(html, "regions")}["ap-southeast"]
    assert ap["state"] == "DOWN: unknown"
    assert ap["freshness"] == "unknown"
    assert ap["lag-messages"] == "unknown"
    assert ap["burrow"] == "UNKNOWN"  # no group read for it: not OK
    assert ap["link"] == "none: no site of its own"
    assert '<span class="badge ERR">DOWN: unknown</span>' in html
    assert "redis refused the connection" in html
    # Kafka unreadable: every region's lag and group status are unknown, not OK.
    rows = table_rows(page(report(kafka_error="cannot reach 127.0.0.1:1")), "regions")
    assert {row["burrow"] for row in rows} == {"UNKNOWN"}
    assert {row["lag-seconds"] for row in rows} == {"unknown"}


def test_a_link_the_emulator_did_not_report_is_unknown() -> None:
    blind = report()
    blind = Report(
        at=blind.at,
        kafka=blind.kafka,
        regions=blind.regions,
        slots=blind.slots,
        connectors=blind.connectors,
        severity="WARN",
        problems=(),
        links=(),
        links_error="the WAN emulator does not answer",
    )
    html = page(blind)
    rows = {row["region"]: row for row in table_rows(html, "regions")}
    assert rows["eu-west"]["link"] == "central-eu-west: unknown (behind 40.0 s)"
    assert '<span class="badge UNKNOWN">central-eu-west: unknown</span>' in html
    assert "UNKNOWN the WAN emulator does not answer" in text(html)


def test_links_snapshots_dead_letters_connectors_and_slots_are_shown() -> None:
    html = page()
    links = {row["link-name"]: row["link-state"] for row in table_rows(html, "links")}
    assert links == {"central-eu-west": "CUT for 40 s", "central-us-east": "UP"}
    snapshots = text(html.split('id="snapshots"')[1].split("</div>")[0])
    assert "edgefeed-shop RUNNING" in snapshots
    assert (
        "1/2 tables, 2,000 rows; reading public.events at key [1500] of [6000] (25%)" in snapshots
    )
    dead = text(html.split('id="deadletters"')[1].split("</div>")[0])
    assert "edgefeed.deadletter unknown-region 2" in dead
    assert "edgefeed.deadletter.eu-west missing-key 1" in dead
    assert "3 in all, 1 new" in text(html)
    connectors = text(html.split('id="connectors"')[1].split("</div>")[0])
    assert "edgefeed-shop RUNNING task 0 FAILED task 0 FAILED: boom" in connectors
    slots = text(html.split('id="slots"')[1].split("</div>")[0])
    assert "edgefeed_shop OK active 3.0 MiB reserved active" in slots
    assert "link central-eu-west CUT for 40 s" in text(html)


def test_the_page_reloads_itself_and_needs_nothing_from_outside() -> None:
    html = page(refresh_s=15.0)
    assert '<meta http-equiv="refresh" content="15">' in html
    assert "<script" not in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "<link" not in html
    # The one stylesheet is the one the policy allows by its hash.
    style = re.search(r"<style>(.*?)</style>", html, re.S)
    assert style is not None
    digest = base64.b64encode(hashlib.sha256(style.group(1).encode()).digest()).decode()
    assert f"style-src 'sha256-{digest}'" in CONTENT_SECURITY_POLICY
    assert "default-src 'none'" in CONTENT_SECURITY_POLICY


def test_an_old_report_says_so() -> None:
    assert "STALE REPORT" not in page(now=NOW + 20)
    assert "the exporter has not collected for 600 s" in page(now=NOW + 600)


def test_names_reasons_and_errors_from_outside_are_escaped() -> None:
    hostile = report()
    hostile = Report(
        at=NOW,
        kafka=KafkaReport(
            (_group(f"edgefeed-forward-{HOSTILE}", HOSTILE),),
            (),
            1,
            HOSTILE,
            1,
            0,
            deadletters_by_reason=((HOSTILE, f'"><img src=x onerror=alert(1)>{HOSTILE}', 1),),
        ),
        regions=(
            RegionReport(
                HOSTILE, "DOWN", "ERR", None, None, (), error=f"{HOSTILE} & more", link=HOSTILE
            ),
        ),
        slots=(
            SlotReport(
                HOSTILE, None, "logical", None, False, None, None, None, None, "WARN", HOSTILE
            ),
        ),
        connectors=(
            ConnectorReport(
                HOSTILE, "FAILED", (TaskReport(0, "FAILED", HOSTILE, HOSTILE),), HOSTILE, "ERR"
            ),
        ),
        severity="ERR",
        problems=(HOSTILE,),
        snapshots=(
            SnapshotReport(
                HOSTILE,
                HOSTILE,
                "RUNNING",
                (SnapshotTable(HOSTILE, None, "RUNNING"),),
                HOSTILE,
                HOSTILE,
                HOSTILE,
                None,
            ),
        ),
        links=(_link(HOSTILE, "DOWN"),),
        links_error=HOSTILE,
        cdc_error=HOSTILE,
        connect_error=HOSTILE,
        snapshot_error=HOSTILE,
    )
    html = page(hostile)
    assert "<script" not in html
    assert "<img" not in html
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in html
    assert "&quot;&gt;&lt;img src=x onerror=alert(1)&gt;" in html
    assert "&amp; more" in html
    # Read back as text, the names are what they were.
    rows = table_rows(html, "regions")
    assert rows[0]["region"] == HOSTILE


def test_sparkline_points_span_the_window_and_break_at_unknown_values() -> None:
    samples = [(0.0, 1.0), (50.0, 99.0), (100.0, 2.0), (150.0, None), (175.0, 0.0), (200.0, 10.0)]
    lines = sparkline_points(samples, start=100.0, end=200.0, top=10.0, width=100.0, height=20.0)
    # Before the start: left out. 2 s of 10 at x 0; the unknown value breaks the line;
    # 0 s at the bottom, the top value at the top.
    assert lines == [[(0.0, 16.0)], [(75.0, 20.0), (100.0, 0.0)]]
    over = sparkline_points(
        [(100.0, 50.0)], start=0.0, end=100.0, top=10.0, width=100.0, height=20.0
    )
    assert over == [[(100.0, 0.0)]]  # over the top: drawn at the top


def test_the_page_draws_each_regions_history_from_the_ring_buffer() -> None:
    history = FreshnessHistory(span_s=600.0, max_points=5)
    for i in range(8):
        r = report(NOW - 70 + 10 * i)
        history.add(r)
    samples = history.samples("eu-west")
    assert len(samples) == 5  # bounded
    assert [at for at, _ in samples] == [NOW - 40 + 10 * i for i in range(5)]
    assert history.samples("ap-southeast")[0][1] is None  # unread: a gap, not 0
    html = render_status(report(NOW), history, budget_s=5.0, refresh_s=15.0, now=NOW)
    eu_row = html.split('<td data-field="region">eu-west</td>')[1].split("</tr>")[0]
    # 40 s of history: at least 30 s wide, so it spans the whole sparkline; eu-west's
    # 42 s is the top (the budget's line at 5 of 42 s).
    assert '<polyline class="line" points="0,0 40,0 80,0 120,0 160,0"/>' in eu_row
    assert 'y1="24.7"' in eu_row
    # Old rounds leave by age too.
    history.add(report(NOW + 3600))
    assert [at for at, _ in history.samples("eu-west")] == [NOW + 3600]


@contextmanager
def serving(token: str | None) -> Iterator[tuple[str, StatusBoard]]:
    board = StatusBoard(
        budget_s=5.0, refresh_s=15.0, history=FreshnessHistory(), clock=lambda: NOW + 1
    )
    board.update(report())
    server, thread = start_endpoint(
        make_registry(ReportCollector(5.0, 1)),
        host="127.0.0.1",
        port=0,
        security=EndpointSecurity(token=token),
        status=board,
    )
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", board
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _get(url: str, authorization: str | None = None) -> tuple[int, str, dict[str, str]]:
    request = urllib.request.Request(url)
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode(), dict(exc.headers)


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.mark.parametrize("path", ["/status", "/status.json"])
def test_the_status_page_takes_the_token_as_basic_password_or_bearer(path: str) -> None:
    with serving(TOKEN) as (base, _board):
        url = base + path
        for presented in (
            None,
            basic("ops", "wrong"),
            basic("ops", TOKEN[:-1]),
            basic(TOKEN, ""),  # the token as the user name is not the password
            "Basic !!!not-base64",
            "Basic " + base64.b64encode(TOKEN.encode()).decode(),  # no colon
            f"Bearer {TOKEN}x",
            f"Digest {TOKEN}",
        ):
            status, body, headers = _get(url, presented)
            assert status == 401, presented
            assert headers["WWW-Authenticate"] == 'Basic realm="edgefeed status", charset="UTF-8"'
            assert headers["Cache-Control"] == "no-store"
            assert TOKEN not in body and "eu-west" not in body
        for presented in (basic("ops", TOKEN), basic("", TOKEN), f"Bearer {TOKEN}"):
            status, body, _ = _get(url, presented)
            assert status == 200, presented
            assert "eu-west" in body and TOKEN not in body


def test_metrics_still_take_only_the_bearer_token() -> None:
    with serving(TOKEN) as (base, _board):
        status, _, headers = _get(base + "/metrics", basic("ops", TOKEN))
        assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
        assert _get(base + "/metrics", f"Bearer {TOKEN}")[0] == 200


def test_without_a_token_the_page_is_open_with_strict_headers() -> None:
    with serving(None) as (base, _board):
        status, body, headers = _get(base + "/status")
        assert status == 200
        assert headers["Content-Type"] == "text/html; charset=utf-8"
        assert headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert headers["Cache-Control"] == "no-store"
        assert headers["X-Frame-Options"] == "DENY"
        assert sorted(row["region"] for row in table_rows(body, "regions")) == [
            "ap-southeast",
            "eu-west",
            "us-east",
        ]


def test_the_json_endpoint_holds_the_report_and_the_freshness_history() -> None:
    with serving(None) as (base, board):
        board.update(report(NOW + 15))
        status, body, headers = _get(base + "/status.json")
    assert status == 200
    assert headers["Content-Type"] == "application/json"
    assert headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
    data = json.loads(body)
    assert data["report"]["at"] == NOW + 15
    assert [r["region"] for r in data["report"]["regions"]] == [
        "eu-west",
        "us-east",
        "ap-southeast",
    ]
    assert data["report"]["kafka"]["deadletters_by_reason"] == [
        ["edgefeed.deadletter", "unknown-region", 2],
        ["edgefeed.deadletter.eu-west", "missing-key", 1],
    ]
    assert {link["name"]: link["state"] for link in data["report"]["links"]} == {
        "central-eu-west": "CUT",
        "central-us-east": "UP",
    }
    assert data["freshness_history"]["eu-west"] == [[NOW, 42.0], [NOW + 15, 42.0]]
    assert data["freshness_history"]["ap-southeast"] == [[NOW, None], [NOW + 15, None]]


def test_before_the_first_report_the_page_says_so() -> None:
    html = render_status(None, FreshnessHistory(), budget_s=5.0, refresh_s=15.0, now=NOW)
    assert "No report collected yet." in html
