"""Auxiliary-loss-free load balancing (`train.moe_expert_bias_update_rate`, docs/training.md "Expert bias"): the
selection bias (`e_score_correction_bias`) of tiny DeepSeek-V3 / GLM-4.5 models built from their transformers configs
moves after one training step exactly as the hand formula from the loads counted here (from the experts each MoE
block really computed with, over the real tokens of every micro-batch's forward, read by hooks independent of Relax's
router control); replayed routes are the ones counted; the engine routes with the synced bias (its routers' choice
equal to a top-k computed here by hand in fp64); a checkpoint keeps it; models without such a bias, negative rates,
Megatron and LoRA are refused before start."""

from __future__ import annotations

import pytest
import torch
from moe_hooks import hand_group_topk, observe_moe_blocks, tiny_moe_model
from safetensors.torch import load_file

from relax.algorithms.grpo import GRPOConfig
from relax.batch import TrainBatch
from relax.config.schema import ModelConfig, TrainConfig
from relax.metrics import LOSS, MOE_EXPERT_BIAS_MAX, MOE_EXPERT_BIAS_MIN, ROUTER_OWN_AGREEMENT, SKIPPED_STEPS
from relax.models.moe import moe_routers
from relax.rollout.embedded import EmbeddedEngine
from relax.train.torch_policy import TorchPolicy

V = 64
COMMON = dict(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              intermediate_size=64, max_position_embeddings=128, pad_token_id=0, bos_token_id=None, eos_token_id=1,
              tie_word_embeddings=False, first_k_dense_replace=1, moe_intermediate_size=32, n_routed_experts=8,
              num_experts_per_tok=2, n_shared_experts=1, norm_topk_prob=True)
RATE = 0.01


