"""Loading models from local files: the built-in demo checkpoints or a user's own model.

Three file kinds, none fetched from the network:

* an edgefeed checkpoint (``save_checkpoint``): architecture name, its config,
  the ``state_dict``, labels and version, loaded with ``weights_only=True``;
* a bare ``state_dict`` for a built-in architecture (its default config);
* a whole serialized module: ``torch.export`` (``.pt2``) or TorchScript
  (``.pt``/``.ts``/``.torchscript``), served as a tensor or classifier model.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from workers.exceptions import ModelLoadError, UnknownModelError, WorkerConfigError
from workers.features import FeatureSource
from workers.models.base import ServedModel
from workers.models.classifier import (
    ClassifierConfig,
    ImageClassifier,
    ImageClassifierNet,
    TensorModel,
)
from workers.models.ranking import Ranker, RankerConfig, RankingNet

__all__ = [
    "BUILTIN_MODELS",
    "CHECKPOINT_FORMAT",
    "WEIGHTS_DIR",
    "load_checkpoint",
    "load_module_file",
    "load_served_model",
    "save_checkpoint",
]

CHECKPOINT_FORMAT = "edgefeed.workers/v1"
WEIGHTS_DIR = Path(__file__).parent / "weights"
BUILTIN_MODELS: dict[str, tuple[str, str]] = {
    # name -> (architecture, shipped weights file)
    "image-classifier": ("image-classifier", "image_classifier.pt"),
    "ranker": ("ranker", "ranker.pt"),
}
ModelKind = Literal["classifier", "tensor"]


def save_checkpoint(
    path: str | Path,
    arch: str,
    config: ClassifierConfig | RankerConfig,
    module: nn.Module,
    *,
    labels: Sequence[str] = (),
    version: str = "1",
    metrics: dict[str, float] | None = None,
) -> None:
    """Write an edgefeed checkpoint that :func:`load_checkpoint` reads back."""
    torch.save(
        {
            "format": CHECKPOINT_FORMAT,
            "arch": arch,
            "config": config.to_dict(),
            "state_dict": module.state_dict(),
            "labels": list(labels),
            "version": version,
            "metrics": dict(metrics or {}),
        },
        Path(path),
    )


def load_checkpoint(path: str | Path, arch: str | None = None) -> dict[str, Any]:
    """Read a checkpoint (or a bare state_dict for ``arch``) without unpickling code.

    Raises:
        ModelLoadError: missing file, not a checkpoint, or an unknown architecture.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"weights file {str(path)!r} does not exist")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ModelLoadError(
            f"cannot read {str(path)!r} as tensors ({type(exc).__name__}: {exc}); a whole "
            "TorchScript or torch.export module goes in --model-file instead"
        ) from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{str(path)!r} holds a {type(raw).__name__}, not a state_dict")
    if raw.get("format") == CHECKPOINT_FORMAT:
        return raw
    if arch is None:
        raise ModelLoadError(
            f"{str(path)!r} is a bare state_dict; name its architecture "
            f"({', '.join(sorted(BUILTIN_MODELS))})"
        )
    config: ClassifierConfig | RankerConfig = (
        ClassifierConfig() if arch == "image-classifier" else RankerConfig()
    )
    return {
        "format": CHECKPOINT_FORMAT,
        "arch": arch,
        "config": config.to_dict(),
        "state_dict": raw,
        "labels": [],
        "version": path.stem,
        "metrics": {},
    }


def _build(checkpoint: dict[str, Any], path: Path) -> tuple[nn.Module, Any]:
    arch = checkpoint["arch"]
    if arch == "image-classifier":
        config: Any = ClassifierConfig.from_dict(checkpoint["config"])
        module: nn.Module = ImageClassifierNet(config)
    elif arch == "ranker":
        config = RankerConfig.from_dict(checkpoint["config"])
        module = RankingNet(config)
    else:
        raise ModelLoadError(f"{str(path)!r} has unknown architecture {arch!r}")
    try:
        module.load_state_dict(checkpoint["state_dict"], strict=True)
    except RuntimeError as exc:
        raise ModelLoadError(
            f"{str(path)!r} does not fit architecture {arch!r} with config "
            f"{checkpoint['config']}: {exc}"
        ) from None
    return module.eval(), config


