"""The mixture-of-experts router families Relax can record, compare, replay and train the MoE losses of: one
`RouterFamily` per family, registered in `FAMILIES` (docs/training.md, "Mixture of experts").

Each entry says which transformers router class(es) it covers, which `config.json` model_type values hold them, how
to read (and rewrite) the router's forward output, how to recompute the routing weights of FORCED experts from this
model's own router scores (rollout routing replay: the choice is given, the weights keep their gradient through the
router's scores, as megatron-core's `RouterReplay` and slime do), and which scores the load-balancing loss averages.
`relax.models.moe.RouterControl` hooks every router of a registered class and asks the family; nothing else
branches on the family. The formulas are transformers' own (5.x; each router's `forward`):

- softmax then top-k (Qwen3-MoE, Qwen2-MoE, Mixtral, Qwen3-VL-MoE's text model): p = softmax(z) in fp32, the top-k
  of p, weights p[top-k], renormalised to sum 1 when `norm_topk_prob` (Mixtral and Qwen3-VL-MoE always: their routers
  have no such switch), then cast to z's dtype (Mixtral keeps fp32);
- top-k over the logits then softmax over the k (gpt-oss): z = h W^T + b (the router's bias is in the logits, so it
  moves both the choice and the weights), weights softmax(z[top-k]);
- sigmoid with a selection-only bias (DeepSeek-V3, GLM-4.5: `deepseek_v3`, `glm4_moe`): s = sigmoid(z) in fp32, the
  experts chosen by s + `e_score_correction_bias` within the `topk_group` best of `n_group` groups, weights s[top-k]
  (the bias left out), divided by their sum + 1e-20 when `norm_topk_prob`, times `routed_scaling_factor`.

A forced expert's weight is that formula at the forced expert, whatever the router would have chosen: for the
sigmoid family the group limit and the bias only decide the choice, so a forced expert outside the router's groups
still gets s[e]. The load-balancing loss averages softmax(z) for the first two families and, as megatron-core does for
sigmoid routers (`compute_routing_scores_for_aux_loss`), s / sum(s) for the third; the z-loss reads z for all.

`RouterFamily.selection_bias` names the router's buffer that enters the choice only (DeepSeek-V3's and GLM-4.5's
`e_score_correction_bias`): the one auxiliary-loss-free load balancing moves (`train.moe_expert_bias_update_rate`,
`relax.train.routing.TrainerRouting.update_selection_bias`); None for a family whose routers have none.

Which router tensors a bf16 rollout engine holds in fp32 is not restated here: the model class declares it
(transformers' `_keep_in_fp32_modules_strict`: DeepSeek-V3's and GLM-4.5's `gate.weight` and
`e_score_correction_bias`; none for the other families), and `relax.models.hf.kept_in_fp32` reads that declaration for
the engine's loading, the trainer's weight sync and the trainer's fp32 router compute alike.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


def softmax_scores(logits: torch.Tensor) -> torch.Tensor:
    """[M, E] fp32 softmax of the router logits: the scores the load-balancing loss of a softmax router averages."""
    return torch.softmax(logits.float(), dim=-1)


def normalised_sigmoid_scores(logits: torch.Tensor) -> torch.Tensor:
    """[M, E] fp32 sigmoid of the router logits over their sum (+ 1e-20): megatron-core's scores of a sigmoid router
    for the load-balancing loss."""
    s = torch.sigmoid(logits.float())
    return s / (s.sum(-1, keepdim=True) + 1e-20)


def read_triple(output: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [M, E], weights [M, k], experts [M, k]) of a router that returns them as one tuple in that order (every
    family registered here, in transformers 5.x)."""
    logits, weights, experts = output
    return logits, weights, experts


def write_triple(output: tuple, weights: torch.Tensor, experts: torch.Tensor) -> tuple:
    """The router output `read_triple` read, with the weights and experts the block will use instead."""
    return output[0], weights, experts


def _softmax_topk_weights(router: nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    # Qwen3MoeTopKRouter / Qwen2MoeTopKRouter: softmax(z, dtype=float), p[top-k], / sum under norm_topk_prob,
    # cast to z's dtype
    top = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, experts)
    if router.norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    return top.to(logits.dtype)


