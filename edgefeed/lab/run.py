"""One lab run: deploy every topology on the local stack, send interleaved requests
through emulated links, and read each term from the production instrumentation.

Everything runs in this process on one event loop: the WAN links
(:mod:`edgefeed.wan`, the sites' emulator), one inference server per topology
(:class:`workers.InferenceServer`, the production server) and the client
(:class:`workers.WorkerClient`, which measures T_network). Requests are sent
one at a time, round robin over the topologies, so no two contend and a slow
moment of the shared machine hits every topology alike. PostgreSQL and the
region's Redis are the local stack's real services.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool

from edge_cache import AsyncFeatureClient
from edgefeed.devstack.ports import free_ports
from edgefeed.lab.data import ITEM_QUERY, USER_QUERY, LabData, seed_events, write_edge_cache
from edgefeed.lab.exceptions import LabDataError
from edgefeed.lab.images import JPEG_TYPE, edge_envelope, photo_classifier, synthetic_photo
from edgefeed.lab.stats import Sample, TopologySummary, summarize
from edgefeed.lab.topologies import (
    ImageTopology,
    LabOptions,
    RankTopology,
    image_topologies,
    rank_topologies,
)
from edgefeed.settings import EdgefeedSettings
from edgefeed.wan import Link, LinkParams, LinkSpec
from workers.batcher import BatchingConfig
from workers.client import InferenceAnswer, WorkerClient
from workers.distill import LAB_STUDENT, TEACHER_FILE
from workers.features import EdgeCacheFeatureSource, FeatureSource
from workers.inputs import ENVELOPE_TYPE
from workers.models import load_checkpoint, load_served_model
from workers.models.base import ServedModel
from workers.models.loading import WEIGHTS_DIR
from workers.runtime import RuntimeConfig
from workers.server import InferenceServer, ServerConfig
from workers.sqlfeatures import SqlFeatureSource
from workers.timing import HEADER_TIMING_DETAIL

__all__ = ["LabResult", "run_lab", "sample_of"]

Progress = Callable[[str], None]
_DETAIL = {HEADER_TIMING_DETAIL: "1"}  # T_service by phase, for the body's upload time


@dataclass(frozen=True, slots=True)
class LabResult:
    """A whole run: one summary per topology, the models' accuracy, the setup."""

    ranking: list[TopologySummary]
    images: list[TopologySummary]
    accuracy: dict[str, dict[str, float]]
    options: LabOptions
    photo_bytes: int = 0
    samples: dict[str, list[Sample]] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        """Edge with edgefeed's T_total p50 over Central's (target: at most 1/3)."""
        by_key = {s.key: s for s in self.ranking}
        if "central" not in by_key or "edge-edgefeed" not in by_key:
            return None
        return by_key["edge-edgefeed"].terms["total"].p50 / by_key["central"].terms["total"].p50

    def as_dict(self) -> dict[str, Any]:
        return {
            "ranking": [s.as_dict() for s in self.ranking],
            "images": [s.as_dict() for s in self.images],
            "accuracy": self.accuracy,
            "edge_over_central_p50": None if self.ratio is None else round(self.ratio, 4),
            "photo_bytes": self.photo_bytes,
            "options": {
                name: getattr(self.options, name) for name in self.options.__dataclass_fields__
            },
        }


def model_accuracy() -> dict[str, dict[str, float]]:
    """Held-out metrics stored in the lab checkpoint by ``python -m workers.distill``."""
    metrics: dict[str, float] = load_checkpoint(WEIGHTS_DIR / TEACHER_FILE).get("metrics", {})
    out: dict[str, dict[str, float]] = {}
    for model in ("teacher_fp32", "student_fp32", "student_int8"):
        out[model] = {
            name: float(metrics[f"{model}_{name}"])
            for name in ("auc", "accuracy")
            if f"{model}_{name}" in metrics
        }
    return out


@dataclass(slots=True)
class _Deployed:
    """One running topology: its worker, its links, its client."""

    server: InferenceServer
    client_link: Link
    client: WorkerClient
    data_link: Link | None = None

    def bytes(self) -> tuple[int, int]:
        wire = self.client_link.bytes_up + self.client_link.bytes_down
        wan = 0 if self.data_link is None else self.data_link.bytes_up + self.data_link.bytes_down
        return wire, wan

    async def close(self) -> None:
        await self.client.aclose()
        await self.server.stop()
        for link in (self.client_link, self.data_link):
            if link is not None:
                await link.close()


