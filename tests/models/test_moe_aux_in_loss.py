"""`train/loss` is the loss the torch trainer back-propagates, the MoE load-balancing term included
(`train.moe_aux_loss_coef`): `pg_loss + kl_loss_coef * kl_loss - entropy_coef * entropy + coef * moe_aux_loss`,
the load-balancing loss computed by hand from Hugging Face's router logits."""

from __future__ import annotations

import pytest
import torch

from relax.algorithms.grpo import GRPOConfig
from relax.batch import TrainBatch
from relax.config.schema import ModelConfig, TrainConfig
from relax.models.hf import build_model, position_ids_from_mask
from relax.models.moe import load_balancing_loss
from relax.rollout.embedded import EmbeddedEngine
from relax.train.torch_policy import TorchPolicy

V = 64
MOE = ModelConfig(arch="qwen3_moe", dtype="float32")  # 2 layers, 4 experts, top-2
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def batch() -> TrainBatch:
    s = EmbeddedEngine(build_model(MOE, V, 0, seed=0), eos_token_ids=[1], pad_token_id=0).generate(
        PROMPTS, n_samples_per_prompt=2, max_new_tokens=8, seed=5)
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(s.response_mask.shape, generator=g) * s.response_mask
    ref = (s.rollout_logp + 0.3 * torch.randn(s.response_mask.shape, generator=g)) * s.response_mask
    return TrainBatch.from_samples(s, advantages=adv, ref_logp=ref)


def policy(coef: float) -> TorchPolicy:
    return TorchPolicy(MOE, TrainConfig(moe_aux_loss_coef=coef, lr=0.0), vocab_size=V, pad_token_id=0, seed=0,
                       device="cpu", num_threads=1)


def aux_by_hand(model: torch.nn.Module, batch: TrainBatch) -> float:
    """The load-balancing loss of the whole batch's real tokens (mean over MoE layers) from HF's router logits."""
    ids, mask = batch.sequences()
    with torch.no_grad():
        z = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                  output_router_logits=True).router_logits
    real = mask.reshape(-1).bool()
    return sum(float(load_balancing_loss(zl, torch.softmax(zl, -1).topk(2, -1).indices, real, 4, 2))
               for zl in z) / len(z)


ALGOS = {"pg": GRPOConfig(), "kl_entropy": GRPOConfig(use_kl_loss=True, kl_loss_coef=0.2, entropy_coef=0.05)}


@pytest.mark.parametrize("algo", list(ALGOS))
def test_train_loss_includes_the_load_balancing_term(batch, algo):
    cfg, coef = ALGOS[algo], 0.5
    p = policy(coef)
    by_hand = aux_by_hand(p.model.eval(), batch)
    out = p.train_step(batch, cfg, per_token=True, micro_batch_size=len(batch))
    assert out["train/moe_aux_loss"] == pytest.approx(by_hand, rel=1e-4)
    others = out["train/pg_loss"] + cfg.kl_loss_coef * out.get("train/kl_loss", 0.0) \
        - cfg.entropy_coef * out["train/entropy"]  # per token: the entropy term is reduced as train/entropy is
    assert out["train/loss"] == pytest.approx(others + coef * by_hand, rel=1e-5, abs=1e-7)
    # negative control: without the coefficient the same weights give a train/loss smaller by coef * aux
    plain = policy(0.0).train_step(batch, cfg, per_token=True, micro_batch_size=len(batch))
    assert "train/moe_aux_loss" not in plain and plain["train/pg_loss"] == pytest.approx(out["train/pg_loss"])
    assert plain["train/loss"] == pytest.approx(others, rel=1e-5, abs=1e-7)
    assert out["train/loss"] - plain["train/loss"] == pytest.approx(coef * by_hand, rel=1e-4)


def test_train_loss_adds_each_micro_batchs_share(batch):
    """Several micro-batches: each adds coef * (its share of the rows) * its own loss, as the gradient does; the
    step's train/moe_aux_loss is that row-weighted mean, so train/loss = pg_loss + coef * moe_aux_loss still."""
    out = policy(0.25).train_step(batch, GRPOConfig(), per_token=True, micro_batch_size=2)
    assert out["train/moe_aux_loss"] > 0.5
    assert out["train/loss"] == pytest.approx(out["train/pg_loss"] + 0.25 * out["train/moe_aux_loss"], rel=1e-6)
