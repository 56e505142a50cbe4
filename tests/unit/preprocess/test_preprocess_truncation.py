"""A JPEG cut short is refused for every kind the decoder accepts, from libjpeg's own signal.

Kinds: baseline RGB (4:2:0 and 4:4:4), progressive RGB, greyscale (baseline and
progressive), CMYK (Adobe, baseline and progressive), YCCK, and files with
restart intervals. Each is cut (an EOI marker appended, or not) and sent down
every decode path: ``decode_image``, the reference path and the fast path
(JPEG draft mode). Nothing here looks at pixel colours: a cut CMYK file fills
with a colour that is not mid-grey, and used to pass.
"""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from hostile_images import as_ycck, jpeg, scan_data_end  # type: ignore[import-not-found]
from PIL import Image

from preprocess import (
    CorruptInputError,
    ImageProfile,
    Limits,
    UnsupportedInputError,
    decode_image,
    get_profile,
    preprocess_image,
)
from preprocess.jpeg import check_jpeg

KINDS = {
    "rgb": {},
    "rgb-444": {"subsampling": 0},
    "rgb-progressive": {"progressive": True},
    "grey": {"mode": "L"},
    "grey-progressive": {"mode": "L", "progressive": True},
    "cmyk": {"mode": "CMYK"},
    "cmyk-progressive": {"mode": "CMYK", "progressive": True},
    "ycck": {"mode": "CMYK", "ycck": True},
    "restarts": {"restart_marker_blocks": 5},
    "restarts-progressive": {"progressive": True, "restart_marker_rows": 1},
}
PATHS = ("decode", "reference", "fast")
PROFILE = get_profile("imagenet-224")
# A small target so the fast path really decodes DCT-scaled (draft mode).
SMALL = ImageProfile(name="trunc-small", resize_shorter=48, layout="HWC", dtype="uint8")


@pytest.fixture(scope="module")
def photo() -> np.ndarray:
    from skimage import data

    # An odd size: partial blocks and MCUs on the right and bottom edges.
    return np.asarray(Image.fromarray(data.astronaut()).resize((389, 301)))


@pytest.fixture(scope="module")
def files(photo: np.ndarray) -> dict[str, bytes]:
    made = {}
    for kind, options in KINDS.items():
        options = dict(options)
        ycck = options.pop("ycck", False)
        data = jpeg(photo, **options)  # type: ignore[arg-type]
        made[kind] = as_ycck(data) if ycck else data
    return made


def _run(path: str, data: bytes) -> object:
    if path == "decode":
        return decode_image(data)
    return preprocess_image(data, SMALL, fast=path == "fast")


