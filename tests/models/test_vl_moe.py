"""Qwen3-VL-MoE (model.arch=qwen3_vl_moe, model=tiny_vl_moe) on the torch trainer and the embedded engine: a tiny
model built from config; the engine records the experts of every token it feeds, image placeholders included (they go
through the text model's MoE layers like any token), at the columns the trainer lays them out at; replay forces
exactly those experts with the family's weights, computed here by hand (fp64) from each router's input; a two-step
run on an image task replays with router agreement 1; what is not built is refused before start."""

from __future__ import annotations

import pytest
import torch
from moe_hooks import observe_moe_blocks

from relax.algorithms.grpo import GRPOConfig
from relax.batch import TrainBatch
from relax.config import ConfigError, load_config
from relax.config.schema import ModelConfig, TrainConfig
from relax.data.datasets import PromptDataset
from relax.data.images import VisionData, build_tiny_vl_processor, build_tiny_vl_tokenizer
from relax.data.shapes import generate_shapes
from relax.metrics import MOE_AUX_LOSS, MOE_Z_LOSS, ROUTER_AGREEMENT, ROUTER_OWN_AGREEMENT
from relax.models.hf import build_model
from relax.models.moe import moe_routers, router_control, router_family, stack_recorded
from relax.models.vision import vision_inputs
from relax.rollout.embedded import EmbeddedEngine
from relax.train.torch_policy import TorchPolicy

CFG = ModelConfig(name="tiny_vl_moe", arch="qwen3_vl_moe", dtype="float32")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_vl_tokenizer()


@pytest.fixture(scope="module")
def items(tokenizer):
    """Three shape prompts with an image each (the same length: no left padding to trim)."""
    records = [(r, f"shapes:{i}") for i, r in enumerate(generate_shapes(3, seed=0))]
    data = PromptDataset.from_records(records, tokenizer, vision=VisionData(build_tiny_vl_processor(tokenizer)))
    return list(data)


def _model(tokenizer, perturb: bool = False) -> torch.nn.Module:
    """tiny_vl_moe, its routers drawn large (experts far from ties); `perturb`: its routers moved (an engine whose
    routers disagree with the trainer's)."""
    model = build_model(CFG, len(tokenizer), tokenizer.pad_token_id, seed=0).eval()
    draw, g = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in moe_routers(model):
            router.weight.normal_(0.0, 0.5, generator=draw)
            if perturb:
                router.weight.add_(0.5 * router.weight.std() * torch.randn(router.weight.shape, generator=g))
    return model


def test_tiny_vl_moe_is_built_from_config_with_sparse_text_layers(tokenizer):
    model = build_model(CFG, len(tokenizer), tokenizer.pad_token_id, seed=0)
    routers = moe_routers(model)
    assert model.config.model_type == "qwen3_vl_moe"
    assert len(routers) == CFG.num_layers and routers[0].num_experts == CFG.num_experts
    assert routers[0].top_k == CFG.num_experts_per_tok and "Qwen3-VL-MoE" in router_family(routers[0]).name


