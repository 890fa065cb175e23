"""The routed experts of a `/generate` answer, as SGLang sends them (`--enable-return-routed-experts` on the server,
`return_routed_experts: true` in the request; docs/training.md, "Mixture of experts").

SGLang's format: `meta_info["routed_experts"]` is the base64 encoding of an int32 array [seqlen - 1, layers, k] in
row-major order, seqlen = prompt tokens + output tokens: the top-k experts of every token the engine fed through the
model (the prompt, then each output token but the last, which was sampled and never fed), in every MoE layer
(SGLang's `RoutedExpertsCapturer.get_routed_experts`; clients decode it with NumPy's `frombuffer` as int32).
`encode` writes it (the embedded server), `decode` reads it back (the client), and `place` puts one answer's routes
into the columns of `Samples.routed_experts` (prompt left-padded, response right-padded), where a token without a
route (padding, the last output token) holds the missing value (`relax.models.moe.route_fill`).
"""

from __future__ import annotations

import base64
from typing import Any, Optional

import numpy as np
import torch

from relax.config.vision_rules import VL_MOE_SGLANG_ROUTES
from relax.models.gguf_cache import gguf_config
from relax.models.moe import route_dtype, route_fill
from relax.models.moe_families import (
    ROUTED_MODEL_TYPES,
    dense_among_sparse,
    dense_among_sparse_message,
    family_of_model_type,
)


def encode(routes: torch.Tensor) -> str:
    """SGLang's `routed_experts` string of routes [tokens, layers, k] (any integer dtype)."""
    array = routes.to(torch.int32).contiguous().numpy()
    return base64.b64encode(array.tobytes()).decode("ascii")


def decode(value: Any, num_layers: int, top_k: int) -> torch.Tensor:
    """[tokens, layers, k] int32 of an answer's `routed_experts`; ValueError when it is not SGLang's format or not
    of this model's MoE layers and top-k."""
    if not isinstance(value, str):
        raise ValueError(f"meta_info.routed_experts is {type(value).__name__}, not SGLang's base64 string")
    try:
        raw = base64.b64decode(value.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as exc:
        raise ValueError(f"meta_info.routed_experts is not base64: {exc}") from None
    width = num_layers * top_k
    if len(raw) % (4 * width):
        raise ValueError(f"meta_info.routed_experts holds {len(raw)} bytes, not whole tokens of {num_layers} MoE "
                         f"layers x top-{top_k} int32 experts")
    return torch.from_numpy(np.frombuffer(raw, dtype=np.int32).copy()).view(-1, num_layers, top_k)


def place(rows: list[tuple[int, int, Optional[torch.Tensor]]], P: int, T: int, num_layers: int, top_k: int,
          num_experts: int) -> torch.Tensor:
    """`Samples.routed_experts` [N, P + T, layers, k] (the compact dtype of `num_experts`) of N answers, each given as
    (prompt tokens, output tokens, its decoded routes or None): a row's prompt at columns P - prompt .. P - 1, its
    output from column P; routes beyond the tokens fed (prompt + output - 1) are refused, fewer leave the rest
    missing."""
    dtype = route_dtype(num_experts)
    out = torch.full((len(rows), P + T, num_layers, top_k), route_fill(dtype), dtype=dtype)
    for i, (prompt, n_out, routes) in enumerate(rows):
        if routes is None:
            continue
        fed = prompt + max(n_out - 1, 0)
        if routes.shape[0] > fed:
            raise ValueError(f"an answer routed {routes.shape[0]} tokens, more than the {fed} it fed ({prompt} prompt "
                             f"and {n_out} output tokens, the last never fed)")
        bad = (routes < 0) | (routes >= num_experts)
        if bool(bad.any()):
            raise ValueError(f"an answer routed tokens to experts {sorted(set(routes[bad].tolist()))[:5]} outside "
                             f"0..{num_experts - 1}")
        seq = torch.full((prompt + n_out, num_layers, top_k), route_fill(dtype), dtype=dtype)
        seq[:routes.shape[0]] = routes.to(dtype)
        out[i, P - prompt:P] = seq[:prompt]
        out[i, P:P + n_out] = seq[prompt:]
    return out


def moe_shape(model_cfg: Any) -> tuple[int, int, int]:
    """(MoE layers, experts per token, experts) of the run's model (`model.source=config`: its fields; a model read
    from files: its config.json, of a registered router family, `relax.models.moe_families`); ValueError for a model
    without routed experts of such a family, or with dense layers among its sparse ones (DeepSeek-V3's and GLM-4.5's
    first_k_dense_replace, Qwen-MoE's decoder_sparse_step / mlp_only_layers: which layers SGLang's answer would hold
    is not read)."""
    if model_cfg.source == "config":
        if model_cfg.arch == "qwen3_vl_moe":  # refused before start (relax.config.vision_rules)
            raise ValueError(VL_MOE_SGLANG_ROUTES)
        if model_cfg.arch != "qwen3_moe":
            raise ValueError(f"model.arch={model_cfg.arch} has no routed experts")
        return int(model_cfg.num_layers), int(model_cfg.num_experts_per_tok), int(model_cfg.num_experts)
    from transformers import AutoConfig

    from relax.models.hf import resolve_model_path

    path = resolve_model_path(model_cfg)
    if model_cfg.source == "gguf":
        config = gguf_config(path)
    else:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    if family_of_model_type(config.model_type) is None:
        raise ValueError(f"the model at {str(path)!r} ({config.model_type}) has no routed experts of a supported "
                         f"router family ({', '.join(ROUTED_MODEL_TYPES)})")
    if hasattr(config, "text_config"):  # a vision-language MoE: refused before start (relax.config.vision_rules)
        raise ValueError(VL_MOE_SGLANG_ROUTES)
    if dense_among_sparse(config):  # refused before start too (relax.models.moe.check_moe_checkpoint)
        raise ValueError(dense_among_sparse_message(config.model_type, str(path)))
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    return int(config.num_hidden_layers), int(config.num_experts_per_tok), int(experts)
