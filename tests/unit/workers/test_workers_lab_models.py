"""The lab's shipped teacher and student: their stored metrics are what they score on
the held-out synthetic clicks, and the int8 student stays within 3 points of the
teacher (the case study: 92% vs 95%)."""

from __future__ import annotations

import pytest
import torch

from workers.distill import (
    LAB_STUDENT,
    LAB_TEACHER,
    STUDENT_FILE,
    TEACHER_FILE,
    evaluate,
    lab_world,
)
from workers.models import load_checkpoint
from workers.models.loading import WEIGHTS_DIR
from workers.models.ranking import RankingNet
from workers.runtime import quantize_int8


def _module(filename: str, config: object) -> RankingNet:
    checkpoint = load_checkpoint(WEIGHTS_DIR / filename)
    module = RankingNet(config)  # type: ignore[arg-type]
    module.load_state_dict(checkpoint["state_dict"])
    return module.eval()


def test_the_shipped_metrics_are_reproduced_and_the_int8_student_is_within_three_points() -> None:
    torch.manual_seed(0)
    world = lab_world()
    teacher = evaluate(_module(TEACHER_FILE, LAB_TEACHER), LAB_TEACHER, world)
    student = _module(STUDENT_FILE, LAB_STUDENT)
    student_int8 = evaluate(quantize_int8(student), LAB_STUDENT, world)
    stored = load_checkpoint(WEIGHTS_DIR / STUDENT_FILE)["metrics"]
    assert teacher["auc"] == pytest.approx(stored["teacher_fp32_auc"], abs=0.01)
    assert student_int8["auc"] == pytest.approx(stored["student_int8_auc"], abs=0.05)
    assert teacher["auc"] - student_int8["auc"] <= 3.0
    assert teacher["accuracy"] - student_int8["accuracy"] <= 3.0
    assert teacher["auc"] > 55.0, "the teacher learned something from the clicks"


def test_the_student_is_much_smaller_than_the_teacher() -> None:
    sizes = [
        sum(p.numel() for p in RankingNet(config).parameters())
        for config in (LAB_TEACHER, LAB_STUDENT)
    ]
    assert sizes[0] > 20 * sizes[1]
