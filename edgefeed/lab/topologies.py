"""The topologies the lab deploys, and the case study's figures beside them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from edgefeed.lab.exceptions import LabSettingError

__all__ = [
    "CASE_STUDY_CENTRAL",
    "CASE_STUDY_EDGE",
    "ImageTopology",
    "LabOptions",
    "RankTopology",
    "image_topologies",
    "rank_topologies",
]

CASE_STUDY_CENTRAL = {"network": 200.0, "data": 50.0, "model": 100.0, "total": 350.0}
"""shared/background.md: the shop served from Beijing (no service figure given)."""
CASE_STUDY_EDGE = {"network": 30.0, "data": 10.0, "model": 30.0, "service": 40.0, "total": 110.0}
"""shared/background.md: the same shop at the edge (INT8 distilled student, edge cache)."""

FeatureKind = Literal["sql", "edge-cache"]


@dataclass(frozen=True, slots=True)
class LabOptions:
    """What one lab run does.

    Attributes:
        requests: Measured ranking requests per topology (interleaved).
        warmup: Unmeasured requests per topology first (connections, caches).
        candidates: Items ranked per request.
        image_requests: Measured requests per image topology (0: no image path).
        central_delay_ms: One-way delay client -> central (London -> Beijing: 100).
        edge_delay_ms: One-way delay client -> edge (15).
        wan_delay_ms: One-way delay edge -> central (the WAN query, the image upload).
        image_bandwidth_mbit: Bandwidth of the image path's WAN link.
        users: Generated users.
        items: Generated items.
        events: Generated events of the last hour in PostgreSQL.
        region: The edge region (its Redis is the edge cache).
    """

    requests: int = 150
    warmup: int = 3
    candidates: int = 32
    image_requests: int = 12
    central_delay_ms: float = 100.0
    edge_delay_ms: float = 15.0
    wan_delay_ms: float = 100.0
    image_bandwidth_mbit: float = 20.0
    users: int = 2000
    items: int = 500
    events: int = 100_000
    region: str = "eu-west"

    def __post_init__(self) -> None:
        for name, low in (("requests", 1), ("warmup", 0), ("candidates", 1), ("users", 1)):
            value = getattr(self, name)
            if value < low:
                raise LabSettingError(f"{name}={value} must be at least {low}")
        if self.items < self.candidates:
            raise LabSettingError(
                f"items={self.items} must be at least candidates={self.candidates} "
                "(a request ranks distinct items)"
            )
        if self.image_requests < 0 or self.events < 0:
            raise LabSettingError(
                f"image_requests={self.image_requests} and events={self.events} must be 0 or more"
            )
        for name in ("central_delay_ms", "edge_delay_ms", "wan_delay_ms"):
            if getattr(self, name) < 0:
                raise LabSettingError(f"{name}={getattr(self, name)} must be 0 or more")
        if not self.image_bandwidth_mbit > 0:
            raise LabSettingError(
                f"image_bandwidth_mbit={self.image_bandwidth_mbit} must be positive"
            )


@dataclass(frozen=True, slots=True)
class RankTopology:
    """One deployment of the ranking service.

    Attributes:
        key: Short name.
        title: What a person reads.
        client_delay_ms: One-way delay of the client's link to the worker.
        features: ``sql``: computed per request by the lab's SQL; ``edge-cache``:
            read from the region's Redis through the lookup client.
        data_delay_ms: One-way delay between the worker and PostgreSQL (None:
            the worker sits beside the database, no link).
        weights: Checkpoint file in ``workers/models/weights``.
        precision: ``fp32`` or ``int8``.
        model: Which model, as the table names it; also the key of its accuracy.
        case_study: The case study's figures for this deployment, if any.
    """

    key: str
    title: str
    client_delay_ms: float
    features: FeatureKind
    data_delay_ms: float | None
    weights: str
    precision: str
    model: str
    case_study: dict[str, float]

    @property
    def links(self) -> str:
        text = f"client link {self.client_delay_ms:g} ms one way"
        if self.data_delay_ms is not None:
            text += f"; worker -> PostgreSQL {self.data_delay_ms:g} ms one way"
        return text


@dataclass(frozen=True, slots=True)
class ImageTopology:
    """One way of getting a 1080p photo to the classifier.

    Attributes:
        key: Short name.
        title: What a person reads.
        edge_preprocess: The edge turns the JPEG into an envelope before sending.
        central: The worker is central, behind the bandwidth-limited WAN link;
            otherwise it is at the edge, on a link without delay or cap.
    """

    key: str
    title: str
    edge_preprocess: bool
    central: bool


def rank_topologies(options: LabOptions) -> list[RankTopology]:
    """Central, edge without cache, edge with edgefeed."""
    from workers.distill import STUDENT_FILE, TEACHER_FILE

    return [
        RankTopology(
            key="central",
            title="Central: SQL features, teacher fp32",
            client_delay_ms=options.central_delay_ms,
            features="sql",
            data_delay_ms=None,
            weights=TEACHER_FILE,
            precision="fp32",
            model="teacher_fp32",
            case_study=CASE_STUDY_CENTRAL,
        ),
        RankTopology(
            key="edge-sql",
            title="Edge without cache: SQL across the WAN, student int8",
            client_delay_ms=options.edge_delay_ms,
            features="sql",
            data_delay_ms=options.wan_delay_ms,
            weights=STUDENT_FILE,
            precision="int8",
            model="student_int8",
            case_study={},
        ),
        RankTopology(
            key="edge-edgefeed",
            title="Edge with edgefeed: edge cache, student int8",
            client_delay_ms=options.edge_delay_ms,
            features="edge-cache",
            data_delay_ms=None,
            weights=STUDENT_FILE,
            precision="int8",
            model="student_int8",
            case_study=CASE_STUDY_EDGE,
        ),
    ]


def image_topologies() -> list[ImageTopology]:
    """(a) raw JPEG to the centre, (b) preprocessed at the edge, (c) all at the edge."""
    return [
        ImageTopology("image-raw", "(a) raw JPEG across the WAN to a central worker", False, True),
        ImageTopology(
            "image-edge-pre", "(b) preprocessed at the edge, envelope across the WAN", True, True
        ),
        ImageTopology("image-edge", "(c) all at the edge", False, False),
    ]
