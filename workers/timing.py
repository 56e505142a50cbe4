"""The per-request latency budget: T_total = T_network + T_data + T_model + T_service.

The server measures T_data (payload decode, feature lookup), T_model (the forward
pass of the batch the request rode in) and T_service (everything else it spent:
queueing, (de)serialization, HTTP) and sends them in response headers; the
client measures its own round trip and attributes what the server did not
account for to T_network.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "HEADER_BATCH_ROWS",
    "HEADER_DEADLINE_MS",
    "HEADER_TIMING_DETAIL",
    "HEADER_T_DATA",
    "HEADER_T_MODEL",
    "HEADER_T_PHASES",
    "HEADER_T_SERVER",
    "HEADER_T_SERVICE",
    "SERVICE_PHASES",
    "LatencyBreakdown",
    "ServerTiming",
]

HEADER_DEADLINE_MS = "X-Edgefeed-Deadline-Ms"
HEADER_T_DATA = "X-Edgefeed-T-Data-Ms"
HEADER_T_MODEL = "X-Edgefeed-T-Model-Ms"
HEADER_T_SERVICE = "X-Edgefeed-T-Service-Ms"
HEADER_T_SERVER = "X-Edgefeed-T-Server-Ms"
HEADER_BATCH_ROWS = "X-Edgefeed-Batch-Rows"
#: Request header: ``1`` asks for T_service by phase in :data:`HEADER_T_PHASES`.
HEADER_TIMING_DETAIL = "X-Edgefeed-Timing-Detail"
#: Response header (when asked for): ``http=0.012, read=0.004, ...`` in ms.
HEADER_T_PHASES = "X-Edgefeed-T-Phases-Ms"

SERVICE_PHASES = ("http", "read", "queue", "batch", "resume", "render", "other")
"""The phases T_service is made of, in request order.

``http``: from the request's first byte to its handler (header parsing and the
event loop's queue); ``read``: the body; ``queue``: waiting for a batch to be
dispatched; ``batch``: the batch's round trip to the model thread minus the
forward pass (thread hand-off, batch assembly, splitting the outputs);
``resume``: from the batch's results to the request's handler running again;
``render``: the answer's JSON; ``other``: the rest (admission, metrics).
Writing the answer to the socket happens after the headers are sent and is
in no term.
"""


@dataclass(frozen=True, slots=True)
class ServerTiming:
    """What the server spent on one request, in seconds.

    Attributes:
        data_s: Decoding the payload and looking up features.
        model_s: The forward pass of the batch that held the request.
        service_s: The rest: queueing, (de)serialization, framework.
        batch_rows: Rows in that batch (1 when it ran alone).
        phases: T_service by phase (:data:`SERVICE_PHASES`), seconds; empty
            when not measured or not asked for.
    """

    data_s: float
    model_s: float
    service_s: float
    batch_rows: int = 1
    phases: tuple[tuple[str, float], ...] = ()

    @property
    def server_s(self) -> float:
        """Everything the server spent: data + model + service."""
        return self.data_s + self.model_s + self.service_s

    def headers(self, detail: bool = False) -> dict[str, str]:
        """Response headers: one per term plus the W3C ``Server-Timing`` header.

        Args:
            detail: Add :data:`HEADER_T_PHASES` (T_service by phase).
        """
        data, model, service = self.data_s * 1e3, self.model_s * 1e3, self.service_s * 1e3
        headers = {
            HEADER_T_DATA: f"{data:.3f}",
            HEADER_T_MODEL: f"{model:.3f}",
            HEADER_T_SERVICE: f"{service:.3f}",
            HEADER_T_SERVER: f"{self.server_s * 1e3:.3f}",
            HEADER_BATCH_ROWS: str(self.batch_rows),
            "Server-Timing": (
                f"data;dur={data:.3f}, model;dur={model:.3f}, service;dur={service:.3f}"
            ),
        }
        if detail and self.phases:
            headers[HEADER_T_PHASES] = ", ".join(
                f"{name}={seconds * 1e3:.3f}" for name, seconds in self.phases
            )
        return headers

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> ServerTiming | None:
        """Parse the headers :meth:`headers` wrote; None when they are absent or malformed."""
        try:
            phases: tuple[tuple[str, float], ...] = ()
            if HEADER_T_PHASES in headers:
                pairs = (part.strip().split("=", 1) for part in headers[HEADER_T_PHASES].split(","))
                phases = tuple((name, float(ms) / 1e3) for name, ms in pairs)
            return cls(
                data_s=float(headers[HEADER_T_DATA]) / 1e3,
                model_s=float(headers[HEADER_T_MODEL]) / 1e3,
                service_s=float(headers[HEADER_T_SERVICE]) / 1e3,
                batch_rows=int(headers.get(HEADER_BATCH_ROWS, "1")),
                phases=phases,
            )
        except (KeyError, ValueError):
            return None


@dataclass(frozen=True, slots=True)
class LatencyBreakdown:
    """The four terms of one request's latency, in seconds, as the client saw it.

    Attributes:
        network_s: Client round trip minus the server's own time.
        data_s: Server: decode and feature lookup.
        model_s: Server: forward pass.
        service_s: Server: queueing, (de)serialization.
    """

    network_s: float
    data_s: float
    model_s: float
    service_s: float

    @property
    def total_s(self) -> float:
        """T_total, which equals the client-measured round trip."""
        return self.network_s + self.data_s + self.model_s + self.service_s

    @classmethod
    def from_round_trip(cls, round_trip_s: float, server: ServerTiming) -> LatencyBreakdown:
        """Attribute a round trip: what the server did not account for is network."""
        network = max(0.0, round_trip_s - server.server_s)
        return cls(network, server.data_s, server.model_s, server.service_s)
