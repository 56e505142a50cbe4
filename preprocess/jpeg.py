"""JPEG specifics: the marker structure (read without decoding), and a decode that sees cuts.

Pillow (libjpeg) decodes every scan a file holds and silently fills a scan that
an end-of-image marker (or any marker) cuts short: libjpeg warns
("Premature end of JPEG file", "premature end of data segment") and Pillow
drops its warnings. Both are attack surfaces: a progressive JPEG of a few
hundred kilobytes can carry thousands of scans over a 40-megapixel canvas
(minutes of CPU), and a file cut to 5% with an EOI marker appended decodes to
fill with no error, whatever its colour space.

:func:`check_jpeg` walks the markers (one pass; the entropy-coded data is
skipped with a regex) before any decoding: scan count, a progression that
never codes some coefficients, a scan short of the restart markers its
restart interval requires, a sequential image missing a component's scan.

:func:`load_jpeg` then decodes with libjpeg's own signal for a cut inside the
last scan: the data is fed without its end-of-image marker, so a scan that
needs bits the file does not hold makes libjpeg suspend for more input (a
complete scan does not) instead of filling. See its docstring for the one
blind spot this leaves, a cut within the decoder's lookahead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

from PIL import Image, ImageFile

from preprocess.exceptions import (
    CorruptInputError,
    DecompressionBombError,
    UnsupportedInputError,
)
from preprocess.limits import Limits

__all__ = ["JpegStructure", "check_jpeg", "load_jpeg"]

# The end of an entropy-coded segment: 0xFF followed by neither a stuffed zero
# nor a restart marker (RST0-RST7), nor a fill byte.
_SEGMENT_END = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
_RESTART = re.compile(rb"\xff[\xd0-\xd7]")
_SOF_PROGRESSIVE = frozenset({0xC2, 0xC6, 0xCA, 0xCE})
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Arithmetic-coded frames, and the arithmetic conditioning table marker (DAC).
_ARITHMETIC = frozenset(range(0xC9, 0xD0))
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})
_DRI = 0xDD
_SOS = 0xDA
_EOI = 0xD9
# Bytes the entropy decoder may read past the end of a complete scan before it
# knows the scan is done: libjpeg-turbo refills its bit buffer to 57 bits (64-bit
# builds), so at most 7 bytes; one more for margin. Stuffed 0xFF bytes (FF 00)
# are data, not a marker, so they never stop the decoder the way an EOI does;
# as data they are all one bits, which no Huffman code is (each decodes as an
# invalid 17-bit code, the smallest thing a cut scan can take from them).
_LOOKAHEAD = b"\xff\x00" * 8
# A byte libjpeg's marker reader discards (and counts as consumed) but its
# entropy decoder cannot complete a block from.
_PROBE = b"\x00"
_END = b"\xff\xd9"
_CUT = (
    "JPEG data is truncated: it stops before the image does (a scan needs more data "
    "than the file holds{how}); resend the whole file"
)


class _Decoder(Protocol):
    """Pillow's incremental decoder (``Image._getdecoder``), as ImageFile.load drives it."""

    def decode(self, buffer: bytes | memoryview, /) -> tuple[int, int]: ...


@dataclass(frozen=True, slots=True)
class JpegStructure:
    """What a JPEG's markers say.

    Attributes:
        progressive: A progressive (SOF2/6/10/14) frame.
        scans: Number of SOS markers in the main image.
        complete: Every coefficient of every component is coded down to bit 0
            (progressive), or every component has its scan (sequential); a
            structure that is not complete is refused, so this is always True.
        data_end: Offset just past the last scan's entropy-coded data (where
            its EOI marker, or whatever follows the scan, starts).
        coefficient_bytes: Memory libjpeg takes for the whole image's DCT
            coefficients when the image is coded in several scans (progressive,
            or one scan per component); 0 for a single-scan image, which is
            decoded a row of blocks at a time.
    """

    progressive: bool
    scans: int
    complete: bool
    data_end: int
    coefficient_bytes: int


