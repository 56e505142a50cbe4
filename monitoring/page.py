"""The exporter's status page: ``/status`` (HTML for people) and ``/status.json``.

Both render the report the exporter's collection loop made last (the one
``/metrics`` renders), never a collection of their own. The page is one
server-rendered HTML document with everything inline: its stylesheet (allowed by
its hash in the Content-Security-Policy), an SVG sparkline of each region's
freshness, no script at all; it reloads itself with ``<meta http-equiv="refresh">``.
Every value that comes from outside (region, group, connector, topic and slot
names, dead-letter reasons, error texts) is escaped.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from monitoring.model import GroupReport, LinkReport, RegionReport, Report, SnapshotReport

__all__ = [
    "CONTENT_SECURITY_POLICY",
    "CSS",
    "FreshnessHistory",
    "StatusBoard",
    "render_status",
    "sparkline_points",
    "status_json",
]

Point = tuple[float, float]

CSS = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:1.2em 2em;color:#1d2430}
h1{font-size:1.4em;margin:0 0 .2em}h2{font-size:1.1em;margin:1.4em 0 .4em}
table{border-collapse:collapse;margin:.2em 0}
th,td{padding:.25em .7em;border-bottom:1px solid #dde2ea;text-align:left;vertical-align:middle}
th{background:#f2f4f8;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.badge{display:inline-block;padding:.05em .5em;border-radius:.3em;font-weight:600}
.OK{background:#d8f3dc;color:#1b5e20}.WARN{background:#fff3c4;color:#7a5200}
.ERR{background:#ffd6d6;color:#8b0000}.UNKNOWN{background:#e3e6ec;color:#39414f}
.meta{color:#5a6372}.problems li{color:#8b0000}.none{color:#5a6372;font-style:italic}
svg.spark{vertical-align:middle}svg.spark .budget{stroke:#c77;stroke-dasharray:3 2}
svg.spark .line{stroke:#2d6cdf;fill:none;stroke-width:1.5}
""".strip()

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; "
    f"style-src 'sha256-{base64.b64encode(hashlib.sha256(CSS.encode()).digest()).decode()}'; "
    "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
"""No script, no fetch, no frame, no form; only the page's own stylesheet."""

#: Sparkline size in CSS pixels.
SPARK_WIDTH, SPARK_HEIGHT = 160.0, 28.0


class FreshnessHistory:
    """A bounded ring buffer of each region's freshness over the last minutes.

    Written by the collection loop, read by the page's threads: hence the lock.

    Args:
        span_s: How far back the sparkline reaches.
        max_points: Reports kept at most (oldest dropped first).
    """

    def __init__(self, span_s: float = 600.0, max_points: int = 600) -> None:
        self.span_s = span_s
        self._lock = threading.Lock()
        self._rounds: deque[tuple[float, dict[str, float | None]]] = deque(maxlen=max_points)

    def add(self, report: Report) -> None:
        """Keep the freshness of every region ``report`` read (None: unknown)."""
        values = {r.region: r.freshness_seconds for r in report.regions}
        with self._lock:
            self._rounds.append((report.at, values))
            while self._rounds and self._rounds[0][0] < report.at - self.span_s:
                self._rounds.popleft()

    def samples(self, region: str) -> list[tuple[float, float | None]]:
        """``(at, freshness)`` of ``region`` over the span, oldest first."""
        with self._lock:
            return [(at, values[region]) for at, values in self._rounds if region in values]

    def as_dict(self) -> dict[str, list[tuple[float, float | None]]]:
        with self._lock:
            regions = sorted({name for _at, values in self._rounds for name in values})
        return {name: self.samples(name) for name in regions}


def sparkline_points(
    samples: Sequence[tuple[float, float | None]],
    *,
    start: float,
    end: float,
    top: float,
    width: float = SPARK_WIDTH,
    height: float = SPARK_HEIGHT,
) -> list[list[Point]]:
    """The polyline(s) of a sparkline: x from ``start`` (0) to ``end`` (``width``),
    y from 0 s (``height``, the bottom) to ``top`` (0); values over ``top`` are
    drawn at the top, samples before ``start`` left out. An unknown sample breaks
    the line, so a gap shows as a gap, not as a slope between its neighbours."""
    lines: list[list[Point]] = [[]]
    for at, value in samples:
        if at < start:
            continue
        if value is None:
            if lines[-1]:
                lines.append([])
            continue
        x = max(0.0, min(width, (at - start) / (end - start) * width))
        y = height - min(max(value, 0.0), top) / top * height
        lines[-1].append((round(x, 1), round(y, 1)))
    return [line for line in lines if line]


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _utc(at: float, fmt: str) -> str:
    return time.strftime(fmt, time.gmtime(at))


