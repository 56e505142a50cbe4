"""`edgefeed preprocess` on hostile inputs and clashing output names."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hostile_images import cut_with_eoi, jpeg, scan_bomb  # type: ignore[import-not-found]
from typer.testing import CliRunner

from edgefeed.cli import app
from preprocess import decode_envelope


@pytest.fixture(scope="module")
def photo() -> np.ndarray:
    from skimage import data

    return np.asarray(data.astronaut())


def _run(*args: str) -> tuple[int, dict[str, object]]:
    result = CliRunner().invoke(app, ["preprocess", *args, "--json"])
    return result.exit_code, json.loads(result.stdout)


def test_cli_refuses_a_scan_bomb_and_a_cut_jpeg_and_writes_the_good_file(
    photo: np.ndarray, tmp_path: Path
) -> None:
    good = tmp_path / "good.jpg"
    good.write_bytes(jpeg(photo))
    bomb = tmp_path / "bomb.jpg"
    bomb.write_bytes(scan_bomb(1024, 3000))
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(cut_with_eoi(jpeg(photo), 0.05))
    out = tmp_path / "out"
    code, report = _run(str(good), str(bomb), str(cut), "--out", str(out))
    assert code == 2
    files = {Path(str(f["input"])).name: f for f in report["files"]}  # type: ignore[attr-defined]
    assert files["good.jpg"]["error"] is None
    assert "Limits.max_jpeg_scans" in files["bomb.jpg"]["error"]
    assert "stops before the image does" in files["cut.jpg"]["error"]
    assert sorted(p.name for p in out.iterdir()) == ["good.efe"]


def test_cli_gives_every_input_its_own_output_file(photo: np.ndarray, tmp_path: Path) -> None:
    """`a.jpg x/a.jpg a-1.jpg`: three inputs, three envelopes, none overwritten."""
    sources = [tmp_path / "a.jpg", tmp_path / "x" / "a.jpg", tmp_path / "a-1.jpg"]
    for index, source in enumerate(sources):
        source.parent.mkdir(exist_ok=True)
        source.write_bytes(jpeg(np.roll(photo, 100 * index, axis=1)))
    out = tmp_path / "out"
    code, report = _run(*map(str, sources), "--out", str(out), "--profile", "imagenet-224-uint8")
    assert code == 0
    outputs = [str(f["output"]) for f in report["files"]]  # type: ignore[attr-defined]
    assert len(set(outputs)) == 3
    assert len(list(out.iterdir())) == 3
    tensors = [decode_envelope(Path(path).read_bytes()).to_numpy() for path in outputs]
    for i in range(3):
        for j in range(i + 1, 3):
            assert not np.array_equal(tensors[i], tensors[j])