@dataclass(slots=True)
class _Frame:
    width: int
    height: int
    # component id -> (horizontal, vertical) sampling factors
    sampling: dict[int, tuple[int, int]]

    def blocks(self, component: int) -> tuple[int, int]:
        """Blocks across and down one component's plane (before MCU padding)."""
        h, v = self.sampling[component]
        h_max = max(f[0] for f in self.sampling.values())
        v_max = max(f[1] for f in self.sampling.values())
        # jdinput.c: jdiv_round_up(image_width * h_samp, max_h_samp * DCTSIZE)
        return _ceil(self.width * h, h_max * 8), _ceil(self.height * v, v_max * 8)

    def mcus(self, components: list[int]) -> int:
        """MCUs in a scan of these components (T.81 A.2)."""
        if len(components) == 1:
            across, down = self.blocks(components[0])
            return across * down
        h_max = max(f[0] for f in self.sampling.values())
        v_max = max(f[1] for f in self.sampling.values())
        return _ceil(self.width, 8 * h_max) * _ceil(self.height, 8 * v_max)

    def coefficient_bytes(self) -> int:
        """libjpeg's whole-image coefficient buffer: 64 two-byte values a block,
        each plane padded to whole MCUs (jdcoefct.c)."""
        total = 0
        for component, (h, v) in self.sampling.items():
            across, down = self.blocks(component)
            total += _ceil(across, h) * h * _ceil(down, v) * v * 128
        return total