def _seconds(value: float | None) -> str:
    if value is None:
        return "unknown"
    return f"{value:.1f} s" if value < 600 else f"{value / 60:.0f} min"


def _count(value: int | None) -> str:
    return "unknown" if value is None else f"{value:,}"


def _bytes(value: int | None) -> str:
    return human_bytes(value, "unknown")


def human_bytes(value: int | None, missing: str) -> str:
    """``value`` bytes in B, KiB, MiB or GiB (``missing`` when unknown); also what
    ``edgefeed lag`` prints."""
    if value is None:
        return missing
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(value)


_SEVERITY_CLASS = {
    "OK": "OK",
    "IDLE": "OK",
    "UP": "OK",
    "RUNNING": "OK",
    "COMPLETED": "OK",
    "WARN": "WARN",
    "STALE": "WARN",
    "NODATA": "WARN",
    "REBUILDING": "WARN",
    "PACED": "OK",
    "PAUSED": "WARN",
    "NOTFOUND": "WARN",
    "ERR": "ERR",
    "CUT": "ERR",
    "DOWN": "ERR",
    "FAILED": "ERR",
    "STOP": "ERR",
    "STALL": "ERR",
    "REWIND": "ERR",
    "ABORTED": "ERR",
    "ABSENT": "ERR",
}


def _badge(text: str, state: str | None = None) -> str:
    css = _SEVERITY_CLASS.get(state or text, "UNKNOWN")
    return f'<span class="badge {css}">{_e(text)}</span>'


def _table(headers: Iterable[str], rows: list[list[str]], empty: str) -> str:
    if not rows:
        return f'<p class="none">{_e(empty)}</p>'
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _td(text: str, *, numeric: bool = False, raw: bool = False, data: str = "") -> str:
    cls = ' class="n"' if numeric else ""
    attr = f' data-field="{data}"' if data else ""
    return f"<td{cls}{attr}>{text if raw else _e(text)}</td>"


def _sparkline(
    samples: Sequence[tuple[float, float | None]], now: float, span_s: float, budget: float
) -> str:
    # A young exporter has less history than the span: the line spans what there is
    # (half a minute at least) rather than a sliver at the right edge.
    start = max(now - span_s, min((at for at, _v in samples), default=now))
    start = min(start, now - 30.0)
    known = [v for at, v in samples if v is not None and at >= start]
    top = max([budget * 2, *known]) if known else budget * 2
    lines = sparkline_points(samples, start=start, end=now, top=top)
    budget_y = SPARK_HEIGHT - budget / top * SPARK_HEIGHT
    polylines = "".join(
        '<polyline class="line" points="' + " ".join(f"{x:g},{y:g}" for x, y in line) + '"/>'
        for line in lines
    )
    label = (
        f"freshness over the last {_seconds(now - start)}, up to {top:.1f} s "
        f"at the top; budget {budget:g} s (dashed)"
    )
    return (
        f'<svg class="spark" width="{SPARK_WIDTH:g}" height="{SPARK_HEIGHT:g}" '
        f'viewBox="0 0 {SPARK_WIDTH:g} {SPARK_HEIGHT:g}" role="img" aria-label="{_e(label)}">'
        f"<title>{_e(label)}</title>"
        f'<line class="budget" x1="0" x2="{SPARK_WIDTH:g}" '
        f'y1="{budget_y:.1f}" y2="{budget_y:.1f}"/>'
        f"{polylines}</svg>"
    )


def _groups_of(report: Report, region: str) -> list[GroupReport]:
    return [g for g in report.kafka.groups if g.region == region]


def _link_text(link: LinkReport | None, name: str) -> tuple[str, str]:
    """(text, state) of a region's link (``name`` set)."""
    if link is None:
        return f"{name}: unknown", "UNKNOWN"
    if link.state == "CUT":
        since = f" for {link.cut_for_s:.0f} s" if link.cut_for_s is not None else ""
        return f"{name}: CUT{since}", "CUT"
    return f"{name}: {link.state}", link.state


