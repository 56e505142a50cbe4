"""What a lab run shows: rich tables in the terminal and a self-contained HTML report
(inline SVG stacked bars, no script, nothing fetched when it is opened)."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from rich.table import Table

from edgefeed.lab.stats import TERMS, TopologySummary

__all__ = ["TERM_COLOURS", "render_html", "topology_table"]

TERM_COLOURS = {
    "network": "#4e79a7",
    "data": "#f28e2b",
    "model": "#59a14f",
    "service": "#b07aa1",
}
_LABELS = {
    "network": "T_network",
    "data": "T_data",
    "model": "T_model",
    "service": "T_service",
    "total": "T_total",
}


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _bytes(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.2f} MB"
    if value >= 1e3:
        return f"{value / 1e3:.1f} kB"
    return f"{value:.0f} B"


def _accuracy(summary: TopologySummary) -> str:
    if not summary.accuracy:
        return ""
    parts = [f"{name} {value:.2f}" for name, value in summary.accuracy.items()]
    return f"held-out {', '.join(parts)} (%)"


def topology_table(summary: TopologySummary) -> Table:
    """One topology: p50/p95/p99 of each term next to the case study's figure."""
    table = Table(title=summary.title, title_justify="left", min_width=60)
    table.add_column("ms")
    for column in ("p50", "p95", "p99"):
        table.add_column(column, justify="right")
    has_study = bool(summary.case_study)
    if has_study:
        table.add_column("case study", justify="right", style="dim")
    for term in TERMS:
        p = summary.terms[term]
        row = [_LABELS[term], _ms(p.p50), _ms(p.p95), _ms(p.p99)]
        if has_study:
            row.append(_ms(summary.case_study.get(term)))
        table.add_row(*row, style="bold" if term == "total" else None)
    caption = [
        summary.links,
        f"{summary.requests} requests",
        f"{_bytes(summary.wire_bytes)}/request on the client's link",
    ]
    if summary.wan_bytes:
        caption.append(f"{_bytes(summary.wan_bytes)}/request on the worker's WAN link")
    if summary.model:
        caption.append(summary.model)
    if summary.accuracy:
        caption.append(_accuracy(summary))
    caption.append(f"terms vs measured: max gap {summary.max_gap_ms:.3f} ms")
    table.caption = "; ".join(caption)
    table.caption_justify = "left"
    return table


def _bars(rows: Sequence[tuple[str, str, dict[str, float], bool]], title: str) -> str:
    """An SVG of stacked horizontal bars: (key, label, term -> ms, from the case study);
    a bar's length is the sum of its terms, its caption T_total (``total``) when given."""
    width, label_w, bar_h, gap, top = 1100, 420, 26, 14, 40
    scale_w = width - label_w - 90
    longest = max((_stack(terms) for _, _, terms, _ in rows), default=1.0) or 1.0
    height = top + len(rows) * (bar_h + gap) + 50
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
        f'<text x="0" y="20" font-size="16" font-weight="bold">{escape(title)}</text>',
    ]
    for n, (key, label, terms, study) in enumerate(rows):
        y = top + n * (bar_h + gap)
        kind = "case-study" if study else "topology"
        out.append(f'<g class="{kind}" data-key="{escape(key)}">')
        style = ' font-style="italic" fill="#666"' if study else ""
        out.append(
            f'<text x="0" y="{y + bar_h * 0.7:.1f}" font-size="13"{style}>{escape(label)}</text>'
        )
        x = float(label_w)
        for term, colour in TERM_COLOURS.items():
            value = terms.get(term, 0.0)
            w = value / longest * scale_w
            if w <= 0:
                continue
            opacity = ' fill-opacity="0.45"' if study else ""
            out.append(
                f'<rect class="term-{term}" x="{x:.2f}" y="{y}" width="{w:.2f}" '
                f'height="{bar_h}" fill="{colour}"{opacity}>'
                f"<title>{_LABELS[term]} {value:.1f} ms</title></rect>"
            )
            x += w
        total = terms.get("total", _stack(terms))
        out.append(
            f'<text x="{x + 6:.2f}" y="{y + bar_h * 0.7:.1f}" font-size="13">'
            f"T_total {total:.0f} ms</text>"
        )
        out.append("</g>")
    legend_y = height - 20
    for n, (term, colour) in enumerate(TERM_COLOURS.items()):
        x = label_w + n * 130
        out.append(
            f'<rect x="{x}" y="{legend_y - 11}" width="12" height="12" fill="{colour}"/>'
            f'<text x="{x + 17}" y="{legend_y}" font-size="12">{_LABELS[term]}</text>'
        )
    out.append("</svg>")
    return "\n".join(out)


