"""Rules of `train.backend=megatron` that a config can be checked against before anything starts.

Pure: reads the config and the algorithm registry, imports no backend (megatron-core's presence is looked up
with `importlib.util.find_spec`, not imported). A model read from files (`model.source=hf`) is checked again by
the backend when it starts, against the model's own config.json (heads, layers, architecture). The rules that the
Megatron policy also checks when it starts, against the sizes and layers it runs with, are stated once here
(`sequence_parallel_violation`, `pack_sequences_violation`, `micro_batch_tokens_violation`): validation and the
policy call the same function.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

from relax.algorithms.base import Violation
from relax.config.derive import actor_world_size
from relax.config.schema import MOE_ARCHS, RelaxConfig

MEGATRON_ARCHS = ("qwen3", "llama", "qwen3_moe")  # MoE rules: relax.config.moe_rules
INSTALL_HINT = "pip install -e '.[megatron]'"
# What this build runs; options for the rest validate their values but are rejected before start (here and in
# `relax.config.validate`), with what is available instead. When a backend or mode is built, its line goes.
NOT_BUILT = "is not available in this build"


def megatron_installed() -> bool:
    """Whether megatron-core can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:  # no `megatron` package at all
        return False


def megatron_violations(cfg: RelaxConfig) -> list[Violation]:
    """Every broken rule of the Megatron backend ([] unless `train.backend=megatron`)."""
    t, m = cfg.train, cfg.model
    if t.backend != "megatron":
        return [] if t.expert_parallel_size == 1 else [Violation(
            ("train.expert_parallel_size", "train.backend"),
            f"train.expert_parallel_size={t.expert_parallel_size} needs train.backend=megatron (the torch backend "
            "trains on one device)")]
    out: list[Violation] = []

    def require(ok: bool, fields: str | tuple[str, ...], message: str) -> None:
        if not ok:
            out.append(Violation(fields=(fields,) if isinstance(fields, str) else fields, message=message))

    out.extend(moe_violations(cfg))

    require(megatron_installed(), "train.backend",
            f"train.backend=megatron needs megatron-core, which is not installed: {INSTALL_HINT}")
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size"):
        value = getattr(t, key)
        require(value >= 1, f"train.{key}", f"train.{key}={value} must be >= 1")
    tp, pp = max(1, t.tensor_parallel_size), max(1, t.pipeline_parallel_size)
    require(m.arch in MEGATRON_ARCHS, "model.arch",
            f"model.arch={m.arch!r} is not supported by train.backend=megatron (supported: "
            f"{', '.join(MEGATRON_ARCHS)}; Qwen3.5 has no converter yet)")
    if m.source == "config":
        require(m.num_attention_heads % tp == 0 and m.num_key_value_heads % tp == 0,
                ("train.tensor_parallel_size", "model.num_attention_heads", "model.num_key_value_heads"),
                f"train.tensor_parallel_size={tp} must divide model.num_attention_heads={m.num_attention_heads} "
                f"and model.num_key_value_heads={m.num_key_value_heads}: each tensor-parallel rank holds whole "
                f"query groups")
        require(m.num_layers % pp == 0, ("train.pipeline_parallel_size", "model.num_layers"),
                f"train.pipeline_parallel_size={pp} must divide model.num_layers={m.num_layers}: pipeline stages "
                f"hold equal numbers of layers")
    sequence_parallel = sequence_parallel_violation(t.backend, t.sequence_parallel, t.tensor_parallel_size)
    if sequence_parallel is not None:
        out.append(sequence_parallel)
    require(t.context_parallel_size == 1, "train.context_parallel_size",
            f"train.context_parallel_size={t.context_parallel_size} is not supported by train.backend=megatron: "
            "megatron-core's context parallelism runs in Transformer Engine's attention, and this backend does not "
            "split sequences over ranks yet (train.sequence_parallel splits activations within tensor parallelism)")
    return out


