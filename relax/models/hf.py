"""Model construction (with the one translation of architecture fields between Relax's names and a transformers
config's: `HF_ARCH_NAMES`) and the definition of a response token's log-probability.

`token_logprobs` defines "log-probability of a response token" for the torch backends and the critic's
alignment, so that old, new and reference log-probs are computed the same way. The trainer and the reference
role compute exactly these values through `relax.train.logprobs.response_logprobs` (chunked, without
[N, T, V] fp32 tensors), which is tested against this definition.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from transformers import AutoConfig

from relax.config.schema import ModelConfig
from relax.data.tokenizer import require_hf_config
from relax.data.tokenizer import resolve_model_path as _resolve_model_path
from relax.models import vision
from relax.models.gguf_cache import gguf_config, load_gguf_model

if TYPE_CHECKING:  # modeling_utils costs seconds to import; the driver only needs the names for hints
    from transformers import PreTrainedModel

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def pick_device() -> torch.device:
    """The device a single-device backend uses: the first GPU when there is one, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bf16 matmul (AVX512-BF16 or AMX), where bf16 pays off."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return "avx512_bf16" in flags or "amx_bf16" in flags
    return False


def pick_dtype(model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """The compute dtype: explicit float32/bfloat16 honoured; "auto" is bf16 only where it is fast."""
    name = model_cfg.dtype
    if name in _DTYPES:
        return _DTYPES[name]
    if name != "auto":
        raise ValueError(f"model.dtype={name!r}: expected auto, float32 or bfloat16")
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    return torch.float32


def resolve_model_path(model_cfg: ModelConfig, *, key: str = "model.path") -> Path:
    """Where an hf/gguf model lives; fails early (before any loading) when it is not there. A PEFT adapter directory
    is its base with the adapters merged, which each command writes before it starts (`relax.models.peft_merge`).
    `key`: the option the path was given as, which the messages name (`relax.data.tokenizer.named`)."""
    path = _resolve_model_path(model_cfg, key=key)
    if path is None:
        raise ValueError("model.source=config has no model path")
    if model_cfg.source == "hf":
        require_hf_config(path, key)
    return path


def context_length(model_cfg: ModelConfig) -> int | None:
    """The model's context (max_position_embeddings) without loading its weights: the config's field for
    `source=config`, else the model's own config file; None when it does not say."""
    if model_cfg.source == "config":
        return model_cfg.max_position_embeddings
    path = resolve_model_path(model_cfg)
    if model_cfg.source == "gguf":
        config = gguf_config(path)
    else:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    return int(getattr(config, "max_position_embeddings", 0) or 0) or None


# ---- the architecture fields: the model config's names and transformers' ---------------------------------------

# Each architecture field of a causal LM under Relax's name (the model config's, `model.num_layers`, for the fields
# it has; the Megatron backend's `ArchSpec` has them all) -> the attribute of a transformers config that holds it.
# The one translation between the two: `hf_arch_fields` reads a transformers config through it, `hf_arch_kwargs`
# writes one.
HF_ARCH_NAMES: dict[str, str] = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate_size",
    "rope_theta": "rope_theta",
    "rms_norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings",
    "max_position_embeddings": "max_position_embeddings",
}

# the architecture fields a `source=config` model takes from the model config (the others: the tokenizer's vocabulary,
# tied embeddings, transformers' defaults)
MODEL_CONFIG_ARCH_FIELDS = ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                            "intermediate_size", "max_position_embeddings")


def hf_arch_kwargs(fields: dict[str, Any]) -> dict[str, Any]:
    """Architecture fields under Relax's names as keyword arguments of a transformers config."""
    return {HF_ARCH_NAMES[name]: value for name, value in fields.items()}


