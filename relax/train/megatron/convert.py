"""Hugging Face <-> Megatron-core state dicts (Qwen3 and Llama layouts), per tensor-parallel rank.

Megatron names are those of `GPTModel` with the local layer spec (`local_to_global` gives a Transformer Engine
model's names these too); layer indices here are GLOBAL (a pipeline
stage's local index plus its layer offset). Layouts:
- `linear_qkv`: per query group g (of num_key_value_heads), the group's query heads, then its key head, then
  its value head; tensor-parallel rank r holds groups r*G/TP .. (r+1)*G/TP-1, so the ranks' shards concatenate
  to the TP=1 layout.
- `linear_fc1`: [gate; up] of each rank's slice of the intermediate dimension (so shards do NOT concatenate to
  the TP=1 layout: each is split into its gate and up halves first).
- column-parallel (`linear_qkv`, `linear_fc1`, `word_embeddings`, `output_layer`) split rows, row-parallel
  (`linear_proj`, `linear_fc2`) split columns, norms are replicated.
- Embedding and output layer hold `padded_vocab_size(TP)` rows; rows past the HF vocab are zero.
- MoE (Qwen3-MoE): `mlp.router.weight` is HF's `mlp.gate.weight`; expert e's `linear_fc1` is HF's
  `mlp.experts.gate_up_proj[e]` ([gate; up], as the dense fc1) and its `linear_fc2` is `mlp.experts.down_proj[e]`
  (transformers' in-memory layout, the experts of a layer stacked in one tensor; `hf_expert_getter` reads the
  per-expert tensors a checkpoint on disk holds). Expert indices here are GLOBAL too (an expert-parallel rank's local
  index plus its expert offset); experts are not split by tensor parallelism (MoE models train at TP=1).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch

from relax.train.megatron.model import ArchSpec

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
# expert tensor -> the HF tensor holding every expert of the layer
_HF_EXPERTS = {"linear_fc1": "mlp.experts.gate_up_proj", "linear_fc2": "mlp.experts.down_proj"}

# Megatron layer-local name -> HF layer-local name, for the tensors that map one to one.
_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
_ROW_PARALLEL = {"self_attention.linear_proj.weight": "self_attn.o_proj.weight", "mlp.linear_fc2.weight":
                 "mlp.down_proj.weight"}


def megatron_names(spec: ArchSpec, *, layers: range, pre_process: bool, post_process: bool,
                   experts: range | None = None) -> list[str]:
    """Megatron parameter names (global layer and expert indices) a stage with `layers` (and, MoE, `experts`:
    default all) holds."""
    names = ["embedding.word_embeddings.weight"] if pre_process else []
    experts = range(spec.num_experts) if experts is None else experts
    for i in layers:
        p = f"decoder.layers.{i}."
        names += [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight",
                  p + "self_attention.linear_proj.weight", p + "pre_mlp_layernorm.weight"]
        if spec.moe:
            names.append(p + "mlp.router.weight")
            for e in experts:
                names += [p + f"mlp.experts.local_experts.{e}.linear_fc1.weight",
                          p + f"mlp.experts.local_experts.{e}.linear_fc2.weight"]
        else:
            names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
        if spec.qk_norm:
            names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
    if post_process:
        names.append("decoder.final_layernorm.weight")
        if not spec.tie_word_embeddings or not pre_process:  # a last stage without the embedding keeps a copy
            names.append("output_layer.weight")
    return names


def _shard(x: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return x.chunk(size, dim=dim)[rank].contiguous()


def _pad_vocab(w: torch.Tensor, rows: int) -> torch.Tensor:
    if w.shape[0] == rows:
        return w
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])


def _qkv_groups(spec: ArchSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q/k/v projections -> Megatron's interleaved [G, (heads/G + 2) * head_dim, H] layout, flattened."""
    G, d = spec.num_key_value_heads, spec.head_dim
    per = spec.num_attention_heads // G
    H = q.shape[-1]
    q = q.reshape(G, per * d, H)
    k = k.reshape(G, d, H)
    v = v.reshape(G, d, H)
    return torch.cat([q, k, v], dim=1).reshape(-1, H)


