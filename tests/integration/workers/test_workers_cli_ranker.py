"""`edgefeed workers seed-demo` and `serve --model ranker --region R` on a real edge cache."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import yaml
from worker_process import seed_demo, worker_process  # type: ignore[import-not-found]

from workers.cpusched import available, current_slice_us

pytestmark = pytest.mark.integration

EDGEFEED = str(Path(sys.executable).with_name("edgefeed"))


def _settings(tmp_path: Path, redis_url: str) -> Path:
    path = tmp_path / "edgefeed.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "regions": [
                    {"name": "eu-west", "redis_url": redis_url, "residency_zone": "eu"},
                ]
            }
        )
    )
    return path


def _post_json(url: str, body: dict[str, object]) -> tuple[int, dict[str, object], dict[str, str]]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), dict(error.headers)


async def test_seed_demo_then_serve_ranker_from_the_region_cache(
    tmp_path: Path, region_cache: aioredis.Redis, workers_redis_url: str
) -> None:
    settings = _settings(tmp_path, workers_redis_url)
    assert "wrote 200 demo_user and 500 demo_item vectors" in seed_demo(settings, "eu-west")

    with worker_process("--model", "ranker", settings=settings, region="eu-west") as worker:
        line = worker.banner
        assert "serving 'ranker' for region 'eu-west'" in line, line
        # The ranker's own batch default (its rows are tiny) and the worker's loop.
        assert "256 rows per batch; event loop uvloop" in line, line
        # Every thread (event loop, model thread, torch's) asked for the short slice.
        tasks = Path(f"/proc/{worker.process.pid}/task").iterdir()
        slices = {current_slice_us(int(task.name)) for task in tasks}
        assert slices == ({100.0} if available() else {None}), slices
        said = "scheduler slice 0.1 ms" if available() else "scheduler slice: the kernel's"
        assert said in line, line
        url = worker.url
        status, body, headers = _post_json(
            f"{url}/v1/models/ranker/infer", {"user_id": "u3", "item_ids": ["i1", "i2", "i3"]}
        )
        assert status == 200, body
        assert len(body["scores"]) == 3  # type: ignore[arg-type]
        assert float(headers["X-Edgefeed-T-Data-Ms"]) > 0
        # 100 candidates in one request: refused at the old default of 32 rows.
        many = [f"i{i}" for i in range(100)]
        status, body, _ = _post_json(
            f"{url}/v1/models/ranker/infer", {"user_id": "u3", "item_ids": many}
        )
        assert status == 200, body
        assert [entry["item_id"] for entry in body["ranking"]].count("i99") == 1  # type: ignore[union-attr]
        status, body, _ = _post_json(
            f"{url}/v1/models/ranker/infer", {"user_id": "nobody", "item_ids": ["i1"]}
        )
        assert status == 422
        assert "demo_user 'nobody': no features" in body["error"]["message"]  # type: ignore[index]
        worker.process.send_signal(signal.SIGTERM)
        assert worker.process.wait(timeout=30) == 0


def test_serve_ranker_for_an_undeclared_region_exits_2(
    tmp_path: Path, workers_redis_url: str
) -> None:
    settings = _settings(tmp_path, workers_redis_url)
    done = subprocess.run(
        [
            EDGEFEED,
            "--settings",
            str(settings),
            "workers",
            "serve",
            "--model",
            "ranker",
            "--region",
            "mars",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert "region 'mars' not in regions: eu-west" in done.stderr
