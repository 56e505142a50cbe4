"""Models load from local files: demo checkpoints, state_dicts, TorchScript, torch.export."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from workers.batcher import BatchingConfig
from workers.client import WorkerClient
from workers.exceptions import ModelLoadError, UnknownModelError, WorkerConfigError
from workers.models import (
    ClassifierConfig,
    ImageClassifier,
    ImageClassifierNet,
    TensorModel,
    load_served_model,
    save_checkpoint,
)
from workers.models.loading import BUILTIN_MODELS, WEIGHTS_DIR, load_checkpoint
from workers.server import InferenceServer
from workers.synthetic import SHAPE_CLASSES


def test_shipped_demo_weights_are_small_trained_checkpoints() -> None:
    for name, (arch, filename) in BUILTIN_MODELS.items():
        path = WEIGHTS_DIR / filename
        assert path.stat().st_size < 2 * 1024 * 1024, name
        checkpoint = load_checkpoint(path)
        assert checkpoint["arch"] == arch
        assert checkpoint["metrics"], f"{name} checkpoint records no held-out metric"
    classifier = load_served_model("image-classifier")
    assert isinstance(classifier, ImageClassifier)
    assert classifier.labels == list(SHAPE_CLASSES)
    accuracy = load_checkpoint(WEIGHTS_DIR / "image_classifier.pt")["metrics"]
    assert accuracy["held_out_accuracy"] > 0.85


def test_unknown_model_and_missing_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError, match="'bert' is not built in"):
        load_served_model("bert")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_served_model("image-classifier", weights=tmp_path / "nope.pt")
    with pytest.raises(WorkerConfigError, match="give it a feature source"):
        load_served_model("ranker")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_served_model("image-classifier", weights=tmp_path / "junk.pt")


def test_bare_state_dict_of_the_wrong_architecture_is_refused(tmp_path: Path) -> None:
    torch.save(torch.nn.Linear(3, 3).state_dict(), tmp_path / "linear.pt")
    with pytest.raises(ModelLoadError, match="does not fit architecture 'image-classifier'"):
        load_served_model("image-classifier", weights=tmp_path / "linear.pt")


def test_own_checkpoint_and_bare_state_dict_load(tmp_path: Path) -> None:
    torch.manual_seed(1)
    config = ClassifierConfig(num_classes=3, hidden=(16,))
    net = ImageClassifierNet(config).eval()
    save_checkpoint(
        tmp_path / "mine.pt", "image-classifier", config, net, labels=["a", "b", "c"], version="v7"
    )
    model = load_served_model("image-classifier", weights=tmp_path / "mine.pt")
    assert isinstance(model, ImageClassifier)
    assert (model.labels, model.version) == (["a", "b", "c"], "v7")
    torch.save(ImageClassifierNet(ClassifierConfig()).state_dict(), tmp_path / "bare.pt")
    assert load_served_model("image-classifier", weights=tmp_path / "bare.pt").version == "bare"


def _affine() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh()).eval()


async def _serve_rows(model: TensorModel, rows: np.ndarray) -> np.ndarray:
    batching = BatchingConfig(max_batch_size=4)
    async with (
        InferenceServer([model], batching=batching) as server,
        WorkerClient(server.url) as client,
    ):
        answer = await client.classify(model.name, rows)
    return np.array(answer.body["outputs"])


async def test_torch_export_file_is_served_as_a_tensor_model(tmp_path: Path) -> None:
    module = _affine()
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(module, (torch.zeros(2, 5),), dynamic_shapes=({0: batch},))
    torch.export.save(program, tmp_path / "affine.pt2")
    model = load_served_model("affine", model_file=tmp_path / "affine.pt2", input_shape=(5,))
    rows = np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32)
    served = await _serve_rows(model, rows)
    with torch.inference_mode():
        np.testing.assert_allclose(served, module(torch.from_numpy(rows)).numpy(), atol=1e-6)


async def test_torchscript_file_is_served_as_a_tensor_model(tmp_path: Path) -> None:
    module = _affine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.trace(module, torch.zeros(1, 5)), str(tmp_path / "affine.pt"))
    model = load_served_model("affine", model_file=tmp_path / "affine.pt", input_shape=(5,))
    rows = np.ones((2, 5), np.float32)
    served = await _serve_rows(model, rows)
    with torch.inference_mode():
        np.testing.assert_allclose(served, module(torch.from_numpy(rows)).numpy(), atol=1e-6)


def test_model_file_needs_its_input_shape(tmp_path: Path) -> None:
    program = torch.export.export(_affine(), (torch.zeros(1, 5),))
    torch.export.save(program, tmp_path / "affine.pt2")
    with pytest.raises(WorkerConfigError, match="--input-shape"):
        load_served_model("affine", model_file=tmp_path / "affine.pt2")
    with pytest.raises(WorkerConfigError, match="must be \\(size, size, 3\\)"):
        load_served_model(
            "affine", model_file=tmp_path / "affine.pt2", kind="classifier", input_shape=(5,)
        )
