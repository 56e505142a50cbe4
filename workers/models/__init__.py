"""Models the workers serve: an image classifier, a ranking model, user modules."""

from __future__ import annotations

from workers.models.base import Prepared, ServedModel
from workers.models.classifier import (
    ClassifierConfig,
    ImageClassifier,
    ImageClassifierNet,
    TensorModel,
)
from workers.models.loading import (
    BUILTIN_MODELS,
    load_checkpoint,
    load_module_file,
    load_served_model,
    save_checkpoint,
)
from workers.models.ranking import Ranker, RankerConfig, RankingNet, RankRequest

__all__ = [
    "BUILTIN_MODELS",
    "ClassifierConfig",
    "ImageClassifier",
    "ImageClassifierNet",
    "Prepared",
    "RankRequest",
    "Ranker",
    "RankerConfig",
    "RankingNet",
    "ServedModel",
    "TensorModel",
    "load_checkpoint",
    "load_module_file",
    "load_served_model",
    "save_checkpoint",
]
