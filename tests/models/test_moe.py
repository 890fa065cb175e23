"""Mixture-of-experts models (relax.models.moe, relax.rollout.routes, relax.train.routing): the embedded engine on
Qwen3-MoE against a plain Hugging Face forward, rollout routing replay in the torch trainer, the load-balancing
loss, the routes in Samples, and the config rules."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from relax.algorithms.grpo import GRPOConfig
from relax.batch import Samples, TrainBatch, concat_samples
from relax.config.schema import ModelConfig, TrainConfig
from relax.models.hf import build_model, position_ids_from_mask, token_logprobs
from relax.models.moe import load_balancing_loss, moe_routers, recorded_mask
from relax.rollout.embedded import EmbeddedEngine
from relax.train.routing import routes_in_layout
from relax.train.torch_policy import TorchPolicy

V = 64
MOE = ModelConfig(arch="qwen3_moe", dtype="float32")  # 2 layers, 4 experts, top-2
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def _engine(model: torch.nn.Module, *, fast_path: bool | None = None, dtype=None) -> EmbeddedEngine:
    eng = EmbeddedEngine(model, eos_token_ids=[1], pad_token_id=0, fast_path=fast_path, dtype=dtype)
    eng.record_routes = True
    return eng


def _hf_routes(model: torch.nn.Module, samples: Samples) -> torch.Tensor:
    """[N, P+T, L, k] top-k experts of a plain HF forward over prompt+response (output_router_logits: the top-k of
    each layer's softmax, as Qwen3MoeTopKRouter chooses)."""
    ids, mask = samples.sequences()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                    output_router_logits=True)
    k = model.config.num_experts_per_tok
    layers = [torch.softmax(z.float(), -1).topk(k, -1).indices.view(*ids.shape, k) for z in out.router_logits]
    return torch.stack(layers, dim=2)


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.long().sort(-1).values == b.long().sort(-1).values).all(-1)


@pytest.mark.parametrize("fast_path", [True, False])
def test_engine_matches_plain_hf_forward(fast_path):
    """Greedy tokens are the argmax of a plain HF forward, log-probs equal its log-softmax, and the recorded experts
    of every fed token and layer are the ones HF's own router chooses (fast path and DynamicCache path)."""
    model = build_model(MOE, V, 0, seed=0)
    eng = _engine(model, fast_path=fast_path)
    assert eng.fast_path is fast_path
    s = eng.generate(PROMPTS, n_samples_per_prompt=2, max_new_tokens=10, seed=1, temperature=1.0)
    ids, mask = s.sequences()
    P, T = s.prompt_ids.shape[1], s.response_ids.shape[1]
    with torch.no_grad():
        ref = token_logprobs(model, ids, mask, P, T)
    valid = s.response_mask.bool()
    assert torch.allclose(ref[valid], s.rollout_logp[valid], atol=1e-5)
    greedy = eng.generate(PROMPTS, max_new_tokens=10, seed=1, temperature=0.0)  # greedy: argmax of HF's logits
    gids, gmask = greedy.sequences()
    with torch.no_grad():
        logits = model(input_ids=gids, attention_mask=gmask, position_ids=position_ids_from_mask(gmask)).logits
    Pg = greedy.prompt_ids.shape[1]
    argmax = logits[:, Pg - 1:-1].argmax(-1)
    gvalid = greedy.response_mask.bool()
    assert torch.equal(argmax[gvalid], greedy.response_ids[gvalid])
    # routes: [N, P+T, layers, k] uint8, recorded on every real token the engine fed (all but each row's last)
    routes = s.routed_experts
    assert routes.shape == (len(s), P + T, 2, 2) and routes.dtype == torch.uint8
    known = recorded_mask(routes, 4)
    fed = torch.cat([s.prompt_mask, s.response_mask], 1).bool()
    last = P + s.response_mask.sum(1) - 1
    fed[torch.arange(len(s)), last] = False
    assert torch.equal(known.all(-1), fed) and torch.equal(known.any(-1), fed)
    assert bool(_same_sets(_hf_routes(model, s), routes)[fed].all())


