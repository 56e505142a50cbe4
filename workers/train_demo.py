"""Make the demo weights: train both built-in models briefly on generated data.

    python -m workers.train_demo            # writes workers/models/weights/*.pt

Takes about a minute on two CPU cores; the results (held-out accuracy and AUC)
are stored in each checkpoint's ``metrics`` and printed.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from workers.models.classifier import ClassifierConfig, ImageClassifierNet
from workers.models.loading import WEIGHTS_DIR, save_checkpoint
from workers.models.ranking import RankerConfig, RankingNet
from workers.synthetic import SHAPE_CLASSES, click_world, shape_images

__all__ = [
    "SHOP_RANKER",
    "auc",
    "classifier_accuracy",
    "main",
    "train_classifier",
    "train_ranker",
]

SHOP_RANKER = RankerConfig(
    user_features=(
        "views_30m",
        "clicks_30m",
        "carts_1h",
        "purchases_today",
        "spend_today",
        "distinct_items_1h",
    ),
    item_features=("price", "views_1h", "purchases_1h"),
    user_entity="user",
    item_entity="item",
)
HELD_OUT_SEED = 10_001  # the test/benchmark held-out sets use this seed, never seen in training


def classifier_accuracy(module: nn.Module, images: np.ndarray, labels: np.ndarray) -> float:
    """Top-1 accuracy of ``module`` on uint8 NHWC ``images``."""
    with torch.inference_mode():
        logits = module(torch.from_numpy(images))
    return float((logits.argmax(1).numpy() == labels).mean())


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (rank statistic; ties get the average rank)."""
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores), dtype=np.float64)
    ranks[order] = np.arange(1, len(scores) + 1)
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    ranks = (sums / counts)[inverse]
    positives = labels > 0.5
    n_pos, n_neg = int(positives.sum()), int((~positives).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def train_classifier(
    config: ClassifierConfig, *, samples: int = 4000, epochs: int = 3, seed: int = 0
) -> tuple[ImageClassifierNet, dict[str, float]]:
    """Train an :class:`ImageClassifierNet` on generated shapes; return it and held-out accuracy."""
    torch.manual_seed(seed)
    images, labels = shape_images(samples, config.image_size, seed=seed)
    held_images, held_labels = shape_images(1000, config.image_size, seed=HELD_OUT_SEED)
    module = ImageClassifierNet(config)
    optimizer = torch.optim.Adam(module.parameters(), lr=3e-3)
    x, y = torch.from_numpy(images), torch.from_numpy(labels)
    for _ in range(epochs):
        module.train()
        for batch in torch.randperm(samples).split(64):  # type: ignore[no-untyped-call]
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(module(x[batch]), y[batch])
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
    module.eval()
    return module, {"held_out_accuracy": classifier_accuracy(module, held_images, held_labels)}


def train_ranker(
    config: RankerConfig, *, samples: int = 40_000, epochs: int = 4, seed: int = 0
) -> tuple[RankingNet, dict[str, float]]:
    """Train a :class:`RankingNet` on generated clicks; return it and held-out AUC."""
    torch.manual_seed(seed)
    n_user, n_item = len(config.user_features), len(config.item_features)
    world = click_world(dims=max(n_user, n_item), seed=0)
    users, items, clicked = world.pairs(samples, seed=seed)
    held_users, held_items, held_clicked = world.pairs(10_000, seed=HELD_OUT_SEED)
    module = RankingNet(config)
    optimizer = torch.optim.Adam(module.parameters(), lr=3e-3)
    uf = torch.from_numpy(world.user_features[:, :n_user].copy())
    itf = torch.from_numpy(world.item_features[:, :n_item].copy())
    u, i, c = torch.from_numpy(users), torch.from_numpy(items), torch.from_numpy(clicked)
    for _ in range(epochs):
        module.train()
        for batch in torch.randperm(samples).split(256):  # type: ignore[no-untyped-call]
            optimizer.zero_grad()
            probs = module(uf[u[batch]], itf[i[batch]]).clamp(1e-6, 1 - 1e-6)
            loss = nn.functional.binary_cross_entropy(probs, c[batch])
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
    module.eval()
    with torch.inference_mode():
        scores = module(uf[torch.from_numpy(held_users)], itf[torch.from_numpy(held_items)])
    return module, {"held_out_auc": auc(scores.numpy(), held_clicked)}


def main(argv: list[str] | None = None) -> None:
    """Train both demo models and write their checkpoints."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=WEIGHTS_DIR)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(min(2, torch.get_num_threads()))

    start = time.perf_counter()
    classifier_config = ClassifierConfig(num_classes=len(SHAPE_CLASSES))
    classifier, metrics = train_classifier(classifier_config, seed=args.seed)
    save_checkpoint(
        args.out / "image_classifier.pt",
        "image-classifier",
        classifier_config,
        classifier,
        labels=SHAPE_CLASSES,
        version="demo-1",
        metrics=metrics,
    )
    print(f"image-classifier: {metrics} ({time.perf_counter() - start:.1f} s)")

    start = time.perf_counter()
    ranker_config = RankerConfig()
    ranker, metrics = train_ranker(ranker_config, seed=args.seed)
    save_checkpoint(
        args.out / "ranker.pt", "ranker", ranker_config, ranker, version="demo-1", metrics=metrics
    )
    print(f"ranker: {metrics} ({time.perf_counter() - start:.1f} s)")

    # The same architecture over the demo shop's live features (examples/edgefeed.yaml),
    # so `make demo` can rank with what the pipeline writes. Trained on generated data:
    # it shows the serving path and its latency budget, not a recommender's quality.
    start = time.perf_counter()
    shop_config = SHOP_RANKER
    shop, metrics = train_ranker(shop_config, seed=args.seed)
    save_checkpoint(
        args.out / "shop_ranker.pt",
        "ranker",
        shop_config,
        shop,
        version="demo-1",
        metrics=metrics,
    )
    print(f"shop ranker: {metrics} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