def _config(family: str):
    import transformers as tr

    if family == "deepseek_v3":  # a dense first layer, then 2 sparse ones; 4 groups of 2, the best 2 kept
        return tr.DeepseekV3Config(**COMMON, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                   n_group=4, topk_group=2, routed_scaling_factor=2.5, q_lora_rank=16,
                                   kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    if family == "glm4_moe":  # 2 groups of 4, the best one kept
        return tr.Glm4MoeConfig(**COMMON, head_dim=8, n_group=2, topk_group=1, routed_scaling_factor=1.8)
    if family == "mixtral":
        return tr.MixtralConfig(**{k: v for k, v in COMMON.items() if k not in (
            "first_k_dense_replace", "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
            "norm_topk_prob")}, head_dim=8, num_local_experts=8)
    raise AssertionError(family)


def _model(family: str, seed: int = 0, bias_std: float = 0.3) -> torch.nn.Module:
    """The tiny model in fp32 (eager attention), routers far from ties, the selection bias nonzero."""
    def init(router: torch.nn.Module) -> None:
        router.weight.normal_(0.0, 0.5)
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.normal_(0.0, bias_std)

    return tiny_moe_model(_config(family), init, seed)


def _samples(family: str, *, perturbed: bool, record: bool):
    """Samples the embedded engine generated (prompts of different lengths: padded rows), on a copy whose routers
    are perturbed when `perturbed` (its routes then differ from the trainer's own choice)."""
    model = _model(family)
    if perturbed:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for router in moe_routers(model):
                router.weight.add_(0.5 * router.weight.std() * torch.randn(router.weight.shape, generator=g))
                router.e_score_correction_bias.add_(0.3 * torch.randn(router.num_experts, generator=g))
    engine = EmbeddedEngine(model, eos_token_ids=[1], pad_token_id=0)
    engine.record_routes = record
    return engine.generate([[5, 6, 7, 8, 9], [9, 10, 11], [12, 13]], n_samples_per_prompt=2, max_new_tokens=8,
                           seed=3)


def _policy(model: torch.nn.Module, *, replay: bool = False, rate: float = RATE, lr: float = 0.0) -> TorchPolicy:
    return TorchPolicy(ModelConfig(dtype="float32"), TrainConfig(lr=lr, moe_expert_bias_update_rate=rate),
                       vocab_size=V, pad_token_id=0, seed=0, device="cpu", num_threads=1, model=model,
                       routing_replay=replay)


def _biases(model: torch.nn.Module) -> list[torch.Tensor]:
    return [r.e_score_correction_bias.detach().clone() for r in moe_routers(model)]


def _step(policy: TorchPolicy, samples, micro_batch_size: int, advantages=None) -> dict[str, float]:
    adv = torch.zeros(samples.response_mask.shape) if advantages is None else advantages
    batch = TrainBatch.from_samples(samples, advantages=adv)
    return policy.train_step(batch, GRPOConfig(), per_token=True, micro_batch_size=micro_batch_size)


def _observe_masks(model: torch.nn.Module) -> list[torch.Tensor]:
    """The attention mask of every forward of `model` (which tokens are real), read at its call."""
    masks: list[torch.Tensor] = []
    model.register_forward_pre_hook(lambda m, args, kwargs: masks.append(kwargs["attention_mask"].detach().clone()),
                                    with_kwargs=True)
    return masks


@pytest.mark.parametrize("family,replay", [("deepseek_v3", False), ("glm4_moe", False), ("deepseek_v3", True)])
def test_one_step_moves_the_bias_by_the_hand_formula(family, replay):
    """After one step over two micro-batches of padded rows, each MoE layer's bias is b + rate * sign(mean_e c_e - c_e),
    c counted here from the experts each block computed with (the replayed ones under replay, where the trainer's own
    routers disagree with them) over the real tokens of both forwards; fp32; the logged max / min are the new bias's."""
    s = _samples(family, perturbed=replay, record=replay)
    assert bool((s.sequences()[1] == 0).any())  # padding to leave out
    policy = _policy(_model(family), replay=replay)
    before = _biases(policy.model)
    inputs, used = observe_moe_blocks(policy.model)
    masks = _observe_masks(policy.model)
    out = _step(policy, s, micro_batch_size=3)
    routers = moe_routers(policy.model)
    L, E = len(routers), routers[0].num_experts
    assert len(masks) == 2 and len(used) == 2 * L  # two training forwards, nothing else
    if replay:
        assert out[ROUTER_OWN_AGREEMENT] < 1.0  # the routes counted are not the trainer's own
    counts = torch.zeros(L, E, dtype=torch.float64)
    for forward, mask in enumerate(masks):
        real = mask.reshape(-1) != 0
        for layer in range(L):
            experts = used[forward * L + layer][0].long()
            counts[layer] += torch.bincount(experts[real].reshape(-1), minlength=E).double()
    after = _biases(policy.model)
    for layer in range(L):
        c = counts[layer]
        want = before[layer] + torch.sign(c.mean() - c).float() * RATE
        assert after[layer].dtype == torch.float32
        torch.testing.assert_close(after[layer], want, rtol=0, atol=0)
    moved = torch.stack(after) - torch.stack(before)
    assert bool((moved > 0).any()) and bool((moved < 0).any())
    assert out[MOE_EXPERT_BIAS_MAX] == float(torch.stack(after).max())
    assert out[MOE_EXPERT_BIAS_MIN] == float(torch.stack(after).min())
    assert out[SKIPPED_STEPS] == 0.0


def test_a_skipped_step_leaves_the_bias_and_rate_zero_leaves_it_too():
    """A non-finite step changes nothing, the bias included; rate 0 (the default) never touches it."""
    s = _samples("deepseek_v3", perturbed=False, record=False)
    policy = _policy(_model("deepseek_v3"))
    before = _biases(policy.model)
    out = _step(policy, s, micro_batch_size=6, advantages=torch.full(s.response_mask.shape, float("nan")))
    assert out[SKIPPED_STEPS] == 1.0 and MOE_EXPERT_BIAS_MAX not in out
    assert all(torch.equal(a, b) for a, b in zip(before, _biases(policy.model), strict=True))
    off = _policy(_model("deepseek_v3"), rate=0.0)
    out = _step(off, s, micro_batch_size=6)
    assert MOE_EXPERT_BIAS_MAX not in out
    assert all(torch.equal(a, b) for a, b in zip(before, _biases(off.model), strict=True))


def test_a_rollout_of_two_optimizer_steps_logs_the_bias_after_the_last_update():
    """train.num_steps_per_rollout=2: the rollout's logged bias max / min are the bias the model holds after the
    second step's update (read from the routers' buffers), not the mean of the two steps' readings, as
    `train_on_rollout` merges the steps' metrics (`relax.runner.optimizer_steps.LAST`); the loss still averages.
    Before: the mean of the two steps' maxima, which differ by the update."""
    import types

    from relax.runner.optimizer_steps import train_on_rollout

    s = _samples("deepseek_v3", perturbed=False, record=False)
    policy = _policy(_model("deepseek_v3"))
    per_step: list[dict[str, float]] = []

    def train_step(chunk: TrainBatch, actor: bool, rollout_mismatch: bool) -> dict[str, float]:
        per_step.append(policy.train_step(chunk, GRPOConfig(), per_token=True, micro_batch_size=3))
        return per_step[-1]

    cfg = types.SimpleNamespace(algorithm=GRPOConfig(), train=types.SimpleNamespace(
        num_steps_per_rollout=2, global_batch_size=3, use_dynamic_global_batch_size=False))
    batch = TrainBatch.from_samples(s, advantages=torch.zeros(s.response_mask.shape))
    out, steps = train_on_rollout(cfg, types.SimpleNamespace(train_step=train_step), batch, step=0)
    assert steps == 2 and len(per_step) == 2
    after = torch.stack(_biases(policy.model))
    assert per_step[0][MOE_EXPERT_BIAS_MAX] != per_step[1][MOE_EXPERT_BIAS_MAX]  # the update moved the max
    assert out[MOE_EXPERT_BIAS_MAX] == float(after.max()) == per_step[1][MOE_EXPERT_BIAS_MAX]
    assert out[MOE_EXPERT_BIAS_MIN] == float(after.min()) == per_step[1][MOE_EXPERT_BIAS_MIN]
    assert out[LOSS] == pytest.approx((per_step[0][LOSS] + per_step[1][LOSS]) / 2)  # the control: still a mean


def test_the_engine_routes_with_the_synced_bias(tmp_path):
    """A bf16 engine (transformers keeps the router and its bias fp32) gets the trainer's updated bias bit for bit
    with the bf16 weight update, and its routers then choose what a top-k computed here by hand with that bias
    chooses (and not what the old bias would: the update changed routes)."""
    from transformers import AutoModelForCausalLM

    path = tmp_path / "ds"
    _model("deepseek_v3", bias_std=0.0).save_pretrained(str(path))
    engine_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    routers = moe_routers(engine_model)
    assert routers[0].e_score_correction_bias.dtype == torch.float32
    engine = EmbeddedEngine(engine_model, eos_token_ids=[1], pad_token_id=0)
    s = engine.generate([[5, 6, 7, 8, 9], [9, 10, 11], [12, 13]], n_samples_per_prompt=2, max_new_tokens=8, seed=3)

    policy = TorchPolicy(ModelConfig(dtype="float32"), TrainConfig(lr=0.0, moe_expert_bias_update_rate=0.05),
                         vocab_size=V, pad_token_id=0, seed=0, device="cpu", num_threads=1,
                         model=AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32))
    old = _biases(policy.model)
    for _ in range(3):
        _step(policy, s, micro_batch_size=3)
    new = _biases(policy.model)
    assert not any(torch.equal(a, b) for a, b in zip(old, new, strict=True))
    engine.load_weights(policy.state_dict_for_rollout(dtype=torch.bfloat16), version=1)
    for router, bias in zip(routers, new, strict=True):
        assert router.e_score_correction_bias.dtype == torch.float32
        assert torch.equal(router.e_score_correction_bias, bias)  # exactly the trainer's, not bf16-rounded

    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    for layer, router in enumerate(routers):
        router.register_forward_hook(
            lambda m, args, out, layer=layer: seen.append((layer, args[0].detach().float(), out[2].detach())))
    engine.generate([[5, 6, 7, 8, 9], [20, 21, 22, 23]], n_samples_per_prompt=2, max_new_tokens=6, seed=4)
    compared = changed = 0
    for layer, hidden, chosen in seen:
        want, margin = hand_group_topk(routers[layer], hidden, routers[layer].weight, new[layer])
        before, _ = hand_group_topk(routers[layer], hidden, routers[layer].weight, old[layer])
        clear = margin > 1e-4
        assert torch.equal(chosen.long().sort(-1).values[clear], want[clear])
        compared += int(clear.sum())
        changed += int((before != want).any(-1)[clear].sum())
    assert compared > 20 and changed > 0, (compared, changed)