@pytest.mark.parametrize("kind", KINDS)
def test_a_whole_jpeg_of_every_kind_decodes_as_pillow_does(
    files: dict[str, bytes], kind: str
) -> None:
    data = files[kind]
    with Image.open(io.BytesIO(data)) as image:
        expected = np.asarray(image.convert("RGB"))
    np.testing.assert_array_equal(decode_image(data), expected)
    assert preprocess_image(data, PROFILE, fast=True).shape == (3, 224, 224)
    assert preprocess_image(data, PROFILE, fast=False).shape == (3, 224, 224)
    assert preprocess_image(data, SMALL, fast=True).shape[2] == 3


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("cut", ["5%", "50%", "90%", "-200"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_cut_jpeg_with_an_eoi_marker_is_refused(
    files: dict[str, bytes], kind: str, cut: str, path: str
) -> None:
    data = files[kind]
    end = scan_data_end(data)
    keep = end - 200 if cut == "-200" else int(end * int(cut[:-1]) / 100)
    with pytest.raises(CorruptInputError, match=r"truncated|cut short") as info:
        _run(path, data[:keep] + b"\xff\xd9")
    assert info.value.retryable is False
    assert "resend the whole file" in str(info.value)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["rgb", "cmyk", "ycck", "grey-progressive"])
def test_a_cut_jpeg_without_an_eoi_marker_is_refused(
    files: dict[str, bytes], kind: str, path: str
) -> None:
    data = files[kind]
    with pytest.raises(CorruptInputError, match="truncated"):
        _run(path, data[: scan_data_end(data) - 300])


def test_a_cut_first_image_of_an_mpo_is_refused(photo: np.ndarray) -> None:
    # A camera's multi-picture file: the decoder reads the first image, which
    # ends at its own EOI marker, with the second image after it.
    out = io.BytesIO()
    first, second = Image.fromarray(photo), Image.fromarray(photo[::-1].copy())
    first.save(out, "MPO", save_all=True, append_images=[second])
    data = out.getvalue()
    with Image.open(io.BytesIO(data)) as image:
        assert image.format == "MPO"
        expected = np.asarray(image.convert("RGB"))
    np.testing.assert_array_equal(decode_image(data), expected)
    end = scan_data_end(data[: data.index(b"\xff\xd9\xff\xd8") + 2])
    cut = data[: end // 2] + data[end:]  # the first image's EOI and the second image stay
    with pytest.raises(CorruptInputError, match="truncated"):
        decode_image(cut)


def test_cmyk_fill_is_not_grey(files: dict[str, bytes]) -> None:
    # Why the old check (a mid-grey last pixel) let cut CMYK files through.
    data = files["cmyk"]
    cut = data[: scan_data_end(data) // 2] + b"\xff\xd9"
    with Image.open(io.BytesIO(cut)) as image:
        image.load()  # Pillow itself accepts it: libjpeg's warning is dropped
        last = image.convert("RGB").getpixel((image.width - 1, image.height - 1))
    assert last != (128, 128, 128)


@pytest.mark.parametrize("kind", KINDS)
def test_only_a_cut_within_the_decoders_lookahead_goes_unseen(
    files: dict[str, bytes], kind: str
) -> None:
    """Every cut of 1 to 48 bytes off the last scan is refused, or changes at most
    256 pixels, all in the last row of blocks: the blind spot documented in
    preprocess/jpeg.py (the lookahead bytes complete the final blocks)."""
    data = files[kind]
    whole = decode_image(data).astype(np.int16)
    end = scan_data_end(data)
    for cut in range(1, 49):
        try:
            damaged = decode_image(data[: end - cut] + b"\xff\xd9").astype(np.int16)
        except CorruptInputError:
            continue
        changed = np.abs(damaged - whole).max(axis=2) > 0
        rows = np.nonzero(changed.any(axis=1))[0]
        assert rows.size == 0 or rows.min() >= whole.shape[0] - 16, (kind, cut)
        assert changed.sum() <= 256, (kind, cut, int(changed.sum()))


def test_a_scan_short_of_its_restart_markers_is_refused(files: dict[str, bytes]) -> None:
    # Intervals spliced out of the middle: each restart interval is whole, the
    # scan ends where it should, but intervals are missing.
    data = files["restarts"]
    markers = [i for i in range(len(data) - 1) if data[i] == 0xFF and 0xD0 <= data[i + 1] <= 0xD7]
    spliced = data[: markers[10]] + data[markers[40] :]
    with pytest.raises(CorruptInputError, match=r"restart markers are there"):
        decode_image(spliced)


def test_an_arithmetic_coded_jpeg_is_unsupported(files: dict[str, bytes]) -> None:
    data = files["rgb"]
    arithmetic = data.replace(b"\xff\xc0", b"\xff\xc9", 1)  # SOF9: arithmetic, sequential
    with pytest.raises(UnsupportedInputError, match="arithmetic-coded JPEGs are not supported"):
        decode_image(arithmetic)


def test_a_sequential_jpeg_missing_a_components_scan_is_refused() -> None:
    # One scan per component (non-interleaved) is legal; this file stops after the first.
    components = bytes([1, 0x11, 0, 2, 0x11, 1, 3, 0x11, 1])
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, 16, 16, 3) + components
    sos = b"\xff\xda" + struct.pack(">HB", 8, 1) + bytes([1, 0x00, 0, 63, 0])
    data = b"\xff\xd8" + sof + sos + b"\x00" + b"\xff\xd9"
    with pytest.raises(CorruptInputError, match=r"components \[2, 3\] never coded"):
        check_jpeg(data, Limits())
