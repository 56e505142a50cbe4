"""The lab's numbers: one sample per request, percentiles per topology (no I/O)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["TERMS", "Percentiles", "Sample", "TopologySummary", "summarize"]

TERMS = ("network", "data", "model", "service", "total")
"""The latency terms a table shows, T_total last."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One request of one topology, in milliseconds and bytes.

    Attributes:
        network_ms: T_network as the client attributed it (round trip minus the
            worker's own time).
        data_ms: T_data: the worker's decode and feature lookup, plus any work
            the edge did before sending (image preprocessing).
        model_ms: T_model from the worker's header.
        service_ms: T_service from the worker's header.
        measured_ms: The measured total: the client's clock from sending the
            request to the answer's last byte, plus the edge's work before
            sending (image preprocessing): what the four terms must add up to.
        wall_ms: The lab's clock around the whole call (adds the client
            library's own work outside its clock, and any stall of the machine).
        wire_bytes: Bytes that crossed the client's link, both directions.
        wan_bytes: Bytes that crossed the worker's link to its data (the WAN
            query of the edge without cache), both directions.
    """

    network_ms: float
    data_ms: float
    model_ms: float
    service_ms: float
    measured_ms: float
    wall_ms: float = 0.0
    wire_bytes: int = 0
    wan_bytes: int = 0

    @property
    def total_ms(self) -> float:
        """T_total = T_network + T_data + T_model + T_service."""
        return self.network_ms + self.data_ms + self.model_ms + self.service_ms

    def term(self, name: str) -> float:
        """The value of one of :data:`TERMS`."""
        if name == "total":
            return self.total_ms
        value: float = getattr(self, f"{name}_ms")
        return value


@dataclass(frozen=True, slots=True)
class Percentiles:
    """p50, p95 and p99 of one term, in milliseconds."""

    p50: float
    p95: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        if not values:
            raise ValueError("percentiles of no values: run at least one request")
        p50, p95, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 95, 99])
        return cls(float(p50), float(p95), float(p99))

    def as_dict(self) -> dict[str, float]:
        return {"p50": round(self.p50, 3), "p95": round(self.p95, 3), "p99": round(self.p99, 3)}


@dataclass(frozen=True, slots=True)
class TopologySummary:
    """What a table row group and a bar show for one topology.

    Attributes:
        key: Short name (``central``, ``edge-sql``, ``edge-edgefeed``, ``image-raw``...).
        title: What a person reads.
        requests: Requests measured.
        terms: :data:`TERMS` -> percentiles.
        wire_bytes: Mean bytes per request across the client's link.
        wan_bytes: Mean bytes per request across the worker's data link.
        max_gap_ms: Largest difference between a request's four terms and its
            measured total.
        wall_overhead_ms: p50 of the lab's outer clock minus the measured total
            (the client library's work outside its own clock).
        model: Which model and precision served it.
        accuracy: The model's held-out metrics (percent), when known.
        case_study: The case study's figure per term (ms), when it has one.
        links: The emulated links, as a person reads them.
    """

    key: str
    title: str
    requests: int
    terms: Mapping[str, Percentiles]
    wire_bytes: float
    wan_bytes: float
    max_gap_ms: float
    wall_overhead_ms: float = 0.0
    model: str = ""
    accuracy: Mapping[str, float] = field(default_factory=dict)
    case_study: Mapping[str, float] = field(default_factory=dict)
    links: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "title": self.title,
            "requests": self.requests,
            "terms_ms": {name: p.as_dict() for name, p in self.terms.items()},
            "wire_bytes_per_request": round(self.wire_bytes, 1),
            "wan_bytes_per_request": round(self.wan_bytes, 1),
            "max_gap_ms": round(self.max_gap_ms, 3),
            "wall_overhead_ms": round(self.wall_overhead_ms, 3),
            "model": self.model,
            "accuracy": dict(self.accuracy),
            "case_study_ms": dict(self.case_study),
            "links": self.links,
        }


def summarize(
    key: str,
    title: str,
    samples: Sequence[Sample],
    *,
    model: str = "",
    accuracy: Mapping[str, float] | None = None,
    case_study: Mapping[str, float] | None = None,
    links: str = "",
) -> TopologySummary:
    """Percentiles of every term over ``samples`` (each term on its own: the p50 of
    T_total is not the sum of the terms' p50s).

    Raises:
        ValueError: ``samples`` is empty.
    """
    if not samples:
        raise ValueError(f"topology {key!r} has no samples: run at least one request")
    terms = {name: Percentiles.of([s.term(name) for s in samples]) for name in TERMS}
    return TopologySummary(
        key=key,
        title=title,
        requests=len(samples),
        terms=terms,
        wire_bytes=float(np.mean([s.wire_bytes for s in samples])),
        wan_bytes=float(np.mean([s.wan_bytes for s in samples])),
        max_gap_ms=max(abs(s.total_ms - s.measured_ms) for s in samples),
        wall_overhead_ms=float(np.median([s.wall_ms - s.measured_ms for s in samples])),
        model=model,
        accuracy=dict(accuracy or {}),
        case_study=dict(case_study or {}),
        links=links,
    )