def test_a_checkpoint_keeps_the_bias(tmp_path):
    """save_checkpoint writes the updated bias (fp32) into the HF weights, which relax-export copies; a fresh policy
    resumed from it holds it bit for bit."""
    s = _samples("deepseek_v3", perturbed=False, record=False)
    policy = _policy(_model("deepseek_v3"), lr=1e-3)
    _step(policy, s, micro_batch_size=3)
    bias = _biases(policy.model)
    assert not any(torch.equal(a, b) for a, b in zip(bias, _biases(_model("deepseek_v3")), strict=True))
    policy.save_checkpoint(tmp_path / "ck")
    saved = {}
    for f in sorted((tmp_path / "ck").glob("*.safetensors")):
        saved |= load_file(str(f))
    names = policy.routing.selection_bias_names(policy.model)
    assert len(names) == 2
    for name, b in zip(names, bias, strict=True):
        assert saved[name].dtype == torch.float32 and torch.equal(saved[name], b)
    resumed = _policy(_model("deepseek_v3"))
    resumed.load_checkpoint(tmp_path / "ck")
    assert all(torch.equal(a, b) for a, b in zip(bias, _biases(resumed.model), strict=True))


@pytest.mark.parametrize("overrides,message", [
    (["model=tiny_moe"], "model.arch=qwen3_moe built from config has no such bias in its routers"),
    ([], "model.arch=qwen3 built from config has no MoE router"),
    (["model.source=hf", "model.path=/nonexistent", "train.backend=megatron"],
     "train.moe_expert_bias_update_rate=0.001 with train.backend=megatron is not available in this build"),
    (["model.source=hf", "model.path=/nonexistent", "model.lora_rank=4"],
     "with model.lora_rank=4 is not available in this build"),
])
def test_options_refused_by_the_config(overrides, message):
    from relax.config import load_config

    with pytest.raises(Exception, match="train.moe_expert_bias_update_rate") as e:
        load_config([*overrides, "train.moe_expert_bias_update_rate=0.001"])
    assert message in str(e.value), str(e.value)


