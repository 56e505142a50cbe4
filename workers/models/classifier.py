"""The image classifier: uint8 NHWC pixels in (as the preprocess envelope carries them),
normalization fused into the forward pass on the device, class scores out."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from workers.exceptions import InvalidTensorError
from workers.inputs import InputSpec, decode_array, decodes_inline
from workers.models.base import Prepared, ServedModel, require_finite
from workers.models.config import PlainConfig

__all__ = ["ClassifierConfig", "ImageClassifier", "ImageClassifierNet", "TensorModel"]


@dataclass(frozen=True, slots=True)
class ClassifierConfig(PlainConfig):
    """Architecture of :class:`ImageClassifierNet`.

    Attributes:
        num_classes: Output classes.
        image_size: Height and width of the (square) input, in pixels.
        channels: Output channels of each conv stage (3x3 conv, ReLU, 2x2 max-pool).
        hidden: Widths of the dense head after global average pooling.
        mean: Per-channel pixel mean on a 0-1 scale (RGB).
        std: Per-channel pixel standard deviation on a 0-1 scale.
    """

    num_classes: int = 6
    image_size: int = 32
    channels: tuple[int, ...] = (16, 32, 64)
    hidden: tuple[int, ...] = (128,)
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.25, 0.25, 0.25)


class ImageClassifierNet(nn.Module):
    """Small CNN with a dense head; takes uint8 ``(N, H, W, 3)`` pixels.

    Casting to the compute dtype, scaling to 0-1 and normalizing happen inside
    ``forward``, i.e. on the device: the host sends 1 byte per pixel, not 4.
    """

    def __init__(self, config: ClassifierConfig) -> None:
        super().__init__()
        self.config = config
        scale = torch.tensor(config.std).view(1, 3, 1, 1) * 255.0
        self.register_buffer("pixel_mean", torch.tensor(config.mean).view(1, 3, 1, 1) * 255.0)
        self.register_buffer("pixel_scale", 1.0 / scale)
        layers: list[nn.Module] = []
        in_channels = 3
        for out_channels in config.channels:
            layers += [
                nn.Conv2d(in_channels, out_channels, 3, padding=1),
                nn.ReLU(),
                nn.MaxPool2d(2),
            ]
            in_channels = out_channels
        self.features = nn.Sequential(*layers)
        head: list[nn.Module] = []
        width = in_channels
        for hidden in config.hidden:
            head += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        head.append(nn.Linear(width, config.num_classes))
        self.head = nn.Sequential(*head)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        mean = cast(torch.Tensor, self.pixel_mean)
        scale = cast(torch.Tensor, self.pixel_scale)
        x = images.permute(0, 3, 1, 2).to(mean.dtype)
        x = (x - mean) * scale
        x = self.features(x)
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)
        out: torch.Tensor = self.head(x)
        return out


class TensorModel(ServedModel):
    """Any module taking one tensor of fixed per-row shape and dtype.

    Requests carry one array of shape ``row_shape`` (one row) or ``(n, *row_shape)``;
    the answer holds the raw output rows. Used for user-supplied TorchScript or
    ``torch.export`` models.
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        row_shape: Sequence[int],
        dtype: str,
        version: str = "1",
    ) -> None:
        self.name = name
        self.module = module
        self.row_shape = tuple(int(dim) for dim in row_shape)
        self.dtype = np.dtype(dtype)
        self.version = version
        self._dtype_hint = ""

    def _rows_of(self, array: np.ndarray, max_rows: int) -> np.ndarray:
        if array.dtype != self.dtype:
            raise InvalidTensorError(
                f"model {self.name!r} takes dtype {self.dtype.name}, got {array.dtype.name}; "
                f"send {self.dtype.name}{self._dtype_hint}"
            )
        if array.shape == self.row_shape:
            array = array[np.newaxis]
        if array.ndim != len(self.row_shape) + 1 or array.shape[1:] != self.row_shape:
            shape = ",".join(str(dim) for dim in self.row_shape)
            raise InvalidTensorError(
                f"model {self.name!r} takes shape ({shape}) or (n,{shape}), got "
                f"{tuple(array.shape)}"
            )
        if not 1 <= array.shape[0] <= max_rows:
            raise InvalidTensorError(
                f"request holds {array.shape[0]} rows; this worker takes 1 to {max_rows} "
                "per request (split it)"
            )
        return array

    async def parse(
        self,
        body: bytes,
        content_type: str | None,
        headers: Mapping[str, str],
        *,
        max_rows: int,
        max_bytes: int | None = None,
    ) -> Prepared:
        spec = InputSpec(self.row_shape, self.dtype.name, max_rows, self.name)
        if decodes_inline(body, content_type):  # a small plain tensor: cheaper than a hop
            array = decode_array(body, content_type, headers, max_bytes=max_bytes, spec=spec)
        else:
            # Decoding (Brotli, WebP, a large .npy) runs in a thread: the event loop
            # keeps answering other requests while the body is decoded.
            array = await asyncio.to_thread(
                decode_array, body, content_type, dict(headers), max_bytes=max_bytes, spec=spec
            )
        rows = self._rows_of(array, max_rows)
        return Prepared(inputs=(np.ascontiguousarray(rows),), rows=int(rows.shape[0]))

    def example_rows(self, rows: int) -> tuple[np.ndarray, ...]:
        return (np.zeros((rows, *self.row_shape), dtype=self.dtype),)

    def render(self, prepared: Prepared, output: np.ndarray) -> dict[str, Any]:
        require_finite(self.name, output)
        return {"model": self.name, "version": self.version, "outputs": output.tolist()}

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "input": {"shape": ["n", *self.row_shape], "dtype": self.dtype.name},
        }


class ImageClassifier(TensorModel):
    """Serves an image classifier: uint8 ``(H, W, 3)`` or ``(n, H, W, 3)`` in, top-k classes out.

    Args:
        name: Model name.
        module: Takes uint8 NHWC, returns logits ``(n, classes)``.
        labels: Class names, index-aligned with the logits.
        image_size: Expected height and width.
        top_k: Classes listed per image in the answer.
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        labels: Sequence[str],
        image_size: int,
        version: str = "1",
        top_k: int = 3,
    ) -> None:
        super().__init__(name, module, (image_size, image_size, 3), "uint8", version)
        self.labels = list(labels)
        self.top_k = top_k
        self._dtype_hint = (
            " pixels (use a uint8 preprocess profile: normalization runs on the device)"
        )

    def render(self, prepared: Prepared, output: np.ndarray) -> dict[str, Any]:
        require_finite(self.name, output)
        shifted = output - output.max(axis=1, keepdims=True)
        probs = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
        k = min(self.top_k, output.shape[1])
        predictions = []
        for row_logits, row_probs in zip(output, probs, strict=True):
            order = np.argsort(-row_probs)[:k]
            predictions.append(
                {
                    "top": [
                        {
                            "index": int(i),
                            "label": self._label(int(i)),
                            "score": float(row_probs[i]),
                        }
                        for i in order
                    ],
                    "logits": row_logits.tolist(),
                }
            )
        return {"model": self.name, "version": self.version, "predictions": predictions}

    def _label(self, index: int) -> str:
        return self.labels[index] if index < len(self.labels) else str(index)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "labels": self.labels}