def _region_row(
    report: Report, region: RegionReport, history: FreshnessHistory, budget: float
) -> list[str]:
    groups = _groups_of(report, region.region)
    if report.kafka.error is not None or not groups:
        lag_s, burrow = "unknown", _badge("UNKNOWN")
    else:
        lag_s = _seconds(max(g.lag_seconds for g in groups))
        burrow = " ".join(
            _badge(f"{g.status}", g.status) + f' <span class="meta">{_e(g.group)}</span>'
            for g in groups
        )
    if region.link is None:
        link_cell = "none: no site of its own"
    else:
        link_text, link_state = _link_text(report.link(region.link), region.link)
        link_cell = _badge(link_text, link_state)
    state = region.state
    state_text = "DOWN: unknown" if state == "DOWN" else state
    notes = []
    if region.error:
        notes.append(region.error)
    if region.rebuilding:
        notes.append("rebuilding " + ", ".join(region.rebuilding))
    if region.quarantined:
        notes.append(f"{region.quarantined} quarantined")
    behind = "" if region.behind_seconds is None else f" (behind {_seconds(region.behind_seconds)})"
    return [
        _td(region.region, data="region"),
        _td(_badge(state_text, state), raw=True, data="state"),
        _td(_seconds(region.freshness_seconds), numeric=True, data="freshness"),
        _td(
            _sparkline(history.samples(region.region), report.at, history.span_s, budget), raw=True
        ),
        _td(lag_s, numeric=True, data="lag-seconds"),
        _td(_count(region.pending), numeric=True, data="lag-messages"),
        _td(burrow, raw=True, data="burrow"),
        _td(link_cell + _e(behind), raw=True, data="link"),
        _td("; ".join(notes)),
    ]


def _snapshot_progress(snap: SnapshotReport) -> str:
    done = sum(
        1 for t in snap.tables if t.rows is not None or t.status not in ("PENDING", "RUNNING")
    )
    text = f"{done}/{len(snap.tables)} tables, {snap.rows:,} rows"
    if snap.current_table:
        text += f"; reading {snap.current_table}"
        if snap.last_key is not None and snap.max_key is not None:
            text += f" at key {snap.last_key} of {snap.max_key}"
            try:
                last, top = (
                    float(str(snap.last_key).strip("[]")),
                    float(str(snap.max_key).strip("[]")),
                )
                if top > 0:
                    text += f" ({min(last / top, 1.0):.0%})"
            except ValueError:
                pass
    return text