@contextlib.contextmanager
def _collector_between_rounds() -> Iterator[Callable[[], object]]:
    """Automatic garbage collection off while requests are in flight; the caller
    collects between rounds. Client, links and workers share this process here (in
    production each has its own), so a collection triggered by one would stall the
    others mid-request and land in whichever term was running."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield lambda: gc.collect(1)
    finally:
        if enabled:
            gc.enable()


async def _link(name: str, target_port: int, params: LinkParams) -> Link:
    (port,) = free_ports(1)
    link = Link(LinkSpec(name, port, "127.0.0.1", target_port, params))
    await link.start()
    return link


async def _serve(model: ServedModel, precision: str, region: str, rows: int) -> InferenceServer:
    server = InferenceServer(
        [model],
        runtime=RuntimeConfig(device="cpu", precision=precision, compile="off"),
        batching=BatchingConfig(max_batch_size=rows),
        config=ServerConfig(region=region),
    )
    await server.start()
    return server


async def _sql_pool(dsn: str, link: Link | None) -> AsyncConnectionPool[Any]:
    conninfo = dsn if link is None else make_conninfo(dsn, port=str(link.spec.listen_port))
    # Two connections: a ranking request looks its user and its items up at once.
    # Autocommit, as a read path runs: one round trip per query (no BEGIN before it,
    # no ROLLBACK when the connection goes back to the pool).
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        conninfo, min_size=2, max_size=2, open=False, timeout=30.0, kwargs={"autocommit": True}
    )
    try:
        await pool.open(wait=True, timeout=60.0)
    except Exception as exc:  # psycopg's errors, the pool's timeout
        await pool.close()
        raise LabDataError(
            f"the lab's SQL feature source could not connect ({type(exc).__name__}); is "
            "PostgreSQL up (`edgefeed dev up`)?"
        ) from None
    return pool


async def _deploy_rank(
    topology: RankTopology, settings: EdgefeedSettings, options: LabOptions
) -> _Deployed:
    data_link: Link | None = None
    source: FeatureSource
    if topology.features == "sql":
        if topology.data_delay_ms is not None:
            data_link = await _link(
                f"{topology.key}-data",
                settings.database.port,
                LinkParams(delay_ms=topology.data_delay_ms),
            )
        try:
            pool = await _sql_pool(settings.database.dsn(), data_link)
        except BaseException:
            if data_link is not None:
                await data_link.close()
            raise
        source = SqlFeatureSource(
            pool, {LAB_STUDENT.user_entity: USER_QUERY, LAB_STUDENT.item_entity: ITEM_QUERY}
        )
    else:
        lookup = AsyncFeatureClient.from_settings(
            settings, options.region, LAB_STUDENT.schemas(), timeout_s=5.0, max_connections=4
        )
        source = EdgeCacheFeatureSource(lookup)
    model = load_served_model("ranker", weights=WEIGHTS_DIR / topology.weights, features=source)
    try:
        server = await _serve(model, topology.precision, options.region, options.candidates)
    except BaseException:
        await model.aclose()
        if data_link is not None:
            await data_link.close()
        raise
    link = await _link(
        f"{topology.key}-client", server.port, LinkParams(delay_ms=topology.client_delay_ms)
    )
    client = WorkerClient(f"http://127.0.0.1:{link.spec.listen_port}", timeout_s=60.0)
    return _Deployed(server, link, client, data_link)


async def _measure(
    deployed: _Deployed, send: Callable[[WorkerClient], Awaitable[InferenceAnswer]]
) -> Sample:
    wire0, wan0 = deployed.bytes()
    start = time.perf_counter()
    answer = await send(deployed.client)
    measured = time.perf_counter() - start
    wire1, wan1 = deployed.bytes()
    return sample_of(answer, measured, 0.0, wire1 - wire0, wan1 - wan0)


def sample_of(answer: InferenceAnswer, wall_s: float, edge_s: float, wire: int, wan: int) -> Sample:
    """The four terms of one answer. The worker starts its clock at the request's first
    byte, so a body still crossing the link counts in its T_service (phase ``read``);
    bytes in flight on the link are network time, so the lab moves that phase to
    T_network (both from the worker's phase header: the sum is unchanged)."""
    latency = answer.latency
    read_ms = min(answer.phases_ms.get("read", 0.0), latency.service_s * 1e3)
    return Sample(
        network_ms=latency.network_s * 1e3 + read_ms,
        # Preprocessing at the edge, before the upload, is data preparation too.
        data_ms=(edge_s + latency.data_s) * 1e3,
        model_ms=latency.model_s * 1e3,
        service_ms=latency.service_s * 1e3 - read_ms,
        measured_ms=(edge_s + answer.round_trip_s) * 1e3,
        wall_ms=wall_s * 1e3,
        wire_bytes=wire,
        wan_bytes=wan,
    )


async def _rank_phase(
    settings: EdgefeedSettings,
    options: LabOptions,
    data: LabData,
    accuracy: dict[str, dict[str, float]],
    progress: Progress,
) -> tuple[list[TopologySummary], dict[str, list[Sample]]]:
    topologies = rank_topologies(options)
    deployed: dict[str, _Deployed] = {}
    try:
        for topology in topologies:
            progress(f"deploying {topology.key}")
            deployed[topology.key] = await _deploy_rank(topology, settings, options)
        requests = data.requests(options.warmup + options.requests, options.candidates)
        samples: dict[str, list[Sample]] = {t.key: [] for t in topologies}
        with _collector_between_rounds() as collect:
            for n, (user, items) in enumerate(requests):
                body = json.dumps({"user_id": user, "item_ids": items}).encode()

                async def send(client: WorkerClient, body: bytes = body) -> InferenceAnswer:
                    return await client.infer("ranker", body, "application/json", headers=_DETAIL)

                collect()
                for topology in topologies:
                    sample = await _measure(deployed[topology.key], send)
                    if n >= options.warmup:
                        samples[topology.key].append(sample)
                        progress("")
    finally:
        for one in deployed.values():
            await one.close()
    summaries = [
        summarize(
            t.key,
            t.title,
            samples[t.key],
            model=t.model.replace("_", " "),
            accuracy=accuracy.get(t.model, {}),
            case_study=t.case_study,
            links=t.links,
        )
        for t in topologies
    ]
    return summaries, samples


async def _image_phase(
    settings: EdgefeedSettings, options: LabOptions, progress: Progress
) -> tuple[list[TopologySummary], dict[str, list[Sample]], int]:
    photo = await asyncio.to_thread(synthetic_photo)
    wan = LinkParams(delay_ms=options.wan_delay_ms, bandwidth_mbit=options.image_bandwidth_mbit)
    topologies = image_topologies()
    deployed: dict[str, _Deployed] = {}
    servers: list[InferenceServer] = []
    try:
        progress("deploying the image workers")
        servers.append(await _serve(photo_classifier(), "fp32", "central", 1))
        servers.append(await _serve(photo_classifier(), "fp32", options.region, 1))
        central, edge = servers
        for topology in topologies:
            server = central if topology.central else edge
            params = wan if topology.central else LinkParams()
            link = await _link(f"{topology.key}-client", server.port, params)
            client = WorkerClient(f"http://127.0.0.1:{link.spec.listen_port}", timeout_s=60.0)
            deployed[topology.key] = _Deployed(server, link, client)
        samples: dict[str, list[Sample]] = {t.key: [] for t in topologies}
        with _collector_between_rounds() as collect:
            for n in range(options.warmup + options.image_requests):
                collect()
                for topology in topologies:
                    sample = await _measure_image(deployed[topology.key], topology, photo)
                    if n >= options.warmup:
                        samples[topology.key].append(sample)
                        progress("")
    finally:
        for one in deployed.values():
            await one.client.aclose()
            await one.client_link.close()
        for server in servers:
            await server.stop()
    links = {
        True: f"WAN {options.wan_delay_ms:g} ms one way, {options.image_bandwidth_mbit:g} Mbit/s",
        False: "edge site: no WAN",
    }
    summaries = [
        summarize(
            t.key,
            t.title,
            samples[t.key],
            model="image classifier fp32",
            links=links[t.central],
        )
        for t in topologies
    ]
    return summaries, samples, len(photo)


async def _measure_image(deployed: _Deployed, topology: ImageTopology, photo: bytes) -> Sample:
    wire0, _ = deployed.bytes()
    start = time.perf_counter()
    edge_s = 0.0
    body, content_type = photo, JPEG_TYPE
    if topology.edge_preprocess:
        body = await asyncio.to_thread(edge_envelope, photo)
        content_type = ENVELOPE_TYPE
        edge_s = time.perf_counter() - start
    answer = await deployed.client.infer("photo-classifier", body, content_type, headers=_DETAIL)
    measured = time.perf_counter() - start
    wire1, _ = deployed.bytes()
    return sample_of(answer, measured, edge_s, wire1 - wire0, 0)


async def run_lab(
    settings: EdgefeedSettings, options: LabOptions, progress: Progress | None = None
) -> LabResult:
    """Load the data, deploy every topology, measure, tear everything down.

    Args:
        settings: The local stack's settings (PostgreSQL and ``options.region``'s Redis
            must be up).
        options: What to run.
        progress: Called with a phase name when a phase starts, and with ``""``
            after each measured request.

    Raises:
        LabDataError: PostgreSQL could not be loaded or queried.
        SettingsError: ``options.region`` is not in the settings.
    """
    report: Progress = progress or (lambda _: None)
    region = settings.region(options.region)
    data = LabData(options.users, options.items)
    report("loading events into PostgreSQL")
    position = await asyncio.to_thread(seed_events, settings.database.dsn(), data, options.events)
    report(f"writing features into {options.region}'s edge cache")
    user_schema, item_schema = LAB_STUDENT.schemas()
    await write_edge_cache(
        settings.database.dsn(), region, user_schema, item_schema, data, position
    )
    accuracy = model_accuracy()
    ranking, samples = await _rank_phase(settings, options, data, accuracy, report)
    images: list[TopologySummary] = []
    photo_bytes = 0
    if options.image_requests:
        images, image_samples, photo_bytes = await _image_phase(settings, options, report)
        samples.update(image_samples)
    return LabResult(ranking, images, accuracy, options, photo_bytes, samples)
