"""The latency lab's models: a teacher ranker and a student distilled from it.

    python -m workers.distill        # writes workers/models/weights/lab_{teacher,student}.pt

The data is synthetic: the generated click world of :mod:`workers.synthetic`
(users and items with noisy feature vectors, clicks drawn from latent tastes),
seen through as many features as the lab's SQL query and edge cache serve
(six per user, three per item). The teacher is a wide ranker trained on the
clicks; the student, about 1/40 of its size, is trained on the teacher's
scores of many more pairs than the labelled ones (soft targets) plus the
clicks it has. The student is served int8 (dynamic quantization of its
``Linear`` layers, the worker runtime's ``precision="int8"``); the numbers of
teacher fp32, student fp32 and student int8 on held-out pairs are stored in
each checkpoint's ``metrics`` and printed. Takes about a minute on two cores.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from workers.models.loading import WEIGHTS_DIR, save_checkpoint
from workers.models.ranking import RankerConfig, RankingNet
from workers.runtime import quantize_int8
from workers.synthetic import ClickWorld, click_world
from workers.train_demo import HELD_OUT_SEED, auc

__all__ = [
    "LAB_STUDENT",
    "LAB_TEACHER",
    "STUDENT_FILE",
    "TEACHER_FILE",
    "distill_student",
    "evaluate",
    "lab_world",
    "main",
    "train_teacher",
]

LAB_USER_FEATURES = (
    "views_30m",
    "clicks_30m",
    "carts_30m",
    "purchases_30m",
    "spend_30m",
    "distinct_items_30m",
)
LAB_ITEM_FEATURES = ("price", "views_30m", "purchases_30m")
LAB_TEACHER = RankerConfig(
    user_features=LAB_USER_FEATURES,
    item_features=LAB_ITEM_FEATURES,
    user_entity="lab_user",
    item_entity="lab_item",
    tower=128,
    hidden=(512, 256),
)
LAB_STUDENT = RankerConfig(
    user_features=LAB_USER_FEATURES,
    item_features=LAB_ITEM_FEATURES,
    user_entity="lab_user",
    item_entity="lab_item",
    tower=16,
    hidden=(32,),
)
TEACHER_FILE = "lab_teacher.pt"
STUDENT_FILE = "lab_student.pt"


def lab_world() -> ClickWorld:
    """The generated click world the lab's models learn (six feature columns)."""
    return click_world(dims=len(LAB_USER_FEATURES), seed=0)


def _inputs(
    world: ClickWorld, config: RankerConfig, users: np.ndarray, items: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    uf = world.user_features[:, : len(config.user_features)]
    itf = world.item_features[:, : len(config.item_features)]
    return torch.from_numpy(np.ascontiguousarray(uf[users])), torch.from_numpy(
        np.ascontiguousarray(itf[items])
    )


def evaluate(module: nn.Module, config: RankerConfig, world: ClickWorld) -> dict[str, float]:
    """Held-out AUC and accuracy (click predicted when p > 0.5), both in percent."""
    users, items, clicked = world.pairs(20_000, seed=HELD_OUT_SEED)
    with torch.inference_mode():
        scores = module(*_inputs(world, config, users, items)).numpy()
    return {
        "auc": round(100.0 * auc(scores, clicked), 2),
        "accuracy": round(100.0 * float(((scores > 0.5) == (clicked > 0.5)).mean()), 2),
    }


def _fit(
    module: nn.Module,
    inputs: tuple[torch.Tensor, torch.Tensor],
    targets: torch.Tensor,
    *,
    epochs: int,
    lr: float = 2e-3,
    batch: int = 512,
) -> None:
    optimizer = torch.optim.Adam(module.parameters(), lr=lr)
    users, items = inputs
    for _ in range(epochs):
        module.train()
        for rows in torch.randperm(len(targets)).split(batch):  # type: ignore[no-untyped-call]
            optimizer.zero_grad()
            probs = module(users[rows], items[rows]).clamp(1e-6, 1 - 1e-6)
            loss = nn.functional.binary_cross_entropy(probs, targets[rows])
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
    module.eval()


def train_teacher(
    world: ClickWorld, *, samples: int = 60_000, epochs: int = 4, seed: int = 0
) -> RankingNet:
    """The teacher: :data:`LAB_TEACHER` trained on ``samples`` labelled clicks."""
    torch.manual_seed(seed)
    users, items, clicked = world.pairs(samples, seed=seed)
    module = RankingNet(LAB_TEACHER)
    _fit(
        module, _inputs(world, LAB_TEACHER, users, items), torch.from_numpy(clicked), epochs=epochs
    )
    return module


def distill_student(
    teacher: nn.Module,
    world: ClickWorld,
    *,
    samples: int = 120_000,
    epochs: int = 4,
    hard_weight: float = 0.2,
    seed: int = 0,
) -> RankingNet:
    """The student: :data:`LAB_STUDENT` fitted to the teacher's scores of ``samples``
    pairs, blended with the clicks (``hard_weight`` of the target)."""
    torch.manual_seed(seed + 1)
    users, items, clicked = world.pairs(samples, seed=seed + 1)
    inputs = _inputs(world, LAB_TEACHER, users, items)
    with torch.inference_mode():
        soft = teacher(*inputs)
    targets = (1.0 - hard_weight) * soft + hard_weight * torch.from_numpy(clicked)
    module = RankingNet(LAB_STUDENT)
    _fit(module, inputs, targets.clone(), epochs=epochs)
    return module


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Train the teacher, distil the student, write both checkpoints; return the metrics."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=WEIGHTS_DIR)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    world = lab_world()

    start = time.perf_counter()
    teacher = train_teacher(world, seed=args.seed)
    student = distill_student(teacher, world, seed=args.seed)
    metrics = {
        "teacher_fp32": evaluate(teacher, LAB_TEACHER, world),
        "student_fp32": evaluate(student, LAB_STUDENT, world),
        "student_int8": evaluate(quantize_int8(student), LAB_STUDENT, world),
    }
    flat = {f"{model}_{name}": value for model, m in metrics.items() for name, value in m.items()}
    save_checkpoint(
        args.out / TEACHER_FILE, "ranker", LAB_TEACHER, teacher, version="lab-1", metrics=flat
    )
    save_checkpoint(
        args.out / STUDENT_FILE, "ranker", LAB_STUDENT, student, version="lab-1", metrics=flat
    )
    for model, values in metrics.items():
        print(f"{model}: held-out AUC {values['auc']:.2f}, accuracy {values['accuracy']:.2f}")
    print(f"({time.perf_counter() - start:.1f} s)")
    return metrics


if __name__ == "__main__":
    main()