def test_a_negative_rate_is_refused():
    from relax.config import load_config

    with pytest.raises(Exception, match=r"train.moe_expert_bias_update_rate=-0.1 must be >= 0"):
        load_config(["train.moe_expert_bias_update_rate=-0.1"])


def test_checkpoints_are_checked_before_start_and_in_the_trainer(tmp_path):
    """The pre-Ray checks pass DeepSeek-V3 and GLM-4.5 checkpoints and refuse Mixtral's (its routers have no selection
    bias) naming the option and the model's type; the trainer refuses a Mixtral model handed in."""
    from relax.config import load_config
    from relax.runner.preflight import preflight

    for family in ("deepseek_v3", "glm4_moe", "mixtral"):
        path = tmp_path / family
        _model(family).save_pretrained(str(path))
        cfg = load_config(["model.source=hf", f"model.path={path}", "train.moe_expert_bias_update_rate=0.001"])
        problems = preflight(cfg, only=("model",)).problems
        if family == "mixtral":
            assert "train.moe_expert_bias_update_rate=0.001: the model at" in problems["model"], problems
            assert "'mixtral', whose routers choose by their scores alone" in problems["model"], problems
        else:
            assert "model" not in problems, problems
    with pytest.raises(ValueError, match="MixtralForCausalLM's routers .* no selection bias"):
        _policy(_model("mixtral"))


@pytest.mark.slow
def test_a_deepseek_v3_run_updates_the_bias_end_to_end(in_process, small_run, tmp_path):
    """A two-step run of a tiny DeepSeek-V3 checkpoint (model.source=hf) with replay and the bias update, through the
    training loop: the bias metrics on both steps, router agreement 1 (the engine routed as the trainer replays), and
    the final checkpoint holds a bias that moved, whose max and min are the last step's logged ones."""
    from relax.config import load_config
    from relax.data.tokenizer import load_tokenizer
    from relax.runner.train import run

    tokenizer = load_tokenizer(load_config([]).model)
    config = _config("deepseek_v3")
    config.vocab_size, config.pad_token_id = len(tokenizer), tokenizer.pad_token_id
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(tmp_path / "model"))
    tokenizer.save_pretrained(str(tmp_path / "model"))
    cfg = load_config(small_run("model.source=hf", f"model.path={tmp_path / 'model'}", "model.dtype=float32",
                                "rollout.routing_replay=true", "train.moe_expert_bias_update_rate=0.01",
                                f"train.save_dir={tmp_path / 'ckpt'}", steps=2))
    result = run(cfg, output_dir=tmp_path / "out")
    assert result.series("rollout/router_agreement") == [1.0, 1.0]
    top, low = result.series(MOE_EXPERT_BIAS_MAX), result.series(MOE_EXPERT_BIAS_MIN)
    assert len(top) == len(low) == 2 and top[-1] > 0 > low[-1]
    policies = sorted({f.parent for f in (tmp_path / "ckpt").rglob("policy/*.safetensors")})
    assert len(policies) == 1  # train.save_interval=0: the final checkpoint only
    saved = {}
    for f in sorted(policies[0].glob("*.safetensors")):
        saved |= load_file(str(f))
    bias = torch.stack([t for n, t in sorted(saved.items()) if n.endswith("e_score_correction_bias")])
    assert bias.shape == (2, 8) and bias.dtype == torch.float32
    assert float(bias.max()) == pytest.approx(top[-1], abs=0) and float(bias.min()) == pytest.approx(low[-1], abs=0)
