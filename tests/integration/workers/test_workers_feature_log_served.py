"""A real worker (`edgefeed workers serve --model ranker`) on a real edge cache logs
exactly what it served: the values its model was fed and the scores it answered."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis.asyncio as aioredis
import yaml
from worker_process import seed_demo, worker_process  # type: ignore[import-not-found]

from workers.synthetic import click_world

pytestmark = pytest.mark.integration

EDGEFEED = str(Path(sys.executable).with_name("edgefeed"))


def _rank(url: str, body: dict[str, object], request_id: str) -> dict[str, object]:
    request = urllib.request.Request(
        f"{url}/v1/models/ranker/infer",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "X-Edgefeed-Request-Id": request_id},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.headers["X-Edgefeed-Request-Id"] == request_id
        answer: dict[str, object] = json.loads(response.read())
        return answer


@pytest.mark.parametrize("processes", [1, 2])
async def test_a_served_worker_logs_exactly_the_values_and_scores_it_served(
    tmp_path: Path, region_cache: aioredis.Redis, workers_redis_url: str, processes: int
) -> None:
    logs = tmp_path / "logs"
    settings = tmp_path / "edgefeed.yaml"
    settings.write_text(
        yaml.safe_dump(
            {
                "regions": [
                    {"name": "eu-west", "redis_url": workers_redis_url, "residency_zone": "eu"}
                ],
                "workers": {"feature_log": {"dir": str(logs), "sample_rate": 1.0}},
            }
        )
    )
    seed_demo(settings, "eu-west")
    world = click_world()
    served: dict[str, tuple[str, list[str], list[float]]] = {}
    with worker_process(
        "--model", "ranker", "--processes", str(processes), settings=settings, region="eu-west"
    ) as worker:
        assert f"feature log {logs / 'eu-west'} at 100%" in worker.banner, worker.banner
        for n in range(30):
            user = world.user_ids[n % 7]
            items = list(world.item_ids[n : n + 1 + n % 5])
            answer = _rank(worker.url, {"user_id": user, "item_ids": items}, f"req-{n}")
            served[f"req-{n}"] = (user, items, answer["scores"])  # type: ignore[assignment]
        worker.process.send_signal(signal.SIGTERM)
        assert worker.process.wait(timeout=60) == 0
    files = sorted((logs / "eu-west" / "ranker").iterdir())
    assert files and all(f.suffix == ".parquet" for f in files), files
    children = {re.search(r"-c(\d+)-", f.name).group(1) for f in files}  # type: ignore[union-attr]
    assert children <= {str(i) for i in range(processes)}
    table = pa.concat_tables([pq.read_table(f) for f in files])
    rows = table.to_pylist()
    assert len(rows) == sum(len(items) for _, items, _ in served.values()), "each row once"
    user_of = dict(zip(world.user_ids, world.user_features, strict=True))
    item_of = dict(zip(world.item_ids, world.item_features, strict=True))
    for row in rows:
        user, items, scores = served[row["request_id"]]
        assert row["user_id"] == user
        assert row["item_id"] == items[row["row"]]
        assert row["prediction"] == np.float32(scores[row["row"]])
        assert [row[f"demo_user.u{k}"] for k in range(16)] == user_of[user].tolist()
        assert [row[f"demo_item.i{k}"] for k in range(16)] == item_of[row["item_id"]].tolist()
        assert row["feature_set_version"] == "demo_user=1,demo_item=1"
        assert row["region"] == "eu-west" and row["t_model_ms"] > 0
    summary = subprocess.run(
        [EDGEFEED, "features", "logs", "summary", str(logs), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert summary.returncode == 0, summary.stderr
    found = json.loads(summary.stdout)
    assert found["rows"] == len(rows)
    assert found["entity_types"] == ["demo_item", "demo_user"]
    assert found["corrupt"] == [] and found["temporary"] == []
