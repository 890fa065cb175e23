"""What an algorithm is: a config dataclass, two math hooks, capability flags and its own checks.

Each algorithm module (`relax/algorithms/<name>.py`) builds one `Algorithm` and calls `register`.
Generic code (config validation, the runner, the trainers) reads only this interface, so adding an
algorithm never touches it. This module imports torch only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class AlgorithmConfig:
    """Settings shared by every algorithm; subclasses add their own and set `name`.

    `eps_clip_high=None` means "same as eps_clip". Keys here exist for every algorithm; a key
    that only one algorithm understands belongs on that algorithm's subclass, so that Hydra
    rejects it for the others.
    """

    name: str = "grpo"
    eps_clip: float = 0.2
    eps_clip_high: Optional[float] = None
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "k3"
    kl_coef: float = 0.0
    use_tis: bool = False
    tis_clip: float = 2.0
    use_rollout_logprobs: bool = False
    normalize_advantages: bool = False
    normalize_rewards: bool = True
    std_normalization: bool = True
    entropy_coef: float = 0.0

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high


@dataclass(frozen=True)
class Violation:
    """One broken rule: the dotted config keys involved and a message with values and reason."""

    fields: tuple[str, ...]
    message: str


@dataclass
class AdvantageInputs:
    """What the advantages step has for a whole global batch (responses of a group consecutive)."""

    rewards: torch.Tensor  # [N] scalar reward per response
    mask: torch.Tensor  # [N, T] 1 on response tokens that count
    group_size: int
    old_logp: Optional[torch.Tensor] = None  # [N, T]
    ref_logp: Optional[torch.Tensor] = None  # [N, T]
    values: Optional[torch.Tensor] = None  # [N, T] critic values (PPO)


@dataclass
class AdvantageOutput:
    advantages: torch.Tensor  # [N, T], zero on masked tokens
    returns: Optional[torch.Tensor] = None  # [N, T] critic targets (PPO)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class PolicyLossOutput:
    """Per-token policy loss before TIS, KL, entropy and reduction (applied by shared code)."""

    loss: torch.Tensor  # [B, T]
    clipped: Optional[torch.Tensor] = None  # [B, T] bool; None: the loss never clips
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


AdvantageFn = Callable[[Any, AdvantageInputs], AdvantageOutput]
# (config, logp, old_logp, advantages, mask) -> PolicyLossOutput
PolicyLossFn = Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], PolicyLossOutput]
CheckFn = Callable[[Any], list[Violation]]


def no_checks(cfg: Any) -> list[Violation]:
    return []


@dataclass(frozen=True)
class Algorithm:
    """A registry entry. `check` receives the whole resolved RelaxConfig (duck-typed)."""

    name: str
    config_cls: type[AlgorithmConfig]
    compute_advantages: AdvantageFn
    policy_loss: PolicyLossFn
    summary: str  # one line: use it when ...
    requires_critic: bool = False
    requires_reference: bool = False  # besides the generic "a KL term needs a reference"
    supports_async: bool = True  # fully_async / hybrid modes, max_staleness > 0, partial rollout
    supports_context_parallel: bool = True
    supports_multi_step: bool = True  # train.num_steps_per_rollout > 1
    group_relative: bool = True  # needs rollout.n_samples_per_prompt >= 2
    rowwise_loss: bool = True  # a micro-batch's loss is the sum of its rows' (trainers may regroup rows)
    per_token_loss: bool = False  # value of train.calculate_per_token_loss when left unset
    per_token_loss_required: bool = False  # an explicit other value is an error
    metrics: tuple[str, ...] = ()  # metric names this algorithm adds
    check: CheckFn = no_checks


_REGISTRY: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    if algorithm.name in _REGISTRY and _REGISTRY[algorithm.name] is not algorithm:
        raise ValueError(f"algorithm {algorithm.name!r} is already registered")
    if algorithm.config_cls.name != algorithm.name:
        raise ValueError(
            f"{algorithm.config_cls.__name__}.name is {algorithm.config_cls.name!r}, expected {algorithm.name!r}"
        )
    _REGISTRY[algorithm.name] = algorithm
    return algorithm


def unregister(name: str) -> None:
    """For tests that register a temporary algorithm."""
    _REGISTRY.pop(name, None)


def get(name: str) -> Algorithm:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown algorithm {name!r}; known: {', '.join(names())}") from None


def names() -> list[str]:
    return sorted(_REGISTRY)


@dataclass
class LossBatch:
    """One micro-batch as the trainer hands it to `relax.algorithms.loss.compute_loss`."""

    logp: torch.Tensor  # [B, T] current policy, with grad
    old_logp: torch.Tensor  # [B, T] policy that produced the batch (recomputed by the trainer)
    advantages: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T]
    ref_logp: Optional[torch.Tensor] = None  # [B, T] when a KL loss needs it
    rollout_logp: Optional[torch.Tensor] = None  # [B, T] rollout engine's log-probs (TIS)
    entropy: Optional[torch.Tensor] = None  # [B, T] when entropy_coef > 0
