"""The worked example of docs/adding-an-algorithm.md: a tenth algorithm, registered only for this test."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from relax.algorithms import (
    AdvantageInputs,
    AdvantageOutput,
    Algorithm,
    AlgorithmConfig,
    LossBatch,
    PolicyLossOutput,
    compute_loss,
    get,
    names,
    register,
    unregister,
)
from relax.algorithms import functional as F
from relax.algorithms.base import positive

# ---- the module of the worked example (relax/algorithms/vanilla_pg.py) ----


@dataclass(frozen=True)
class VanillaPGConfig(AlgorithmConfig):
    name: str = "vanilla_pg"
    # multiplies the advantages; the range is declared on the field and validation checks it with every other one
    adv_scale: float = positive(1.0, says="must be a finite number > 0: it scales the advantages")


def compute_advantages(cfg: VanillaPGConfig, inputs: AdvantageInputs) -> AdvantageOutput:
    """`A = adv_scale * (R - mean_g)` on every valid token."""
    a = cfg.adv_scale * F.group_mean_baseline(inputs.rewards.float(), inputs.group_size)
    return AdvantageOutput(advantages=F.broadcast_to_tokens(a, inputs.mask))


def policy_loss(
    cfg: VanillaPGConfig, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> PolicyLossOutput:
    """Unclipped importance-weighted policy gradient: `-ratio * A`."""
    return PolicyLossOutput(loss=-torch.exp(logp - old_logp) * advantages, clipped=None)


VANILLA_PG = Algorithm(
    name="vanilla_pg",
    config_cls=VanillaPGConfig,
    compute_advantages=compute_advantages,
    policy_loss=policy_loss,
    summary="unclipped policy gradient with a group-mean baseline; use it as a teaching example",
    supports_async=False,
    # the shared fields its loss never reads: validation rejects a value other than the default
    ignores={"eps_clip": "its loss has no clip", "eps_clip_high": "its loss has no clip",
             "dual_clip_c": "its loss is not the PPO-Clip surrogate"},
)

# ---- the test ----


@pytest.fixture
def vanilla_pg():
    register(VANILLA_PG)
    try:
        yield get("vanilla_pg")
    finally:
        unregister("vanilla_pg")


def test_tenth_algorithm_through_the_registry_and_compute_loss(vanilla_pg):
    assert "vanilla_pg" in names()
    cfg = VanillaPGConfig(adv_scale=2.0)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float32)
    adv = vanilla_pg.compute_advantages(cfg, AdvantageInputs(torch.tensor([1.0, 0.0]), mask, 2)).advantages
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]]))
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, metrics = compute_loss(
        cfg, LossBatch(logp=logp, old_logp=torch.zeros(2, 3), advantages=adv, mask=mask), per_token=True, denominator=5
    )
    torch.testing.assert_close(loss, torch.tensor((-1 - 1 + 1 + 1 + 1) / 5))
    assert metrics["train/pg_clipfrac"].item() == 0.0
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv / 5)


def test_fields_its_loss_never_reads_are_rejected(vanilla_pg):
    from relax.config.schema import RelaxConfig
    from relax.config.validate import validate

    def messages(**fields: Any) -> list[str]:
        return [v.message for v in validate(RelaxConfig(algorithm=VanillaPGConfig(**fields)))
                if any(f.startswith("algorithm.") for f in v.fields)]

    assert messages() == []
    for key, value in (("dual_clip_c", 3.0), ("eps_clip", 0.1)):
        assert [m for m in messages(**{key: value}) if f"algorithm.{key}={value} has no effect: its loss" in m]


def test_the_range_declared_on_its_field_is_validated(vanilla_pg):
    from relax.config.schema import RelaxConfig
    from relax.config.validate import validate

    for value in (0.0, -1.0, float("inf"), float("nan")):
        found = [v for v in validate(RelaxConfig(algorithm=VanillaPGConfig(adv_scale=value)))
                 if "algorithm.adv_scale" in v.fields]
        assert [v.message for v in found] == [f"algorithm.adv_scale={value} must be a finite number > 0: it scales "
                                              "the advantages"]


def test_registering_a_name_twice_fails(vanilla_pg):
    with pytest.raises(ValueError):
        register(Algorithm("vanilla_pg", VanillaPGConfig, compute_advantages, policy_loss, "dup"))


def test_unregistered_afterwards():
    assert "vanilla_pg" not in names()