def hf_rope(config: Any) -> tuple[Optional[str], Optional[float]]:
    """(rope type, rope theta) of a transformers config, wherever its version keeps them: `rope_parameters`
    (transformers 5), else `rope_scaling` and the config's own `rope_theta` (4). The type is "default" (plain
    RoPE) where none is named; theta None where the config has none."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    name = HF_ARCH_NAMES["rope_theta"]
    return params.get("rope_type", params.get("type", "default")), params.get(name, getattr(config, name, None))


def _rope_theta(config: Any) -> float:
    theta = hf_rope(config)[1]
    if theta is None:
        raise ValueError(f"{config.model_type}: the config has no rope_theta")
    return float(theta)


def hf_arch_fields(config: Any) -> dict[str, Any]:
    """The architecture fields of a transformers `config` under Relax's names (`HF_ARCH_NAMES`), typed. Where a
    config may leave one out, transformers' default: as many key/value heads as attention heads, head_dim =
    hidden_size // heads, untied embeddings. ValueError when the config has no rope_theta."""

    def get(name: str, *default: Any) -> Any:
        return getattr(config, HF_ARCH_NAMES[name], *default)

    heads = get("num_attention_heads")
    return {
        "vocab_size": int(get("vocab_size")),
        "hidden_size": int(get("hidden_size")),
        "num_layers": int(get("num_layers")),
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(get("num_key_value_heads", None) or heads),
        "head_dim": int(get("head_dim", None) or get("hidden_size") // heads),
        "intermediate_size": int(get("intermediate_size")),
        "rope_theta": _rope_theta(config),
        "rms_norm_eps": float(get("rms_norm_eps")),
        "tie_word_embeddings": bool(get("tie_word_embeddings", False)),
        "max_position_embeddings": int(get("max_position_embeddings")),
    }


def qwen3_moe_config(model_cfg: ModelConfig, vocab_size: int, pad_token_id: int) -> Any:
    """The Qwen3MoeConfig of a `source=config`, `arch=qwen3_moe` model: every layer sparse, `num_experts` experts of
    `moe_intermediate_size`, top-`num_experts_per_tok` routing renormalised (as Qwen3-30B-A3B), tied embeddings."""
    from transformers import Qwen3MoeConfig

    arch = {name: getattr(model_cfg, name) for name in MODEL_CONFIG_ARCH_FIELDS}
    return Qwen3MoeConfig(
        **hf_arch_kwargs({"vocab_size": vocab_size, **arch, "tie_word_embeddings": True}),
        num_experts=model_cfg.num_experts,
        num_experts_per_tok=model_cfg.num_experts_per_tok,
        moe_intermediate_size=model_cfg.moe_intermediate_size,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        output_router_logits=False,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        eos_token_id=None,
        use_cache=False,
        attn_implementation="sdpa",
    )


def qwen3_config(model_cfg: ModelConfig, vocab_size: int, pad_token_id: int) -> Any:
    """The Qwen3Config of a `source=config` model (tied embeddings, sdpa attention); arch=qwen3_moe: its
    Qwen3MoeConfig (`qwen3_moe_config`)."""
    from transformers import Qwen3Config

    if model_cfg.arch == "qwen3_moe":
        return qwen3_moe_config(model_cfg, vocab_size, pad_token_id)
    arch = {name: getattr(model_cfg, name) for name in MODEL_CONFIG_ARCH_FIELDS}
    return Qwen3Config(
        **hf_arch_kwargs({"vocab_size": vocab_size, **arch, "tie_word_embeddings": True}),
        pad_token_id=pad_token_id,
        bos_token_id=None,
        eos_token_id=None,
        use_cache=False,
        attn_implementation="sdpa",
    )


def checkpoint_attention(path: Any, auto_cls: Any = None) -> str:
    """The attention a checkpoint directory is loaded with through the transformers Auto class `auto_cls`
    (AutoModelForCausalLM when None; AutoModelForSequenceClassification for a classifier reward model): sdpa where
    the class it maps the checkpoint's config to has it, else eager (gpt-oss: transformers runs its attention sinks in
    eager attention only, and refuses sdpa)."""
    if auto_cls is None:
        from transformers import AutoModelForCausalLM as auto_cls

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    cls = auto_cls._model_mapping.get(type(config), None)
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", True) else "eager"


def build_model(
    model_cfg: ModelConfig,
    vocab_size: int,
    pad_token_id: int,
    *,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    key: str = "model.path",
) -> PreTrainedModel:
    """A causal LM as `model_cfg` describes it, parameters in `dtype` on `device`. `key`: the option its path was
    given as, which a missing path's message names (a judge's `reward_model.path`).

    `source=config` is initialised on the CPU under `seed` (global RNG untouched), so the same seed
    gives the same weights on every device and in every process. `hf`/`gguf` load local files only.
    A vision-language model (model=tiny_vl, a Qwen-VL directory) is `relax.models.vision`'s.
    """
    if vision.is_vision_config(model_cfg):
        return vision.build_or_load(model_cfg, vocab_size, pad_token_id, seed=seed, dtype=dtype, device=device)
    if model_cfg.source == "config":
        if model_cfg.arch not in ("qwen3", "qwen3_moe"):
            raise ValueError(f"model.arch={model_cfg.arch!r}: only qwen3 and qwen3_moe are supported for "
                             "model.source=config")
        from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

        config = qwen3_config(model_cfg, vocab_size, pad_token_id)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = (Qwen3MoeForCausalLM if model_cfg.arch == "qwen3_moe" else Qwen3ForCausalLM)(config)
        cast_parameters(model, dtype)
    elif model_cfg.source in ("hf", "gguf"):
        from transformers import AutoModelForCausalLM

        path = resolve_model_path(model_cfg, key=key)
        if model_cfg.source == "gguf":  # de-quantised to fp32 once (relax.models.gguf_cache), then cast
            model = load_gguf_model(path, local_files_only=True, attn_implementation="sdpa")
            cast_parameters(model, dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype,
                                                         attn_implementation=checkpoint_attention(path))
        n_embed = model.get_input_embeddings().weight.shape[0]
        if vocab_size > n_embed:
            raise ValueError(f"tokenizer vocab_size={vocab_size} exceeds the model's {n_embed} embeddings ({path})")
        if model.config.pad_token_id is None:
            model.config.pad_token_id = pad_token_id
        model.config.use_cache = False
    else:
        raise ValueError(f"model.source={model_cfg.source!r}: expected config, hf or gguf")
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model.to(device)


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast weights only: buffers such as RoPE's inv_freq stay fp32, as the trainer's are, so that rollout and
    trainer log-probs differ only by the weights' precision. The weights the model's class keeps in fp32
    (`kept_in_fp32`: DeepSeek-V3's and GLM-4.5's routers) stay fp32 too, as `from_pretrained(dtype=...)` keeps them,
    so that an engine built from a .gguf file or from a config holds what one loaded from a checkpoint holds."""
    keep = kept_in_fp32(model, dtype)
    for name, param in model.named_parameters():
        if name not in keep:
            param.data = param.data.to(dtype)


def kept_in_fp32(model: torch.nn.Module, dtype: Optional[torch.dtype]) -> frozenset[str]:
    """The `model.state_dict()` names of the tensors transformers keeps in fp32 when it loads `model`'s class in
    `dtype`: its `_keep_in_fp32_modules_strict` for bf16 or fp16 (DeepSeek-V3 and GLM-4.5: each router's
    `gate.weight` and `e_score_correction_bias`, whose forward computes in fp32), its `_keep_in_fp32_modules` for fp16
    (gpt-oss's norms), matched as `from_pretrained` matches them (each pattern searched in the name, `*` any run of
    characters). The one owner of which tensors a rollout engine of that class holds in fp32: the engine's loading
    (`from_pretrained`, `cast_parameters`) keeps them, the trainer ships them in fp32 (`with_fp32_kept`). Empty for a
    module that is not a transformers model, for fp32 and for None (no cast)."""
    plan_of = getattr(model, "_get_dtype_plan", None)  # transformers' PreTrainedModel: the plan from_pretrained uses
    if dtype is None or dtype == torch.float32 or plan_of is None:
        return frozenset()
    patterns = [p for p, d in plan_of(dtype).items() if d == torch.float32]
    if not patterns:
        return frozenset()
    rx = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in patterns))
    return frozenset(name for name in model.state_dict() if rx.search(name))


_FP32_COMPUTE = threading.local()  # each thread's stack of the autocast-off contexts `fp32_compute`'s hooks entered


def fp32_compute(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Run the modules whose own weights `kept_in_fp32(model, dtype)` names (DeepSeek-V3's / GLM-4.5's routers) with
    autocast off, once per model: the trainer's fp32 master copy under bf16 autocast would otherwise compute them in
    bf16 (autocast casts the router's `F.linear` inputs, its weight included), while the engine, whose bf16 model
    holds them fp32 and runs without autocast, computes them in fp32 as their forward asks (`.type(torch.float32)`).
    Idempotent; nothing for fp32 or for a model whose class keeps nothing in fp32."""
    keep = kept_in_fp32(model, dtype)
    if not keep or getattr(model, "_relax_fp32_compute", False):
        return

    def enter(module: torch.nn.Module, args: tuple) -> None:
        ctx = torch.autocast(next(module.parameters()).device.type, enabled=False)
        ctx.__enter__()
        _FP32_COMPUTE.__dict__.setdefault("stack", []).append(ctx)

    def leave(module: torch.nn.Module, args: tuple, output: Any) -> None:
        _FP32_COMPUTE.stack.pop().__exit__(None, None, None)

    for path, module in model.named_modules():
        own = [f"{path}.{n}" if path else n for n, _ in module.named_parameters(recurse=False)]
        if own and all(n in keep for n in own):
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave, always_call=True)
    model._relax_fp32_compute = True