def _perturbed_engine(seed: int = 1, scale: float = 0.3) -> EmbeddedEngine:
    """An engine whose routers disagree with the trainer's: each router weight plus scale * std * noise."""
    model = build_model(MOE, V, 0, seed=0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in moe_routers(model):
            router.weight.add_(scale * router.weight.std() * torch.randn(router.weight.shape, generator=g))
    return _engine(model)


def _policy(replay: bool, **train) -> TorchPolicy:
    return TorchPolicy(MOE, TrainConfig(**train), vocab_size=V, pad_token_id=0, seed=0, device="cpu",
                       num_threads=1, routing_replay=replay)


def _experts_seen(model: torch.nn.Module) -> list[list[torch.Tensor]]:
    """The top-k index every Qwen3MoeExperts call receives, per layer: an observer independent of RouterControl."""
    seen: list[list[torch.Tensor]] = []
    for layer in model.model.layers:
        calls: list[torch.Tensor] = []
        seen.append(calls)
        layer.mlp.experts.register_forward_hook(lambda m, args, out, calls=calls: calls.append(args[1].detach()))
    return seen


@pytest.mark.parametrize("packed", [False, True])
def test_replayed_routes_equal_recorded(packed):
    """With routing replay, the experts every trainer forward sends each token to (old log-probs and the training
    step, trimmed or packed micro-batches) are the engine's, on every recorded token of every layer, although the
    engine's routers disagree with the trainer's."""
    s = _perturbed_engine().generate(PROMPTS, n_samples_per_prompt=3, max_new_tokens=12, seed=2)
    policy = _policy(True, pack_sequences=packed)
    seen = _experts_seen(policy.model)
    policy.compute_logprobs(s, micro_batch_size=4)
    batch = TrainBatch.from_samples(s, advantages=torch.randn(s.response_mask.shape) * s.response_mask)
    out = policy.train_step(batch, GRPOConfig(), per_token=True, micro_batch_size=4)
    assert out["rollout/router_agreement"] == 1.0 and out["rollout/router_own_agreement"] < 0.95
    checked = 0
    for calls in seen:
        assert len(calls) == 6  # 3 micro-batches (9 rows of 4) in each of the two passes
    # the micro-batches in the order the trainer ran them
    from relax.train.trainer import length_sorted_micro_batches

    splits = length_sorted_micro_batches(s, 4, packed=packed)
    for call, rows in enumerate(splits + splits):
        want = routes_in_layout(s.select(rows), packed)  # [M, L, k], -1 where not recorded
        for layer, calls in enumerate(seen):
            got = calls[call]
            known = (want[:, layer] >= 0).all(-1)
            assert got.shape[0] == want.shape[0]
            assert bool(_same_sets(got[known], want[known, layer]).all())
            checked += int(known.sum())
    assert checked > 200


def test_replay_brings_agreement_to_one_and_mismatch_down():
    """A disagreeing engine (router weights perturbed by 0.3 std): without replay 22% of token-layers route
    differently and the mean |trainer - rollout| log-prob is 3.1e-3; replay brings the agreement to 1 and the
    mismatch to 3.3e-4 (docs/training.md, "Mixture of experts")."""
    s = _perturbed_engine().generate([[5, 6, 7, 8], [9, 10, 11]] * 4, n_samples_per_prompt=4, max_new_tokens=16,
                                     seed=3)
    valid = s.response_mask.bool()
    results = {}
    for replay in (False, True):
        policy = _policy(replay)
        logp = policy.compute_logprobs(s, micro_batch_size=8)
        results[replay] = (float((logp - s.rollout_logp)[valid].abs().mean()), policy.routing.metrics())
    (diff_off, m_off), (diff_on, m_on) = results[False], results[True]
    assert m_off["rollout/router_agreement"] < 0.85 and m_on["rollout/router_agreement"] == 1.0
    assert m_on["rollout/router_own_agreement"] == pytest.approx(m_off["rollout/router_own_agreement"], abs=0.02)
    assert diff_off > 2e-3 and diff_on < 5e-4 and diff_on < diff_off / 5


def test_engine_without_routes_is_unchanged():
    """Recording changes nothing the engine samples; off, Samples carry no routes."""
    model = build_model(MOE, V, 0, seed=0)
    eng = EmbeddedEngine(model, eos_token_ids=[1], pad_token_id=0)
    plain = eng.generate(PROMPTS, n_samples_per_prompt=2, max_new_tokens=8, seed=4)
    eng.record_routes = True
    rec = eng.generate(PROMPTS, n_samples_per_prompt=2, max_new_tokens=8, seed=4)
    assert plain.routed_experts is None and rec.routed_experts is not None
    assert torch.equal(plain.response_ids, rec.response_ids) and torch.equal(plain.rollout_logp, rec.rollout_logp)


def test_load_balancing_loss_formula():
    """One layer: HF's Switch loss (whose f sums to k) divided by k; by hand: balanced routing gives 1."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 6, generator=g)
    experts = torch.softmax(logits, -1).topk(2, -1).indices
    ours = load_balancing_loss(logits, experts, None, 6, 2)
    assert float(ours) == pytest.approx(float(load_balancing_loss_func((logits,), 6, 2)) / 2, rel=1e-6)
    uniform = torch.zeros(6, 3)
    balanced = torch.tensor([0, 1, 2, 0, 1, 2])[:, None]  # each expert gets a third of the tokens
    assert float(load_balancing_loss(uniform, balanced, None, 3, 1)) == pytest.approx(1.0)
    valid = torch.arange(37) < 20  # padding left out: the same as the valid rows alone
    assert float(load_balancing_loss(logits, experts, valid, 6, 2)) == pytest.approx(
        float(load_balancing_loss(logits[:20], experts[:20], None, 6, 2)), rel=1e-6)


def test_aux_loss_metric_and_gradient():
    """train.moe_aux_loss_coef: train/moe_aux_loss is the loss of the step's tokens (one micro-batch: by hand from
    HF's router logits), and the coefficient changes the routers' gradients, not those of what lies above the last
    router (the final norm, the last layer's experts)."""
    s = _engine(build_model(MOE, V, 0, seed=0)).generate(PROMPTS, n_samples_per_prompt=2, max_new_tokens=8, seed=5)
    batch = TrainBatch.from_samples(s, advantages=torch.randn(s.response_mask.shape) * s.response_mask)
    grads = {}
    for coef in (0.0, 0.5):
        policy = _policy(False, moe_aux_loss_coef=coef, lr=0.0)
        policy.model.eval()  # no dropout anyway; the same forward as below
        ids, mask = s.sequences()
        with torch.no_grad():
            z = policy.model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                             output_router_logits=True).router_logits
        real = mask.reshape(-1).bool()
        by_hand = sum(float(load_balancing_loss(zl, torch.softmax(zl, -1).topk(2, -1).indices, real, 4, 2))
                      for zl in z) / len(z)
        seen = {}
        for name, p in policy.model.named_parameters():
            p.register_hook(lambda g, name=name, seen=seen: seen.__setitem__(name, g.clone()))
        out = policy.train_step(batch, GRPOConfig(), per_token=True, micro_batch_size=len(s))
        if coef > 0:
            assert out["train/moe_aux_loss"] == pytest.approx(by_hand, rel=1e-4)
        else:
            assert "train/moe_aux_loss" not in out
        grads[coef] = seen
    router = "model.layers.0.mlp.gate.weight"
    assert not torch.allclose(grads[0.0][router], grads[0.5][router])
    for after in ("model.norm.weight", "model.layers.1.mlp.experts.down_proj"):  # above the last router
        assert torch.allclose(grads[0.0][after], grads[0.5][after])


def test_routes_travel_with_samples():
    """select keeps each row's routes; concat re-pads prompts on the left and responses on the right."""
    eng = _engine(build_model(MOE, V, 0, seed=0))
    a = eng.generate([[5, 6]], n_samples_per_prompt=2, max_new_tokens=4, seed=6)
    b = eng.generate([[7, 8, 9, 10, 11]], n_samples_per_prompt=2, max_new_tokens=9, seed=7)
    both = concat_samples([a, b])
    ids, _ = both.sequences()
    P = both.prompt_ids.shape[1]
    for part, rows in ((a, slice(0, 2)), (b, slice(2, 4))):
        p = part.prompt_ids.shape[1]
        got = both.routed_experts[rows]
        assert torch.equal(got[:, P - p:P + part.response_ids.shape[1]], part.routed_experts)
        assert bool((got[:, :P - p] == 255).all()) and bool((got[:, P + part.response_ids.shape[1]:] == 255).all())
    assert torch.equal(both.select(torch.tensor([3])).routed_experts, both.routed_experts[3:4])
    with pytest.raises(ValueError, match="some parts only"):
        concat_samples([a, dataclasses.replace(b, routed_experts=None)])


def test_dense_model_rejects_replay():
    with pytest.raises(ValueError, match="no MoE router"):
        TorchPolicy(ModelConfig(), TrainConfig(), vocab_size=V, pad_token_id=0, seed=0, device="cpu",
                    num_threads=1, routing_replay=True)


def test_routes_survive_a_checkpoint_of_the_rollout_stream(tmp_path):
    """The rollout stream's checkpoint (its buffered batches, `samples_state`, written and read back with
    weights_only=True) keeps each sample's routes exactly: a resumed run replays what the engine recorded."""
    from relax.runner.checkpoint import read_rollout_state, write_rollout_state
    from relax.runner.rollout_driver.stream import samples_state

    s = _engine(build_model(MOE, V, 0, seed=0)).generate(PROMPTS, n_samples_per_prompt=2, max_new_tokens=6, seed=8)
    write_rollout_state(tmp_path, {"buffer": [{"samples": samples_state(s)}]})
    back = Samples(**read_rollout_state(tmp_path)["buffer"][0]["samples"])
    assert back.routed_experts.dtype == torch.uint8 and torch.equal(back.routed_experts, s.routed_experts)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_moe_options_need_an_moe_checkpoint_before_start(tmp_path, arch):
    """rollout.routing_replay on a model read from files: a dense checkpoint is refused by the pre-Ray checks,
    naming the option and the model's type; a Qwen3-MoE one passes."""
    from relax.config import load_config
    from relax.runner.preflight import preflight

    build_model(ModelConfig(arch=arch), 40, 0, seed=0).save_pretrained(str(tmp_path / "m"))
    cfg = load_config(["model.source=hf", f"model.path={tmp_path / 'm'}", "rollout.routing_replay=true"])
    pre = preflight(cfg, only=("model",))
    if arch == "qwen3":
        assert "rollout.routing_replay=true" in pre.problems["model"] and "'qwen3'" in pre.problems["model"]
    else:
        assert pre.ok, pre.problems


def test_episode_routes_cover_every_turn_and_observation():
    """Multi-turn episodes (guess_number: the model's turns and the environment's observations in one generation):
    every token the engine fed, observations included, carries the experts HF's own router chooses over the whole
    episode, and the trainer replays them (agreement 1)."""
    from relax.agents.episode import EpisodeMaker
    from relax.agents.loops import AgentFactory
    from relax.data.tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    model = build_model(MOE, len(tok), tok.pad_token_id, seed=0)
    engine = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    engine.record_routes = True
    maker = EpisodeMaker(AgentFactory("guess_number", [], None, None), tok, max_turns=4, max_tool_errors=3)
    text = tok.apply_chat_template([{"role": "user", "content": "guess"}], add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    eps = [maker.new({"label": str(s)}) for s in (2, 7) for _ in range(2)]
    s = engine.generate([prompt, prompt[1:]], n_samples_per_prompt=2, max_new_tokens=40, seed=3, episodes=eps,
                        turn_limit=4)
    assert int(s.obs_mask().sum()) > 0
    P = s.prompt_ids.shape[1]
    fed = torch.cat([s.prompt_mask, s.present()], 1).bool()
    fed[torch.arange(len(s)), P + s.present().sum(1) - 1] = False  # each row's last token is never fed
    known = recorded_mask(s.routed_experts, MOE.num_experts)
    assert torch.equal(known.all(-1), fed)
    assert bool(_same_sets(_hf_routes(model, s), s.routed_experts)[fed].all())
    policy = TorchPolicy(MOE, TrainConfig(), vocab_size=len(tok), pad_token_id=tok.pad_token_id, seed=0,
                         device="cpu", num_threads=1, routing_replay=True)
    policy.compute_logprobs(s, micro_batch_size=4)
    assert policy.routing.metrics()["rollout/router_agreement"] == 1.0
