"""The router tensors a bf16 rollout engine keeps in fp32 (transformers' `_keep_in_fp32_modules_strict`: DeepSeek-V3's
and GLM-4.5's `gate.weight` and `e_score_correction_bias`; none for the other registered families) travel in fp32 on
every sync path, so the engine holds the trainer's router bit for bit and chooses the experts the trainer's fp32
weights choose; the trainer computes those routers in fp32 under bf16 autocast, as the engine does."""

from __future__ import annotations

import pytest
import torch
from moe_hooks import hand_group_topk, tiny_moe_model
from test_moe_families import _config as family_config

from relax.config.schema import ModelConfig, TrainConfig
from relax.models.hf import cast_parameters, kept_in_fp32, with_fp32_kept
from relax.models.moe import moe_routers
from relax.models.weight_buffers import WeightBuffers, cpu_state
from relax.rollout.embedded import EmbeddedEngine
from relax.rollout.sglang.wire import flatten_bucket, unflatten_bucket
from relax.train.logprobs import forward_logprobs
from relax.train.torch_policy import TorchPolicy

V = 64
FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "deepseek_v3", "glm4_moe"]
SIGMOID = ("deepseek_v3", "glm4_moe")


def _model(family: str, seed: int = 0) -> torch.nn.Module:
    """The tiny fp32 model of `family` built from its config; a sigmoid router's weights drawn OFF the bf16 grid
    (each entry a bf16 value plus up to half a bf16 step), so bf16 rounding moves every entry and, near a tie of two
    experts, the choice."""
    def init(router: torch.nn.Module) -> None:
        w = torch.randn(router.weight.shape) * 0.5
        grid = w.bfloat16().float()
        step = (torch.nextafter(grid.bfloat16(), torch.tensor(float("inf"), dtype=torch.bfloat16)).float()
                - grid).abs()
        router.weight.copy_(grid + step * torch.empty_like(w).uniform_(-0.49, 0.49))
        if family in SIGMOID:
            router.e_score_correction_bias.normal_(0.0, 0.05)

    return tiny_moe_model(family_config(family), init, seed)


def _fp32_names(model: torch.nn.Module) -> set[str]:
    return {n for n, t in model.state_dict().items() if t.is_floating_point() and t.dtype == torch.float32}


@pytest.mark.parametrize("family", FAMILIES)
def test_kept_in_fp32_is_what_the_bf16_engine_holds_in_fp32(tmp_path, family):
    """Per registered family: the tensors a bf16 engine loaded by from_pretrained holds in fp32 (read off the engine,
    the independent side) are exactly `kept_in_fp32`, the routers' weight and bias for DeepSeek-V3 / GLM-4.5 and none
    for the others; an engine cast in place (.gguf, built from config) holds the same."""
    from transformers import AutoModelForCausalLM

    model = _model(family)
    model.save_pretrained(str(tmp_path / family))
    engine = AutoModelForCausalLM.from_pretrained(str(tmp_path / family), dtype=torch.bfloat16)
    kept = kept_in_fp32(model, torch.bfloat16)
    assert _fp32_names(engine) == kept
    if family in SIGMOID:
        assert kept == {f"model.layers.{i}.mlp.gate.{n}" for i in (1, 2) for n in ("weight", "e_score_correction_bias")}
    else:
        assert kept == set()
    assert kept_in_fp32(model, torch.float32) == kept_in_fp32(model, None) == set()
    cast_parameters(model, torch.bfloat16)
    assert _fp32_names(model) == kept


def test_qwen3_vl_moe_keeps_nothing_in_fp32():
    from relax.models.hf import build_model

    model = build_model(ModelConfig(name="tiny_vl_moe", arch="qwen3_vl_moe", dtype="float32"), 300, 0, seed=0)
    assert moe_routers(model) and kept_in_fp32(model, torch.bfloat16) == set()