def _ceil(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def _u16(data: bytes, offset: int) -> int:
    return (data[offset] << 8) | data[offset + 1]


def _parse_frame(body: bytes) -> _Frame | None:
    if len(body) < 6:
        return None
    height, width, count = _u16(body, 1), _u16(body, 3), body[5]
    sampling: dict[int, tuple[int, int]] = {}
    for i in range(count):
        at = 6 + 3 * i
        if at + 1 >= len(body):
            break
        factors = body[at + 1]
        sampling[body[at]] = (max(1, factors >> 4), max(1, factors & 0x0F))
    return _Frame(width, height, sampling) if sampling else None


def check_jpeg(data: bytes, limits: Limits) -> JpegStructure:
    """Walk a JPEG's markers; refuse a scan bomb and every cut the markers show.

    Raises:
        DecompressionBombError: more scans than ``limits.max_jpeg_scans``.
        CorruptInputError: markers are damaged; a progressive image misses
            scans; a scan holds fewer restart markers than its restart interval
            needs; a sequential image misses a component's scan.
    """
    size = len(data)
    position = 2  # after SOI
    scans = 0
    progressive = False
    frame: _Frame | None = None
    restart_interval = 0
    first_scan_components = 0
    scanned: set[int] = set()
    data_end = size
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
        if marker == _EOI:
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
        if marker in _ARITHMETIC:
            raise UnsupportedInputError(
                "arithmetic-coded JPEGs are not supported (libjpeg cannot tell one cut "
                "short from a whole one, and Pillow cannot load them past 64 KB); "
                "re-encode with Huffman coding, e.g. jpegtran -optimize"
            )
        if marker in _SOF and frame is None:
            progressive = marker in _SOF_PROGRESSIVE
            frame = _parse_frame(body)
            coded = {component: [64] * 64 for component in frame.sampling} if frame else {}
        elif marker == _DRI and len(body) >= 2:
            restart_interval = _u16(body, 0)
        elif marker == _SOS:
            scans += 1
            if scans > limits.max_jpeg_scans:
                raise DecompressionBombError(
                    f"JPEG holds more than {limits.max_jpeg_scans} scans "
                    "(Limits.max_jpeg_scans); every scan is a pass over the whole image, "
                    "refused before decoding"
                )
            components = _note_scan(body, coded)
            if scans == 1:
                first_scan_components = len(components)
            scanned.update(components)
            end = _SEGMENT_END.search(data, position)
            data_end = size if end is None else end.start()
            if frame is not None and restart_interval and components:
                _check_restarts(data, position, data_end, frame, components, restart_interval)
            position = data_end
    if progressive and coded and not all(max(bits) == 0 for bits in coded.values()):
        raise CorruptInputError(
            f"progressive JPEG stops after {scans} scans with coefficients never coded: "
            "the file was cut short; resend the whole file"
        )
    if frame is not None and scans and not progressive and set(frame.sampling) - scanned:
        raise CorruptInputError(
            f"JPEG stops after {scans} scans with components "
            f"{sorted(set(frame.sampling) - scanned)} never coded: the file was cut short; "
            "resend the whole file"
        )
    multi_scan = progressive or 0 < first_scan_components < len(coded)
    return JpegStructure(
        progressive=progressive,
        scans=scans,
        complete=True,
        data_end=data_end,
        coefficient_bytes=frame.coefficient_bytes() if frame is not None and multi_scan else 0,
    )


def _check_restarts(
    data: bytes, start: int, end: int, frame: _Frame, components: list[int], interval: int
) -> None:
    """A scan of M MCUs with a restart every ``interval`` holds ceil(M / interval) - 1
    restart markers; fewer means intervals are missing (cut and spliced)."""
    if any(component not in frame.sampling for component in components):
        return  # libjpeg refuses the scan itself ("Invalid component ID")
    needed = _ceil(frame.mcus(components), interval) - 1
    found = len(_RESTART.findall(data, start, end))
    if found < needed:
        raise CorruptInputError(
            _CUT.format(how=f": {found} of its {needed} restart markers are there")
        )


def _note_scan(body: bytes, coded: dict[int, list[int]]) -> list[int]:
    """Record which coefficients (Ss..Se) a scan codes, down to which bit (Al);
    return the scan's component ids."""
    if not body:
        return []
    count = body[0]
    if len(body) < 1 + 2 * count + 3:
        return []
    components = [body[1 + 2 * i] for i in range(count)]
    start, end, approx = body[1 + 2 * count], body[2 + 2 * count], body[3 + 2 * count]
    low = approx & 0x0F
    for component in components:
        bits = coded.get(component)
        if bits is None:
            continue
        for k in range(start, min(end, 63) + 1):
            bits[k] = min(bits[k], low)
    return components


def load_jpeg(image: ImageFile.ImageFile, data: bytes, structure: JpegStructure) -> None:
    """Decode an opened (and possibly drafted) JPEG's pixels; refuse a cut last scan.

    Replaces ``image.load()``: the same libjpeg decoder Pillow uses, fed the
    file up to the end of its last scan's data, then :data:`_LOOKAHEAD`, with
    no end-of-image marker. A complete scan finishes there (the decoder reads
    the lookahead bytes ahead but never needs them); a cut one needs more bits
    and suspends for input that never comes, which is libjpeg's own "premature
    end" condition made visible (with an EOI marker present it would warn,
    which Pillow drops, and fill). An image coded in several scans only
    finishes at its end-of-image marker, so one more byte is fed first: libjpeg's
    marker reader (waiting after a complete last scan) consumes it, a suspended
    scan cannot complete a block from it.

    Blind spot: the lookahead bytes are data to a cut scan. A cut that loses
    no more than what they stand in for (the tail of the final blocks, whose
    remaining codes an end-of-block ends) decodes without a signal; it changes
    pixels of the last row of blocks only (measured in docs/preprocess.md).

    Raises:
        CorruptInputError: the last scan is cut short, or libjpeg fails.
    """
    if len(image.tile) != 1:
        raise CorruptInputError(f"JPEG with {len(image.tile)} tiles is not a plain image")
    name, extents, offset, args = image.tile[0]
    if offset > structure.data_end:
        raise CorruptInputError("JPEG image data starts after its last scan ends; damaged file")
    image.load_prepare()
    decoder = Image._getdecoder(image.mode, name, args, image.decoderconfig)
    try:
        decoder.setimage(image.im, extents)
        status = _feed(decoder, memoryview(data)[offset : structure.data_end])
    finally:
        decoder.cleanup()
        image.tile = []
    if status < 0:
        message = ImageFile.ERRORS.get(status, f"error {status}")
        raise CorruptInputError(
            f"image data is truncated or damaged (JPEG decoder: {message}); "
            "re-encode or resend the file"
        )


def _feed(decoder: _Decoder, body: memoryview) -> int:
    """Run the decoder over ``body`` and the lookahead; return its status when it finishes.

    Raises:
        CorruptInputError: the decoder needs more data than the scans hold.
    """
    consumed, status = decoder.decode(body)
    if consumed < 0:
        return status
    rest = bytes(body[consumed:]) + _LOOKAHEAD
    consumed, status = decoder.decode(rest)
    if consumed < 0:
        return status  # a single-scan image: every row is out
    if consumed != len(rest):
        raise CorruptInputError(_CUT.format(how=""))
    consumed, status = decoder.decode(_PROBE)
    if consumed != len(_PROBE):
        raise CorruptInputError(_CUT.format(how=""))
    consumed, status = decoder.decode(_END)
    if consumed < 0:
        return status
    raise CorruptInputError(_CUT.format(how=""))
