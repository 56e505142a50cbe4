"""Every guard triggers on a crafted bad input, with a typed error, and nothing crashes."""

from __future__ import annotations

import contextlib
import struct
import zlib

import numpy as np
import pytest
from preprocess_photos import encode

from preprocess import (
    CONTENT_TYPE_JSON,
    CONTENT_TYPE_TENSOR,
    CorruptInputError,
    DecompressionBombError,
    InputTooLargeError,
    Limits,
    PreprocessError,
    UnsupportedInputError,
    brotli_compress,
    brotli_decompress,
    decode_envelope,
    decode_image,
    encode_envelope,
    get_profile,
    preprocess_batch,
    preprocess_image,
    probe_image,
    webp_decode,
)

PROFILE = get_profile("imagenet-224")


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_bomb(width: int, height: int) -> bytes:
    """A valid PNG header declaring a huge greyscale canvas, with one tiny IDAT chunk."""
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 1024)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", idat)
        + _png_chunk(b"IEND", b"")
    )


def _bad_input(error: type[PreprocessError], call: object, *args: object, **kwargs: object) -> str:
    with pytest.raises(error) as info:
        call(*args, **kwargs)  # type: ignore[operator]
    assert isinstance(info.value, ValueError)  # maps to HTTP 4xx
    assert info.value.retryable is False
    return str(info.value)


def test_max_input_bytes(rocket_jpg: bytes) -> None:
    limits = Limits(max_input_bytes=len(rocket_jpg) - 1)
    message = _bad_input(InputTooLargeError, preprocess_image, rocket_jpg, PROFILE, limits=limits)
    assert str(len(rocket_jpg)) in message and "max_input_bytes" in message
    _bad_input(InputTooLargeError, brotli_decompress, b"x" * 100, limits=Limits(max_input_bytes=10))


@pytest.mark.parametrize(("width", "height"), [(20_000, 20_000), (50_000, 1_000)])
def test_pixel_bomb_is_refused_before_decoding(width: int, height: int) -> None:
    bomb = png_bomb(width, height)
    assert len(bomb) < 2_000
    message = _bad_input(DecompressionBombError, preprocess_image, bomb, PROFILE)
    assert "max_pixels" in message and "refused before decoding" in message
    _bad_input(DecompressionBombError, probe_image, bomb)
    _bad_input(DecompressionBombError, decode_image, bomb)


def test_pixel_limit_is_configurable(rocket_jpg: bytes) -> None:
    message = _bad_input(
        DecompressionBombError,
        preprocess_image,
        rocket_jpg,
        PROFILE,
        limits=Limits(max_pixels=640 * 427 - 1),
    )
    assert "640x427" in message
    assert preprocess_image(rocket_jpg, PROFILE, limits=Limits(max_pixels=640 * 427)).shape


def test_brotli_bomb_stops_at_the_limit() -> None:
    bomb = brotli_compress(b"\x00" * (50 * 1024 * 1024), quality=5)
    assert len(bomb) < 100_000
    message = _bad_input(
        DecompressionBombError,
        brotli_decompress,
        bomb,
        limits=Limits(max_decoded_bytes=1024 * 1024),
    )
    assert "max_decoded_bytes" in message
    envelope = decode_envelope(
        encode_envelope(
            b"{" + b" " * 10_000_000 + b"}", content_type=CONTENT_TYPE_JSON, encoding="brotli"
        ),
        limits=Limits(max_decoded_bytes=1_000_000),
    )
    _bad_input(DecompressionBombError, envelope.to_json)


def test_brotli_tensor_cannot_expand_past_its_declared_shape() -> None:
    data = encode_envelope(
        np.zeros(1000, np.float32), content_type=CONTENT_TYPE_TENSOR, encoding="brotli"
    )
    header_length = struct.unpack_from("<I", data, 5)[0]
    forged = data.replace(b'"shape":[1000]', b'"shape":[10]')
    assert len(forged) == len(data) - 2
    forged = forged[:5] + struct.pack("<I", header_length - 2) + forged[9:]
    _bad_input(DecompressionBombError, decode_envelope(forged).to_numpy)


def test_truncated_images(rocket_jpg: bytes, astronaut_png: bytes) -> None:
    for data in (rocket_jpg[: len(rocket_jpg) // 2], astronaut_png[: len(astronaut_png) // 2]):
        message = _bad_input(CorruptInputError, preprocess_image, data, PROFILE)
        assert "truncated" in message
        _bad_input(CorruptInputError, preprocess_image, data, PROFILE, fast=False)
    _bad_input(CorruptInputError, preprocess_image, rocket_jpg[:50], PROFILE)


def test_corrupt_and_unsupported_inputs(rocket_jpg: bytes) -> None:
    _bad_input(CorruptInputError, preprocess_image, b"", PROFILE)
    message = _bad_input(CorruptInputError, preprocess_image, b"hello world" * 10, PROFILE)
    assert "JPEG, PNG or WebP" in message
    scrambled = bytearray(rocket_jpg)
    scrambled[200:4000] = bytes(3800)
    # Damaged entropy-coded data either fails cleanly or decodes to garbage; never crashes.
    with contextlib.suppress(CorruptInputError):
        preprocess_image(bytes(scrambled), PROFILE)
    from PIL import Image

    gif = encode(Image.new("RGB", (8, 8)), "GIF")
    assert "GIF" in _bad_input(UnsupportedInputError, preprocess_image, gif, PROFILE)
    _bad_input(UnsupportedInputError, preprocess_image, "not bytes", PROFILE)
    _bad_input(CorruptInputError, webp_decode, rocket_jpg)
    _bad_input(CorruptInputError, brotli_decompress, b"\xff" * 64)
    packed = brotli_compress(b"a" * 10_000)
    assert "truncated" in _bad_input(CorruptInputError, brotli_decompress, packed[:-3])


def test_bad_inputs_do_not_stop_a_batch(rocket_jpg: bytes) -> None:
    inputs = [rocket_jpg, png_bomb(20_000, 20_000), rocket_jpg[:500], b"junk", rocket_jpg]
    result = preprocess_batch(inputs, PROFILE, on_error="collect", workers=2)
    assert sorted(result.errors) == [1, 2, 3]
    assert isinstance(result.errors[1], DecompressionBombError)
    assert isinstance(result.errors[2], CorruptInputError)
    assert isinstance(result.errors[3], CorruptInputError)
    assert result.arrays[0] is not None and result.arrays[4] is not None
    np.testing.assert_array_equal(result.arrays[0], result.arrays[4])
    with pytest.raises(DecompressionBombError):
        preprocess_batch(inputs, PROFILE)
