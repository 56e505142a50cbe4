"""What the server needs from a model: parse a request, example rows, render a result."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from workers.exceptions import NonFiniteOutputError

if TYPE_CHECKING:
    from workers.featurelog import LogLayout

try:
    import torch
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "the model workers need PyTorch: pip install torch==2.13.0 'edgefeed[workers]'"
    ) from exc

__all__ = ["Prepared", "ServedModel", "require_finite"]


def require_finite(model: str, output: np.ndarray) -> None:
    """Refuse an output holding NaN or infinity, naming where the first one is.

    Raises:
        NonFiniteOutputError: the output holds a NaN or an infinity.
    """
    if output.dtype.kind not in "fc":
        return
    bad = ~np.isfinite(output)
    if not bad.any():
        return
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise NonFiniteOutputError(
        f"model {model!r} produced {output[where]} at output index {list(where)} "
        f"({int(bad.sum())} non-finite of {output.size} values); the model or its "
        "weights are broken for this input (JSON cannot carry NaN or infinity)"
    )


@dataclass(frozen=True, slots=True)
class Prepared:
    """One parsed request, ready to be batched.

    Attributes:
        inputs: The model's inputs, each with the same leading row count.
        rows: That row count (a request may carry several rows: images, items).
        meta: What :meth:`ServedModel.render` needs besides the outputs (ids).
    """

    inputs: tuple[np.ndarray, ...]
    rows: int
    meta: Any = field(default=None)


class ServedModel(ABC):
    """A model the inference server serves.

    Subclasses own the request format (:meth:`parse`, including T_data work
    such as feature lookup) and the response format (:meth:`render`); the
    runner and batcher stay generic: they concatenate rows, run ``module`` and
    split the output rows back per request.

    Attributes:
        name: The name requests address (``/v1/models/{name}/infer``).
        version: Model version, reported in every response (model consistency
            across regions is checked by comparing it).
        module: The fp32 CPU ``torch.nn.Module``; the runner moves and casts it.
        default_max_batch_size: Rows per forward pass when the worker's settings
            name none (``max_batch_size``); also the most rows one request may carry.
    """

    name: str
    version: str
    module: torch.nn.Module
    default_max_batch_size: ClassVar[int] = 32

    @abstractmethod
    async def parse(
        self,
        body: bytes,
        content_type: str | None,
        headers: Mapping[str, str],
        *,
        max_rows: int,
        max_bytes: int | None = None,
    ) -> Prepared:
        """Decode and validate one request (and fetch its features).

        Raises:
            BadRequestError: or a subclass; the message names the bad value.
        """

    @abstractmethod
    def example_rows(self, rows: int) -> tuple[np.ndarray, ...]:
        """Valid inputs of ``rows`` rows, for warm-up."""

    @abstractmethod
    def render(self, prepared: Prepared, output: np.ndarray) -> dict[str, Any]:
        """The JSON body answering ``prepared``, given its output rows."""

    def describe(self) -> dict[str, Any]:
        """Metadata for ``GET /v1/models``."""
        return {"name": self.name, "version": self.version, "kind": type(self).__name__}

    def log_layout(self) -> LogLayout | None:
        """What a feature log of this model holds (None: it reads no features, no log)."""
        return None

    async def aclose(self) -> None:  # noqa: B027 - optional hook, most models hold nothing
        """Release what :meth:`parse` uses (feature connections)."""