def with_fp32_kept(state: dict[str, torch.Tensor], model: torch.nn.Module,
                   dtype: Optional[torch.dtype]) -> dict[str, torch.Tensor]:
    """`state` (weights cast to the rollout engine's `dtype`, keyed like `model.state_dict()`) with every tensor the
    engine keeps in fp32 (`kept_in_fp32`) replaced by an fp32 CPU copy of `model`'s: the engine then holds the
    trainer's router weights bit for bit, not bf16-rounded ones (its fp32 router would choose experts by rounded
    weights). Only names `state` holds are replaced (an adapters-only state holds none)."""
    keep = kept_in_fp32(model, dtype)
    if not keep:
        return state
    own = model.state_dict()
    for name in keep & state.keys():
        state[name] = own[name].detach().to(device="cpu", dtype=torch.float32, copy=True)
    return state


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count only real tokens, so a left-padded row sees the positions it would alone."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_hidden_states(
    backbone: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_start: int,
    response_len: int,
) -> torch.Tensor:
    """Last hidden states [N, T, H] at positions P-1 .. P+T-2: the state before each response token."""
    out = backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    return out.last_hidden_state[:, response_start - 1 : response_start + response_len - 1]


def response_logprobs_all(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_start: int,
    response_len: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """fp32 log-softmax [N, T, V] of the distributions that produced response tokens 0 .. T-1.

    The distribution is `softmax(logits / temperature)`, the one the rollout engine samples from (before any
    top-k/top-p truncation; see `relax.rollout.sampling`), so trainer, reference and rollout log-probs are of
    the same distribution. One forward over prompt+response with position ids from the mask (left padding).
    Logits are computed only at positions P-1 .. P+T-2 (`logits_to_keep`), so the prompt never costs an
    [N, L, V] tensor; under autocast they come out in bf16 and are upcast before the log-softmax.

    This is the unchunked reference definition (any causal LM). The trainer and the reference role compute the
    same values through `relax.train.logprobs.response_logprobs`, which never holds [N, T, V] fp32 tensors
    (chunked lm_head + log-softmax) and falls back to this function for models it does not cover.
    """
    P, T = response_start, response_len
    if P < 1:
        raise ValueError("token_logprobs needs at least one prompt column (response_start >= 1)")
    if input_ids.shape[1] != P + T:
        raise ValueError(f"input_ids has {input_ids.shape[1]} columns, expected response_start+response_len={P + T}")
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        logits_to_keep=T + 1,  # positions P-1 .. P+T-1; the last one predicts past the response
    ).logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


def token_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_start: int,
    response_len: int,
    *,
    with_entropy: bool = False,
    temperature: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log p(response token t | prefix) as [N, T] fp32 (and the entropy [N, T] of that distribution).

    `input_ids`/`attention_mask` are [N, P+T] as `Samples.sequences()` gives them (prompt left-padded,
    response right-padded, response at column P = `response_start`). Masked positions hold finite
    values of no meaning. Runs under whatever autocast/grad mode the caller set. The unchunked reference
    definition; `relax.train.logprobs.response_logprobs` is the memory-saving equivalent the trainer uses.
    """
    logp_all = response_logprobs_all(model, input_ids, attention_mask, response_start, response_len, temperature)
    logp = logp_all.gather(-1, input_ids[:, response_start:].unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp
    return logp, entropy_from_logprobs(logp_all)


def entropy_from_logprobs(logp_all: torch.Tensor) -> torch.Tensor:
    """Entropy over the last axis of log-probabilities (-sum p log p), finite where p underflows."""
    return -(logp_all.exp() * logp_all).sum(-1)
