"""Routing of every registered MoE router family (relax.models.moe_families) on the torch trainer and the embedded
engine, each a tiny model built from its own transformers config: forced routes get the family's weights, computed
here by hand (one token at a time, `math`) from the router's logits, themselves computed by hand from the router's
input; replaying a model's own routes is the identity; the MoE losses read the router logits and the family's
scores; the engine's routes replay in the trainer; unsupported families are refused before start."""

from __future__ import annotations

import math

import pytest
import torch
from moe_hooks import observe_moe_blocks, tiny_moe_model

from relax.batch import TrainBatch
from relax.config.schema import ModelConfig, TrainConfig
from relax.metrics import MOE_AUX_LOSS, MOE_Z_LOSS, ROUTER_AGREEMENT, ROUTER_OWN_AGREEMENT
from relax.models.moe import moe_routers, router_control, stack_recorded
from relax.rollout.embedded import EmbeddedEngine
from relax.train.torch_policy import TorchPolicy

V = 64
COMMON = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, max_position_embeddings=128, pad_token_id=0, bos_token_id=None, eos_token_id=1,
              tie_word_embeddings=False)
PLAIN_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _config(family: str):
    import transformers as tr

    if family == "qwen3_moe":
        return tr.Qwen3MoeConfig(**COMMON, head_dim=8, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                 norm_topk_prob=True)
    if family == "qwen2_moe":  # norm_topk_prob=False (Qwen2-MoE's default): the weights are p[top-k] as they are
        return tr.Qwen2MoeConfig(**COMMON, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                 num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)
    if family == "mixtral":
        return tr.MixtralConfig(**COMMON, head_dim=8, num_local_experts=8, num_experts_per_tok=2)
    if family == "gpt_oss":
        return tr.GptOssConfig(**{**COMMON, "intermediate_size": 32}, rope_parameters=PLAIN_ROPE, head_dim=8,
                               num_local_experts=8,
                               num_experts_per_tok=2, sliding_window=8,
                               layer_types=["sliding_attention", "full_attention"])
    if family == "deepseek_v3":  # a dense first layer, then sparse ones; 4 groups of 2, the best 2 groups kept
        return tr.DeepseekV3Config(**{**COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4},
                                   rope_parameters=PLAIN_ROPE, moe_intermediate_size=32, n_routed_experts=8,
                                   num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                                   n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=16,
                                   kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    if family == "glm4_moe":  # 2 groups of 4, the best one kept
        return tr.Glm4MoeConfig(**{**COMMON, "num_hidden_layers": 3}, head_dim=8, moe_intermediate_size=32,
                                n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=1.8,
                                norm_topk_prob=True)
    raise AssertionError(family)


FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "deepseek_v3", "glm4_moe"]
SIGMOID = ("deepseek_v3", "glm4_moe")


def _model(family: str, seed: int = 0) -> torch.nn.Module:
    """The tiny model of `family` in fp32 (eager attention), its routers' weights drawn large enough that the
    experts are far from ties, and the biases that enter the routing (gpt-oss's router bias, DeepSeek-V3 / GLM's
    selection bias) nonzero."""
    def init(router: torch.nn.Module) -> None:
        router.weight.normal_(0.0, 0.5)
        if family == "gpt_oss":
            router.bias.normal_(0.0, 0.5)
        if family in SIGMOID:
            router.e_score_correction_bias.normal_(0.0, 0.3)

    return tiny_moe_model(_config(family), init, seed)


def _perturb(model: torch.nn.Module, family: str, seed: int = 1, scale: float = 0.5) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in moe_routers(model):
            router.weight.add_(scale * router.weight.std() * torch.randn(router.weight.shape, generator=g))
            if family == "gpt_oss":
                router.bias.add_(scale * torch.randn(router.bias.shape, generator=g))
            if family in SIGMOID:
                router.e_score_correction_bias.add_(0.3 * torch.randn(router.num_experts, generator=g))


def _ids() -> torch.Tensor:
    return torch.randint(2, V, (3, 7), generator=torch.Generator().manual_seed(2))


def _record(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of a plain forward, the routes every router chose in it [B * S, L, k] long)."""
    control = router_control(model)
    control.recording = True
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits
    finally:
        control.recording = False
    B, S = ids.shape
    return logits, stack_recorded(control, B, S).reshape(B * S, control.num_layers, control.top_k).long()


def logits_by_hand(router: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """z = h W^T (+ b for gpt-oss) in fp64, from the router's input."""
    h = hidden.reshape(-1, router.weight.shape[1]).double()
    z = h @ router.weight.detach().double().T
    if getattr(router, "bias", None) is not None:
        z = z + router.bias.detach().double()
    return z


