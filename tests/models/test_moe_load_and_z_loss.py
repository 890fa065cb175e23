"""The expert-load metrics (`train/moe_expert_load_*`) and the router z-loss (`train.moe_z_loss_coef`,
`train/moe_z_loss`) of the torch backend, against a brute-force computation: each Qwen3-MoE router's input captured
by a hook in a forward over the padded batch (another layout than the trainer's trimmed or packed micro-batches),
its gate run by hand (x W^T, softmax, top-k), the real tokens' experts counted one by one, the ratios taken from the
step's counts. The Megatron backend's equal these: tests/megatron/test_megatron_moe_load_and_z_loss.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from relax.algorithms.grpo import GRPOConfig
from relax.batch import TrainBatch
from relax.config.schema import ModelConfig, TrainConfig
from relax.models.hf import build_model, position_ids_from_mask
from relax.models.moe import moe_routers
from relax.rollout.embedded import EmbeddedEngine
from relax.train.torch_policy import TorchPolicy

V = 64
MOE = ModelConfig(arch="qwen3_moe", dtype="float32")  # 2 layers, 4 experts, top-2
E, K = 4, 2
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def _batch(model: torch.nn.Module, record: bool) -> TrainBatch:
    engine = EmbeddedEngine(model, eos_token_ids=[1], pad_token_id=0)
    engine.record_routes = record
    s = engine.generate(PROMPTS, n_samples_per_prompt=2, max_new_tokens=8, seed=5)
    keep = torch.arange(s.response_ids.shape[1]) < torch.tensor([8, 5, 3, 8, 6, 2])[:, None]  # right padding
    s = dataclasses.replace(s, response_ids=s.response_ids * keep, response_mask=s.response_mask * keep,
                            rollout_logp=s.rollout_logp * keep)
    adv = torch.randn(s.response_mask.shape, generator=torch.Generator().manual_seed(1)) * s.response_mask
    return TrainBatch.from_samples(s, advantages=adv)


@pytest.fixture(scope="module")
def batch() -> TrainBatch:
    b = _batch(build_model(MOE, V, 0, seed=0), record=False)
    assert bool((b.prompt_mask == 0).any()) and bool((b.present() == 0).any())  # padding on both sides
    return b


def policy(replay: bool = False, **train) -> TorchPolicy:
    return TorchPolicy(MOE, TrainConfig(lr=0.0, **train), vocab_size=V, pad_token_id=0, seed=0, device="cpu",
                       num_threads=1, routing_replay=replay)


def gate_by_hand(model: torch.nn.Module, batch: TrainBatch) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(each MoE layer's router logits x W^T [N * (P+T), E], computed by hand from the router's input in a forward
    over the padded batch, with their gradient; the real-token flags [N * (P+T)])."""
    inputs: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, args, out: inputs.append(args[0])) for r in moe_routers(model)]
    ids, mask = batch.sequences()
    try:
        model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask))
    finally:
        for h in hooks:
            h.remove()
    routers = moe_routers(model)
    logits = [x.reshape(-1, x.shape[-1]) @ r.weight.T for x, r in zip(inputs, routers, strict=True)]
    return logits, mask.reshape(-1) != 0


def count_by_hand(experts: list[torch.Tensor], real: torch.Tensor) -> list[list[int]]:
    """counts[layer][e]: real tokens routed to expert e (experts[layer] [M, k]), one token at a time."""
    counts = [[0] * E for _ in experts]
    for layer, chosen in enumerate(experts):
        for m in range(len(real)):
            if real[m]:
                for e in chosen[m].tolist():
                    counts[layer][e] += 1
    return counts


def load_by_hand(counts: list[list[int]]) -> dict[str, float]:
    out: dict[str, float] = {}
    tops, lows, cvs = [], [], []
    for layer, c in enumerate(counts):
        mean = sum(c) / len(c)
        std = (sum((x - mean) ** 2 for x in c) / len(c)) ** 0.5
        tops.append(max(c) / mean)
        lows.append(min(c) / mean)
        cvs.append(std / mean)
        out[f"train/moe_expert_load_max_over_mean/layer_{layer}"] = max(c) / mean
    out["train/moe_expert_load_max_over_mean"] = max(tops)
    out["train/moe_expert_load_min_over_mean"] = min(lows)
    out["train/moe_expert_load_cv"] = sum(cvs) / len(cvs)
    return out


def own_experts(logits: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.softmax(z.detach().float(), -1).topk(K, -1).indices for z in logits]


@pytest.mark.parametrize("packed", [False, True])
def test_expert_load_equals_a_brute_force_count_of_the_real_tokens(batch, packed):
    """Three micro-batches (trimmed, or packed): the step's counts equal the brute-force count of the real tokens'
    experts; the ratios are of the summed counts. Controls: counting the padding too, or averaging each
    micro-batch's own ratio, gives other values, which the test would tell apart."""
    p = policy(pack_sequences=packed)
    logits, real = gate_by_hand(p.model, batch)
    want = load_by_hand(count_by_hand(own_experts(logits), real))
    out = p.train_step(batch, GRPOConfig(), per_token=True, micro_batch_size=2)
    for name, value in want.items():
        assert out[name] == pytest.approx(value, rel=1e-12), name
    with_padding = load_by_hand(count_by_hand(own_experts(logits), torch.ones_like(real)))
    assert any(with_padding[n] != pytest.approx(want[n], rel=1e-6) for n in want)
    per_mb = []
    for rows in torch.split(torch.arange(len(batch)), 2):
        mb = batch.select(rows)
        z, r = gate_by_hand(p.model, mb)
        per_mb.append(load_by_hand(count_by_hand(own_experts(z), r)))
    mean_of_ratios = {n: sum(m[n] for m in per_mb) / len(per_mb) for n in want}
    assert any(mean_of_ratios[n] != pytest.approx(want[n], rel=1e-6) for n in want)


