"""Free ports for stacks started beside others: a stack's settings draw a dozen one at
a time before any is bound, so one process must never be given the same port twice."""

from __future__ import annotations

import random
import socket

import pytest

from edgefeed.devstack import ports
from edgefeed.devstack.ports import free_port, free_ports


def test_a_port_is_never_given_twice_even_when_the_draws_repeat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The draws repeat one port (what independent draws from 12,000 ports do, by
    # chance, in ~1% of a stack's settings): the second call must not return it.
    draws = iter([24001, 24001, 24001, 24002, 24001, 24002, 24003])
    monkeypatch.setattr(ports, "_GIVEN", set())
    monkeypatch.setattr(random.Random, "randrange", lambda _self, _a, _b: next(draws))
    assert [free_port(), free_port(), *free_ports(1)] == [24001, 24002, 24003]


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    found = free_ports(20) + [free_port() for _ in range(20)]
    assert len(set(found)) == len(found)
    for port in found:
        assert 20000 <= port < 32000
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
