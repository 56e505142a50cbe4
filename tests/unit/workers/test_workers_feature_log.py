"""The feature log (workers.featurelog): sampled, off the request path, rolled by size
and time, renamed atomically, recovered after a kill; read back by
``edgefeed features logs summary`` and ``join``."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from pydantic import ValidationError
from typer.testing import CliRunner

from edgefeed.cli import app
from edgefeed.settings import SettingsError, settings_from_mapping
from workers.exceptions import FeatureLogError
from workers.featurelog import (
    TEMP_SUFFIX,
    FeatureLogger,
    FeatureLogSettings,
    LoggedEntity,
    LogLayout,
    recover_leftovers,
)
from workers.logfiles import join_labels, summarize
from workers.models.base import Prepared
from workers.models.ranking import Ranker, RankerConfig, RankingNet
from workers.server import HEADER_REQUEST_ID, InferenceServer

LAYOUT = LogLayout(
    (
        LoggedEntity("person", "user_id", ("a", "b"), 0, version=3, personal=True),
        LoggedEntity("thing", "item_id", ("c",), 1, version=1),
    ),
    lambda prepared: prepared.meta,
)


def _prepared(n: int, user: str = "u1") -> Prepared:
    """A request of ``n`` items: the user's two features broadcast, one per item."""
    users = np.tile(np.array([[1.5, -2.0]], np.float32), (n, 1))
    items = np.arange(n, dtype=np.float32).reshape(n, 1) + 0.25
    return Prepared((users, items), n, ((user,), [f"i{k}" for k in range(n)]))


def _logger(folder: Path, clock: object = time.monotonic, **settings: object) -> FeatureLogger:
    config = FeatureLogSettings(dir=folder, **settings)  # type: ignore[arg-type]
    return FeatureLogger(
        config, LAYOUT, model="m", model_version="7", region="eu-west", clock=clock
    )  # type: ignore[arg-type]


def _offer(logger: FeatureLogger, request_id: str, n: int = 3, user: str = "u1") -> None:
    output = np.linspace(0.1, 0.9, n, dtype=np.float32)
    logger.offer(request_id, 1_700_000_000.5, _prepared(n, user), output, 0.001, 0.002, 0.003)


