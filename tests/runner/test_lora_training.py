"""LoRA through the training loop (the roles in this process, tests/inprocess_ray.py): the reference is the actor's
base with the adapters off (no reference role), adapter-only weight updates in the asynchronous modes, the critic
full, the bytes of each update recorded; bad options rejected before anything starts."""

from __future__ import annotations

import pytest
import torch

from relax.config import ConfigError, load_config
from relax.models.hf import build_model
from relax.runner.errors import RunError
from relax.runner.plan import build_plan
from relax.runner.train import run

pytestmark = pytest.mark.slow

LORA = ["model.lora_rank=4", "model.lora_alpha=8", "train.lr=0.05"]


def adapter_bytes(cfg) -> int:
    """fp32 bytes of rank-r adapters on every linear layer but the head of the tiny model, by hand."""
    m, r = cfg.model, cfg.model.lora_rank
    h, q, kv, i = m.hidden_size, m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim, \
        m.intermediate_size
    per_layer = r * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))
    return 4 * per_layer * m.num_layers


def test_lora_with_a_kl_loss_takes_its_reference_from_the_actor(in_process, small_run, tmp_path):
    cfg = load_config(small_run(*LORA, "algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.01",
                                "model.dtype=float32"))
    plan = build_plan(cfg)
    assert plan.role("reference") is None and plan.reference_on_actor
    assert "adapters off" in plan.role("actor").why
    result = run(cfg, plan, output_dir=tmp_path / "out")
    kl = result.series("train/kl_loss")
    assert len(kl) == 2 and kl[0] == pytest.approx(0.0, abs=1e-6) and kl[1] > 0  # the policy starts as the base
    tensors = {t.data_ptr(): t for t in build_model(cfg.model, 40, 0, seed=1).state_dict().values()}
    full = sum(4 * t.numel() for t in tensors.values())  # fp32, the tied head once
    assert result.series("perf/sync_bytes") == [full, full]  # merged: the whole model each time
    assert (tmp_path / "ckpt" / "step_000002" / "policy" / "adapter_model.safetensors").is_file()


def test_adapter_updates_in_fully_async_with_partial_rollout(in_process, small_run, tmp_path):
    cfg = load_config(small_run(*LORA, "rollout.lora_sync=adapter", "train.mode=fully_async",
                                "rollout.partial_rollout=true", "model.dtype=float32", steps=3))
    result = run(cfg, output_dir=tmp_path / "out")
    assert [s for s, _ in result.history] == [0, 1, 2]
    assert set(result.series("perf/sync_bytes")) == {adapter_bytes(cfg)}
    assert all(torch.isfinite(torch.tensor(result.series("train/loss"))))


def test_ppo_keeps_a_full_critic(in_process, small_run, tmp_path):
    cfg = load_config(small_run(*LORA, "algorithm=ppo"))
    result = run(cfg, output_dir=tmp_path / "out")
    assert "critic/value_loss" in result.history[-1][1]
    critic = tmp_path / "ckpt" / "step_000002" / "critic"
    assert (critic / "model.safetensors").is_file() and not (critic / "adapter_model.safetensors").exists()


@pytest.mark.parametrize("overrides,field", [
    (["model.lora_rank=-1"], "model.lora_rank"),
    (["model.lora_alpha=8"], "model.lora_alpha"),  # no adapters: no effect
    (["rollout.lora_sync=adapter"], "rollout.lora_sync"),
    (["model.lora_rank=4", "model.lora_alpha=0"], "model.lora_alpha"),
    (["model.lora_rank=4", "model.lora_dropout=1"], "model.lora_dropout"),
    (["model.lora_rank=4", "model.lora_target_modules=[all-linear,q_proj]"], "model.lora_target_modules"),
    (["model.lora_rank=4", "train.backend=megatron"], "train.backend"),  # not built: says what runs instead
    # servers that cannot read the driver's adapter directories
    (["model.lora_rank=4", "rollout=sglang", "rollout.sglang.urls=[http://10.0.0.2:30000]",
      "rollout.lora_sync=adapter"], "rollout.lora_sync"),
])
def test_bad_lora_options_are_rejected_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    assert any(field in v.fields for v in err.value.violations), str(err.value)


def test_target_modules_the_model_lacks_are_named_with_those_it_has_before_ray(ray_not_started, small_run,
                                                                              tmp_path):
    cfg = load_config(small_run("model.lora_rank=4", "model.lora_target_modules=[q_proj,attn_out]"))
    with pytest.raises(RunError, match=r"\['attn_out'\] are not linear layers.*'o_proj'"):
        run(cfg, output_dir=tmp_path / "out")
    assert not ray_not_started


def test_lora_with_episodes_dynamic_sampling_and_evaluation(in_process, small_run, tmp_path):
    """Nothing of the adapters is specific to a data or sampling path: multi-turn episodes, dynamic sampling and
    evaluation run with them as without (the adapters' updates reach the engine that plays the episodes)."""
    cfg = load_config(small_run(*LORA, "data=guess_number", "rollout.max_turns=3", "rollout.max_episode_tokens=40",
                                "rollout.lora_sync=adapter", "rollout.filter_groups=true",
                                "rollout.max_filter_rounds=2", "train.eval_interval=2", "data.num_eval_prompts=4"))
    result = run(cfg, output_dir=tmp_path / "out")
    (_, last), (_, evaluation) = result.history[-2:]
    assert [s for s, _ in result.history] == [0, 1, 2]  # step 2: the evaluation of the weights of 2 steps, alone
    assert "rollout/turns_mean" in last and "rollout/filter_rounds" in last
    assert list(evaluation) and all(k.startswith("eval/") for k in evaluation)
    assert "eval/guess_number/mean_at_1" in evaluation
