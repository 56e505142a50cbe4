from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from preprocess import decode_envelope, get_profile, preprocess_image


@pytest.fixture(scope="module")
def app() -> Iterator[typer.Typer]:
    # Until the dev branch lands, edgefeed/cli/__init__.py names a module this
    # branch does not have; stand in for it so the root app can be built.
    import edgefeed

    added = not (Path(edgefeed.__file__).parent / "cli" / "dev.py").exists()
    if added:
        stub = types.ModuleType("edgefeed.cli.dev")
        stub.register = lambda app: None  # type: ignore[attr-defined]
        sys.modules["edgefeed.cli.dev"] = stub
    from edgefeed.cli import app as root

    yield root
    if added:
        sys.modules.pop("edgefeed.cli.dev", None)


@pytest.fixture
def images(hd_jpegs: dict[str, bytes], tmp_path: Path) -> list[Path]:
    paths = []
    for name in ("astronaut.png", "coffee.png", "rocket.jpg"):
        path = tmp_path / "in" / f"{Path(name).stem}.jpg"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(hd_jpegs[name])
        paths.append(path)
    return paths


@pytest.mark.parametrize("workers", ["1", "2"])
def test_cli_writes_envelopes_and_reports_bytes(
    app: typer.Typer, images: list[Path], tmp_path: Path, workers: str
) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        [
            "preprocess",
            *map(str, images),
            "--out",
            str(out),
            "--profile",
            "imagenet-224-fp16",
            "--workers",
            workers,
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["failed"] == 0
    assert report["bytes_in"] == sum(p.stat().st_size for p in images)
    assert report["bytes_out"] == sum(f["bytes_out"] for f in report["files"])
    profile = get_profile("imagenet-224-fp16")
    for entry, image in zip(report["files"], images, strict=True):
        written = Path(entry["output"])
        assert written == out / f"{image.stem}.efe"
        envelope = decode_envelope(written.read_bytes())
        assert entry["shape"] == [3, 224, 224] and entry["dtype"] == "float16"
        np.testing.assert_array_equal(
            envelope.to_numpy(), preprocess_image(image.read_bytes(), profile)
        )


def test_cli_reports_bad_files_and_keeps_going(
    app: typer.Typer, images: list[Path], tmp_path: Path
) -> None:
    bad = tmp_path / "in" / "broken.jpg"
    bad.write_bytes(images[0].read_bytes()[:300])
    result = CliRunner().invoke(
        app,
        ["preprocess", str(images[0]), str(bad), "--out", str(tmp_path / "out"), "-p", "webp-720"],
    )
    assert result.exit_code == 2
    assert "before" in result.output and "after" in result.output
    # (rich wraps a long tmp path at the console's width, even inside the name)
    assert "broken.jpg" in result.output.replace("\n", "") and "truncated" in result.output
    assert (tmp_path / "out" / "astronaut.efe").exists()
    assert not (tmp_path / "out" / "broken.efe").exists()


def test_cli_refuses_unknown_profile_and_encoding(
    app: typer.Typer, images: list[Path], tmp_path: Path
) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["preprocess", str(images[0]), "--out", str(tmp_path), "-p", "x"])
    assert result.exit_code == 2
    assert "'x' is not registered" in result.output
    result = runner.invoke(
        app, ["preprocess", str(images[0]), "--out", str(tmp_path), "-e", "webp"]
    )
    assert result.exit_code == 2  # float32 imagenet tensors cannot travel as WebP
    assert "uint8" in result.output
