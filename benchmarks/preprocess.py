"""Benchmark of the edge preprocessing stage (quoted in docs/benchmarks.md).

(a) images/s on one core turning 1920x1080 JPEGs into 224x224 normalised
    float32 tensors (profile imagenet-224): edgefeed's fast path (JPEG draft
    mode + reduce + box resize + LUT normalise) against the straightforward
    Pillow path (full decode, resize the whole frame, crop, NumPy normalise).
    Also: the fast path's difference from the full-decode path, and images/s
    of a PreprocessPool using every core.
(b) WebP against JPEG at matched SSIM on scikit-image's real photographs: for
    each JPEG quality, the smallest WebP (binary search on quality) whose SSIM
    is at least the JPEG's.
(c) Brotli against gzip on a realistic JSON feature payload: ratio and MB/s,
    and compress + transfer + decompress time at 10 and 100 Mbit/s.

The 1920x1080 JPEGs are made from scikit-image's colour photographs
(astronaut, chelsea, coffee, motorcycle_left, rocket): upscaled with Lanczos
until they cover 1920x1080, centre-cropped to exactly 1920x1080, saved as
JPEG quality 90 (4:2:0), like a camera frame.

    .venv/bin/python benchmarks/preprocess.py            # full run, ~1 minute
    .venv/bin/python benchmarks/preprocess.py --smoke    # a few seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import io
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# This file is named like the package it measures; drop its own folder from the
# import path so ``import preprocess`` finds the package, not this script.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import numpy as np  # noqa: E402
import skimage  # noqa: E402
from PIL import Image  # noqa: E402
from skimage.metrics import structural_similarity  # noqa: E402

from preprocess import (  # noqa: E402
    IMAGENET_MEAN,
    IMAGENET_STD,
    PreprocessPool,
    brotli_compress,
    brotli_decompress,
    encode_image,
    get_profile,
    preprocess_image,
    webp_decode,
    webp_encode,
)

DATA = Path(skimage.__file__).parent / "data"
PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "motorcycle_left.png", "rocket.jpg")
RESULTS = Path(__file__).parent / "results" / "preprocess.json"


def load_photo(name: str) -> Image.Image:
    with Image.open(DATA / name) as image:
        return image.convert("RGB")


def hd_jpeg(image: Image.Image) -> bytes:
    scale = max(1920 / image.width, 1080 / image.height)
    big = image.resize(
        (round(image.width * scale), round(image.height * scale)), Image.Resampling.LANCZOS
    )
    left, top = (big.width - 1920) // 2, (big.height - 1080) // 2
    out = io.BytesIO()
    big.crop((left, top, left + 1920, top + 1080)).save(out, "JPEG", quality=90)
    return out.getvalue()


_MEAN = np.asarray(IMAGENET_MEAN, dtype=np.float32)
_STD = np.asarray(IMAGENET_STD, dtype=np.float32)


def baseline(data: bytes) -> np.ndarray:
    """The straightforward path: full decode, resize, centre crop, NumPy normalise."""
    with Image.open(io.BytesIO(data)) as image:
        image = image.convert("RGB")
        width, height = image.size
        short, long = min(width, height), max(width, height)
        new_long = int(256 * long / short)
        size = (256, new_long) if width <= height else (new_long, 256)
        image = image.resize(size, Image.Resampling.BILINEAR)
        left, top = round((size[0] - 224) / 2), round((size[1] - 224) / 2)
        image = image.crop((left, top, left + 224, top + 224))
    array = np.asarray(image, dtype=np.float32) / np.float32(255.0)
    return np.ascontiguousarray(((array - _MEAN) / _STD).transpose(2, 0, 1))


def throughput(func: Any, inputs: list[bytes], repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        for data in inputs:
            func(data)
    return repeat * len(inputs) / (time.perf_counter() - start)


def bench_tensors(
    jpegs: list[bytes], rounds: int, repeat: int, pool_workers: int
) -> dict[str, Any]:
    profile = get_profile("imagenet-224")

    coarse = dataclasses.replace(profile, name="imagenet-224-gap1", reducing_gap=1.0)

    def fast(data: bytes) -> np.ndarray:
        return preprocess_image(data, profile)

    def fast_gap1(data: bytes) -> np.ndarray:
        return preprocess_image(data, coarse)

    # Same result check first: the baseline is the reference path's twin.
    diffs: dict[str, list[np.ndarray]] = {"gap2": [], "gap1": []}
    for data in jpegs:
        reference = baseline(data)
        np.testing.assert_allclose(
            preprocess_image(data, profile, fast=False), reference, atol=1e-6
        )
        # Differences in grey levels: normalised units times 255 * std.
        diffs["gap2"].append(np.abs(fast(data) - reference) * (255 * _STD[:, None, None]))
        diffs["gap1"].append(np.abs(fast_gap1(data) - reference) * (255 * _STD[:, None, None]))
    rates: dict[str, list[float]] = {"fast": [], "gap1": [], "baseline": []}
    funcs = {"fast": fast, "gap1": fast_gap1, "baseline": baseline}
    for func in funcs.values():
        throughput(func, jpegs, 1)  # warm-up (LUTs, page cache)
    for _ in range(rounds):  # interleaved, so machine noise hits all alike
        for key, func in funcs.items():
            rates[key].append(throughput(func, jpegs, repeat))

    def speedup(key: str) -> float:
        return statistics.median(f / b for f, b in zip(rates[key], rates["baseline"], strict=True))

    result: dict[str, Any] = {
        "fast_images_per_s": statistics.median(rates["fast"]),
        "gap1_images_per_s": statistics.median(rates["gap1"]),
        "baseline_images_per_s": statistics.median(rates["baseline"]),
        "speedup": speedup("fast"),
        "speedup_gap1": speedup("gap1"),
    }
    for key, parts in diffs.items():
        levels = np.concatenate([d.ravel() for d in parts])
        result[f"parity_{key}"] = {
            "mean": float(levels.mean()),
            "p99": float(np.percentile(levels, 99)),
            "max": float(levels.max()),
        }
    if pool_workers > 1:
        batch = jpegs * max(1, repeat)
        with PreprocessPool(pool_workers) as pool:
            pool.map(batch[:pool_workers], profile)  # start the processes
            start = time.perf_counter()
            pool.map(batch, profile)
            result["pool_workers"] = pool_workers
            result["pool_images_per_s"] = len(batch) / (time.perf_counter() - start)
    return result


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    return float(structural_similarity(a, b, channel_axis=-1, data_range=255))


def jpeg_bytes(image: Image.Image, quality: int) -> bytes:
    out = io.BytesIO()
    image.save(out, "JPEG", quality=quality, optimize=True)
    return out.getvalue()


def bench_webp(photos: dict[str, Image.Image], qualities: list[int], method: int) -> dict[str, Any]:
    rows = []
    for name, image in photos.items():
        pixels = np.asarray(image)
        for quality in qualities:
            jpeg = jpeg_bytes(image, quality)
            with Image.open(io.BytesIO(jpeg)) as decoded:
                target = ssim(pixels, np.asarray(decoded.convert("RGB")))
            low, high, best = 0, 100, None
            while low <= high:  # smallest WebP quality reaching the JPEG's SSIM
                mid = (low + high) // 2
                webp = webp_encode(pixels, quality=mid, method=method)
                score = ssim(pixels, webp_decode(webp))
                if score >= target:
                    best, high = (mid, len(webp), score), mid - 1
                else:
                    low = mid + 1
            if best is None:
                webp = webp_encode(pixels, quality=100, method=method)
                best = (100, len(webp), ssim(pixels, webp_decode(webp)))
            rows.append(
                {
                    "photo": name,
                    "size": f"{image.width}x{image.height}",
                    "jpeg_quality": quality,
                    "jpeg_bytes": len(jpeg),
                    "jpeg_ssim": target,
                    "webp_quality": best[0],
                    "webp_bytes": best[1],
                    "webp_ssim": best[2],
                    "saving": 1 - best[1] / len(jpeg),
                }
            )
    total_jpeg = sum(r["jpeg_bytes"] for r in rows)
    total_webp = sum(r["webp_bytes"] for r in rows)
    return {
        "method": method,
        "rows": rows,
        "total_saving": 1 - total_webp / total_jpeg,
        "median_saving": statistics.median(r["saving"] for r in rows),
    }


def feature_payload(users: int) -> bytes:
    """A feature-lookup answer: per user, 30 days of behaviour and an embedding."""
    rng = np.random.default_rng(7)
    categories = ["shoes", "phones", "books", "toys", "garden", "beauty", "sports", "food"]
    countries = ["de", "fr", "sg", "my", "th", "gb", "es", "it"]
    document = {
        "model": "ranker-v12",
        "generated_at": "2026-12-02T10:00:00Z",
        "users": [
            {
                "user_id": int(1_000_000 + i),
                "country": countries[i % len(countries)],
                "home_region": "eu-west" if i % 3 else "ap-southeast",
                "clicks_30d": rng.poisson(3, 30).tolist(),
                "purchases_30d": rng.poisson(0.2, 30).tolist(),
                "top_categories": [
                    categories[j] for j in rng.choice(len(categories), 3, replace=False)
                ],
                "avg_basket_eur": round(float(rng.gamma(2.0, 20.0)), 2),
                "embedding": np.round(rng.standard_normal(32), 4).tolist(),
                "last_seen": f"2026-12-0{1 + i % 2}T{i % 24:02d}:{i % 60:02d}:00Z",
            }
            for i in range(users)
        ],
    }
    return json.dumps(document).encode()


def rate(func: Any, size: int, minimum_s: float) -> tuple[Any, float]:
    runs, start, result = 0, time.perf_counter(), None
    while True:
        result = func()
        runs += 1
        elapsed = time.perf_counter() - start
        if elapsed >= minimum_s:
            return result, runs * size / elapsed / 1e6


def bench_brotli(
    payload: bytes, levels: list[int], gzip_levels: list[int], minimum_s: float
) -> dict[str, Any]:
    rows = []
    for level in levels:
        packed, comp = rate(
            lambda lv=level: brotli_compress(payload, quality=lv, text=True),
            len(payload),
            minimum_s,
        )
        out, decomp = rate(lambda p=packed: brotli_decompress(p), len(payload), minimum_s)
        assert out == payload
        rows.append(
            {
                "codec": "brotli",
                "level": level,
                "ratio": len(payload) / len(packed),
                "bytes": len(packed),
                "compress_mb_s": comp,
                "decompress_mb_s": decomp,
            }
        )
    for level in gzip_levels:
        packed, comp = rate(
            lambda lv=level: gzip.compress(payload, compresslevel=lv, mtime=0),
            len(payload),
            minimum_s,
        )
        out, decomp = rate(lambda p=packed: gzip.decompress(p), len(payload), minimum_s)
        assert out == payload
        rows.append(
            {
                "codec": "gzip",
                "level": level,
                "ratio": len(payload) / len(packed),
                "bytes": len(packed),
                "compress_mb_s": comp,
                "decompress_mb_s": decomp,
            }
        )
    for row in rows:
        # Latency model: compress + transfer + decompress, at two link speeds.
        for mbit in (10, 100):
            row[f"total_ms_{mbit}mbit"] = 1e3 * (
                len(payload) / 1e6 / row["compress_mb_s"]
                + row["bytes"] * 8 / (mbit * 1e6)
                + len(payload) / 1e6 / row["decompress_mb_s"]
            )
    return {"payload_bytes": len(payload), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny run that only checks it works")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON results")
    args = parser.parse_args(argv)
    smoke = args.smoke
    names = PHOTOS[:1] if smoke else PHOTOS
    photos = {name: load_photo(name) for name in names}
    jpegs = [hd_jpeg(photos[name]) for name in names]
    cores = len(os.sched_getaffinity(0))
    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {cores} cores, Python {platform.python_version()}",
        "smoke": smoke,
        "hd_jpeg_bytes": [len(j) for j in jpegs],
    }

    print(f"(a) 1920x1080 JPEG -> imagenet-224 float32, one core ({len(jpegs)} photos)")
    a = bench_tensors(
        jpegs,
        rounds=1 if smoke else 5,
        repeat=1 if smoke else 4,
        pool_workers=0 if smoke else cores,
    )
    results["tensors"] = a
    print(f"    straightforward Pillow path          {a['baseline_images_per_s']:7.1f} images/s")
    for label, rate_key, speed_key, parity_key in (
        ("edgefeed fast path (reducing_gap=2)", "fast_images_per_s", "speedup", "parity_gap2"),
        ("edgefeed fast path (reducing_gap=1)", "gap1_images_per_s", "speedup_gap1", "parity_gap1"),
    ):
        parity = a[parity_key]
        print(
            f"    {label}  {a[rate_key]:7.1f} images/s  {a[speed_key]:.2f}x (target >= 3x); "
            f"vs full decode: mean {parity['mean']:.2f}, p99 {parity['p99']:.1f}, "
            f"max {parity['max']:.0f} grey levels"
        )
    if "pool_images_per_s" in a:
        print(f"    PreprocessPool({a['pool_workers']})   {a['pool_images_per_s']:8.1f} images/s")

    print("(b) WebP vs JPEG (optimize=True) at matched SSIM, real photos at native size")
    b = bench_webp(photos, [85] if smoke else [60, 75, 85, 95], method=4)
    results["webp"] = b
    print(
        f"    {'photo':<20} {'jpeg q':>6} {'jpeg B':>8} {'SSIM':>7} "
        f"{'webp q':>6} {'webp B':>8} {'SSIM':>7} {'saving':>7}"
    )
    for r in b["rows"]:
        print(
            f"    {r['photo']:<20} {r['jpeg_quality']:>6} {r['jpeg_bytes']:>8} "
            f"{r['jpeg_ssim']:>7.4f} {r['webp_quality']:>6} {r['webp_bytes']:>8} "
            f"{r['webp_ssim']:>7.4f} {r['saving']:>7.1%}"
        )
    print(
        f"    WebP saving at equal SSIM: total {b['total_saving']:.1%}, "
        f"median {b['median_saving']:.1%} (target >= 25%)"
    )

    payload = feature_payload(50 if smoke else 2000)
    print(f"(c) Brotli vs gzip on a {len(payload) / 1e6:.2f} MB JSON feature payload")
    c = bench_brotli(
        payload,
        [4] if smoke else [0, 1, 3, 4, 5, 6, 9, 11],
        [6] if smoke else [1, 6, 9],
        minimum_s=0.01 if smoke else 0.3,
    )
    results["brotli"] = c
    print(
        f"    {'codec':<7} {'level':>5} {'ratio':>6} {'bytes':>9} "
        f"{'comp MB/s':>10} {'decomp MB/s':>12} {'ms @10Mbit/s':>13} {'ms @100Mbit/s':>14}"
    )
    for r in c["rows"]:
        print(
            f"    {r['codec']:<7} {r['level']:>5} {r['ratio']:>6.2f} {r['bytes']:>9} "
            f"{r['compress_mb_s']:>10.1f} {r['decompress_mb_s']:>12.1f} "
            f"{r['total_ms_10mbit']:>13.1f} {r['total_ms_100mbit']:>14.1f}"
        )

    print("(d) bytes on the wire per 1920x1080 frame (envelope included), mean over the photos")
    sizes: dict[str, float] = {
        "raw RGB frame": 1920 * 1080 * 3,
        "JPEG q90 frame": statistics.mean(len(j) for j in jpegs),
    }
    for name in ("imagenet-224", "imagenet-224-fp16", "imagenet-224-uint8", "webp-720"):
        sizes[name] = statistics.mean(len(encode_image(j, get_profile(name))) for j in jpegs)
    results["payload_bytes"] = sizes
    for name, size in sizes.items():
        print(f"    {name:<20} {size:>10.0f} bytes")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