def test_expert_load_counts_the_replayed_experts():
    """rollout.routing_replay: the experts counted are those the forward used (the engine's, recorded by an engine
    whose routers were perturbed), not the trainer's own choice; where the engine recorded none, the router's own."""
    engine_model = build_model(MOE, V, 0, seed=0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for r in moe_routers(engine_model):
            r.weight.add_(0.5 * r.weight.std() * torch.randn(r.weight.shape, generator=g))
    b = _batch(engine_model, record=True)
    p = policy(replay=True)
    logits, real = gate_by_hand(p.model, b)
    routes = b.routed_experts.long().reshape(-1, *b.routed_experts.shape[2:])  # [N * (P+T), L, k]
    recorded = (routes < E).all(-1)
    own = own_experts(logits)
    used = [torch.where(recorded[:, layer, None], routes[:, layer], own[layer]) for layer in range(len(own))]
    assert any(bool((recorded[:, layer] & real & (used[layer].sort(-1).values != own[layer].sort(-1).values)
                     .any(-1)).any()) for layer in range(len(own)))  # the engine disagrees somewhere
    want = load_by_hand(count_by_hand(used, real))
    out = p.train_step(b, GRPOConfig(), per_token=True, micro_batch_size=2)
    assert out["rollout/router_agreement"] == 1.0
    for name, value in want.items():
        assert out[name] == pytest.approx(value, rel=1e-12), name
    assert load_by_hand(count_by_hand(own, real)) != pytest.approx(want)  # the trainer's own choice: other counts


def test_z_loss_is_the_hand_formula_in_train_loss_and_its_gradient(batch):
    """train/moe_z_loss = mean over MoE layers and real tokens of logsumexp(x W^T)^2 (by hand), measured with the
    coefficient 0 too; with train.moe_z_loss_coef=0.1, train/loss grows by 0.1 times it and every gradient by 0.1
    times the hand formula's: the routers' (and the weights before them), not the last layer's experts nor the head."""
    coef = 0.1
    off, on = policy(), policy(moe_z_loss_coef=coef)
    logits, real = gate_by_hand(off.model, batch)
    z_hand = torch.stack([torch.logsumexp(x.float(), -1)[real].square().mean() for x in logits]).mean()
    hand_grads = torch.autograd.grad(coef * z_hand, [q for _, q in off.model.named_parameters()], allow_unused=True)
    z = float(z_hand.detach())
    off.model.zero_grad(set_to_none=True)
    out_off = off.accumulate_gradients(batch, GRPOConfig(), per_token=True, micro_batch_size=2)
    out_on = on.accumulate_gradients(batch, GRPOConfig(), per_token=True, micro_batch_size=2)
    assert out_off["train/moe_z_loss"] == pytest.approx(z, rel=1e-5)
    assert out_on["train/moe_z_loss"] == pytest.approx(z, rel=1e-5)
    assert out_on["train/loss"] - out_off["train/loss"] == pytest.approx(coef * z, rel=1e-5)
    assert out_on["train/pg_loss"] == pytest.approx(out_off["train/pg_loss"], rel=1e-6)
    params = dict(on.model.named_parameters())
    untouched = set()
    for (name, q_off), g_hand in zip(off.model.named_parameters(), hand_grads, strict=True):
        change = params[name].grad - q_off.grad
        if g_hand is None or float(g_hand.norm()) == 0:
            assert float(change.abs().max()) < 1e-7, name
            untouched.add(name)
            continue
        assert float((change - g_hand).norm() / g_hand.norm()) < 1e-4, name
    for layer in range(MOE.num_layers):
        assert float(hand_grads[list(params).index(f"model.layers.{layer}.mlp.gate.weight")].norm()) > 1e-3
    # after the last router: the last layer's experts and the final norm (the head is tied to the embedding)
    assert {"model.norm.weight", "model.layers.1.mlp.experts.gate_up_proj"} <= untouched


def test_z_loss_on_a_dense_model_is_refused_before_start(tmp_path):
    from relax.config import ConfigError, load_config
    from relax.runner.preflight import preflight

    with pytest.raises(ConfigError) as err:
        load_config(["train.moe_z_loss_coef=0.01"])
    [v] = [v for v in err.value.violations if "train.moe_z_loss_coef" in v.fields]
    assert "model.arch" in v.fields and "dense" in v.message, v.message
    with pytest.raises(ValueError, match="train.moe_z_loss_coef needs a mixture-of-experts model"):
        TorchPolicy(ModelConfig(), TrainConfig(moe_z_loss_coef=0.01), vocab_size=V, pad_token_id=0, seed=0,
                    device="cpu", num_threads=1)
    cfg = load_config(["model=tiny_moe", "train.moe_z_loss_coef=0.01"])
    assert cfg.train.moe_z_loss_coef == 0.01
    build_model(ModelConfig(), 40, 0, seed=0).save_pretrained(str(tmp_path / "dense"))  # read from files
    pre = preflight(load_config(["model.source=hf", f"model.path={tmp_path / 'dense'}", "train.moe_z_loss_coef=0.01"]),
                    only=("model",))
    assert "train.moe_z_loss_coef=0.01" in pre.problems["model"] and "'qwen3'" in pre.problems["model"]
