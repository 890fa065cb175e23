"""Megatron-core GPTModel built from a Hugging Face config: the Qwen3 layout, the Llama layout (SmolLM2) and the
Qwen3-MoE layout (every layer's MLP a megatron-core MoE layer: a `TopKRouter` and `SequentialMLP` experts, the
all-to-all token dispatcher over `train.expert_parallel_size` ranks).

Layer specs (`train.layer_spec`, resolved by `resolve_layer_spec`), both with RMSNorm and, for Qwen3, per-head
q/k RMSNorm:
- `local`: megatron-core's own PyTorch modules; runs wherever torch does (CPU processes over gloo as well as
  GPUs). Its norms are `SequenceParallelRMSNorm` (megatron-core's torch norm refuses sequence parallelism).
- `transformer_engine`: Transformer Engine's modules (fused norm + linear, TE attention); CUDA only. The same
  weights under two other names (`convert.TE_NAMES`).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from relax.models.hf import hf_arch_fields, hf_rope

SUPPORTED_ARCHS = ("qwen3", "llama", "qwen3_moe")


@dataclass(frozen=True)
class ArchSpec:
    """What the model builder and the converter need to know of an architecture: its fields under Relax's names
    (`relax.models.hf.HF_ARCH_NAMES` translates them to and from transformers')."""

    arch: str  # "qwen3" | "llama" (config.model_type)
    vocab_size: int  # rows of the HF embedding
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    # mixture of experts (qwen3_moe; 0 for a dense model): experts per layer, experts per token, each expert's width,
    # whether the top-k weights are renormalised to sum 1 (HF's norm_topk_prob)
    num_experts: int = 0
    moe_top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm of queries and keys before RoPE (Qwen3, Qwen3-MoE)."""
        return self.arch in ("qwen3", "qwen3_moe")

    @property
    def moe(self) -> bool:
        """Every layer's MLP is a mixture of experts."""
        return self.num_experts > 0

    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary rows Megatron holds: a multiple of the tensor-parallel size (extra rows are never sampled)."""
        return int(math.ceil(self.vocab_size / tp) * tp)


def arch_from_hf_config(config: Any) -> ArchSpec:
    """The ArchSpec of a transformers config; ValueError for an architecture the backend does not build."""
    arch = getattr(config, "model_type", None)
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"model architecture {arch!r} is not supported by train.backend=megatron "
                         f"(supported: {', '.join(SUPPORTED_ARCHS)})")
    if arch == "llama" and (getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)):
        raise ValueError("llama: attention_bias/mlp_bias=true is not supported by the Megatron converter")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"{arch}: hidden_act={config.hidden_act!r} is not supported (only silu)")
    rope_type = hf_rope(config)[0]
    if rope_type not in (None, "default"):  # `build_gpt_model` builds plain RoPE of `rope_theta`
        raise ValueError(f"{config.model_type}: rope_type={rope_type!r} is not supported by the Megatron backend "
                         "(only plain RoPE)")
    moe: dict[str, Any] = {}
    if arch == "qwen3_moe":
        if int(getattr(config, "decoder_sparse_step", 1)) != 1 or list(getattr(config, "mlp_only_layers", []) or []):
            raise ValueError("qwen3_moe: dense layers among the sparse ones (decoder_sparse_step != 1 or "
                             "mlp_only_layers) are not supported by the Megatron backend")
        moe = {"num_experts": int(config.num_experts), "moe_top_k": int(config.num_experts_per_tok),
               "moe_intermediate_size": int(config.moe_intermediate_size),
               "norm_topk_prob": bool(getattr(config, "norm_topk_prob", True))}
    return ArchSpec(arch=arch, **hf_arch_fields(config), **moe)


def check_parallel_sizes(spec: ArchSpec, *, tp: int, pp: int, ep: int = 1) -> None:
    """ValueError unless TP divides the attention and key/value heads, PP divides the layers and EP the experts
    (`relax.config.megatron_rules` checks a `source=config` model's sizes before start; this, the model's own)."""
    problems = []
    if spec.moe and spec.num_experts % ep:
        problems.append(f"train.expert_parallel_size={ep} must divide num_experts={spec.num_experts}")
    if not spec.moe and ep != 1:
        problems.append(f"train.expert_parallel_size={ep} needs a mixture-of-experts model")
    if spec.num_attention_heads % tp or spec.num_key_value_heads % tp:
        problems.append(f"train.tensor_parallel_size={tp} must divide num_attention_heads="
                        f"{spec.num_attention_heads} and num_key_value_heads={spec.num_key_value_heads}")
    if spec.num_layers % pp:
        problems.append(f"train.pipeline_parallel_size={pp} must divide num_layers={spec.num_layers}")
    if problems:
        raise ValueError(f"{spec.arch} model: " + "; ".join(problems))


def transformer_config(
    spec: ArchSpec,
    *,
    tp: int = 1,
    pp: int = 1,
    params_dtype: torch.dtype = torch.float32,
    autocast_dtype: Optional[torch.dtype] = None,
    use_cpu_initialization: bool = True,
    recompute: bool = False,
    sequence_parallel: bool = False,
    ep: int = 1,
    routing_replay: bool = False,
) -> Any:
    """The megatron TransformerConfig of `spec`: no dropout, no fusions, no bias, per-token loss scaling.

    `sequence_parallel` (train.sequence_parallel, TP > 1): activations outside attention and the MLP are split
    along the sequence over the tensor-parallel ranks (the sequence length must be a multiple of TP).

    `recompute` (model.gradient_checkpointing): megatron-core's full activation recompute, every layer on its own
    (`recompute_granularity="full"`, `recompute_method="uniform"`, one layer per checkpoint): a layer keeps only its
    input for the backward, which runs its forward again.

    `params_dtype` bf16 makes Megatron keep bf16 parameters with fp32 master weights in the optimizer (GPU
    only); `autocast_dtype` runs the forward under autocast with fp32 parameters instead. Weights are loaded by
    the converter afterwards (`perform_initialization=False`).

    MoE (`spec.moe`): megatron-core's top-k router as Hugging Face's Qwen3-MoE router (softmax of fp32 logits; with
    `norm_topk_prob` the top-k logits' softmax, which is p[top-k] renormalised, else p[top-k] itself), no token
    dropping, megatron-core's own load-balancing loss off (train.moe_aux_loss_coef is the torch backend's loss, which
    `relax.train.megatron.replay.MegatronRouting` adds to each router; the router z-loss's coefficient is set per
    step by `relax.train.megatron.replay.MegatronRouting.z_loss_coeff`), experts one MLP
    after another (`SequentialMLP`: megatron-core's grouped GEMMs need Transformer Engine or the grouped_gemm CUDA
    kernels), spread over `ep` expert-parallel ranks by the all-to-all dispatcher. `routing_replay`: every router gets
    megatron-core's `RouterReplay` (`relax.train.megatron.replay` drives it).
    """
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    moe: dict[str, Any] = {}
    if spec.moe:
        moe = dict(num_moe_experts=spec.num_experts, moe_router_topk=spec.moe_top_k,
                   moe_ffn_hidden_size=spec.moe_intermediate_size, moe_router_pre_softmax=not spec.norm_topk_prob,
                   moe_router_score_function="softmax", moe_router_load_balancing_type="none",
                   moe_aux_loss_coeff=0.0, moe_router_dtype="fp32", moe_grouped_gemm=False,
                   moe_permute_fusion=False, moe_router_fusion=False, expert_model_parallel_size=ep,
                   moe_enable_routing_replay=routing_replay)
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_key_value_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=use_cpu_initialization,
        perform_initialization=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        enable_autocast=autocast_dtype is not None,
        autocast_dtype=autocast_dtype,
        attention_softmax_in_fp32=True,
        calculate_per_token_loss=True,
        # pipeline stages exchange each micro-batch's shape first (micro-batches are trimmed to their own length)
        variable_seq_lengths=pp > 1,
        # the default dispatcher (allgather) refuses variable lengths; all-to-all sends each token to its experts' ranks
        moe_token_dispatcher_type="alltoall",
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
        **moe,
    )


LAYER_SPECS = ("local", "transformer_engine")


def transformer_engine_importable() -> bool:
    """Whether Transformer Engine can be imported here (looked up, not imported)."""
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ModuleNotFoundError, ValueError):
        return False


def resolve_layer_spec(choice: str, device: torch.device) -> str:
    """`train.layer_spec` on this rank: auto -> transformer_engine on a CUDA device where Transformer Engine is
    importable, else local. ValueError for transformer_engine where it cannot run."""
    te = device.type == "cuda" and transformer_engine_importable()
    if choice == "auto":
        return "transformer_engine" if te else "local"
    if choice == "transformer_engine" and not te:
        where = "Transformer Engine is not installed here" if device.type == "cuda" else f"this rank runs on {device}"
        raise ValueError(f"train.layer_spec=transformer_engine: {where} (it needs a CUDA device and "
                         "`import transformer_engine`); use train.layer_spec=local or auto")
    if choice not in LAYER_SPECS:
        raise ValueError(f"train.layer_spec={choice!r}: one of auto, {', '.join(LAYER_SPECS)}")
    return choice


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm as a megatron-core norm module: built as `(config, hidden_size, eps)`, its weight marked
    `sequence_parallel` when the config is, so that `finalize_model_grads` sums its gradient over the
    tensor-parallel ranks (each saw only its part of the sequence)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The norm of `x` in its own dtype. Under CPU bf16 autocast (fp32 parameters, bf16 activations) the input
        is bf16 and the weight fp32, which `torch.rms_norm` cannot fuse: it warned ("Mismatch dtype between input and
        weight ... Cannot dispatch to fused implementation") and normalized in fp32, returning bf16. That arithmetic,
        done here explicitly (the same values: the fp32 input is exact), and no warning."""
        if x.dtype == self.weight.dtype:
            return super().forward(x)
        return torch.rms_norm(x.to(self.weight.dtype), self.normalized_shape, self.weight, self.eps).to(x.dtype)


def layer_spec(spec: ArchSpec, config: Any, which: str) -> Any:
    """What `GPTModel` builds its decoder from: Transformer Engine's layer spec, or the local spec with
    `SequenceParallelRMSNorm` for every norm (the layers' and the final one) as a whole block's submodules."""
    from megatron.core.models.gpt import gpt_layer_specs

    experts = spec.num_experts if spec.moe else None
    if spec.moe:
        _define_te_gemm()
    if which == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=False,
                                                                          qk_layernorm=spec.qk_norm)
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False,
                                                     qk_layernorm=spec.qk_norm, normalization="RMSNorm")
    sub = layer.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = SequenceParallelRMSNorm
    if spec.qk_norm:
        sub.self_attention.submodules.q_layernorm = SequenceParallelRMSNorm
        sub.self_attention.submodules.k_layernorm = SequenceParallelRMSNorm
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config),
                                      layer_norm=SequenceParallelRMSNorm)