def _stack(terms: dict[str, float]) -> float:
    return sum(terms.get(term, 0.0) for term in TERM_COLOURS)


def _p50s(summary: TopologySummary) -> dict[str, float]:
    return {term: summary.terms[term].p50 for term in (*TERM_COLOURS, "total")}


def _html_table(summaries: Sequence[TopologySummary]) -> str:
    head = (
        "".join(f"<th>{_LABELS[t]} p50 / p95 / p99</th>" for t in TERMS)
        + "<th>bytes/request (client link)</th><th>bytes/request (WAN)</th><th>model</th>"
    )
    rows = []
    for s in summaries:
        cells = "".join(
            f"<td>{_ms(s.terms[t].p50)} / {_ms(s.terms[t].p95)} / {_ms(s.terms[t].p99)}</td>"
            for t in TERMS
        )
        rows.append(
            f"<tr><th>{escape(s.title)}</th>{cells}<td>{_bytes(s.wire_bytes)}</td>"
            f"<td>{_bytes(s.wan_bytes) if s.wan_bytes else '-'}</td>"
            f"<td>{escape(s.model)} {escape(_accuracy(s))}</td></tr>"
        )
    return f"<table><tr><th>topology</th>{head}</tr>{''.join(rows)}</table>"


def render_html(
    ranking: Sequence[TopologySummary],
    images: Sequence[TopologySummary] = (),
    *,
    ratio: float | None = None,
    notes: Sequence[str] = (),
) -> str:
    """The report: stacked p50 bars per topology (the case study's beside them), then
    the full numbers. Self-contained: inline SVG and CSS, no script."""
    rows: list[tuple[str, str, dict[str, float], bool]] = []
    for s in ranking:
        rows.append((s.key, s.title, _p50s(s), False))
        if s.case_study:
            study = {t: s.case_study.get(t, 0.0) for t in (*TERM_COLOURS, "total")}
            rows.append((f"{s.key}-case-study", "  case study (background.md)", study, True))
    parts = [
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"/>',
        "<title>edgefeed latency lab</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;"
        "margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;font-size:13px;"
        "text-align:right}th:first-child{text-align:left}</style></head><body>",
        "<h1>edgefeed latency lab</h1>",
        "<p>T_total = T_network + T_data + T_model + T_service, p50 per term, "
        "measured by the client and the workers' headers.</p>",
    ]
    if ratio is not None:
        verdict = "meets" if ratio <= 1 / 3 else "misses"
        parts.append(
            f"<p><b>Edge with edgefeed / Central, T_total p50: {ratio:.3f}</b> "
            f"(target at most 0.333, case study 0.31: {verdict} it).</p>"
        )
    parts.append(_bars(rows, "Ranking: p50 of each term (ms)"))
    parts.append(_html_table(ranking))
    if images:
        image_rows = [(s.key, s.title, _p50s(s), False) for s in images]
        parts.append(_bars(image_rows, "1080p photo to a classifier: p50 of each term (ms)"))
        parts.append(_html_table(images))
    for note in notes:
        parts.append(f"<p>{escape(note)}</p>")
    parts.append("</body></html>")
    return "\n".join(parts)
