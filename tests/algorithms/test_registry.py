"""The registry: entries, flags, defaults, per-algorithm checks, advantages hooks, import isolation."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
import torch

import relax.algorithms as A
from relax.algorithms import AdvantageInputs
from relax.algorithms import functional as F
from relax.config.schema import RelaxConfig

D = torch.float64
ALL = ["cispo", "grpo", "gspo", "m2po", "ppo", "reinforce_pp", "reinforce_pp_baseline", "rloo", "sapo"]


def make_cfg(name, algorithm=None, **sections):
    cfg = RelaxConfig(algorithm=A.get(name).config_cls(**(algorithm or {})))
    for section, overrides in sections.items():
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **overrides)})
    return cfg


def test_all_algorithms_registered():
    assert set(ALL) <= set(A.names())


@pytest.mark.parametrize("name", ALL)
def test_entry_and_default_config(name):
    algo = A.get(name)
    assert algo.name == name
    cfg = algo.config_cls()
    assert isinstance(cfg, A.AlgorithmConfig) and cfg.name == name
    assert dataclasses.is_dataclass(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.eps_clip = 0.3  # type: ignore[misc]
    assert algo.summary and "\n" not in algo.summary
    assert algo.check(make_cfg(name)) == []


def test_get_unknown_lists_known():
    with pytest.raises(KeyError, match="grpo"):
        A.get("nope")


def test_capability_flags():
    flags = {n: A.get(n) for n in ALL}
    assert [n for n in ALL if flags[n].requires_critic] == ["ppo"]
    assert {n for n in ALL if not flags[n].supports_async} == {"rloo", "ppo", "reinforce_pp", "reinforce_pp_baseline"}
    assert [n for n in ALL if not flags[n].supports_context_parallel] == ["m2po"]
    assert [n for n in ALL if not flags[n].supports_multi_step] == ["rloo"]
    assert {n for n in ALL if not flags[n].group_relative} == {"ppo", "reinforce_pp"}
    assert (flags["rloo"].per_token_loss, flags["rloo"].per_token_loss_required) == (True, True)
    assert (flags["cispo"].per_token_loss, flags["cispo"].per_token_loss_required) == (True, False)
    assert [n for n in ALL if flags[n].needs_step_statistics] == ["m2po"]
    for n in ("reinforce_pp", "reinforce_pp_baseline"):
        assert (flags[n].per_token_loss, flags[n].per_token_loss_required) == (False, True)
    assert "train/ppo_kl_m2_before" in flags["m2po"].metrics
    assert "rollout/rloo/dropped_group_frac" in flags["rloo"].metrics


def test_config_defaults_from_seed_doc():
    assert (A.PPOConfig.gamma, A.PPOConfig.lambd, A.PPOConfig.value_clip) == (1.0, 1.0, 0.2)
    assert (A.PPOConfig.num_critic_only_steps, A.PPOConfig.critic_lr) == (0, None)
    assert (A.SAPOConfig.tau_pos, A.SAPOConfig.tau_neg) == (1.0, 1.05)
    assert (A.M2POConfig.kl2_budget, A.M2POConfig.miniclip_low, A.M2POConfig.miniclip_high) == (0.01, 0.3, 0.5)
    assert A.ReinforcePPConfig.kl_coef > 0 and A.ReinforcePPConfig.gamma == 1.0
    assert A.ReinforcePPBaselineConfig.kl_loss_type == "k2"


VIOLATIONS = [
    ("rloo", {"normalize_rewards": False}, {}, "algorithm.normalize_rewards"),
    ("rloo", {"normalize_advantages": True}, {}, "algorithm.normalize_advantages"),
    ("rloo", {}, {"train": {"use_dynamic_global_batch_size": True}}, "train.use_dynamic_global_batch_size"),
    ("rloo", {"use_kl_loss": True, "kl_loss_coef": 0.01}, {}, "train.ref_load"),
    ("ppo", {}, {"cluster": {"colocate": False}}, "cluster.colocate"),
    ("reinforce_pp", {"use_kl_loss": True}, {}, "algorithm.use_kl_loss"),
    ("reinforce_pp_baseline", {"use_kl_loss": True, "kl_loss_type": "k3"}, {}, "algorithm.kl_loss_type"),
]


@pytest.mark.parametrize("name,algorithm,sections,field", VIOLATIONS)
def test_each_rule_names_its_field(name, algorithm, sections, field):
    violations = A.get(name).check(make_cfg(name, algorithm, **sections))
    assert len(violations) == 1, violations
    v = violations[0]
    assert isinstance(v, A.Violation)
    assert field in v.fields
    key = field.rsplit(".", 1)[-1]
    assert key in v.message and ":" in v.message


# ranges declared on the algorithms' own fields (`positive`, `in_range`...): validation checks them with every other
# declared range, so an algorithm's `check` does not restate them
FIELD_RANGES = [
    ("m2po", "kl2_budget", 0.0),
    ("m2po", "kl2_budget", math.inf),
    ("m2po", "miniclip_low", 1.0),
    ("m2po", "miniclip_low", -0.1),
    ("m2po", "miniclip_high", -0.1),
    ("m2po", "miniclip_high", math.nan),
    ("m2po", "miniclip_high", math.inf),
    ("ppo", "gamma", 1.5),
    ("ppo", "lambd", -0.1),
    ("ppo", "value_clip", 0.0),
    ("ppo", "num_critic_only_steps", -1),
    ("ppo", "critic_lr", 0.0),
    ("reinforce_pp", "kl_coef", 0.0),
    ("reinforce_pp", "gamma", 1.01),
    ("sapo", "tau_pos", 0.0),
    ("sapo", "tau_neg", -1.0),
    # +inf passes `> 0` and then breaks the math (SAPO's loss is NaN at ratio 1); nan fails every comparison
    ("sapo", "tau_neg", math.inf),
    ("sapo", "tau_pos", math.inf),
    ("sapo", "tau_pos", math.nan),
    ("ppo", "critic_lr", math.inf),
    ("opd", "reward_coef", math.nan),
    ("opd", "reward_coef", math.inf),
    ("opd", "reward_coef", -0.5),
    ("opd", "teacher_adv_clip", 0.0),
]


@pytest.mark.parametrize("name,key,value", FIELD_RANGES)
def test_each_declared_range_refuses_its_value_naming_the_field_and_why(name, key, value):
    from relax.algorithms.base import range_of

    allowed = range_of(A.get(name).config_cls, key)
    assert allowed is not None and not allowed.admits(value)
    message = allowed.message(key, value)
    assert message.startswith(f"{key}={value} must be") and ":" in message, message
    assert allowed.admits(getattr(A.get(name).config_cls(), key))  # the default is in it


@pytest.mark.parametrize("name,key,value", [("sapo", "tau_neg", "inf"), ("ppo", "gamma", "1.5"),
                                            ("opd", "reward_coef", "nan")])
def test_a_declared_range_stops_the_config_before_anything_starts(name, key, value):
    from relax.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=rf"algorithm\.{key}={value} must be"):
        load_config([f"algorithm={name}", f"algorithm.{key}={value}"])


def test_sapo_rejects_an_infinite_temperature_because_its_loss_is_nan_there():
    from relax.algorithms import LossBatch, compute_loss

    def loss(**taus):
        logp = torch.tensor([[-0.5, -0.7, -0.2]], requires_grad=True)
        batch = LossBatch(logp=logp, old_logp=torch.tensor([[-0.5, -0.6, -0.2]]),
                          advantages=torch.tensor([[-1.0, -1.0, 1.0]]), mask=torch.ones(1, 3))
        return compute_loss(A.SAPOConfig(**taus), batch, per_token=True, denominator=3)[0]

    assert not torch.isfinite(loss(tau_neg=math.inf))  # what the check keeps out
    assert torch.isfinite(loss(tau_neg=1e6))  # a large finite temperature is a hard gate, and accepted
    from relax.algorithms.base import range_of

    assert range_of(A.SAPOConfig, "tau_neg").admits(1e6) and range_of(A.SAPOConfig, "tau_pos").admits(1e-3)
    message = range_of(A.SAPOConfig, "tau_neg").message("tau_neg", math.inf)
    assert message == ("tau_neg=inf must be a finite number > 0: it is the sigmoid gate's temperature where A <= 0 "
                       "(higher: stronger suppression)")


def test_m2po_takes_the_engines_logprobs_for_stale_data_with_tis_off():
    # what the later (Chinese) spec revision recommends for M2PO on stale asynchronous data (docs/algorithms.md)
    from relax.config import ConfigError, load_config

    assert "use_rollout_logprobs" not in A.get("m2po").ignores
    stale = ["algorithm=m2po", "train.mode=fully_async", "train.max_staleness=4"]
    assert load_config([*stale, "algorithm.use_rollout_logprobs=true"]).algorithm.use_rollout_logprobs
    with pytest.raises(ConfigError) as err:
        load_config([*stale, "algorithm.use_rollout_logprobs=true", "algorithm.use_tis=true"])
    assert any({"algorithm.use_tis", "algorithm.use_rollout_logprobs"} <= set(v.fields)
               for v in err.value.violations), str(err.value)


def test_rules_that_pass():
    assert A.get("rloo").check(make_cfg("rloo", {"use_kl_loss": True}, train={"ref_load": "/ckpt/ref"})) == []
    assert A.get("opd").check(make_cfg("opd", {"reward_coef": 0.5})) == []
    assert A.get("reinforce_pp_baseline").check(make_cfg("reinforce_pp_baseline", {"use_kl_loss": True})) == []
    assert A.get("ppo").check(make_cfg("ppo", {"gamma": 0.0, "lambd": 0.95, "critic_lr": 1e-5})) == []


def test_ignored_fields_are_fields_of_the_config():
    for name in A.names():
        algo = A.get(name)
        assert set(algo.ignores) <= {f.name for f in dataclasses.fields(algo.config_cls)}, name


def test_check_accepts_duck_typed_config():
    from types import SimpleNamespace

    cfg = SimpleNamespace(algorithm=A.ReinforcePPConfig(use_kl_loss=True))
    assert A.get("reinforce_pp").check(cfg)[0].fields == ("algorithm.use_kl_loss",)


# ---------------------------------------------------------------------------------------------- advantages


def inputs(rewards, mask, group_size, **kw):
    return AdvantageInputs(
        rewards=torch.tensor(rewards, dtype=D), mask=torch.tensor(mask, dtype=D), group_size=group_size, **kw
    )


MASK4 = [[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]]


def test_grpo_family_advantages_broadcast_and_mask():
    for name in ("grpo", "cispo", "gspo", "sapo", "m2po"):
        out = A.get(name).compute_advantages(A.get(name).config_cls(), inputs([0.0, 1.0, 2.0, 2.0], MASK4, 2))
        a = 1 / (2**-0.5 + 1e-6) * 0.5
        torch.testing.assert_close(
            out.advantages, torch.tensor([[-a, -a, 0], [a, 0, 0], [0, 0, 0], [0, 0, 0]], dtype=D)
        )


def test_grpo_raw_rewards_and_whitening_switches():
    grpo = A.get("grpo")
    out = grpo.compute_advantages(A.GRPOConfig(normalize_rewards=False), inputs([0.0, 1.0, 2.0, 2.0], MASK4, 2))
    torch.testing.assert_close(out.advantages[:, 0], torch.tensor([0.0, 1.0, 2.0, 0.0], dtype=D))
    out = grpo.compute_advantages(A.GRPOConfig(normalize_advantages=True), inputs([0.0, 1.0, 2.0, 5.0], MASK4, 2))
    valid = torch.tensor(MASK4, dtype=D) > 0
    assert out.advantages[valid].mean().abs() < 1e-9
    assert (out.advantages[valid].var(unbiased=False) - 1).abs() < 1e-6


def test_rloo_advantages_hook():
    out = A.get("rloo").compute_advantages(A.RLOOConfig(), inputs([0.0, 1.0, 2.0, 2.0], MASK4, 2))
    torch.testing.assert_close(out.advantages, torch.tensor([[-1, -1, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0]], dtype=D))
    assert out.metrics["rollout/rloo/empty_response_frac"] == 0.25
    assert out.metrics["rollout/rloo/zero_adv_group_frac"] == 0.5


def test_rloo_empty_responses_count_tokens_before_the_stop_token():
    # valid lengths 2, 1, 3, 0; rows 1 and 2 ended with a stop token, so row 1 (a lone stop token) is empty
    stopped = torch.tensor([False, True, True, False])
    out = A.get("rloo").compute_advantages(A.RLOOConfig(), inputs([0.0, 1.0, 2.0, 2.0], MASK4, 2, stopped=stopped))
    assert out.metrics["rollout/rloo/empty_response_frac"] == 0.5
    assert out.metrics["rollout/rloo/no_signal_frac"] == pytest.approx(3 / 6)  # group 2's tokens, of all valid


def test_reinforce_pp_baseline_hook_is_normalized_group_mean():
    out = A.get("reinforce_pp_baseline").compute_advantages(
        A.ReinforcePPBaselineConfig(), inputs([0.0, 1.0, 2.0, 5.0], MASK4, 2)
    )
    c = torch.tensor([-0.5, 0.5, -1.5, 1.5], dtype=D)
    tok = c[:, None] * torch.tensor(MASK4, dtype=D)
    torch.testing.assert_close(out.advantages, F.global_token_normalize(tok, torch.tensor(MASK4, dtype=D)))


def test_reinforce_pp_hook():
    old = torch.full((4, 3), -1.0, dtype=D)
    ref = torch.full((4, 3), -1.5, dtype=D)
    cfg = A.ReinforcePPConfig(kl_coef=0.1, gamma=1.0)
    out = A.get("reinforce_pp").compute_advantages(
        cfg, inputs([1.0, 0.0, 1.0, 1.0], MASK4, 1, old_logp=old, ref_logp=ref)
    )
    m = torch.tensor(MASK4, dtype=D)
    ret = F.reinforce_pp_returns(torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=D), m, old, ref, 0.1, 1.0)
    torch.testing.assert_close(out.advantages, F.global_token_normalize(ret, m))


def test_ppo_hook_gae_and_kl_penalty():
    values = torch.tensor([[0.5, 0.25, 0.0]] * 4, dtype=D)
    m = torch.tensor(MASK4, dtype=D)
    r = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=D)
    out = A.get("ppo").compute_advantages(
        # the raw GAE (PPO whitens by default; the whitening: tests/algorithms/test_clip_ranges_and_defaults.py)
        A.PPOConfig(gamma=0.9, lambd=0.8, normalize_advantages=False), inputs(r.tolist(), MASK4, 1, values=values)
    )
    adv, ret = F.gae(r, values, m, 0.9, 0.8)
    torch.testing.assert_close(out.advantages, adv)
    torch.testing.assert_close(out.returns, ret)
    old = torch.zeros(4, 3, dtype=D)
    ref = torch.full((4, 3), -1.0, dtype=D)  # k1 = 1 on every token
    cfg = A.PPOConfig(kl_coef=0.5, normalize_advantages=False)
    out = A.get("ppo").compute_advantages(cfg, inputs(r.tolist(), MASK4, 1, values=values, old_logp=old, ref_logp=ref))
    # gamma = lambda = 1: A_t = sum of token rewards from t on - V_t
    torch.testing.assert_close(out.advantages[0], torch.tensor([1 - 1.0 - 0.5, 1 - 0.5 - 0.25, 0], dtype=D))
    with pytest.raises(ValueError):
        A.get("ppo").compute_advantages(A.PPOConfig(), inputs(r.tolist(), MASK4, 1))


# ---------------------------------------------------------------------------------------------- isolation


def test_import_pulls_no_heavy_frameworks():
    code = (
        "import sys, relax.algorithms\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('ray', 'hydra', 'omegaconf', 'mlflow', 'transformers')]\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("name", ALL)
def test_advantages_ignore_masked_tokens(name):
    g = torch.Generator().manual_seed(7)
    m = torch.tensor(MASK4, dtype=D)
    kw = {
        "old_logp": -torch.rand(4, 3, generator=g, dtype=D),
        "ref_logp": -torch.rand(4, 3, generator=g, dtype=D),
        "values": torch.randn(4, 3, generator=g, dtype=D),
    }
    rewards = [0.0, 1.0, 3.0, 1.0]
    cfg = A.get(name).config_cls()
    a = A.get(name).compute_advantages(cfg, inputs(rewards, MASK4, 2, **kw))
    garbage = {k: torch.where(m > 0, v, torch.full_like(v, 9.0)) for k, v in kw.items()}
    b = A.get(name).compute_advantages(cfg, inputs(rewards, MASK4, 2, **garbage))
    torch.testing.assert_close(a.advantages, b.advantages)
    assert torch.all(a.advantages[m == 0] == 0)
    assert torch.isfinite(a.advantages).all()
    if a.returns is not None:
        torch.testing.assert_close(a.returns, b.returns)
