"""Every decode path, checks included, stays within ``Limits.max_image_bytes``.

Peak RSS is measured in a process of its own for each call (peak_rss.py):
the worst cases issue 30 names at the default budget (320 MiB), and for each
kind of image and each path an image exactly at the edge of its estimate,
which must then hold. An image whose path would pass the budget is refused
before a pixel is decoded, with a message naming the size, the estimate, the
limit and the fix.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
from hostile_images import jpeg, png16  # type: ignore[import-not-found]
from peak_rss import Job, Peak, measure  # type: ignore[import-not-found]
from PIL import Image

from preprocess import (
    DecompressionBombError,
    Limits,
    decode_image,
    get_profile,
    preprocess_image,
)

MiB = 1024 * 1024
BUDGET = Limits().max_image_bytes


def _photo(width: int, height: int) -> Image.Image:
    """A real photo (scikit-image's coffee) resized, with noise so it compresses like one."""
    from skimage import data

    rng = np.random.default_rng(30)
    base = np.asarray(Image.fromarray(data.coffee()).resize((width, height)), dtype=np.int16)
    noisy = base + rng.integers(-12, 13, base.shape, dtype=np.int16)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def _save(image: Image.Image, fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


@pytest.fixture(scope="module")
def worst(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The issue's cases: a 6300x6300 JPEG whose last pixel is mid-grey, a 61 KB
    file declaring 40000x1000, and a 4x6000 PNG that imagenet-224 upscales."""
    folder = tmp_path_factory.mktemp("worst")
    pixels = np.asarray(_photo(1575, 1575).resize((6300, 6300), Image.Resampling.NEAREST)).copy()
    pixels[-64:, -64:] = 128  # what libjpeg fills a cut scan with: used to trigger 2 more decodes
    files = {
        "grey-tail-6300": jpeg(pixels),
        "cut-40000x1000": jpeg(np.tile(np.asarray(_photo(1000, 1000)), (1, 40, 1)))[:61_000]
        + b"\xff\xd9",
        "thin-4x6000": _save(_photo(4, 6000), "PNG"),
    }
    paths = {}
    for name, data in files.items():
        paths[name] = folder / name
        paths[name].write_bytes(data)
    return paths


@pytest.fixture(scope="module")
def worst_peaks(worst: dict[str, Path]) -> dict[tuple[str, str], Peak]:
    jobs = [Job(str(path), call) for path in worst.values() for call in ("decode", "reference")]
    jobs.append(Job(str(worst["grey-tail-6300"]), "fast"))
    jobs.append(Job(str(worst["cut-40000x1000"]), "fast"))
    peaks = zip(jobs, measure(jobs), strict=True)
    return {(Path(job.path).name, job.call): peak for job, peak in peaks}


@pytest.mark.parametrize("call", ["decode", "reference", "fast"])
def test_a_valid_6300px_jpeg_with_a_grey_last_pixel_decodes_once_within_budget(
    worst_peaks: dict[tuple[str, str], Peak], call: str
) -> None:
    # Was 799 MiB (decode, reference) and 650 MiB (fast): two more full decodes.
    peak = worst_peaks[("grey-tail-6300", call)]
    assert peak.result in ([6300, 6300, 3], [3, 224, 224])
    assert peak.grown <= BUDGET, f"{call}: peak RSS grew {peak.grown / MiB:.0f} MiB"


@pytest.mark.parametrize("call", ["decode", "reference", "fast"])
def test_a_61kb_jpeg_declaring_40000x1000_is_refused_within_budget(
    worst: dict[str, Path], worst_peaks: dict[tuple[str, str], Peak], call: str
) -> None:
    # Was ~803 MiB before it was refused.
    assert worst["cut-40000x1000"].stat().st_size == 61_002
    peak = worst_peaks[("cut-40000x1000", call)]
    assert isinstance(peak.result, str) and peak.result.startswith("CorruptInputError")
    assert "truncated" in peak.result
    assert peak.grown <= BUDGET, f"{call}: peak RSS grew {peak.grown / MiB:.0f} MiB"


def test_a_thin_image_the_profile_would_upscale_past_the_budget_is_refused(
    worst: dict[str, Path], worst_peaks: dict[tuple[str, str], Peak]
) -> None:
    # imagenet-224's Resize(256) makes 4x6000 a 256x384000 image (375 MiB) on the
    # reference path, which resizes before it crops; the fast path resamples the crop only.
    peak = worst_peaks[("thin-4x6000", "reference")]
    assert isinstance(peak.result, str)
    assert re.search(r"4x6000 RGB pixels needs about \d+ bytes to preprocess", peak.result)
    assert "peak while resizing" in peak.result and "Limits.max_image_bytes" in peak.result
    assert peak.grown <= BUDGET
    data = worst["thin-4x6000"].read_bytes()
    assert preprocess_image(data, get_profile("imagenet-224"), fast=True).shape == (3, 224, 224)
    assert worst_peaks[("thin-4x6000", "decode")].result == [6000, 4, 3]


def _kinds() -> dict[str, bytes]:
    photo = _photo(2000, 1900)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated: the reference path holds the image twice while turning it
    rotated = exif.tobytes()
    grey16 = Image.fromarray(np.asarray(photo.convert("L")).astype(np.uint16) * 257)
    return {
        "jpeg-rotated": _save(photo, "JPEG", quality=90, exif=rotated),
        "jpeg-progressive-444": _save(photo, "JPEG", quality=90, subsampling=0, progressive=True),
        "cmyk-rotated": _save(photo.convert("CMYK"), "JPEG", quality=90, exif=rotated),
        "cmyk-progressive": _save(photo.convert("CMYK"), "JPEG", quality=90, progressive=True),
        "grey-progressive": _save(photo.convert("L"), "JPEG", quality=90, progressive=True),
        "png-rgba-rotated": _save(photo.convert("RGBA"), "PNG", compress_level=1, exif=rotated),
        "png-palette": _save(photo.convert("P"), "PNG", compress_level=1),
        "png-16bit": _save(grey16, "PNG", compress_level=1),
        "webp-lossless": _save(photo, "WEBP", lossless=True, quality=0, method=0),
        "png-thin": _save(photo.resize((6, 2000)), "PNG"),
        "jpeg-wide-rotated": _save(_photo(20000, 200), "JPEG", quality=90, exif=rotated),
    }


CALLS = [("decode", "imagenet-224"), ("reference", "imagenet-224"), ("fast", "imagenet-224")]
CALLS += [("reference", "letterbox-640"), ("fast", "webp-720")]


def _estimate(data: bytes, call: str, profile: str) -> int:
    """The path's own estimate, read from its refusal at a 1-byte budget."""
    with pytest.raises(DecompressionBombError) as info:
        if call == "decode":
            decode_image(data, limits=Limits(max_image_bytes=1))
        else:
            preprocess_image(
                data, get_profile(profile), limits=Limits(max_image_bytes=1), fast=call == "fast"
            )
    found = re.search(r"needs about (\d+) bytes", str(info.value))
    assert found, str(info.value)
    return int(found.group(1))


def test_every_path_of_every_kind_stays_within_its_estimate(tmp_path: Path) -> None:
    """At a budget equal to its own estimate each path is accepted and its peak
    RSS stays within it; one byte less and it is refused before decoding."""
    jobs, estimates = [], []
    for kind, data in _kinds().items():
        path = tmp_path / kind
        path.write_bytes(data)
        for call, profile in CALLS:
            estimate = _estimate(data, call, profile)
            jobs.append(Job(str(path), call, profile, {"max_image_bytes": estimate}))
            estimates.append(estimate)
    over = []
    for job, estimate, peak in zip(jobs, estimates, measure(jobs), strict=True):
        where = f"{Path(job.path).name} {job.call} {job.profile}"
        assert isinstance(peak.result, list), f"{where}: {peak.result}"
        if peak.grown > estimate:
            over.append(f"{where}: grew {peak.grown / MiB:.1f} MiB > {estimate / MiB:.1f}")
    assert not over, over


def test_a_path_over_the_budget_is_refused_before_decoding_with_the_fix() -> None:
    data = png16(3000)
    budget = Limits(max_image_bytes=16 * MiB)
    with pytest.raises(DecompressionBombError) as info:
        decode_image(data, limits=budget)
    message = str(info.value)
    assert "3000x3000 I;16 pixels needs about" in message
    assert f"over the limit of {16 * MiB} (Limits.max_image_bytes)" in message
    assert "refused before decoding" in message and "raise the limit" in message
    assert isinstance(info.value, ValueError) and info.value.retryable is False
