"""Test doubles of the workers' tests (a module of its own: test files import it)."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable

import torch
from torch import nn

POISON = -1.0


class GatedDouble(nn.Module):
    """``y = 2x`` on rows of 4 floats; waits at the gate; fails on a row holding -1."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.in_forward = threading.Event()
        self.rows_run: list[int] = []
        self.values_run: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.in_forward.set()
        if not self.gate.wait(timeout=60):
            raise RuntimeError("test gate never opened")
        if bool((x == POISON).any()):
            raise RuntimeError("poison row in batch")
        self.rows_run.append(int(x.shape[0]))
        self.values_run.extend(float(v) for v in x[:, 0])
        return x * 2

    def hold(self) -> None:
        """Close the gate: the next forward pass blocks until :meth:`release`."""
        self.in_forward.clear()
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()


Eventually = Callable[[Callable[[], bool], str], Awaitable[None]]


def metric_value(exposition: str, name: str, **labels: str) -> float | None:
    """The value of sample ``name`` with ``labels`` in a Prometheus exposition text."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None