def render_status(
    report: Report | None,
    history: FreshnessHistory,
    *,
    budget_s: float,
    refresh_s: float,
    now: float | None = None,
) -> str:
    """The whole page for the latest ``report`` (None: the first collection is not in)."""
    now = time.time() if now is None else now
    refresh = max(round(refresh_s), 2)
    head = (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="refresh" content="{refresh}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>edgefeed status</title><style>{CSS}</style></head><body>"
    )
    if report is None:
        return head + "<h1>edgefeed status</h1><p>No report collected yet.</p></body></html>"
    age = max(now - report.at, 0.0)
    stale = age > 3 * refresh_s + 10
    parts = [
        f"<h1>edgefeed status {_badge(report.severity)}</h1>",
        f'<p class="meta">collected {_utc(report.at, "%Y-%m-%d %H:%M:%S UTC")} ({age:.0f} s ago);'
        f" freshness budget {budget_s:g} s; this page reloads every {refresh} s</p>",
    ]
    if stale:
        parts.append(
            f"<p>{_badge('STALE REPORT', 'ERR')} the exporter has not collected for {age:.0f} s: "
            "what follows is old</p>"
        )
    if report.problems:
        items = "".join(f"<li>{_e(p)}</li>" for p in report.problems)
        parts.append(f'<ul class="problems">{items}</ul>')

    parts.append("<h2>Regions</h2>")
    if report.kafka.error:
        parts.append(f"<p>{_badge('UNKNOWN')} Kafka: {_e(report.kafka.error)}</p>")
    rows = [_region_row(report, r, history, budget_s) for r in report.regions]
    parts.append(
        '<div id="regions">'
        + _table(
            (
                "region",
                "state",
                "freshness",
                f"freshness, up to the last {history.span_s / 60:g} min",
                "lag",
                "messages pending",
                "consumer group (Burrow)",
                "WAN link",
                "notes",
            ),
            rows,
            "no region read by this exporter",
        )
        + "</div>"
    )

    parts.append("<h2>WAN links</h2>")
    if report.links_error:
        parts.append(f"<p>{_badge('UNKNOWN')} {_e(report.links_error)}</p>")
    link_rows = []
    for link in report.links:
        text, state = _link_text(link, link.name)
        link_rows.append(
            [
                _td(link.name, data="link-name"),
                _td(_badge(text.split(": ", 1)[1], state), raw=True, data="link-state"),
                _td(f"{link.delay_ms:g} ms / {link.observed_delay_ms:.0f} ms", numeric=True),
                _td(
                    f"{_bytes(int(link.bytes_per_s_up))}/s up, "
                    f"{_bytes(int(link.bytes_per_s_down))}/s down",
                    numeric=True,
                ),
                _td(str(link.connections), numeric=True),
                _td(link.error or ""),
            ]
        )
    parts.append(
        '<div id="links">'
        + _table(
            ("link", "state", "delay set / seen", "throughput", "connections", "error"),
            link_rows,
            "no WAN link (or none this exporter reads)",
        )
        + "</div>"
    )

    parts.append("<h2>Snapshots</h2>")
    if report.snapshot_error:
        parts.append(f"<p>{_badge('UNKNOWN')} {_e(report.snapshot_error)}</p>")
    snap_rows = [
        [
            _td(s.connector),
            _td(_badge(s.state), raw=True),
            _td(_snapshot_progress(s)),
            _td("unknown" if s.updated_ms is None else _utc(s.updated_ms / 1000, "%H:%M:%S UTC")),
        ]
        for s in report.snapshots
    ]
    parts.append(
        '<div id="snapshots">'
        + _table(
            ("connector", "state", "progress", "updated"), snap_rows, "no incremental snapshot"
        )
        + "</div>"
    )

    parts.append("<h2>Dead letters</h2>")
    kafka = report.kafka
    total = "unknown" if kafka.deadletters is None else f"{kafka.deadletters:,}"
    new = f", {kafka.deadletters_new:,} new" if kafka.deadletters_new else ""
    parts.append(f"<p>{_e(total)} in all{_e(new)}</p>")
    dl_rows = [
        [_td(topic), _td(reason, data="reason"), _td(f"{count:,}", numeric=True)]
        for topic, reason, count in kafka.deadletters_by_reason
    ]
    parts.append(
        '<div id="deadletters">'
        + _table(("topic", "reason", "dead letters"), dl_rows, "no dead letter")
        + "</div>"
    )

    parts.append("<h2>Connectors and replication slots</h2>")
    if report.connect_error:
        parts.append(f"<p>{_badge('UNKNOWN')} Kafka Connect: {_e(report.connect_error)}</p>")
    conn_rows = [
        [
            _td(c.name),
            _td(_badge(c.state), raw=True),
            _td(", ".join(f"task {t.id} {t.state}" for t in c.tasks) or "no task"),
            _td(c.failure or ""),
        ]
        for c in report.connectors
    ]
    parts.append(
        '<div id="connectors">'
        + _table(("connector", "state", "tasks", "failure"), conn_rows, "no connector read")
        + "</div>"
    )
    if report.cdc_error:
        parts.append(f"<p>{_badge('UNKNOWN')} PostgreSQL: {_e(report.cdc_error)}</p>")
    slot_rows = [
        [
            _td(s.slot),
            _td(_badge(s.severity), raw=True),
            _td("active" if s.active else "inactive"),
            _td(_bytes(s.retained_wal_bytes), numeric=True),
            _td(s.wal_status or "unknown"),
            _td(s.reason),
        ]
        for s in report.slots
    ]
    parts.append(
        '<div id="slots">'
        + _table(
            ("slot", "status", "reader", "retained WAL", "wal_status", "why"),
            slot_rows,
            "no replication slot read",
        )
        + "</div>"
    )

    parts.append("<h2>Consumer groups</h2>")
    group_rows = [
        [
            _td(g.group),
            _td(_badge(g.status), raw=True),
            _td(_count(g.members), numeric=True),
            _td(f"{g.lag:,}", numeric=True),
            _td(_seconds(g.lag_seconds), numeric=True),
        ]
        for g in report.kafka.groups
    ]
    parts.append(
        _table(("group", "status", "members", "lag", "lag (oldest unread)"), group_rows, "no group")
    )
    return head + "".join(parts) + "</body></html>"


def status_json(report: Report | None, history: FreshnessHistory) -> dict[str, Any]:
    """What the page shows, for machines: the report and each region's freshness history."""
    return {
        "report": None if report is None else report.as_dict(),
        "freshness_history": {
            region: [[at, value] for at, value in samples]
            for region, samples in history.as_dict().items()
        },
    }


@dataclass(slots=True)
class StatusBoard:
    """The latest report and the freshness history, as the page reads them.

    Args:
        budget_s: The freshness budget regions are judged by (the sparkline's line).
        refresh_s: How often the page reloads itself (the collection interval).
        clock: Seconds since the epoch (a fake in tests).
    """

    budget_s: float
    refresh_s: float
    history: FreshnessHistory
    clock: Callable[[], float] = time.time
    _report: Report | None = None

    def update(self, report: Report) -> None:
        self.history.add(report)
        self._report = report  # one reference swap: readers see the old or the new one

    def html(self) -> str:
        return render_status(
            self._report,
            self.history,
            budget_s=self.budget_s,
            refresh_s=self.refresh_s,
            now=self.clock(),
        )

    def json(self) -> str:
        return json.dumps(status_json(self._report, self.history))