def test_engine_routes_image_tokens_and_replay_forces_them_with_the_family_weights(tokenizer, items):
    """The engine, on a perturbed copy, records the experts of every prompt token, image placeholders included: the
    same as a plain forward of the perturbed model over the prompts with their images. The trainer (the unperturbed
    model) replays them: every MoE block computes with exactly the engine's experts on every recorded token (image
    tokens included, where its own routers choose otherwise), weighted by softmax(z)[e] / sum over the forced e of
    z = h W^T computed by hand in fp64 from the router's input; router agreement 1, its own below 1."""
    engine_model = _model(tokenizer, perturb=True)
    engine = EmbeddedEngine(engine_model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    engine.record_routes = True
    s = engine.generate([i.prompt_ids for i in items], n_samples_per_prompt=2, max_new_tokens=6, seed=3,
                        vision=[i.vision for i in items])
    N, P = s.prompt_ids.shape
    L, k = CFG.num_layers, CFG.num_experts_per_tok
    assert s.routed_experts is not None and tuple(s.routed_experts.shape[2:]) == (L, k)
    image_id = int(engine_model.config.image_token_id)
    image = s.prompt_ids == image_id
    assert int(image.sum()) > 0

    # the prompts' routes, image tokens included, are the perturbed model's own choice in a plain forward
    control = router_control(engine_model)
    control.recording = True
    with torch.no_grad():
        engine_model(**vision_inputs(engine_model, s.prompt_ids, s.prompt_mask, s.vision))
    control.recording = False
    plain = stack_recorded(control, N, P)
    real = s.prompt_mask.bool()
    assert torch.equal(s.routed_experts[:, :P][real].long().sort(-1).values, plain[real].sort(-1).values)

    model = _model(tokenizer)
    policy = TorchPolicy(CFG, TrainConfig(lr=0.0), vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         seed=0, device="cpu", num_threads=1, model=model, routing_replay=True)
    inputs, used = observe_moe_blocks(policy.model)
    fed: list[torch.Tensor] = []  # the rows as the trainer feeds them (its micro-batches are sorted by length)
    policy.model.register_forward_pre_hook(lambda m, a, kw: fed.append(kw["input_ids"]), with_kwargs=True)
    policy.compute_logprobs(s, micro_batch_size=len(s))
    m = policy.routing.metrics()
    assert m[ROUTER_AGREEMENT] == 1.0 and m[ROUTER_OWN_AGREEMENT] < 1.0

    ids, mask = s.sequences()
    (fed_ids,) = fed
    assert fed_ids.shape == ids.shape  # no column trimmed: every row's tokens at the engine's columns
    order = [next(j for j in range(N) if torch.equal(ids[j], row)) for row in fed_ids]  # a fed row's sample
    ids, mask = ids[order], mask[order]
    engine_routes = s.routed_experts[order].reshape(N * ids.shape[1], L, k).long()
    recorded = (engine_routes != 255).all(-1)  # [M, L]: the engine's last token of each row was never fed
    on_image = (ids == image_id).reshape(-1)
    own_differs_on_image = False
    for layer, router in enumerate(moe_routers(policy.model)):
        h = inputs[layer].reshape(-1, router.weight.shape[1]).double()
        assert h.shape[0] == ids.numel()
        z = h @ router.weight.detach().double().T
        experts, weights = used[layer]
        want = engine_routes[:, layer]
        forced = recorded[:, layer] & (mask.reshape(-1) != 0)
        assert torch.equal(experts[forced].sort(-1).values, want[forced].sort(-1).values)
        p = torch.softmax(z, -1).gather(1, experts.long())
        assert torch.allclose(weights.double(), p / p.sum(-1, keepdim=True), atol=1e-6)
        own = z.topk(k, -1).indices.sort(-1).values
        own_differs_on_image |= bool((own != want.sort(-1).values).any(-1)[forced & on_image].any())
    assert own_differs_on_image  # replay moved image tokens' experts, not only text tokens'

    # packed (train.pack_sequences: the rows without their padding, one shorter than the others) the routes line up
    # too: every recorded token compared and replayed
    assert bool((s.response_mask == 0).any())  # padding there is to drop
    packed = TorchPolicy(CFG, TrainConfig(lr=0.0, pack_sequences=True), vocab_size=len(tokenizer),
                         pad_token_id=tokenizer.pad_token_id, seed=0, device="cpu", num_threads=1,
                         model=_model(tokenizer), routing_replay=True)
    packed.compute_logprobs(s, micro_batch_size=len(s))
    m = packed.routing.metrics()
    assert m[ROUTER_AGREEMENT] == 1.0 and m[ROUTER_OWN_AGREEMENT] < 1.0

    # a training step with the MoE losses on reads the same routes (finite losses, reported)
    batch = TrainBatch.from_samples(s, advantages=torch.zeros(s.response_mask.shape))
    out = TorchPolicy(CFG, TrainConfig(lr=0.0, moe_aux_loss_coef=0.01, moe_z_loss_coef=0.001),
                      vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, seed=0, device="cpu",
                      num_threads=1, model=_model(tokenizer), routing_replay=True).train_step(
        batch, GRPOConfig(), per_token=True, micro_batch_size=len(s))
    assert torch.isfinite(torch.tensor([out[MOE_AUX_LOSS], out[MOE_Z_LOSS]])).all()


@pytest.mark.slow
@pytest.mark.parametrize("layout", [[], ["train.pack_sequences=true"]])
def test_tiny_vl_moe_trains_on_an_image_task_with_routing_replay(in_process, small_run, tmp_path, layout):
    """model=tiny_vl_moe data=shapes, two steps end to end with routing replay and the MoE losses, padded and packed
    (the packed layout's alignment is checked on rows with padding in the test above): the engine's routes reach the
    trainer (router agreement 1 on both steps), the losses and the expert load are reported, and the rollouts held
    images."""
    from relax.runner.train import run

    cfg = load_config(small_run("model=tiny_vl_moe", "data=shapes", "rollout.routing_replay=true",
                                "model.dtype=float32", "train.moe_aux_loss_coef=0.01", "train.moe_z_loss_coef=0.001",
                                *layout, steps=2))
    result = run(cfg, output_dir=tmp_path / "out")
    assert result.series("rollout/router_agreement") == [1.0, 1.0]
    assert len(result.series("rollout/router_own_agreement")) == 2
    assert len(result.series("train/moe_aux_loss")) == 2 and len(result.series("train/moe_z_loss")) == 2
    load = result.series("train/moe_expert_load_max_over_mean")
    assert len(load) == 2 and all(1.0 <= v <= CFG.num_experts / CFG.num_experts_per_tok for v in load)
    assert all(v > 0 for v in result.series("rollout/image_token_frac"))
    assert all(torch.isfinite(torch.tensor(result.series("train/loss"))))


@pytest.mark.parametrize("overrides,field,words", [
    (["rollout=sglang", "rollout.sglang.server=embedded", "rollout.routing_replay=true"], "rollout.routing_replay",
     "Qwen3-VL-MoE) over SGLang's protocol are not built"),
    (["rollout=sglang", "rollout.sglang.server=embedded", "rollout.record_routes=true"], "rollout.record_routes",
     "Qwen3-VL-MoE) over SGLang's protocol are not built"),
    (["train.backend=megatron", "rollout.routing_replay=true"], "train.backend",
     "train.backend=megatron is not built for vision-language models"),
])
def test_what_is_not_built_is_refused_before_start(overrides, field, words):
    with pytest.raises(ConfigError) as exc:
        load_config(["model=tiny_vl_moe", "data=shapes", *overrides])
    hits = [v for v in exc.value.violations if field in v.fields]
    assert hits and words in hits[0].message, [v.message for v in exc.value.violations]


def test_moe_sizes_of_tiny_vl_moe_are_checked():
    with pytest.raises(ConfigError) as exc:
        load_config(["model=tiny_vl_moe", "model.num_experts_per_tok=0"])
    assert any("model.num_experts_per_tok=0 must be > 0" in v.message for v in exc.value.violations)
    with pytest.raises(ConfigError) as exc:
        load_config(["model=tiny_vl_moe", "model.num_experts_per_tok=8"])
    assert any("must be <= model.num_experts=4" in v.message for v in exc.value.violations)
