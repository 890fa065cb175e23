"""MegatronActorGroup: TP=2 rank actors on a local Ray, behind the PolicyWorker interface."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                or importlib.util.find_spec("megatron.core") is None,
                                reason="megatron-core is not installed (pip install -e '.[megatron]')")]


def test_actor_group_tp2_speaks_the_policy_worker_interface(tmp_path, ray_local):
    from relax.algorithms.grpo import GRPOConfig
    from relax.batch import TrainBatch
    from relax.config import resolve
    from relax.config.schema import ModelConfig, RelaxConfig, RolloutConfig, TrainConfig
    from relax.metrics import ACTOR_COMPUTE_TIME, GRAD_NORM, PG_LOSS
    from relax.models.hf import build_model
    from relax.roles.megatron_actor import MegatronActorGroup
    from relax.roles.workers import ModelInfo
    from relax.train.torch_policy import TorchPolicy

    model = ModelConfig(name="tiny-test", source="config", dtype="float32", hidden_size=32, num_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                        max_position_embeddings=64)
    train = TrainConfig(backend="megatron", tensor_parallel_size=2, lr=1e-2, micro_batch_size=4, num_rollout=2,
                        num_steps_per_rollout=1, calculate_per_token_loss=True)
    cfg = resolve(RelaxConfig(algorithm=GRPOConfig(), model=model, train=train,
                              rollout=RolloutConfig(temperature=0.8), seed=5))
    info = ModelInfo(vocab_size=32, pad_token_id=0, eos_token_ids=(1,))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 32, (6, 7), generator=g)
    batch = TrainBatch(prompt_ids=ids[:, :4], prompt_mask=torch.ones(6, 4, dtype=torch.long),
                       response_ids=ids[:, 4:], response_mask=torch.ones(6, 3, dtype=torch.long),
                       rollout_logp=torch.zeros(6, 3), finish_reason=["stop"] * 6,
                       advantages=torch.randn(6, 1, generator=g).expand(6, 3).clone())
    ref = TorchPolicy(model, train, vocab_size=32, pad_token_id=0, seed=5, temperature=0.8, num_threads=1,
                      total_steps=2)

    group = None
    try:
        group = MegatronActorGroup(cfg, info, threads=1)
        assert group.ping() == "ok"
        torch.testing.assert_close(group.logprobs(batch), ref.compute_logprobs(batch, 4), atol=1e-5, rtol=0)
        out = group.train_step(batch, rollout_mismatch=True)
        expected = ref.train_step(batch, cfg.algorithm, per_token=True, micro_batch_size=4, rollout_mismatch=True)
        assert out[PG_LOSS] == pytest.approx(expected[PG_LOSS], rel=1e-4)
        assert out[GRAD_NORM] == pytest.approx(expected[GRAD_NORM], rel=1e-4)
        assert out[ACTOR_COMPUTE_TIME] > 0
        weights = group.weights().tensors()  # WeightBuffers, through the object store
        hf = build_model(model, 32, 0, seed=99)
        hf.load_state_dict(weights, strict=False)  # tied lm_head comes with the embedding
        for name, value in ref.state_dict_for_rollout().items():
            torch.testing.assert_close(hf.state_dict()[name], value, atol=1e-5, rtol=1e-4)
        group.save(str(tmp_path / "ckpt"))
        second = group.train_step(batch)
        group.load(str(tmp_path / "ckpt"))
        again = group.train_step(batch)
        for m in (second, again):
            m.pop(ACTOR_COMPUTE_TIME)
        assert again == pytest.approx(second, rel=1e-6)
        group.save_hf(str(tmp_path / "hf"))
        assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "model.safetensors").is_file()
    finally:
        if group is not None:
            group.kill()
