"""A JPEG's marker structure, read without decoding a pixel.

Pillow (libjpeg) decodes every scan a file holds and silently zero-fills a
scan that an end-of-image marker cuts short. Both are attack surfaces: a
progressive JPEG of a few hundred kilobytes can carry thousands of scans over
a 40-megapixel canvas (minutes of CPU), and a file cut to 5% with an EOI
marker appended decodes to grey fill with no error. Walking the markers costs
one pass over the bytes (the entropy-coded data is skipped with a regex), so
it runs before any decoding.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from preprocess.exceptions import CorruptInputError, DecompressionBombError
from preprocess.limits import Limits

__all__ = ["JpegStructure", "check_jpeg"]

# The end of an entropy-coded segment: 0xFF followed by neither a stuffed zero
# nor a restart marker (RST0-RST7), nor a fill byte.
_SEGMENT_END = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
_SOF_PROGRESSIVE = frozenset({0xC2, 0xC6, 0xCA, 0xCE})
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})


@dataclass(frozen=True, slots=True)
class JpegStructure:
    """What a JPEG's markers say.

    Attributes:
        progressive: A progressive (SOF2/6/10/14) frame.
        scans: Number of SOS markers in the main image.
        complete: Every coefficient of every component is coded down to bit 0
            (always true for a sequential JPEG that has its one scan).
    """

    progressive: bool
    scans: int
    complete: bool


def _u16(data: bytes, offset: int) -> int:
    return (data[offset] << 8) | data[offset + 1]


def check_jpeg(data: bytes, limits: Limits) -> JpegStructure:
    """Walk a JPEG's markers; refuse a scan bomb and a progression with missing scans.

    Raises:
        DecompressionBombError: more scans than ``limits.max_jpeg_scans``.
        CorruptInputError: markers are damaged, or a progressive image misses
            scans (it was cut and an end-of-image marker appended).
    """
    size = len(data)
    position = 2  # after SOI
    scans = 0
    progressive = False
    components: list[int] = []
    # component id -> per coefficient, the lowest bit coded so far (64 = not coded)
    coded: dict[int, list[int]] = {}
    while position + 1 < size:
        if data[position] != 0xFF:
            raise CorruptInputError(
                f"JPEG marker expected at byte {position}, found 0x{data[position]:02x}; "
                "the file is damaged"
            )
        marker = data[position + 1]
        if marker == 0xFF:  # fill byte before a marker
            position += 1
            continue
        if marker == 0xD9:  # EOI
            break
        if marker in _STANDALONE:
            position += 2
            continue
        if position + 4 > size:
            break
        length = _u16(data, position + 2)
        body = data[position + 4 : position + 2 + length]
        if length < 2 or len(body) != length - 2:
            raise CorruptInputError(f"JPEG segment 0x{marker:02x} at byte {position} is truncated")
        position += 2 + length
        if marker in _SOF and len(body) >= 6:
            progressive = marker in _SOF_PROGRESSIVE
            count = body[5]
            components = [body[6 + 3 * i] for i in range(count) if 6 + 3 * i < len(body)]
            coded = {component: [64] * 64 for component in components}
        elif marker == 0xDA:
            scans += 1
            if scans > limits.max_jpeg_scans:
                raise DecompressionBombError(
                    f"JPEG holds more than {limits.max_jpeg_scans} scans "
                    "(Limits.max_jpeg_scans); every scan is a pass over the whole image, "
                    "refused before decoding"
                )
            _note_scan(body, coded)
            end = _SEGMENT_END.search(data, position)
            position = size if end is None else end.start()
    complete = not progressive or all(max(bits) == 0 for bits in coded.values())
    if progressive and coded and not complete:
        raise CorruptInputError(
            f"progressive JPEG stops after {scans} scans with coefficients never coded: "
            "the file was cut short; resend the whole file"
        )
    return JpegStructure(progressive=progressive, scans=scans, complete=complete)


def _note_scan(body: bytes, coded: dict[int, list[int]]) -> None:
    """Record which coefficients (Ss..Se) a scan codes, down to which bit (Al)."""
    if not body:
        return
    count = body[0]
    if len(body) < 1 + 2 * count + 3:
        return
    start, end, approx = body[1 + 2 * count], body[2 + 2 * count], body[3 + 2 * count]
    low = approx & 0x0F
    for i in range(count):
        bits = coded.get(body[1 + 2 * i])
        if bits is None:
            continue
        for k in range(start, min(end, 63) + 1):
            bits[k] = min(bits[k], low)
