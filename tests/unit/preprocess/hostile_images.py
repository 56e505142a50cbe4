"""Hostile images built in the test (nothing downloaded): cut JPEGs, scan bombs, 16-bit PNGs."""

from __future__ import annotations

import io
import re

import numpy as np
from PIL import Image

_SEGMENT_END = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")


def jpeg(
    pixels: np.ndarray,
    *,
    progressive: bool = False,
    quality: int = 90,
    mode: str | None = None,
    **options: object,
) -> bytes:
    image = Image.fromarray(pixels)
    if mode is not None:
        image = image.convert(mode)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=quality, progressive=progressive, **options)
    return out.getvalue()


def as_ycck(data: bytes) -> bytes:
    """A CMYK JPEG from Pillow relabelled YCCK (Adobe APP14 transform 2).

    libjpeg then decodes its scans as YCCK and converts them to CMYK, the path a
    YCCK file from Photoshop takes; the colours are not the original's.
    """
    at = data.index(b"Adobe")
    relabelled = bytearray(data)
    relabelled[at + 11] = 2
    return bytes(relabelled)


def scan_data_end(data: bytes) -> int:
    """Offset just past the last scan's entropy-coded data (where EOI starts)."""
    return len(data) - len(_scan_units(data)[2])


def cut_with_eoi(data: bytes, fraction: float) -> bytes:
    """The first ``fraction`` of a JPEG with an end-of-image marker appended."""
    return data[: int(len(data) * fraction)] + b"\xff\xd9"


def _scan_units(data: bytes) -> tuple[bytes, list[bytes], bytes]:
    """Split a JPEG into head, scan units (tables + SOS + entropy data) and tail."""
    position, ends = 2, []
    while data[position + 1] != 0xD9:
        marker = data[position + 1]
        position += 2 + ((data[position + 2] << 8) | data[position + 3])
        if marker == 0xDA:
            end = _SEGMENT_END.search(data, position)
            assert end is not None
            position = end.start()
            ends.append(position)
    starts = [data.index(b"\xff\xda"), *ends[:-1]]
    units = [data[a:b] for a, b in zip(starts, ends, strict=True)]
    return data[: starts[0]], units, data[ends[-1] :]


def scan_bomb(size: int, extra_scans: int) -> bytes:
    """A progressive JPEG of ``size`` x ``size`` whose smallest scan is repeated.

    libjpeg decodes every repeat (a pass over the whole image each, with only a
    warning for the odd progression), so the file costs CPU in proportion to
    ``extra_scans`` times the pixels while staying small.
    """
    canvas = np.empty((size, size, 3), np.uint8)
    canvas[:] = (90, 140, 200)
    head, units, tail = _scan_units(jpeg(canvas, progressive=True, quality=50))
    smallest = min(units[1:], key=len)
    return head + b"".join(units) + smallest * extra_scans + tail


def png16(size: int) -> bytes:
    """A 16-bit greyscale PNG of ``size`` x ``size`` (a few tens of kilobytes)."""
    out = io.BytesIO()
    Image.fromarray(np.zeros((size, size), np.uint16)).save(out, "PNG", optimize=True)
    return out.getvalue()