def _parquet(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.parquet"))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return tmp_path / "logs"


def test_a_logged_request_holds_ids_values_prediction_versions_and_latency(
    folder: Path,
) -> None:
    logger = _logger(folder, flush_rows=1)
    logger.start()
    _offer(logger, "r1", n=2)
    logger.close()
    [path] = _parquet(folder)
    assert path.parent == folder / "eu-west" / "m", "per region, then per model"
    table = pq.read_table(path)
    assert table.schema.field("person.a").type == pa.float32()
    assert table.schema.field("read_time").type == pa.timestamp("us", tz="UTC")
    rows = table.to_pylist()
    assert [(r["request_id"], r["row"], r["user_id"], r["item_id"]) for r in rows] == [
        ("r1", 0, "u1", "i0"),
        ("r1", 1, "u1", "i1"),
    ]
    assert [(r["person.a"], r["person.b"], r["thing.c"]) for r in rows] == [
        (1.5, -2.0, 0.25),
        (1.5, -2.0, 1.25),
    ]
    assert [r["prediction"] for r in rows] == pytest.approx([0.1, 0.9])
    assert rows[0]["feature_set_version"] == "person=3,thing=1"
    assert (rows[0]["model"], rows[0]["model_version"], rows[0]["region"]) == ("m", "7", "eu-west")
    assert rows[0]["read_time"] == dt.datetime(2023, 11, 14, 22, 13, 20, 500000, tzinfo=dt.UTC)
    assert (rows[0]["t_data_ms"], rows[0]["t_model_ms"], rows[0]["t_service_ms"]) == (
        pytest.approx(1.0),
        pytest.approx(2.0),
        pytest.approx(3.0),
    )


def test_personal_drop_leaves_personal_entities_out(folder: Path) -> None:
    logger = _logger(folder, personal="drop")
    logger.start()
    _offer(logger, "r1")
    logger.close()
    columns = pq.read_table(_parquet(folder)[0]).column_names
    assert "user_id" not in columns and "person.a" not in columns
    assert "item_id" in columns and "thing.c" in columns


def test_files_roll_by_size(folder: Path) -> None:
    # Each batch of one 3-row request is ~3 KB of Arrow stream: 2 KB closes a file per batch.
    logger = _logger(folder, flush_rows=1, max_file_mb=2 / 1024)
    logger.start()
    for k in range(5):
        _offer(logger, f"r{k}")
    logger.close()
    files = _parquet(folder)
    assert len(files) == 5
    assert [pq.read_table(f)["request_id"][0].as_py() for f in files] == [f"r{k}" for k in range(5)]
    assert not list(folder.rglob("*.tmp"))


def test_files_roll_by_time(folder: Path) -> None:
    now = [1000.0]
    logger = _logger(folder, clock=lambda: now[0], flush_rows=1, max_file_s=60)
    logger.start()
    _offer(logger, "r1")
    _offer(logger, "r2")
    logger.wait_written()
    assert _parquet(folder) == [], "the file is 0 s old: still open"
    now[0] += 61
    _offer(logger, "r3")  # the open file is past its age: closed, r3 opens the next
    logger.wait_written()
    [first] = _parquet(folder)
    assert pq.read_table(first)["request_id"].to_pylist() == ["r1"] * 3 + ["r2"] * 3
    logger.close()
    files = _parquet(folder)
    assert len(files) == 2
    assert pq.read_table(files[1])["request_id"].to_pylist() == ["r3"] * 3


def test_the_sample_rate_is_honoured_and_a_seed_repeats_the_sample(folder: Path) -> None:
    picks = []
    for _ in range(2):
        logger = _logger(folder, sample_rate=0.3, seed=11, flush_rows=10_000)
        picks.append(
            [logger.offer(str(k), 0.0, _prepared(1), np.zeros(1), 0, 0, 0) for k in range(10_000)]
        )
        logger._buffer.clear()  # never started: nothing to write
    assert picks[0] == picks[1]
    # Binomial(10000, 0.3): mean 3000, sd 45.8; 5 sd either side.
    assert 2770 <= sum(picks[0]) <= 3230
    logger = _logger(folder, sample_rate=0.0)
    assert not any(logger.offer("x", 0.0, _prepared(1), np.zeros(1), 0, 0, 0) for _ in range(100))


@pytest.mark.parametrize("rate", [-0.1, 1.5])
def test_a_sample_rate_outside_0_1_is_refused_naming_it(folder: Path, rate: float) -> None:
    with pytest.raises(ValidationError, match=f"sample_rate {rate} must be between 0 and 1"):
        FeatureLogSettings(dir=folder, sample_rate=rate)
    with pytest.raises(SettingsError) as caught:
        settings_from_mapping(
            {
                "regions": [{"name": "eu-west", "redis_url": "redis://x", "residency_zone": "eu"}],
                "workers": {"feature_log": {"dir": str(folder), "sample_rate": rate}},
            }
        )
    assert "workers.feature_log.sample_rate" in str(caught.value)
    assert "between 0 and 1" in str(caught.value)


def test_a_file_is_never_under_its_final_name_before_it_is_whole(folder: Path) -> None:
    logger = _logger(folder, flush_rows=1)
    logger.start()
    _offer(logger, "r1")
    logger.wait_written()
    region = folder / "eu-west" / "m"
    [temp] = list(region.iterdir())
    assert temp.name.endswith(TEMP_SUFFIX)
    assert f"-p{os.getpid()}-c0-" in temp.name, "named by pid and child index"
    logger.close()
    [final] = list(region.iterdir())
    assert final.name == temp.name.replace(TEMP_SUFFIX, ".parquet")
    assert pq.read_table(final).num_rows == 3


_KILLED_WRITER = textwrap.dedent(
    """
    import sys, numpy as np
    from pathlib import Path
    from workers.featurelog import FeatureLogger, FeatureLogSettings, LoggedEntity, LogLayout
    from workers.models.base import Prepared

    layout = LogLayout((LoggedEntity("thing", "item_id", ("c",), 0),), lambda p: p.meta)
    settings = FeatureLogSettings(dir=Path(sys.argv[1]), flush_rows=1, max_file_mb=0.05)
    logger = FeatureLogger(settings, layout, model="m", model_version="1", region="r")
    logger.start()
    k = 0
    while True:
        ids = [f"r{k}-{j}" for j in range(50)]
        prepared = Prepared((np.full((50, 1), k, np.float32),), 50, (ids,))
        logger.offer(f"r{k}", 0.0, prepared, np.zeros(50, np.float32), 0, 0, 0)
        if k % 20 == 0:
            logger.wait_written()
            print(k, flush=True)  # every request up to k is in the writer's stream
        k += 1
    """
)


@pytest.fixture
def killed_writer(folder: Path) -> Iterator[int]:
    """A writer process killed with SIGKILL mid-write; yields the last request it confirmed."""
    process = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(folder)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        confirmed = -1
        while confirmed < 400:  # several files closed, one open, writes in flight
            line = process.stdout.readline()
            assert line, "the writer ended early"
            confirmed = int(line)
        process.send_signal(signal.SIGKILL)
        process.wait()
        yield confirmed
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


def test_a_killed_writer_leaves_only_whole_files_and_the_next_start_recovers_its_stream(
    folder: Path, killed_writer: int
) -> None:
    region = folder / "r" / "m"
    closed = sorted(region.glob("*.parquet"))
    assert closed, "files were closed before the kill"
    for path in closed:
        pq.read_table(path)  # whole: no exception
    assert list(region.glob(f"*{TEMP_SUFFIX}")), "the open stream is left behind"
    found = summarize(folder)
    assert found.corrupt == [] and found.temporary
    # A new writer on the folder turns the leftover stream into Parquet at start.
    logger = FeatureLogger(
        FeatureLogSettings(dir=folder),
        LogLayout((LoggedEntity("thing", "item_id", ("c",), 0),), lambda p: p.meta),
        model="m",
        model_version="1",
        region="r",
    )
    logger.start()
    logger.close()
    assert not [p for p in region.iterdir() if p.suffix != ".parquet"]
    requests = pa.concat_tables([pq.read_table(p) for p in region.glob("*.parquet")])
    ids = set(requests["request_id"].to_pylist())
    # Lost: at most what was in memory or being written at the kill, never a confirmed row.
    assert {f"r{k}" for k in range(killed_writer + 1)} <= ids
    assert requests.num_rows == 50 * len(ids), "no request is logged in part"


def _write_log(folder: Path) -> None:
    logger = _logger(folder)
    logger.start()
    _offer(logger, "r1", n=2, user="u1")
    _offer(logger, "r2", n=3, user="u2")
    logger.close()


def test_summary_counts_rows_versions_entities_and_names_corrupt_and_temporary_files(
    folder: Path,
) -> None:
    _write_log(folder)
    region = folder / "eu-west" / "m"
    (region / "broken.parquet").write_bytes(b"PAR1 not really")
    (region / f"featurelog-x-p1-c0-00009{TEMP_SUFFIX}").write_bytes(b"")
    found = summarize(folder)
    assert found.rows == 5
    assert dict(found.versions) == {"person=3,thing=1": 5}
    assert dict(found.models) == {"m:7": 5}
    assert found.entities == {"person", "thing"}
    assert [p.name for p, _ in found.corrupt] == ["broken.parquet"]
    assert [p.name for p in found.temporary] == [f"featurelog-x-p1-c0-00009{TEMP_SUFFIX}"]
    result = CliRunner().invoke(app, ["features", "logs", "summary", str(folder)])
    assert result.exit_code == 2, result.output
    assert "5 rows in 1 files" in result.output
    assert "corrupt:" in result.output and "broken.parquet" in result.output
    assert "temporary:" in result.output
    labels = folder.parent / "labels.parquet"
    pq.write_table(pa.table({"request_id": ["r1"]}), labels)
    with pytest.raises(FeatureLogError, match=r"broken\.parquet' is not a readable Parquet"):
        join_labels(folder, labels, folder / "out.parquet")


def test_join_on_request_id_gives_each_label_the_row_the_model_scored(
    folder: Path, tmp_path: Path
) -> None:
    _write_log(folder)
    labels = tmp_path / "labels.parquet"
    pq.write_table(
        pa.table(
            {
                "request_id": ["r2", "r1", "r9"],
                "item_id": ["i2", "i0", "i0"],
                "clicked": [True, False, True],
            }
        ),
        labels,
    )
    out = tmp_path / "train.parquet"
    result = CliRunner().invoke(
        app,
        ["features", "logs", "join", str(folder), "--labels", str(labels), "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    assert "1 of 3 labels had no logged row" in result.output
    train = pq.read_table(out)
    assert train.schema.field("thing.c").type == pa.float32()
    assert train.schema.field("clicked").type == pa.bool_()
    rows = sorted(train.to_pylist(), key=lambda r: r["request_id"])
    assert [
        (r["request_id"], r["item_id"], r["user_id"], r["thing.c"], r["clicked"]) for r in rows
    ] == [
        ("r1", "i0", "u1", 0.25, False),
        ("r2", "i2", "u2", 2.25, True),
    ]


def test_join_asof_takes_the_latest_row_read_before_each_label(
    folder: Path, tmp_path: Path
) -> None:
    _write_log(folder)  # read at 2023-11-14 22:13:20.5 UTC
    read = dt.datetime(2023, 11, 14, 22, 13, 20, 500000, tzinfo=dt.UTC)
    labels = tmp_path / "labels.parquet"
    pq.write_table(
        pa.table(
            {
                "user_id": ["u2", "u1", "u1"],
                "item_id": ["i1", "i1", "i0"],
                "timestamp": pa.array(
                    [
                        read + dt.timedelta(seconds=5),
                        read + dt.timedelta(seconds=1),
                        read - dt.timedelta(seconds=1),
                    ],
                    pa.timestamp("ms", tz="Europe/London"),
                ),
                "clicked": [1, 0, 1],
            }
        ),
        labels,
    )
    report = join_labels(folder, labels, tmp_path / "t.parquet", on="asof")
    assert report.keys == ("user_id", "item_id", "timestamp")
    rows = sorted(pq.read_table(report.out).to_pylist(), key=lambda r: r["user_id"])
    # u1/i0's label came before the read: no row (no leakage from the future).
    assert [(r["user_id"], r["item_id"], r["thing.c"], r["clicked"]) for r in rows] == [
        ("u1", "i1", 1.25, 0),
        ("u2", "i1", 1.25, 1),
    ]
    assert report.unmatched == 1


def test_join_refuses_labels_without_the_join_columns_naming_them(
    folder: Path, tmp_path: Path
) -> None:
    _write_log(folder)
    labels = tmp_path / "labels.parquet"
    pq.write_table(pa.table({"user": ["u1"], "clicked": [True]}), labels)
    with pytest.raises(
        FeatureLogError, match=r"has no column 'request_id'.*its columns: user, clicked"
    ):
        join_labels(folder, labels, tmp_path / "o.parquet")
    with pytest.raises(FeatureLogError, match="none of the log's id columns"):
        join_labels(folder, labels, tmp_path / "o.parquet", on="asof")
    naive = tmp_path / "naive.parquet"
    pq.write_table(
        pa.table({"user_id": ["u1"], "timestamp": pa.array([dt.datetime(2023, 1, 1)])}), naive
    )
    with pytest.raises(
        FeatureLogError, match="'timestamp' is timestamp\\[us\\], not a timestamp with a time zone"
    ):
        join_labels(folder, naive, tmp_path / "o.parquet", on="asof")
    result = CliRunner().invoke(
        app,
        [
            "features",
            "logs",
            "join",
            str(folder),
            "--labels",
            str(labels),
            "--out",
            str(tmp_path / "o.parquet"),
        ],
    )
    assert result.exit_code == 2
    assert "request_id" in result.output
    assert not (tmp_path / "o.parquet").exists()


def test_summary_of_a_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["features", "logs", "summary", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "nope' does not exist" in " ".join(result.output.split())


class _Features:
    """The ranker's features from memory (a unit-level stand-in for the edge cache)."""

    def __init__(self, vectors: dict[str, np.ndarray]) -> None:
        self.vectors = vectors

    async def get(
        self, entity: str, ids: list[str], features: list[str] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        rows = np.stack([self.vectors[i] for i in ids]).astype(np.float32)
        return rows, np.zeros(rows.shape, bool)

    async def aclose(self) -> None:
        return None


async def test_the_server_logs_what_the_ranker_was_fed_and_answers_the_request_id(
    folder: Path,
) -> None:
    rng = np.random.default_rng(3)
    vectors = {name: rng.normal(size=16).astype(np.float32) for name in ("u1", "a", "b", "c")}
    config = RankerConfig()
    torch.manual_seed(0)
    ranker = Ranker("ranker", RankingNet(config).eval(), config, _Features(vectors))
    answers = {}
    async with (
        InferenceServer([ranker], feature_log=FeatureLogSettings(dir=folder)) as server,
        aiohttp.ClientSession() as http,
    ):
        for request in (
            {"user_id": "u1", "item_ids": ["a", "b"]},
            {"user_id": "u1", "item_ids": ["c"]},
        ):
            async with http.post(f"{server.url}/v1/models/ranker/infer", json=request) as response:
                answers[response.headers[HEADER_REQUEST_ID]] = (request, await response.json())
        async with http.post(
            f"{server.url}/v1/models/ranker/infer",
            json={"user_id": "u1", "item_ids": ["a"]},
            headers={HEADER_REQUEST_ID: "mine-1"},
        ) as response:
            assert response.headers[HEADER_REQUEST_ID] == "mine-1"
    rows = pa.concat_tables([pq.read_table(p) for p in _parquet(folder)]).to_pylist()
    assert {r["request_id"] for r in rows} == {*answers, "mine-1"}
    assert rows[0]["feature_set_version"] == "demo_user=1,demo_item=1"
    for row in rows:
        if row["request_id"] == "mine-1":
            continue
        request, answer = answers[row["request_id"]]
        assert row["item_id"] == request["item_ids"][row["row"]]
        assert row["prediction"] == pytest.approx(answer["scores"][row["row"]], rel=1e-6)
        assert [row[f"demo_item.i{k}"] for k in range(16)] == vectors[row["item_id"]].tolist()
        assert [row[f"demo_user.u{k}"] for k in range(16)] == vectors["u1"].tolist()
    counted = {
        outcome: server.metrics.registry.get_sample_value(
            "edgefeed_worker_feature_log_requests_total",
            {"region": server.config.region, "model": "ranker", "outcome": outcome},
        )
        for outcome in ("written", "dropped", "lost")
    }
    assert counted == {"written": 3.0, "dropped": 0.0, "lost": 0.0}


def test_dropped_and_lost_requests_are_counted_by_outcome(folder: Path) -> None:
    """An operator sees a log that is behind (dropped) or cannot write (lost) in the
    worker's metrics, not only in its log."""
    counted: list[tuple[str, int]] = []
    config = FeatureLogSettings(dir=folder, flush_rows=1, max_pending=1)
    logger = FeatureLogger(
        config,
        LAYOUT,
        model="m",
        model_version="7",
        region="eu-west",
        counted=lambda *a: counted.append(a),
    )
    _offer(logger, "r1")  # the writer is not started: its queue holds this batch
    _offer(logger, "r2")  # ... and has no room for this one
    assert counted == [("dropped", 1)]
    logger.start()
    logger.wait_written()
    assert counted == [("dropped", 1), ("written", 1)]
    logger.close()
    logger.start()
    for done in (folder / "eu-west" / "m").iterdir():
        done.unlink()
    (folder / "eu-west" / "m").rmdir()  # the folder is gone: the next write fails
    _offer(logger, "r3")
    logger.wait_written()
    logger.close()
    assert counted[2:] == [("lost", 1)]
    assert (logger.offered, logger.dropped) == (3, 1)
    assert logger.errors >= 1  # (the leftovers scan may also find no folder)


def test_a_stream_whose_recoverer_died_is_recovered_by_the_next(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid is free now: no process of that id is alive
    stream = tmp_path / f"featurelog-20260101T000000Z-p{gone.pid}-c0-00000{TEMP_SUFFIX}"
    batch = pa.record_batch({"request_id": ["r1", "r2"]})
    with pa.OSFile(str(stream), "wb") as sink, pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    claimed = stream.with_name(f"{stream.name}.recovering-{gone.pid}")
    stream.rename(claimed)
    [written] = recover_leftovers(tmp_path)
    assert written.name == stream.name.replace(TEMP_SUFFIX, ".parquet")
    assert pq.read_table(written)["request_id"].to_pylist() == ["r1", "r2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [written.name]
