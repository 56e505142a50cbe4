"""The WAN emulator's schedule: bandwidth, delay, jitter and order, on a fake clock."""

from __future__ import annotations

import itertools
import random

import pytest

from edgefeed.wan import DirectionSchedule, LinkParams, LinkSettingError, RateMeter, TokenBucket


def test_bucket_sends_a_burst_at_once_then_paces_at_the_rate() -> None:
    bucket = TokenBucket(rate=1000.0, burst=500.0)
    assert bucket.departure(500, now=0.0) == 0.0  # starts full
    assert bucket.departure(100, now=0.0) == pytest.approx(0.1)  # 100 bytes at 1000 B/s
    assert bucket.departure(100, now=0.0) == pytest.approx(0.2)  # queued behind the first


def test_bucket_refills_while_idle_but_not_beyond_its_burst() -> None:
    bucket = TokenBucket(rate=1000.0, burst=500.0)
    bucket.departure(500, now=0.0)
    assert bucket.departure(300, now=10.0) == 10.0  # refilled (capped at 500)
    assert bucket.departure(300, now=10.0) == pytest.approx(10.1)  # 200 left, 100 short


def test_chunks_arrive_one_way_delay_after_they_depart() -> None:
    schedule = DirectionSchedule(LinkParams(delay_ms=100.0))
    assert schedule.arrival(1, 1000, now=5.0) == pytest.approx(5.1)


def test_bandwidth_and_delay_add_up() -> None:
    # 8 Mbit/s = 1,000,000 B/s; a 64 KiB burst, then 1 MB more takes about a second.
    schedule = DirectionSchedule(LinkParams(delay_ms=50.0, bandwidth_mbit=8.0))
    first = schedule.arrival(1, 64 * 1024, now=0.0)
    second = schedule.arrival(1, 1_000_000, now=0.0)
    assert first == pytest.approx(0.05)
    assert second == pytest.approx(1.0 + 0.05)


def test_jitter_varies_arrivals_but_never_reorders_a_stream() -> None:
    schedule = DirectionSchedule(LinkParams(delay_ms=20.0, jitter_ms=15.0), rng=random.Random(7))
    arrivals = [schedule.arrival(1, 100, now=i * 0.001) for i in range(500)]
    assert arrivals == sorted(arrivals)
    gaps = {round(b - a, 6) for a, b in itertools.pairwise(arrivals)}
    assert len(gaps) > 10  # it does vary
    assert min(arrivals[i] - i * 0.001 for i in range(500)) >= 0.005 - 1e-9


def test_streams_are_ordered_independently() -> None:
    schedule = DirectionSchedule(LinkParams(delay_ms=100.0))
    schedule.arrival(1, 10, now=0.0)
    schedule.update(LinkParams(delay_ms=10.0))
    assert schedule.arrival(1, 10, now=0.0) == pytest.approx(0.1)  # behind stream 1's chunk
    assert schedule.arrival(2, 10, now=0.0) == pytest.approx(0.01)  # another connection


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"delay_ms": -1.0}, "delay_ms"),
        ({"jitter_ms": -5.0}, "jitter_ms"),
        ({"bandwidth_mbit": 0.0}, "bandwidth_mbit"),
    ],
)
def test_bad_settings_are_typed_errors_naming_the_value(
    values: dict[str, float], named: str
) -> None:
    with pytest.raises(LinkSettingError, match=named):
        LinkParams(**values)
    assert issubclass(LinkSettingError, ValueError)


def test_rate_meter_averages_the_last_whole_seconds_and_falls_to_zero_when_idle() -> None:
    meter = RateMeter(window_s=5)
    for second in range(100, 110):
        meter.add(1000, second + 0.5)
        meter.add(1000, second + 0.9)
    assert meter.rate(110.2) == 2000.0  # seconds 105..109, 2,000 B each
    assert meter.rate(112.0) == 1200.0  # 107..111: three busy seconds of five
    assert meter.rate(200.0) == 0.0  # a cut or idle link shows no traffic
    with pytest.raises(LinkSettingError, match="rate window 0"):
        RateMeter(window_s=0)