def _define_te_gemm() -> None:
    """megatron-core 0.16.1's router gating reads `moe_utils.te_general_gemm`, which that module defines only when
    Transformer Engine imports (a NameError otherwise): None there means plain torch matmuls, as the code intends."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_gpt_model(spec: ArchSpec, config: Any, *, tp: int, pre_process: bool = True,
                    post_process: bool = True, which: str = "local") -> Any:
    """A GPTModel (one pipeline stage: `pre_process` holds the embedding, `post_process` the output layer) of
    layer spec `which` (local | transformer_engine, see `resolve_layer_spec`)."""
    from megatron.core.models.gpt import GPTModel

    model = GPTModel(
        config,
        layer_spec(spec, config, which),
        vocab_size=spec.padded_vocab_size(tp),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=spec.rope_theta,
        parallel_output=True,
    )
    mark_tensor_parallel(model)
    return model


def tp_partition_dim(name: str) -> int | None:
    """The dimension along which tensor-parallel ranks split Megatron tensor `name` (None: replicated). Experts are
    not split (MoE models train at TP=1; they are spread over expert-parallel ranks instead)."""
    if ".experts." in name:
        return None
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_fc1.weight")):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def mark_tensor_parallel(model: torch.nn.Module) -> None:
    """Give tensor-parallel weights megatron's `tensor_model_parallel` / `partition_dim` attributes.

    megatron-core sets them only while initialising weights (`perform_initialization=True`); without them the
    gradient norm counts a sharded weight on tensor-parallel rank 0 only (as if it were replicated), which
    under-reports `train/grad_norm` and mis-clips at TP > 1.
    """
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for name, param in model.named_parameters():
        dim = tp_partition_dim(name)
        if dim is not None and not getattr(param, "tensor_model_parallel", False):
            for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
                if hasattr(param, attr):
                    delattr(param, attr)
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)


def freeze_padding_embedding(model: torch.nn.Module, padding_idx: int | None) -> None:
    """Give the input embedding Hugging Face's `padding_idx` semantics: no gradient flows into the embedding
    row of `padding_idx` from its lookups (HF models build `nn.Embedding(..., padding_idx=config.pad_token_id)`).

    Without this a pad token inside a sequence (a model may sample it) gets its lookup gradient, and HF's
    zero-initialised pad row makes that gradient huge (the first RMSNorm of a zero vector), unlike the torch
    backend. The output layer's gradient (tied or not) is untouched, as in HF. No-op on stages without the
    embedding or when the model has no pad token.
    """
    embedding = getattr(getattr(model, "embedding", None), "word_embeddings", None)
    if embedding is None or padding_idx is None:
        return

    sequence_parallel = bool(getattr(embedding, "reduce_scatter_embeddings", False))

    def hook(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if output.requires_grad:
            keep = (inputs[0] != padding_idx).unsqueeze(-1).to(output.dtype)  # [b, s, 1], as the output [b, s, h]
            if sequence_parallel:  # the output is this tensor-parallel rank's part of the sequence, [s / tp, b, h]
                from megatron.core import parallel_state as ps

                keep = keep.transpose(0, 1).chunk(ps.get_tensor_model_parallel_world_size())[
                    ps.get_tensor_model_parallel_rank()]
            output.register_hook(lambda grad: grad * keep)

    embedding.register_forward_hook(hook)
