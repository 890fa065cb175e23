"""Rules of mixture-of-experts models (model.arch=qwen3_moe, rollout.routing_replay, rollout.record_routes,
train.moe_aux_loss_coef, train.moe_z_loss_coef, train.moe_expert_bias_update_rate) and of the parity gate
(train.mismatch_gate); docs/training.md, "Mixture of experts" and "Parity gate" (MoE models on the Megatron backend,
train.expert_parallel_size: `relax.config.megatron_rules`). Pure: reads the config only. A model read from files
(`model.source=hf`) is checked before start by the pre-Ray checks (`relax.models.moe.check_moe_checkpoint`, which read
its config.json) and again when the trainer starts, against the model it loaded
(`relax.train.routing.TrainerRouting.for_model`: no MoE router, no replay and no MoE loss; no selection bias to update).
"""

from __future__ import annotations

from relax.algorithms.base import Violation
from relax.config.megatron_rules import NOT_BUILT
from relax.config.schema import MOE_ARCHS, ModelConfig, RelaxConfig

MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


def moe_violations(cfg: RelaxConfig) -> list[Violation]:
    """Every broken rule of MoE models and of the parity gate."""
    m, ro, t = cfg.model, cfg.rollout, cfg.train
    out: list[Violation] = []

    def require(ok: bool, fields: str | tuple[str, ...], message: str) -> None:
        if not ok:
            out.append(Violation(fields=(fields,) if isinstance(fields, str) else fields, message=message))

    defaults = ModelConfig()
    if m.source != "config" or m.arch not in MOE_ARCHS:
        for key in MOE_FIELDS:
            require(getattr(m, key) == getattr(defaults, key), f"model.{key}",
                    f"model.{key}={getattr(m, key)} has no effect: it sizes a mixture-of-experts model built from "
                    f"config (model.source=config, model.arch={'|'.join(MOE_ARCHS)})")
    elif min(getattr(m, key) for key in MOE_FIELDS) > 0 and m.num_experts_per_tok > m.num_experts:
        # (a size <= 0 is the schema's range rule's to name: `positive(..., when=("arch", MOE_ARCHS))`)
        require(False, ("model.num_experts_per_tok", "model.num_experts"),
                f"model.num_experts_per_tok={m.num_experts_per_tok} must be <= model.num_experts={m.num_experts}")
    moe_option = [name for name, on in (("rollout.routing_replay", ro.routing_replay),
                                        ("rollout.record_routes", ro.record_routes),
                                        ("train.moe_aux_loss_coef", t.moe_aux_loss_coef > 0),
                                        ("train.moe_z_loss_coef", t.moe_z_loss_coef > 0)) if on]
    for name in moe_option:
        require(m.source != "config" or m.arch in MOE_ARCHS, (name, "model.arch"),
                f"{name} acts on a mixture-of-experts model, but model.arch={m.arch} is dense (model=tiny_moe or "
                "tiny_vl_moe, or a Qwen3-MoE checkpoint such as model=qwen3_30b_a3b)")
    rate = t.moe_expert_bias_update_rate
    if rate > 0:
        name = f"train.moe_expert_bias_update_rate={rate}"
        # Every router a model built from config has (Qwen3-MoE, Qwen3-VL-MoE; a dense model none) chooses by its
        # scores alone: there is no selection bias to move. DeepSeek-V3 / GLM-4.5 are read from files, checked by
        # the pre-Ray checks against their config.json.
        require(m.source != "config", ("train.moe_expert_bias_update_rate", "model.arch"),
                f"{name} updates the selection bias (e_score_correction_bias) of DeepSeek-V3 / GLM-4.5 routers "
                f"(auxiliary-loss-free load balancing), but model.arch={m.arch} built from config has "
                f"{'no such bias in its routers' if m.arch in MOE_ARCHS else 'no MoE router'} (a deepseek_v3 or "
                "glm4_moe checkpoint: model.source=hf, model.path=...)")
        require(t.backend == "torch", ("train.moe_expert_bias_update_rate", "train.backend"),
                f"{name} with train.backend={t.backend} {NOT_BUILT}: the Megatron backend builds Qwen3-MoE routers "
                "only, which have no selection bias (use train.backend=torch)")
        require(m.lora_rank <= 0, ("train.moe_expert_bias_update_rate", "model.lora_rank"),
                f"{name} with model.lora_rank={m.lora_rank} {NOT_BUILT}: the bias is a buffer of the frozen base "
                "model, which a LoRA checkpoint (the adapters) and rollout.lora_sync=adapter do not carry")
    routes = ro.routing_replay or ro.record_routes
    require(not (ro.routing_replay and ro.record_routes), "rollout.record_routes",
            "rollout.record_routes=true has no effect with rollout.routing_replay=true (replay records the routes "
            "too)")
    if routes:
        name = "rollout.routing_replay" if ro.routing_replay else "rollout.record_routes"
        require(ro.backend == "embedded" or ro.sglang.server == "embedded" or bool(ro.sglang.urls),
                (name, "rollout.sglang.server"),
                f"{name} with rollout.sglang.server={ro.sglang.server} {NOT_BUILT}: SGLang answers routed experts "
                "only to requests that carry return_routed_experts, which the sglang-router in front of the servers "
                "(0.3.2) drops; the embedded servers (rollout.sglang.server=embedded) answer them to every request "
                "(servers at rollout.sglang.urls are checked by their first answer)")
        require(cfg.data.openai_agent is None, (name, "data.openai_agent"),
                f"{name} with data.openai_agent {NOT_BUILT}: gateway sessions do not carry routed experts")
        require(not (ro.routing_replay and m.gradient_checkpointing),
                ("rollout.routing_replay", "model.gradient_checkpointing"),
                f"rollout.routing_replay=true with model.gradient_checkpointing=true {NOT_BUILT}: the recomputed "
                "forward of the backward would route afresh instead of replaying")
    if t.mismatch_gate == "off":
        for key in ("mismatch_gate_metric", "mismatch_gate_bound", "mismatch_gate_steps"):
            require(getattr(t, key) == getattr(type(t)(), key), (f"train.{key}", "train.mismatch_gate"),
                    f"train.{key}={getattr(t, key)} has no effect with train.mismatch_gate=off")
    else:
        require(not cfg.algorithm.use_rollout_logprobs, ("train.mismatch_gate", "algorithm.use_rollout_logprobs"),
                f"train.mismatch_gate={t.mismatch_gate} measures the trainer's log-probs against the engine's, but "
                "algorithm.use_rollout_logprobs=true takes the engine's as the old log-probs (no trainer pass)")
    return out
