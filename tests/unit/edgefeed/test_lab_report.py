"""The lab's aggregation, tables and HTML report (no services)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest
from rich.console import Console

from edgefeed.lab import LabOptions, LabSettingError, Sample, summarize
from edgefeed.lab.report import render_html, topology_table
from edgefeed.lab.topologies import CASE_STUDY_CENTRAL, CASE_STUDY_EDGE


def _sample(network: float, data: float, model: float = 1.0, service: float = 0.5) -> Sample:
    total = network + data + model + service
    return Sample(network, data, model, service, measured_ms=total, wall_ms=total + 0.2)


def test_each_term_has_its_own_percentiles_and_the_total_is_not_their_sum() -> None:
    # Two requests whose slow terms are in different requests: the p50 of T_total
    # is a real request's total, not the sum of the terms' p50s.
    samples = [_sample(200.0, 10.0), _sample(10.0, 200.0), _sample(100.0, 100.0)]
    summary = summarize("central", "Central", samples)
    assert summary.requests == 3
    assert summary.terms["network"].p50 == pytest.approx(100.0)
    assert summary.terms["data"].p50 == pytest.approx(100.0)
    assert summary.terms["total"].p50 == pytest.approx(211.5)
    assert summary.terms["total"].p99 == pytest.approx(211.5)
    assert summary.max_gap_ms == pytest.approx(0.0)
    assert summary.wall_overhead_ms == pytest.approx(0.2)


def test_percentiles_interpolate_and_bytes_are_means() -> None:
    samples = [
        Sample(float(n), 0.0, 0.0, 0.0, float(n), wire_bytes=100 * n, wan_bytes=n)
        for n in range(1, 101)
    ]
    summary = summarize("edge-sql", "Edge", samples)
    assert summary.terms["network"].p50 == pytest.approx(50.5)
    assert summary.terms["network"].p95 == pytest.approx(95.05)
    assert summary.terms["network"].p99 == pytest.approx(99.01)
    assert summary.wire_bytes == pytest.approx(5050.0)
    assert summary.wan_bytes == pytest.approx(50.5)


def test_the_gap_between_terms_and_measured_total_is_reported() -> None:
    off = Sample(10.0, 5.0, 1.0, 1.0, measured_ms=19.5)
    summary = summarize("x", "X", [_sample(1.0, 1.0), off])
    assert summary.max_gap_ms == pytest.approx(2.5)


def test_no_samples_is_an_error_naming_the_topology() -> None:
    with pytest.raises(ValueError, match="'central' has no samples"):
        summarize("central", "Central", [])


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"requests": 0}, "requests=0"),
        ({"candidates": 50, "items": 10}, "items=10"),
        ({"image_bandwidth_mbit": 0.0}, "image_bandwidth_mbit=0.0"),
        ({"wan_delay_ms": -1.0}, "wan_delay_ms=-1.0"),
    ],
)
def test_bad_lab_options_are_typed_errors_naming_the_value(
    options: dict[str, float], named: str
) -> None:
    with pytest.raises(LabSettingError, match=re.escape(named)) as caught:
        LabOptions(**options)  # type: ignore[arg-type]
    assert isinstance(caught.value, ValueError)


def _summaries() -> tuple[list, list]:  # type: ignore[type-arg]
    ranking = [
        summarize(
            "central",
            "Central",
            [_sample(200.0, 40.0, 3.0), _sample(205.0, 35.0, 2.0)],
            case_study=CASE_STUDY_CENTRAL,
            accuracy={"auc": 64.6},
            model="teacher fp32",
        ),
        summarize("edge-sql", "Edge without cache", [_sample(30.0, 240.0)]),
        summarize(
            "edge-edgefeed",
            "Edge <with> edgefeed",
            [_sample(30.0, 2.0)],
            case_study=CASE_STUDY_EDGE,
        ),
    ]
    images = [summarize(k, k, [_sample(200.0, 20.0)]) for k in ("image-raw", "image-edge")]
    return ranking, images


class _Groups(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.groups: list[tuple[str, str]] = []
        self.scripts = 0
        self.links = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "g":
            self.groups.append((attributes.get("class") or "", attributes.get("data-key") or ""))
        self.scripts += tag == "script"
        self.links += tag == "link" or "src" in attributes


def test_the_report_has_one_bar_group_per_topology_and_renders_standalone() -> None:
    ranking, images = _summaries()
    html = render_html(ranking, images, ratio=0.178)
    parser = _Groups()
    parser.feed(html)
    bars = [key for kind, key in parser.groups if kind == "topology"]
    assert bars == ["central", "edge-sql", "edge-edgefeed", "image-raw", "image-edge"]
    studies = [key for kind, key in parser.groups if kind == "case-study"]
    assert studies == ["central-case-study", "edge-edgefeed-case-study"]
    assert parser.scripts == 0 and parser.links == 0, "self-contained: no script, nothing fetched"
    assert "0.178" in html
    assert "T_total 350 ms" in html and "T_total 110 ms" in html, "the case study's totals"
    assert "T_total 243 ms" in html, "central's bar is captioned with its T_total p50"
    assert "Edge &lt;with&gt; edgefeed" in html, "titles are escaped"
    svgs = re.findall(r"<svg.*?</svg>", html, flags=re.S)
    assert len(svgs) == 2
    for svg in svgs:
        ET.fromstring(svg)  # well-formed SVG: a browser draws it


def test_bar_segments_are_proportional_to_each_term() -> None:
    ranking, _ = _summaries()
    svg = re.findall(r"<svg.*?</svg>", render_html(ranking), flags=re.S)[0]
    root = ET.fromstring(svg)
    ns = {"s": "http://www.w3.org/2000/svg"}
    widths: dict[str, dict[str, float]] = {}
    for group in root.findall("s:g", ns):
        widths[group.get("data-key", "")] = {
            (rect.get("class") or "").removeprefix("term-"): float(rect.get("width", "0"))
            for rect in group.findall("s:rect", ns)
        }
    central, edge = widths["central"], widths["edge-edgefeed"]
    assert central["network"] / central["data"] == pytest.approx(202.5 / 37.5, rel=1e-3)
    assert central["network"] / edge["network"] == pytest.approx(202.5 / 30.0, rel=1e-3)
    study = widths["central-case-study"]
    assert study["network"] / study["model"] == pytest.approx(2.0, rel=1e-3)
    assert "service" not in study, "the case study gives no service figure for central"


def test_the_table_shows_every_term_beside_the_case_study() -> None:
    ranking, _ = _summaries()
    console = Console(width=200, record=True)
    console.print(topology_table(ranking[0]))
    text = console.export_text()
    for label in ("T_network", "T_data", "T_model", "T_service", "T_total", "case study"):
        assert label in text
    assert "350" in text and "202" in text
    assert "auc 64.60" in text


def test_a_body_still_uploading_counts_as_network_and_the_terms_still_add_up() -> None:
    from edgefeed.lab.run import sample_of
    from workers.client import InferenceAnswer
    from workers.timing import LatencyBreakdown

    # The worker spent 260 ms: 250 reading a body crossing a slow link, 10 on data.
    latency = LatencyBreakdown(network_s=0.2, data_s=0.01, model_s=0.003, service_s=0.252)
    answer = InferenceAnswer({}, latency, 1, {"read": 250.0, "http": 0.5}, round_trip_s=0.465)
    sample = sample_of(answer, wall_s=0.5, edge_s=0.04, wire=1000, wan=0)
    assert sample.network_ms == pytest.approx(450.0)
    assert sample.service_ms == pytest.approx(2.0)
    assert sample.data_ms == pytest.approx(50.0), "edge preprocessing is data preparation"
    assert sample.measured_ms == pytest.approx(505.0)
    assert sample.total_ms == pytest.approx(sample.measured_ms)
    assert sample.wall_ms == pytest.approx(500.0)
