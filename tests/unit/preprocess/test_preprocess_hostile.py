"""Hostile images: cut JPEGs, progressive scan bombs, 16-bit PNGs, lying envelopes.

Each is refused with a typed error before it costs what it asks for; real
photos (scikit-image's) keep decoding.
"""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest
from hostile_images import cut_with_eoi, jpeg, png16, scan_bomb  # type: ignore[import-not-found]
from PIL import Image

from preprocess import (
    CONTENT_TYPE_IMAGE,
    CorruptInputError,
    DecompressionBombError,
    EnvelopeError,
    Limits,
    decode_envelope,
    decode_image,
    get_profile,
    preprocess_image,
)
from preprocess.jpeg import check_jpeg

PROFILE = get_profile("imagenet-224")


@pytest.fixture(scope="module")
def photo() -> np.ndarray:
    from skimage import data

    return np.asarray(data.astronaut())


@pytest.mark.parametrize("progressive", [False, True], ids=["baseline", "progressive"])
@pytest.mark.parametrize("fraction", [0.05, 0.5])
@pytest.mark.parametrize("fast", [False, True], ids=["reference", "fast"])
def test_a_jpeg_cut_short_with_an_eoi_marker_is_refused(
    photo: np.ndarray, progressive: bool, fraction: float, fast: bool
) -> None:
    whole = jpeg(photo, progressive=progressive)
    preprocess_image(whole, PROFILE, fast=fast)  # the whole file is fine
    with pytest.raises(CorruptInputError, match=r"cut|stops before"):
        preprocess_image(cut_with_eoi(whole, fraction), PROFILE, fast=fast)


def test_a_baseline_jpeg_missing_only_its_last_blocks_is_refused(photo: np.ndarray) -> None:
    whole = jpeg(photo)
    cut = whole[:-200] + b"\xff\xd9"
    with pytest.raises(CorruptInputError, match="stops before the image does"):
        decode_image(cut)


def test_a_whole_jpeg_whose_last_pixel_is_mid_grey_is_accepted(photo: np.ndarray) -> None:
    grey = photo.copy()
    grey[-64:, -64:] = 128  # looks like libjpeg's fill for a cut scan, but is the image
    data = jpeg(grey, quality=100)
    assert decode_image(data)[-1, -1].tolist() == [128, 128, 128]
    assert preprocess_image(data, PROFILE).shape == (3, 224, 224)


def test_a_progressive_scan_bomb_is_refused_from_its_markers() -> None:
    bomb = scan_bomb(1024, 3000)
    assert len(bomb) < 400_000
    with pytest.raises(DecompressionBombError, match="more than 64 scans"):
        preprocess_image(bomb, PROFILE)
    with pytest.raises(DecompressionBombError, match=r"Limits\.max_jpeg_scans"):
        decode_image(bomb)
    # A raised limit decodes it (so the refusal above is the limit, not damage).
    assert decode_image(bomb, limits=Limits(max_jpeg_scans=4000)).shape == (1024, 1024, 3)


def test_ordinary_progressive_jpegs_are_well_inside_the_scan_limit(photo: np.ndarray) -> None:
    structure = check_jpeg(jpeg(photo, progressive=True), Limits())
    assert structure.progressive and structure.complete
    assert 1 < structure.scans < Limits().max_jpeg_scans


def test_an_exif_thumbnail_does_not_count_as_scans(photo: np.ndarray) -> None:
    thumbnail = jpeg(photo[::8, ::8].copy())
    exif = Image.Exif()
    exif[0x0112] = 1
    out = io.BytesIO()
    image = Image.fromarray(photo)
    image.save(out, "JPEG", exif=exif.tobytes() + thumbnail)
    assert check_jpeg(out.getvalue(), Limits()).scans == 1


def test_a_16_bit_png_is_refused_by_its_decoded_size_before_decoding() -> None:
    data = png16(4000)  # 16 M pixels, under max_pixels
    with pytest.raises(DecompressionBombError, match=r"I;16 pixels needs about \d+ bytes"):
        preprocess_image(data, PROFILE, limits=Limits(max_image_bytes=32 * 1024 * 1024))