def _mixtral_weights(router: nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    # MixtralTopKRouter: softmax(z.float()), p[top-k], always / sum, left in fp32
    top = torch.softmax(logits.float(), dim=-1).gather(1, experts)
    return top / top.sum(-1, keepdim=True)


def _qwen3_vl_moe_weights(router: nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    # Qwen3VLMoeTextTopKRouter: softmax(z, dtype=float), p[top-k], always / sum, cast to z's dtype
    top = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, experts)
    return (top / top.sum(-1, keepdim=True)).to(logits.dtype)


def _gpt_oss_weights(router: nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    # GptOssTopKRouter: softmax over the k chosen logits (bias included), in z's dtype
    return torch.softmax(logits.gather(1, experts), dim=1, dtype=logits.dtype)


def _sigmoid_weights(router: nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    # DeepseekV3TopkRouter / Glm4MoeTopkRouter: sigmoid(z) (z is fp32 there), s[top-k] without the correction bias,
    # / (sum + 1e-20) under norm_topk_prob, * routed_scaling_factor
    top = torch.sigmoid(logits).gather(1, experts)
    if router.norm_topk_prob:
        top = top / (top.sum(-1, keepdim=True) + 1e-20)
    return top * router.routed_scaling_factor


@dataclass(frozen=True)
class RouterFamily:
    """One router family: `name` (in messages and docs), the `config.json` model_type values whose routers these are,
    the router classes ("module:Class", imported when first needed), the forced-expert weights
    `weights(router, logits [M, E], experts [M, k] long) -> [M, k]` (as the router itself would return them for
    those experts), the load-balancing scores `aux_scores(logits) -> [M, E]`, and how to read / rewrite the router's
    forward output; `selection_bias`: the name of the router's fp32 [E] buffer added to the scores for the choice
    only (auxiliary-loss-free load balancing updates it), None when its routers have none."""

    name: str
    model_types: tuple[str, ...]
    router_paths: tuple[str, ...]
    weights: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    aux_scores: Callable[[torch.Tensor], torch.Tensor] = softmax_scores
    read: Callable[[tuple], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = read_triple
    write: Callable[[tuple, torch.Tensor, torch.Tensor], tuple] = write_triple
    selection_bias: str | None = None

    def router_classes(self) -> tuple[type, ...]:
        out = []
        for path in self.router_paths:
            module, _, name = path.partition(":")
            out.append(getattr(importlib.import_module(module), name))
        return tuple(out)


_T = "transformers.models"
FAMILIES: tuple[RouterFamily, ...] = (
    RouterFamily("Qwen3-MoE / Qwen2-MoE (softmax, top-k)", ("qwen3_moe", "qwen2_moe"),
                 (f"{_T}.qwen3_moe.modeling_qwen3_moe:Qwen3MoeTopKRouter",
                  f"{_T}.qwen2_moe.modeling_qwen2_moe:Qwen2MoeTopKRouter"),
                 _softmax_topk_weights),
    RouterFamily("Mixtral (softmax, top-k, renormalised)", ("mixtral",),
                 (f"{_T}.mixtral.modeling_mixtral:MixtralTopKRouter",), _mixtral_weights),
    RouterFamily("Qwen3-VL-MoE (softmax, top-k, renormalised; the text model's routers, image tokens included)",
                 ("qwen3_vl_moe",),
                 (f"{_T}.qwen3_vl_moe.modeling_qwen3_vl_moe:Qwen3VLMoeTextTopKRouter",), _qwen3_vl_moe_weights),
    RouterFamily("gpt-oss (top-k logits, softmax over k)", ("gpt_oss",),
                 (f"{_T}.gpt_oss.modeling_gpt_oss:GptOssTopKRouter",), _gpt_oss_weights),
    RouterFamily("DeepSeek-V3 / GLM-4.5 (sigmoid, group-limited top-k)", ("deepseek_v3", "glm4_moe"),
                 (f"{_T}.deepseek_v3.modeling_deepseek_v3:DeepseekV3TopkRouter",
                  f"{_T}.glm4_moe.modeling_glm4_moe:Glm4MoeTopkRouter"),
                 _sigmoid_weights, aux_scores=normalised_sigmoid_scores, selection_bias="e_score_correction_bias"),
)

ROUTED_MODEL_TYPES: tuple[str, ...] = tuple(t for f in FAMILIES for t in f.model_types)
# the model_types whose routers have a selection bias (auxiliary-loss-free load balancing can update it)
SELECTION_BIAS_MODEL_TYPES: tuple[str, ...] = tuple(t for f in FAMILIES if f.selection_bias for t in f.model_types)


def dense_among_sparse(config: object) -> bool:
    """Whether a transformers config has dense layers among its sparse MoE ones (DeepSeek-V3's and GLM-4.5's
    first_k_dense_replace, Qwen-MoE's decoder_sparse_step / mlp_only_layers; a vision-language config: its text
    config's). SGLang's answer of routed experts would then hold layers whose order Relax does not read."""
    config = getattr(config, "text_config", None) or config
    return (int(getattr(config, "decoder_sparse_step", 1) or 1) != 1
            or bool(list(getattr(config, "mlp_only_layers", []) or []))
            or int(getattr(config, "first_k_dense_replace", 0) or 0) > 0)


def dense_among_sparse_message(model_type: str, path: str) -> str:
    """Why routes of such a model (`dense_among_sparse`) are refused over SGLang's protocol: the same words before
    start (`relax.models.moe.check_moe_checkpoint`) and where the routes are sized (`relax.rollout.sglang.routes`)."""
    return (f"routed experts of a model with dense layers among its sparse ones ({model_type} at {path!r}) are not "
            "read over SGLang's protocol (the embedded engine, rollout=embedded, records them)")


def family_of_model_type(model_type: str) -> RouterFamily | None:
    """The registered family of a `config.json` model_type (None: not one whose routes Relax handles)."""
    return next((f for f in FAMILIES if model_type in f.model_types), None)


_CLASSES: dict[type, RouterFamily] = {}


def router_families() -> dict[type, RouterFamily]:
    """{router class: its family} of every registered family (imported once)."""
    if not _CLASSES:
        for family in FAMILIES:
            for cls in family.router_classes():
                _CLASSES[cls] = family
    return _CLASSES