def moe_violations(cfg: RelaxConfig) -> list[Violation]:
    """Every broken rule of a mixture-of-experts model on train.backend=megatron (docs/training.md, "Mixture of
    experts"): the experts' spread (train.expert_parallel_size) and the parallel sizes it trains at."""

    t, m = cfg.train, cfg.model
    out: list[Violation] = []

    def require(ok: bool, fields: tuple[str, ...], message: str) -> None:
        if not ok:
            out.append(Violation(fields=fields, message=message))

    moe_config = m.source == "config" and m.arch in MOE_ARCHS
    ep = t.expert_parallel_size
    if ep != 1:
        require(m.source != "config" or moe_config, ("train.expert_parallel_size", "model.arch"),
                f"train.expert_parallel_size={ep} spreads the experts of a mixture-of-experts model, but "
                f"model.arch={m.arch} is dense")
        if moe_config:
            require(ep >= 1 and m.num_experts % ep == 0, ("train.expert_parallel_size", "model.num_experts"),
                    f"train.expert_parallel_size={ep} must divide model.num_experts={m.num_experts}: each "
                    "expert-parallel rank holds as many experts")
        world = actor_world_size(cfg)
        require(ep >= 1 and world % ep == 0, ("train.expert_parallel_size", "cluster.actor_gpus"),
                f"train.expert_parallel_size={ep} must divide the trainer's ranks ({world}: cluster.actor_gpus, or "
                "tensor x pipeline parallel sizes on the CPU): the expert-parallel ranks are the model's "
                "data-parallel ranks")
    if moe_config:
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            require(getattr(t, key) == 1, (f"train.{key}", "model.arch"),
                    f"train.{key}={getattr(t, key)} with a mixture-of-experts model on train.backend=megatron "
                    f"{NOT_BUILT}: MoE models train at tensor and pipeline parallel size 1 (spread the experts with "
                    "train.expert_parallel_size)")
    return out


def sequence_parallel_violation(backend: str, sequence_parallel: bool,
                                tensor_parallel_size: int) -> Optional[Violation]:
    """train.sequence_parallel's rule on either backend (None: kept). Validation checks the config's sizes with it;
    the Megatron policy the tensor-parallel size it runs with."""
    if not sequence_parallel:
        return None
    if backend == "torch":
        return Violation(("train.sequence_parallel",),
                         "train.sequence_parallel=true needs train.backend=megatron with train.tensor_parallel_size > "
                         "1 (the torch backend has no tensor parallelism)")
    if backend == "megatron" and not tensor_parallel_size > 1:
        return Violation(("train.sequence_parallel", "train.tensor_parallel_size"),
                         "train.sequence_parallel=true splits the sequence over tensor-parallel ranks: it needs "
                         f"train.tensor_parallel_size > 1 (got {tensor_parallel_size})")
    return None


def pack_sequences_violation(backend: str, pack_sequences: bool, layer_spec: str) -> Optional[Violation]:
    """train.pack_sequences' rule (None: kept). Validation checks the configured train.layer_spec with it; the
    Megatron policy the layer spec it resolved (auto: local where Transformer Engine cannot run)."""
    if not pack_sequences or backend == "torch" or layer_spec == "transformer_engine":
        return None
    return Violation(("train.pack_sequences", "train.layer_spec"),
                     "train.pack_sequences=true with train.backend=megatron needs train.layer_spec=transformer_engine "
                     f"(got {layer_spec}): megatron-core packs sequences through Transformer Engine's attention (THD "
                     "format), which only GPUs with transformer_engine have; its local layers take no packed sequences")


def micro_batch_tokens_violation(backend: str, max_tokens: Optional[int]) -> Optional[Violation]:
    """train.max_tokens_per_micro_batch's rule (None: kept): only the torch backend forms micro-batches by tokens.
    Validation checks the config with it; the Megatron policy the token budget a call passes it."""
    if max_tokens is None or backend == "torch":
        return None
    return Violation(("train.max_tokens_per_micro_batch", "train.backend"),
                     f"train.max_tokens_per_micro_batch {NOT_BUILT} with train.backend={backend}: its micro-batches "
                     "are formed by rows (train.micro_batch_size)")
