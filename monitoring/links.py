"""WAN links between sites in the report: their state, and the problems they cause.

The rows come from whatever :data:`~monitoring.monitor.LinkReader` the monitor
was given: locally, the WAN emulator's status (edgefeed.wan), one mapping per
link with ``name``, ``state`` (``healed`` or ``cut``), ``endpoint_error``,
``cut_for_s``, ``delay_ms``, ``observed_delay_ms``, ``bytes_up``,
``bytes_down``, ``bytes_per_s_up``, ``bytes_per_s_down`` and
``connections_open``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from monitoring.model import LinkReport, LinkState, RegionReport

__all__ = ["link_problems", "link_reports"]


def link_reports(rows: Sequence[Mapping[str, Any]]) -> tuple[LinkReport, ...]:
    """Each link judged: UP (OK), CUT or DOWN (ERR: nothing crosses it), by name."""
    reports = []
    for row in rows:
        state: LinkState
        if row.get("state") == "cut":
            state = "CUT"
        elif row.get("endpoint_error"):
            state = "DOWN"
        else:
            state = "UP"
        reports.append(
            LinkReport(
                name=str(row["name"]),
                state=state,
                severity="OK" if state == "UP" else "ERR",
                reachable=state == "UP",
                cut_for_s=row.get("cut_for_s"),
                delay_ms=float(row.get("delay_ms") or 0.0),
                observed_delay_ms=float(row.get("observed_delay_ms") or 0.0),
                bytes_per_s_up=float(row.get("bytes_per_s_up") or 0.0),
                bytes_per_s_down=float(row.get("bytes_per_s_down") or 0.0),
                bytes_up=int(row.get("bytes_up") or 0),
                bytes_down=int(row.get("bytes_down") or 0),
                connections=int(row.get("connections_open") or 0),
                error=row.get("endpoint_error") or None,
            )
        )
    return tuple(sorted(reports, key=lambda r: r.name))


def link_problems(
    links: Sequence[LinkReport],
    links_error: str | None,
    regions: Sequence[RegionReport],
    budget_s: float,
) -> tuple[str, ...]:
    """One line per link not UP (with the region behind it) and per region behind
    more than ``budget_s``."""
    problems = [links_error] if links_error else []
    for link in links:
        if link.state == "UP":
            continue
        region = next((r for r in regions if r.link == link.name), None)
        what = (
            f"CUT for {link.cut_for_s:.0f} s"
            if link.state == "CUT" and link.cut_for_s is not None
            else link.state
        )
        problem = f"link {link.name} {what}" + (f": {link.error}" if link.error else "")
        if region is not None and region.behind_seconds is not None:
            problem += f"; region {region.region} {region.behind_seconds:.1f} s behind"
        problems.append(problem)
    for r in regions:
        if r.behind_seconds is not None and r.behind_seconds > budget_s:
            problems.append(
                f"region {r.region} {r.behind_seconds:.1f} s behind (budget {budget_s:g} s)"
                + (f", across link {r.link}" if r.link else "")
            )
    return tuple(problems)