def _rollout_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights a trainer ships a bf16 engine: cast, the kept tensors fp32."""
    return with_fp32_kept(cpu_state(model.state_dict().items(), torch.bfloat16), model, torch.bfloat16)


def _engine(tmp_path, family: str) -> tuple[EmbeddedEngine, torch.nn.Module]:
    """A bf16 engine loaded from a checkpoint of another draw of the model (the sync must bring the trainer's)."""
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"{family}-engine"
    _model(family, seed=5).save_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    return EmbeddedEngine(model, eos_token_ids=[1], pad_token_id=0), model


@pytest.mark.parametrize("family", SIGMOID)
def test_every_sync_path_gives_the_engine_the_trainers_fp32_router(tmp_path, family):
    """The rollout state in bf16 holds the routers in fp32 and everything else in bf16; after the embedded engine
    loads it (in-process, through the WeightBuffers Ray ships, and staged), and through SGLang's flattened bucket,
    each router weight equals the trainer's fp32 one bit for bit (which bf16 rounding would change: every entry is
    off the bf16 grid). The bytes cost: the routers' share of the state."""
    model = _model(family)
    state = _rollout_state(model)
    kept = kept_in_fp32(model, torch.bfloat16)
    assert {n for n, t in state.items() if t.dtype == torch.float32} == kept
    assert all(t.dtype == torch.bfloat16 for n, t in state.items() if n not in kept and t.is_floating_point())
    want = {n: model.state_dict()[n] for n in kept}
    for name, w in want.items():
        assert torch.equal(state[name], w)
        if name.endswith("gate.weight"):
            assert (w.bfloat16().float() != w).all()  # the negative control: bf16 on the wire changes every entry
    extra = sum(t.numel() * 2 for n, t in state.items() if n in kept)  # fp32 over bf16: 2 more bytes an entry
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert extra / total < 0.02, (extra, total)

    for route in ("dict", "buffers", "staged"):
        engine, engine_model = _engine(tmp_path, family)
        if route == "dict":
            engine.load_weights(state, version=1)
        elif route == "buffers":
            engine.load_weights(dict(WeightBuffers.of(state).tensors()), version=1)
        else:
            engine.stage_weights(state, version=1)
            engine.load_weights(state, version=1)
        got = engine_model.state_dict()
        for name, w in want.items():
            assert got[name].dtype == torch.float32 and torch.equal(got[name], w), (route, name)
    sent = dict(unflatten_bucket(flatten_bucket(sorted(state.items()))))
    for name, w in want.items():
        assert sent[name].dtype == torch.float32 and torch.equal(sent[name], w)


def _policy(model: torch.nn.Module, **model_cfg) -> TorchPolicy:
    return TorchPolicy(ModelConfig(**{"dtype": "float32", **model_cfg}), TrainConfig(lr=0.0), vocab_size=V,
                       pad_token_id=0, seed=0, device="cpu", num_threads=1, model=model)


@pytest.mark.parametrize("lora_sync", [None, "merged", "adapter"])
def test_the_policys_rollout_state_carries_the_fp32_router(tmp_path, lora_sync):
    """TorchPolicy.state_dict_for_rollout(bf16): the full state and a LoRA policy's merged weights hold the routers
    in fp32, bit for bit the trainer's, and a bf16 engine loads them so; the adapters-only state holds adapters only."""
    model = _model("deepseek_v3")
    want = {n: t.clone() for n, t in model.state_dict().items() if n in kept_in_fp32(model, torch.bfloat16)}
    lora = {} if lora_sync is None else dict(lora_rank=4, lora_alpha=8.0, lora_target_modules=["o_proj"])
    policy = TorchPolicy(ModelConfig(dtype="float32", **lora), TrainConfig(lr=0.0), vocab_size=V, pad_token_id=0,
                         seed=0, device="cpu", num_threads=1, model=model, lora_sync=lora_sync or "merged")
    state = policy.state_dict_for_rollout(dtype=torch.bfloat16)
    if lora_sync == "adapter":
        assert state and all(".lora_" in n for n in state)
        return
    assert len(want) == 4 and {n for n, t in state.items() if t.dtype == torch.float32} == set(want)
    engine, engine_model = _engine(tmp_path, "deepseek_v3")
    engine.load_weights(state, version=1)
    got = engine_model.state_dict()
    for name, w in want.items():
        assert torch.equal(state[name], w) and torch.equal(got[name], w), name


def _observe(routers) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.dtype]]:
    seen = []
    for layer, router in enumerate(routers):
        router.register_forward_hook(lambda m, args, out, layer=layer: seen.append(
            (layer, args[0].detach().float(), out[2].detach().long().sort(-1).values, out[0].dtype)))
    return seen