def weights_by_hand(family: str, router: torch.nn.Module, z: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The family's routing weights of the given experts, one token at a time from transformers' formulas."""
    out = torch.zeros(experts.shape, dtype=torch.float64)
    for m in range(z.shape[0]):
        row = z[m].tolist()
        chosen = experts[m].tolist()
        if family in ("qwen3_moe", "qwen2_moe", "mixtral"):  # softmax over all experts, then the chosen ones
            total = sum(math.exp(v) for v in row)
            w = [math.exp(row[e]) / total for e in chosen]
            if family == "mixtral" or router.norm_topk_prob:
                w = [x / sum(w) for x in w]
        elif family == "gpt_oss":  # softmax over the chosen logits only (the router bias is in them)
            total = sum(math.exp(row[e]) for e in chosen)
            w = [math.exp(row[e]) / total for e in chosen]
        else:  # sigmoid, the selection bias left out, normalised, scaled
            w = [1.0 / (1.0 + math.exp(-row[e])) for e in chosen]
            if router.norm_topk_prob:
                w = [x / (sum(w) + 1e-20) for x in w]
            w = [x * router.routed_scaling_factor for x in w]
        out[m] = torch.tensor(w, dtype=torch.float64)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_forced_routes_get_the_family_weights_of_the_perturbed_router(family):
    """Routes recorded from one forward, forced on the same tokens after the router weights (and biases) were
    perturbed: every MoE block computes with exactly the recorded experts, weighted by the family's formula of the
    PERTURBED router's logits at those experts (by hand, 1e-6), although the perturbed router itself would choose
    other experts on some token-layers."""
    model = _model(family)
    ids = _ids()
    _, routes = _record(model, ids)
    _perturb(model, family)
    inputs, used = observe_moe_blocks(model)
    control = router_control(model)
    control.arm(routes, force=True, collect=False)
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        control.disarm()
    compared, same_used, same_own = control.take_counts().tolist()
    assert compared == routes.shape[0] * control.num_layers
    assert same_used == compared and same_own < compared  # forcing changed some experts
    routers = moe_routers(model)
    assert len(used) == len(inputs) == len(routers) == control.num_layers
    for layer, router in enumerate(routers):
        experts, weights = used[layer]
        assert torch.equal(experts.long(), routes[:, layer])
        want = weights_by_hand(family, router, logits_by_hand(router, inputs[layer]), routes[:, layer])
        torch.testing.assert_close(weights.double(), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_replaying_a_models_own_routes_is_the_identity(family, dtype):
    """Forcing the routes a model just chose reproduces its logits bit for bit, and its gradient on every router
    weight (the weights keep their gradient through the router's scores); in bf16 too, where the dtype each family
    returns its weights in (Qwen-MoE and gpt-oss: the logits', Mixtral and the sigmoid routers: fp32) shows."""
    model = _model(family).to(dtype)
    ids = _ids()
    plain, routes = _record(model, ids)
    control = router_control(model)

    def grads(force: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        control.arm(routes if force else None, force=force, collect=False)
        try:
            logits = model(input_ids=ids).logits
        finally:
            control.disarm()
        (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
        return logits.detach(), [r.weight.grad.clone() for r in moe_routers(model)]

    own_logits, own_grads = grads(False)
    forced_logits, forced_grads = grads(True)
    assert torch.equal(own_logits, plain) and torch.equal(forced_logits, plain)
    assert control.take_counts().tolist()[1:] == [routes.shape[0] * control.num_layers] * 2
    for own, forced in zip(own_grads, forced_grads, strict=True):
        assert float(forced.abs().max()) > 0
        torch.testing.assert_close(forced, own, atol=1e-7, rtol=1e-5)


def _samples(family: str):
    """Samples the embedded engine generated on the PERTURBED copy of the family's model, routes recorded."""
    model = _model(family)
    _perturb(model, family)
    engine = EmbeddedEngine(model, eos_token_ids=[1], pad_token_id=0)
    engine.record_routes = True
    return engine.generate([[5, 6, 7, 8], [9, 10, 11]], n_samples_per_prompt=3, max_new_tokens=8, seed=3)


def _policy(family: str, replay: bool, **train) -> TorchPolicy:
    return TorchPolicy(ModelConfig(dtype="float32"), TrainConfig(lr=0.0, **train), vocab_size=V, pad_token_id=0,
                       seed=0, device="cpu", num_threads=1, model=_model(family), routing_replay=replay)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_routes_replay_in_the_trainer_and_the_losses_read_the_family_scores(family):
    """The embedded engine (on a perturbed copy) records every fed token's experts through the family's hooks; the
    trainer replays them (agreement 1 where its own routers disagree), and a training step's load-balancing loss and
    router z-loss equal the hand formulas over the router logits of that forward (computed by hand from each
    router's input) and the family's scores: softmax(z), or for a sigmoid router sigmoid(z) / sum."""
    s = _samples(family)
    assert s.routed_experts is not None and bool((s.routed_experts != 255).any())
    policy = _policy(family, True, moe_aux_loss_coef=0.01, moe_z_loss_coef=0.001)
    policy.compute_logprobs(s, micro_batch_size=len(s))
    m = policy.routing.metrics()
    assert m[ROUTER_AGREEMENT] == 1.0 and m[ROUTER_OWN_AGREEMENT] < 1.0

    inputs, used = observe_moe_blocks(policy.model)
    batch = TrainBatch.from_samples(s, advantages=torch.zeros(s.response_mask.shape))
    from relax.algorithms.grpo import GRPOConfig

    out = policy.train_step(batch, GRPOConfig(), per_token=True, micro_batch_size=len(s))
    routers = moe_routers(policy.model)
    assert len(inputs) == len(routers)  # one training forward
    ids, mask = s.sequences()
    real = mask.reshape(-1) != 0
    E, k = routers[0].num_experts, routers[0].top_k
    aux, z2 = [], 0.0
    for layer, router in enumerate(routers):
        z = logits_by_hand(router, inputs[layer])
        experts = used[layer][0].long()
        assert z.shape[0] == experts.shape[0] == real.shape[0]  # no padding trimmed: every row is the longest
        zr, er = z[real], experts[real]
        if family in SIGMOID:
            sig = torch.sigmoid(zr)
            P = (sig / sig.sum(-1, keepdim=True)).mean(0)
        else:
            P = torch.softmax(zr, -1).mean(0)
        f = torch.bincount(er.reshape(-1), minlength=E).double() / zr.shape[0]
        aux.append(E / k * float((f * P).sum()))
        z2 += float((torch.logsumexp(zr, -1) ** 2).sum())
    assert out[MOE_AUX_LOSS] == pytest.approx(sum(aux) / len(aux), rel=1e-5)
    assert out[MOE_Z_LOSS] == pytest.approx(z2 / (len(routers) * int(real.sum())), rel=1e-5)


def test_sigmoid_aux_scores_differ_from_softmax():
    """The sigmoid family's load-balancing scores are not the softmax's (so the test above tells them apart)."""
    from relax.models.moe_families import normalised_sigmoid_scores, softmax_scores

    z = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(normalised_sigmoid_scores(z).mean(0), softmax_scores(z).mean(0), atol=1e-3)


def _save(model: torch.nn.Module, path) -> str:
    model.save_pretrained(str(path))
    return str(path)


@pytest.mark.parametrize("family", FAMILIES)
def test_registered_families_pass_the_checks_before_start(tmp_path, family):
    from relax.config import load_config
    from relax.runner.preflight import preflight

    path = _save(_model(family), tmp_path / "m")
    cfg = load_config(["model.source=hf", f"model.path={path}", "rollout.routing_replay=true",
                       "train.moe_aux_loss_coef=0.01"])
    pre = preflight(cfg, only=("model",))
    assert pre.ok, pre.problems


def _olmoe(tmp_path) -> str:
    """A checkpoint of a mixture-of-experts family no entry registers (OLMoE)."""
    from transformers import AutoModelForCausalLM, OlmoeConfig

    config = OlmoeConfig(**{k: v for k, v in COMMON.items() if k != "bos_token_id"}, num_experts=4,
                         num_experts_per_tok=2)
    return _save(AutoModelForCausalLM.from_config(config), tmp_path / "olmoe")


def test_an_unsupported_moe_family_is_refused_before_start(tmp_path):
    """rollout.routing_replay with an OLMoE checkpoint: refused by the pre-Ray checks naming the option, the model's
    type and the supported ones; in the trainer (a model handed in), refused naming the supported families."""
    from relax.config import load_config
    from relax.runner.preflight import preflight

    path = _olmoe(tmp_path)
    cfg = load_config(["model.source=hf", f"model.path={path}", "rollout.routing_replay=true"])
    pre = preflight(cfg, only=("model",))
    problem = pre.problems["model"]
    assert "rollout.routing_replay=true" in problem and "'olmoe'" in problem and "gpt_oss" in problem, problem
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="no MoE router of qwen3_moe, qwen2_moe, mixtral"):
        TorchPolicy(ModelConfig(dtype="float32"), TrainConfig(), vocab_size=V, pad_token_id=0, seed=0, device="cpu",
                    num_threads=1, model=AutoModelForCausalLM.from_pretrained(path), routing_replay=True)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_other_families_on_megatron_are_refused_before_start(tmp_path, family):
    """train.backend=megatron builds Qwen3-MoE only: a checkpoint of another family is refused by the pre-Ray checks
    naming its type."""
    from relax.config import load_config
    from relax.runner.preflight import preflight

    path = _save(_model(family), tmp_path / "m")
    cfg = load_config(["model.source=hf", f"model.path={path}", "train.backend=megatron",
                       "rollout.routing_replay=true"])
    pre = preflight(cfg, only=("model",))
    problem = pre.problems["model"]
    assert f"{family!r} is not supported by train.backend=megatron" in problem, problem


def test_routes_of_a_family_shape_the_sglang_answers(tmp_path):
    """SGLang-protocol routes (rollout=sglang, embedded servers) are sized by the family's MoE layers, top-k and
    experts read from config.json; a model with a dense first layer (DeepSeek-V3) is refused with the reason."""
    from relax.rollout.sglang.routes import moe_shape

    for family in ("mixtral", "gpt_oss", "qwen2_moe"):
        path = _save(_model(family), tmp_path / family)
        assert moe_shape(ModelConfig(source="hf", path=path)) == (2, 2, 8)
    path = _save(_model("deepseek_v3"), tmp_path / "deepseek_v3")
    with pytest.raises(ValueError, match="dense layers among its sparse ones"):
        moe_shape(ModelConfig(source="hf", path=path))


@pytest.mark.parametrize("family", SIGMOID)
def test_dense_layers_among_sparse_ones_are_refused_before_start_over_sglang(tmp_path, family):
    """The same model with routes over SGLang's protocol (rollout=sglang, embedded servers) is refused by the pre-Ray
    checks with the words the engines' start would use (before, only the engines' start refused it); with the
    embedded rollout the same checkpoint passes them."""
    from relax.config import load_config
    from relax.rollout.sglang.routes import moe_shape
    from relax.runner.preflight import preflight

    path = _save(_model(family), tmp_path / family)
    with pytest.raises(ValueError) as at_start:
        moe_shape(ModelConfig(source="hf", path=path))
    base = ["model.source=hf", f"model.path={path}", "rollout.routing_replay=true"]
    cfg = load_config([*base, "rollout=sglang", "rollout.sglang.server=embedded"])
    problem = preflight(cfg, only=("model",)).problems["model"]
    assert problem == f"rollout.routing_replay=true with rollout=sglang: {at_start.value}", problem
    assert "model" not in preflight(load_config(base), only=("model",)).problems


@pytest.mark.parametrize("family,attention", [("gpt_oss", "eager"), ("mixtral", "sdpa")])
def test_a_checkpoint_loads_with_the_attention_its_class_has(tmp_path, family, attention):
    """gpt-oss's transformers class refuses sdpa (its attention sinks run in eager attention only): a gpt-oss
    checkpoint loads with eager attention, the others keep sdpa; the loaded model's logits are the saved model's."""
    from relax.models.hf import build_model

    model = _model(family)
    path = _save(model, tmp_path / family)
    loaded = build_model(ModelConfig(source="hf", path=path, dtype="float32"), V, 0, seed=0)
    assert loaded.config._attn_implementation == attention
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_a_gpt_oss_classifier_reward_model_loads_with_eager_attention(tmp_path):
    """A gpt-oss sequence-classification reward model (what a merged SEQ_CLS adapter on a gpt-oss base is) loads with
    eager attention, as build_model's causal LM does (one owner: checkpoint_attention); its scores are the saved
    model's."""
    from transformers import GptOssForSequenceClassification

    from relax.data.tokenizer import build_tiny_tokenizer
    from relax.models.reward_model import load_classifier

    tokenizer = build_tiny_tokenizer()
    config = _config("gpt_oss")
    config.vocab_size, config.pad_token_id, config.num_labels = len(tokenizer), tokenizer.pad_token_id, 1
    torch.manual_seed(0)
    model = GptOssForSequenceClassification(config).eval()
    path = _save(model, tmp_path / "gpt_oss_rm")
    tokenizer.save_pretrained(path)
    loaded, _ = load_classifier(path, torch.float32, "cpu")
    assert loaded.config._attn_implementation == "eager"
    ids = torch.randint(3, len(tokenizer), (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