def test_a_small_16_bit_png_near_the_pixel_limit_decodes_in_bounded_memory(
    tmp_path: Path,
) -> None:
    """Peak RSS of a fresh process preprocessing a ~80 KB 16-bit PNG of 6300x6300."""
    path = tmp_path / "deep.png"
    path.write_bytes(png16(6300))
    assert path.stat().st_size < 120_000
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from PIL import Image
        from preprocess import get_profile, preprocess_image
        data = open({str(path)!r}, "rb").read()
        profile = get_profile("imagenet-224")
        def peak():  # VmHWM: this process's own peak (ru_maxrss inherits the parent's)
            status = Path("/proc/self/status").read_text().split("VmHWM:")[1]
            return int(status.split()[0])
        before = peak()
        for fast in (False, True):
            assert preprocess_image(data, profile, fast=fast).shape == (3, 224, 224)
        print(before, peak())
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    before, after = (int(value) * 1024 for value in run.stdout.split())
    grown = after - before
    assert grown < 200 * 1024 * 1024, f"peak RSS grew by {grown / 2**20:.0f} MiB"


def _envelope(header: dict[str, object], payload: bytes) -> bytes:
    full = {**header, "payload_bytes": len(payload), "crc32": zlib.crc32(payload)}
    text = json.dumps(full).encode()
    return struct.pack("<4sBI", b"EDGF", 1, len(text)) + text + payload


def test_a_webp_payload_larger_than_its_declared_shape_is_refused_before_decoding() -> None:
    canvas = io.BytesIO()
    Image.new("RGB", (4000, 4000)).save(canvas, "WEBP", lossless=True, quality=0)
    envelope = decode_envelope(
        _envelope(
            {
                "content_type": CONTENT_TYPE_IMAGE,
                "encoding": "webp-lossless",
                "shape": [32, 32, 3],
                "dtype": "uint8",
                "layout": "HWC",
            },
            canvas.getvalue(),
        )
    )
    with pytest.raises(EnvelopeError, match=r"4000x4000 pixels.*refused before decoding"):
        envelope.to_numpy()


@pytest.mark.parametrize("shape", [[32], [2, 32, 32, 3], [32, 32, 3, 1]])
def test_a_webp_envelope_with_a_non_image_shape_is_a_typed_error(shape: list[int]) -> None:
    canvas = io.BytesIO()
    Image.new("RGB", (32, 32)).save(canvas, "WEBP", lossless=True)
    envelope = decode_envelope(
        _envelope(
            {
                "content_type": CONTENT_TYPE_IMAGE,
                "encoding": "webp",
                "shape": shape,
                "dtype": "uint8",
            },
            canvas.getvalue(),
        )
    )
    with pytest.raises(EnvelopeError, match="WebP payload holds"):
        envelope.to_numpy()


def test_a_brotli_tensor_decodes_into_one_buffer_of_its_declared_size(tmp_path: Path) -> None:
    """Peak memory of decoding a 64 MiB Brotli tensor: the array, not the array twice."""
    from preprocess import encode_envelope

    path = tmp_path / "zeros.efe"
    array = np.zeros((4096, 4096, 4), np.uint8)
    path.write_bytes(encode_envelope(array, content_type="application/x-tensor", encoding="brotli"))
    del array
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from preprocess import decode_envelope
        data = open({str(path)!r}, "rb").read()
        def peak():  # VmHWM: this process's own peak (ru_maxrss inherits the parent's)
            status = Path("/proc/self/status").read_text().split("VmHWM:")[1]
            return int(status.split()[0])
        before = peak()
        array = decode_envelope(data).to_numpy()
        assert array.shape == (4096, 4096, 4) and not array.any()
        print(before, peak())
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    before, after = (int(value) * 1024 for value in run.stdout.split())
    assert after - before < 96 * 1024 * 1024, f"peak grew by {(after - before) / 2**20:.0f} MiB"