def _compare(observed, routers, weights) -> tuple[int, int]:
    """Each observed router call's choice against the fp64 choice by hand with the trainer's fp32 `weights` on its
    clearly decided tokens (margin > 1e-5: far above fp32 rounding of the scores, below what bf16 rounding of the
    weights moves them by): (tokens compared, tokens where the bf16-rounded weights choose otherwise)."""
    compared = rounded_differs = 0
    for layer, hidden, chosen, _ in observed:
        want, margin = hand_group_topk(routers[layer], hidden, weights[layer], routers[layer].e_score_correction_bias)
        rounded, _ = hand_group_topk(routers[layer], hidden, weights[layer].bfloat16().float(),
                                      routers[layer].e_score_correction_bias)
        clear = margin > 1e-5
        assert torch.equal(chosen[clear], want[clear]), (layer, int((chosen != want).any(-1)[clear].sum()))
        compared += int(clear.sum())
        rounded_differs += int((rounded != want).any(-1)[clear].sum())
    return compared, rounded_differs


PROMPTS = [[5, 6, 7, 8, 9], [20, 21, 22, 23], [30, 31]] * 6


def test_the_bf16_trainer_routes_with_its_fp32_router():
    """A tiny DeepSeek-V3 built from config, its routers perturbed off the bf16 grid: the trainer's forward under bf16
    autocast computes the routers in fp32 (fp32 logits) and chooses, on every clearly decided token, what its fp32
    weights choose (fp64 by hand from the router's own input). Negative control: the bf16-rounded weights choose
    otherwise on some of those tokens (what autocast's bf16 linear chose before)."""
    model = _model("deepseek_v3")
    routers = moe_routers(model)
    weights = [r.weight.detach().clone() for r in routers]
    samples = EmbeddedEngine(_model("deepseek_v3"), eos_token_ids=[1], pad_token_id=0).generate(
        PROMPTS, n_samples_per_prompt=4, max_new_tokens=12, seed=4)
    seen = _observe(routers)
    forward_logprobs(model, samples, device=torch.device("cpu"), compute_dtype=torch.bfloat16, temperature=1.0)
    forward_logprobs(model, samples, device=torch.device("cpu"), compute_dtype=torch.bfloat16, temperature=1.0)
    assert seen and all(dtype == torch.float32 for *_, dtype in seen)
    compared, rounded_differs = _compare(seen, routers, weights)
    assert compared > 1000 and rounded_differs > 0, (compared, rounded_differs)


def test_the_synced_bf16_engine_routes_with_the_trainers_fp32_router(tmp_path):
    """The same model, no replay: after a sync the bf16 engine's routers (from_pretrained: fp32 routers) choose, on
    every clearly decided token, what the trainer's fp32 router weights choose (fp64 by hand from the engine router's
    own input), so the trainer and the engine agree there. Negative control: the bf16-rounded weights, which the
    engine held before, choose otherwise on some of those tokens."""
    model = _model("deepseek_v3")
    weights = [r.weight.detach().clone() for r in moe_routers(model)]
    engine, engine_model = _engine(tmp_path, "deepseek_v3")
    engine.load_weights(_rollout_state(model), version=1)
    routers = moe_routers(engine_model)
    seen = _observe(routers)
    engine.generate(PROMPTS, n_samples_per_prompt=4, max_new_tokens=12, seed=4)
    compared, rounded_differs = _compare(seen, routers, weights)
    assert compared > 1000 and rounded_differs > 0, (compared, rounded_differs)
