"""On-policy distillation (OPD): the policy samples, a frozen teacher scores every sampled token, and each token's
advantage is the teacher's log-prob minus the policy's (the negative per-token reverse KL), optionally mixed with
the task reward's group-relative advantage; the PPO-Clip policy loss.

References: Agarwal et al., "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes"
(GKD, ICLR 2024), and Lu & Thinking Machines Lab, "On-Policy Distillation" (2025), whose per-token reverse-KL
advantage with a zero discount this is. docs/algorithms.md has the formulas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from relax.algorithms.base import (
    AdvantageInputs,
    AdvantageOutput,
    Algorithm,
    AlgorithmConfig,
    Violation,
    non_negative,
    positive,
    register,
)
from relax.algorithms.hooks import group_relative_advantages, ppo_clip_policy_loss, violation
from relax.algorithms.lazy import lazy_module
from relax.metrics import OPD_METRICS, TEACHER_ADV_CLIPFRAC, TEACHER_KL, TEACHER_LOGP_MEAN

torch = lazy_module("torch")  # imported by the first computation, not by the registry
F = lazy_module("relax.algorithms.functional")


@dataclass(frozen=True)
class OPDConfig(AlgorithmConfig):
    name: str = "opd"
    # weight of the task reward's group-relative advantage added to the distillation advantage (0: pure distillation,
    # the reward is only recorded)
    # the reward is only recorded); finite: inf made every advantage +-inf (NaN where the reward advantage is 0)
    reward_coef: float = non_negative(0.0, says="must be a finite number >= 0: it weighs the task reward's advantage")
    # clamp each token's distillation advantage to [-c, c] (None: no clip)
    teacher_adv_clip: Optional[float] = positive(None, optional=True,
                                                 says="must be a finite number > 0 (null: no clip)")


# the reward-advantage fields read only when the task reward is mixed in
REWARD_FIELDS = ("normalize_rewards", "std_normalization", "normalize_advantages")


def compute_advantages(cfg: OPDConfig, inputs: AdvantageInputs) -> AdvantageOutput:
    """`A[i, t] = clip(logp_teacher[i, t] - logp_student[i, t]) + reward_coef * A_reward[i]` on valid tokens, where
    `logp_student` is the policy that sampled (`inputs.old_logp`) and `A_reward` GRPO's group-relative advantage
    (`group_relative_advantages`: normalize_rewards, std_normalization, normalize_advantages as for GRPO)."""
    if inputs.teacher_logp is None or inputs.old_logp is None:
        raise ValueError("opd's advantages need the teacher's and the sampling policy's log-probs")
    mask = inputs.mask  # the log-probs are data here: no gradient reaches the teacher or the sampling policy
    student = inputs.old_logp.detach().to(mask.device, torch.float32)
    teacher = inputs.teacher_logp.detach().to(mask.device, torch.float32)
    adv, clipped = F.distillation_advantages(student, teacher, mask, cfg.teacher_adv_clip)
    if cfg.reward_coef:
        adv = adv + cfg.reward_coef * group_relative_advantages(cfg, inputs).advantages.to(adv.dtype)
    valid = mask != 0
    n = max(int(valid.sum()), 1)
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    metrics = {
        TEACHER_LOGP_MEAN: float(torch.where(valid, teacher, zero).sum()) / n,
        TEACHER_KL: float(torch.where(valid, student - teacher, zero).sum()) / n,
        TEACHER_ADV_CLIPFRAC: float(clipped.sum()) / n,
    }
    return AdvantageOutput(advantages=adv * valid, metrics=metrics)


def check(cfg: Any) -> list[Violation]:
    a = cfg.algorithm
    out: list[Violation] = []
    if a.reward_coef == 0:
        defaults = OPDConfig()
        for key in REWARD_FIELDS:
            if getattr(a, key) != getattr(defaults, key):
                out.append(violation(f"algorithm.{key}", f"{key}={getattr(a, key)} has no effect with "
                                     "algorithm.reward_coef=0: the task reward is not trained on (pure distillation)",
                                     "algorithm.reward_coef"))
    elif a.normalize_rewards and cfg.rollout.n_samples_per_prompt < 2:
        out.append(violation("rollout.n_samples_per_prompt",
                             f"n_samples_per_prompt={cfg.rollout.n_samples_per_prompt} must be >= 2 with "
                             f"algorithm.reward_coef={a.reward_coef} and normalize_rewards=true: the reward's "
                             "advantage is relative to the prompt's group", "algorithm.reward_coef"))
    return out


register(
    Algorithm(
        name="opd",
        config_cls=OPDConfig,
        compute_advantages=compute_advantages,
        policy_loss=ppo_clip_policy_loss,
        summary="on-policy distillation: the teacher's per-token log-prob minus the policy's as the advantage; use it "
        "to make a small model good cheaply from a stronger one that shares its tokenizer (teacher.path)",
        requires_teacher=True,
        advantages_read_old_logp=True,
        group_relative=False,  # one sample per prompt is enough for pure distillation (check: not with the reward)
        per_token_loss=True,  # the objective is a per-token KL: every token weighs the same
        metrics=OPD_METRICS,
        ignores={"kl_coef": "reward-side KL shaping is not part of OPD; the teacher's KL is its advantage "
                 "(use_kl_loss adds a KL to a reference)"},
        check=check,
    )
)