def load_module_file(path: str | Path) -> nn.Module:
    """Load a whole module: ``.pt2`` via ``torch.export.load``, else TorchScript.

    Raises:
        ModelLoadError: missing or unreadable file.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file {str(path)!r} does not exist")
    try:
        if path.suffix == ".pt2":
            loaded: nn.Module = torch.export.load(path).module()
            return loaded
        # TorchScript is deprecated upstream in favour of torch.export but many
        # users still have .pt TorchScript files; loading them is still supported.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            scripted: nn.Module = torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call]
        return scripted.eval()
    except Exception as exc:
        raise ModelLoadError(
            f"cannot load {str(path)!r} as torch.export (.pt2) or TorchScript: "
            f"{type(exc).__name__}: {exc}"
        ) from None


def load_served_model(
    name: str,
    *,
    weights: str | Path | None = None,
    features: FeatureSource | Callable[[RankerConfig], FeatureSource] | None = None,
    model_file: str | Path | None = None,
    kind: ModelKind = "tensor",
    input_shape: Sequence[int] = (),
    input_dtype: str = "float32",
    labels: Sequence[str] = (),
) -> ServedModel:
    """Build the :class:`ServedModel` called ``name``.

    Args:
        name: A built-in model (``image-classifier``, ``ranker``) or, with
            ``model_file``, any name.
        weights: Checkpoint or bare state_dict replacing the shipped demo weights.
        features: Feature source of the ranker, or a factory called with the
            ranker's config (so the source can be built for its entities).
        model_file: A user's TorchScript / torch.export module.
        kind: For ``model_file``: ``classifier`` (uint8 NHWC in, logits out) or
            ``tensor`` (raw tensor in and out).
        input_shape: For ``model_file``: per-row input shape (for ``classifier``
            ``(size, size, 3)``).
        input_dtype: For ``model_file`` of kind ``tensor``.
        labels: For classifiers: class names.

    Raises:
        UnknownModelError: ``name`` is not built in and no ``model_file`` is given.
        ModelLoadError: a file is missing or does not fit.
        WorkerConfigError: the ranker without a feature source, or a bad shape.
    """
    if model_file is not None:
        module = load_module_file(model_file)
        if not input_shape:
            raise WorkerConfigError("a --model-file needs its per-row --input-shape")
        if kind == "classifier":
            if len(input_shape) != 3 or input_shape[0] != input_shape[1] or input_shape[2] != 3:
                raise WorkerConfigError(
                    f"classifier input shape must be (size, size, 3), got {tuple(input_shape)}"
                )
            return ImageClassifier(
                name, module, labels, int(input_shape[0]), version=Path(model_file).stem
            )
        return TensorModel(name, module, input_shape, input_dtype, version=Path(model_file).stem)
    if name not in BUILTIN_MODELS:
        raise UnknownModelError(
            f"model {name!r} is not built in ({', '.join(sorted(BUILTIN_MODELS))}); "
            "serve your own with --model-file"
        )
    arch, filename = BUILTIN_MODELS[name]
    path = Path(weights) if weights is not None else WEIGHTS_DIR / filename
    if weights is None and not path.is_file():
        raise ModelLoadError(
            f"demo weights {str(path)!r} are missing; make them with `python -m workers.train_demo`"
        )
    checkpoint = load_checkpoint(path, arch)
    if checkpoint["arch"] != arch:
        raise ModelLoadError(f"{str(path)!r} holds a {checkpoint['arch']!r}, not a {arch!r}")
    module, config = _build(checkpoint, path)
    version = str(checkpoint.get("version", "1"))
    if arch == "image-classifier":
        return ImageClassifier(
            name, module, checkpoint.get("labels") or [], config.image_size, version=version
        )
    if features is None:
        raise WorkerConfigError(
            f"model {name!r} reads features from the edge cache; give it a feature source "
            "(edgefeed workers serve --region R)"
        )
    source = features if isinstance(features, FeatureSource) else features(config)
    return Ranker(name, module, config, source, version=version)