def _split_qkv(spec: ArchSpec, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `_qkv_groups` for the TP=1 layout."""
    G, d = spec.num_key_value_heads, spec.head_dim
    per = spec.num_attention_heads // G
    H = qkv.shape[-1]
    x = qkv.reshape(G, (per + 2) * d, H)
    q, k, v = x.split([per * d, d, d], dim=1)
    return q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)


def hf_to_megatron(
    spec: ArchSpec,
    get: Callable[[str], torch.Tensor],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    layers: range | None = None,
    pre_process: bool = True,
    post_process: bool = True,
    experts: range | None = None,
) -> dict[str, torch.Tensor]:
    """The Megatron tensors of one (tensor-parallel rank, pipeline stage, expert-parallel rank: `experts`), keyed
    with GLOBAL layer and expert indices.

    `get(hf_name)` returns an HF tensor (so that a caller can read a safetensors file lazily). With tied
    embeddings the HF model has no `lm_head.weight`; the embedding is read for the output layer.
    """
    layers = range(spec.num_layers) if layers is None else layers
    rows = spec.padded_vocab_size(tp_size)
    out: dict[str, torch.Tensor] = {}
    stacked: dict[str, torch.Tensor] = {}  # the layer's stacked experts, read once for all of its experts

    def expert(hf_name: str, e: int) -> torch.Tensor:
        if hf_name not in stacked:
            stacked.clear()
            stacked[hf_name] = get(hf_name)
        return stacked[hf_name][e].clone()

    for name in megatron_names(spec, layers=layers, pre_process=pre_process, post_process=post_process,
                               experts=experts):
        if name == "embedding.word_embeddings.weight":
            out[name] = _shard(_pad_vocab(get("model.embed_tokens.weight"), rows), 0, tp_rank, tp_size)
        elif name == "output_layer.weight":
            source = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
            out[name] = _shard(_pad_vocab(get(source), rows), 0, tp_rank, tp_size)
        elif name == "decoder.final_layernorm.weight":
            out[name] = get("model.norm.weight").clone()
        else:
            m = _LAYER.match(name)
            assert m is not None, name
            i, local = int(m.group(1)), m.group(2)
            hf = f"model.layers.{i}."
            e = _EXPERT.match(local)
            if e is not None:
                out[name] = expert(hf + _HF_EXPERTS[e.group(2)], int(e.group(1)))
            elif local == "mlp.router.weight":
                out[name] = get(hf + "mlp.gate.weight").clone()
            elif local in _SIMPLE:
                out[name] = get(hf + _SIMPLE[local]).clone()
            elif local in _ROW_PARALLEL:
                out[name] = _shard(get(hf + _ROW_PARALLEL[local]), 1, tp_rank, tp_size)
            elif local == "self_attention.linear_qkv.weight":
                qkv = _qkv_groups(spec, get(hf + "self_attn.q_proj.weight"), get(hf + "self_attn.k_proj.weight"),
                                  get(hf + "self_attn.v_proj.weight"))
                out[name] = _shard(qkv, 0, tp_rank, tp_size)
            elif local == "mlp.linear_fc1.weight":
                gate = _shard(get(hf + "mlp.gate_proj.weight"), 0, tp_rank, tp_size)
                up = _shard(get(hf + "mlp.up_proj.weight"), 0, tp_rank, tp_size)
                out[name] = torch.cat([gate, up], dim=0)
            else:  # pragma: no cover - megatron_names and this function list the same names
                raise KeyError(name)
    return out


def megatron_to_hf_tensor(spec: ArchSpec, name: str, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors of one Megatron tensor, given its shards of every tensor-parallel rank (in rank order).

    Replicated tensors take rank 0's copy. An output layer tied to the embedding is not exported (HF ties
    `lm_head` to `model.embed_tokens`). An expert's tensor is part of a stacked HF tensor: `hf_experts_tensor`.
    """
    if name == "embedding.word_embeddings.weight":
        return {"model.embed_tokens.weight": torch.cat(shards)[: spec.vocab_size]}
    if name == "output_layer.weight":
        return {} if spec.tie_word_embeddings else {"lm_head.weight": torch.cat(shards)[: spec.vocab_size]}
    if name == "decoder.final_layernorm.weight":
        return {"model.norm.weight": shards[0]}
    m = _LAYER.match(name)
    if m is None:
        raise KeyError(f"no HF counterpart for Megatron tensor {name!r}")
    hf, local = f"model.layers.{m.group(1)}.", m.group(2)
    if local == "mlp.router.weight":
        return {hf + "mlp.gate.weight": shards[0]}
    if _EXPERT.match(local):
        raise KeyError(f"{name!r} is one expert of a stacked HF tensor: convert the layer's experts with "
                       "hf_experts_tensor")
    if local in _SIMPLE:
        return {hf + _SIMPLE[local]: shards[0]}
    if local in _ROW_PARALLEL:
        return {hf + _ROW_PARALLEL[local]: torch.cat(shards, dim=1)}
    if local == "self_attention.linear_qkv.weight":
        q, k, v = _split_qkv(spec, torch.cat(shards))
        return {hf + "self_attn.q_proj.weight": q, hf + "self_attn.k_proj.weight": k,
                hf + "self_attn.v_proj.weight": v}
    if local == "mlp.linear_fc1.weight":
        halves = [s.chunk(2, dim=0) for s in shards]
        return {hf + "mlp.gate_proj.weight": torch.cat([h[0] for h in halves]),
                hf + "mlp.up_proj.weight": torch.cat([h[1] for h in halves])}
    raise KeyError(f"no HF counterpart for Megatron tensor {name!r}")


def expert_of(name: str) -> tuple[int, int, str] | None:
    """(global layer, global expert, linear_fc1 | linear_fc2) of a Megatron expert tensor's name, else None."""
    m = _LAYER.match(name)
    e = _EXPERT.match(m.group(2)) if m is not None else None
    return None if e is None else (int(m.group(1)), int(e.group(1)), e.group(2))


def hf_experts_tensor(layer: int, which: str, experts: list[torch.Tensor]) -> tuple[str, torch.Tensor]:
    """(HF name, tensor) of a layer's stacked experts from each expert's Megatron tensor (`which`: linear_fc1 |
    linear_fc2), in global expert order."""
    return f"model.layers.{layer}.{_HF_EXPERTS[which]}", torch.stack(experts)


def megatron_to_hf(spec: ArchSpec, shard_dicts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A whole HF state dict from the Megatron state dicts of every tensor-parallel rank (global layer and expert
    names; every expert present)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name in shard_dicts[0]:
        where = expert_of(name)
        if where is not None:
            experts.setdefault((where[0], where[2]), {})[where[1]] = shard_dicts[0][name]
            continue
        out.update(megatron_to_hf_tensor(spec, name, [d[name] for d in shard_dicts]))
    for (layer, which), by_index in experts.items():
        name, tensor = hf_experts_tensor(layer, which, [by_index[e] for e in sorted(by_index)])
        out[name] = tensor
    return out


_HF_EXPERT_FILE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def hf_expert_getter(get: Callable[[str], torch.Tensor], has: Callable[[str], bool]) -> Callable[[str], torch.Tensor]:
    """`get` of a checkpoint that may hold each expert on its own, as transformers writes Qwen3-MoE files
    (`mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`): a stacked expert tensor that the files do not hold
    is assembled from them (gate_up_proj[e] = [gate_proj; up_proj], down_proj[e] = down_proj)."""

    def getter(name: str) -> torch.Tensor:
        m = _HF_EXPERT_FILE.match(name)
        if m is None or has(name):
            return get(name)
        prefix, which, out = m.group(1), m.group(2), []
        e = 0
        while has(f"{prefix}.{e}.down_proj.weight"):
            if which == "gate_up_proj":
                out.append(torch.cat([get(f"{prefix}.{e}.gate_proj.weight"), get(f"{prefix}.{e}.up_proj.weight")]))
            else:
                out.append(get(f"{prefix}.{e}.down_proj.weight"))
            e += 1
        if not out:
            return get(name)  # neither layout: the KeyError names the stacked tensor
        return torch.stack(out)

    return getter


# Transformer Engine's layer spec fuses each layer's input norm into `linear_qkv` and its pre-MLP norm into
# `linear_fc1` (megatron-core's own key map between the two specs): the same tensors, named here as the local spec
# names them, so that conversion, checkpoints and weight sync see one set of names whichever spec built the model.
TE_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
            "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}


def local_to_global(name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """A stage's parameter name (either layer spec) as the converter names it: its layer index made global (and an
    expert's index, on expert-parallel rank r: + `expert_offset` = r * local experts), a Transformer Engine name as
    the local spec's (`TE_NAMES`)."""
    m = _LAYER.match(name)
    if m is None:
        return name
    local = TE_NAMES.get(m.group(2), m.group(2))
    e = _EXPERT.match(local)
    if e is not None:
        local = f"mlp.experts.local_experts.{int(e.group(1)) + expert_offset}.{e.group(2)}.weight"
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{local}"


def hf_layer_index(hf_name: str) -> int | None:
    m = _HF_LAYER.match(hf_name)
    return None if m is None else int(m.group(1))


def iter_model_tensors(module: torch.nn.Module, layer_offset: int,
                       expert_offset: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(global Megatron name, tensor) of a stage's weights: its state dict without `_extra_state` entries."""
    for name, tensor in module.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state") or not isinstance(tensor, torch.Tensor):
            continue
        yield local_to_global(name, layer_offset, expert_offset), tensor
