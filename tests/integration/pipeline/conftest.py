"""Fixtures shared by the pipeline's integration modules."""

from __future__ import annotations

import pytest
import redis

from edgefeed.settings import EdgefeedSettings


@pytest.fixture(scope="module")
def empty_region_caches(stack_settings: EdgefeedSettings) -> None:
    """Empty the session's regional Redis servers once, before the module's first test.

    Other modules' pipelines leave their vectors there; a module that compares a
    whole cache with a recomputation (``verify``) asks for this so that it sees
    only its own vectors, whatever ran before it.
    """
    for region in stack_settings.regions:
        with redis.Redis.from_url(region.redis_url) as client:
            client.flushdb()
