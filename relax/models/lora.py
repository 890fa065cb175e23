"""LoRA on a Hugging Face causal LM, with PEFT: adapters on the target linear layers, the base weights frozen.

Each target linear layer computes `x W^T + (alpha / r) (x A^T) B^T` (A: [r, in], B: [out, r], B zero at the start,
so the adapted model starts as the base). What the rest of Relax needs from an adapted model lives here:
- `apply_lora`: the adapters, initialised under the run's seed (the global RNG untouched);
- `linear_layer_names` / `missing_targets`: the linear layers a model has, for a message that names them;
- `rollout_state`: the weights for the engines, merged (`W + (alpha / r) B A` under the base model's names, what PEFT's
  `merge_and_unload` gives, the routers and stacked experts of a mixture-of-experts model included) or the adapters
  alone (the names the engine's own injected adapters have);
- `adapter_params`: the live adapter tensors (old log-probs of stale samples swap only these);
- `base_fingerprint`: what a checkpoint of adapters records about the base it needs, checked on resume.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional

import torch

from relax.models.checkpoint_files import CheckpointFileError
from relax.models.hf import qwen3_config, resolve_model_path
from relax.models.weight_buffers import cpu_state

ADAPTER = "default"  # PEFT's adapter name
ALL_LINEAR = "all-linear"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # what PeftModel.save_pretrained writes, with ADAPTER_CONFIG
ADAPTER_CONFIG = "adapter_config.json"
BASE_FILE = "lora_base.json"  # the base model a checkpoint's adapters were trained on


def lora_config(model_cfg: Any) -> Any:
    """PEFT's LoraConfig of `model.lora_*`."""
    from peft import LoraConfig

    targets = list(model_cfg.lora_target_modules)
    return LoraConfig(r=int(model_cfg.lora_rank), lora_alpha=float(model_cfg.lora_alpha),
                      lora_dropout=float(model_cfg.lora_dropout), bias="none",
                      target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else targets)


def linear_layer_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (`q_proj`, ...), the output head included."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def missing_targets(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """The target names no linear layer of `model` has ([] for all-linear)."""
    if targets == [ALL_LINEAR]:
        return []
    have = set(linear_layer_names(model))
    return [t for t in targets if t not in have]


def apply_lora(model: torch.nn.Module, model_cfg: Any, *, seed: int) -> Any:
    """`model` with adapters injected in place (a PeftModel around it); its base parameters frozen. A's random
    initialisation draws from `seed` (B starts at zero), so every process builds the same adapters."""
    from peft import get_peft_model

    missing = missing_targets(model, list(model_cfg.lora_target_modules))
    if missing:
        raise ValueError(f"model.lora_target_modules: {missing} are not linear layers of the model; it has "
                         f"{linear_layer_names(model)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, lora_config(model_cfg))
    return peft_model


def inject_adapters(model: torch.nn.Module, model_cfg: Any) -> list[str]:
    """Adapters injected into `model` itself (an engine's model: no wrapper, same forward), B zero so the outputs are
    the base's; returns the names of their tensors in `model.state_dict()`."""
    from peft import inject_adapter_in_model

    inject_adapter_in_model(lora_config(model_cfg), model)
    for p in model.parameters():
        p.requires_grad_(False)
    return [k for k in model.state_dict() if ".lora_" in k]


def is_lora(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _lora_layers(base: torch.nn.Module):
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in base.named_modules() if isinstance(m, LoraLayer)]


def _unwrapped(name: str) -> str:
    """A name in the adapted model under the base model's own name: PEFT's `base_layer` levels dropped (a ParamWrapper
    of a module's stacked expert parameters nests one in another, so there can be several)."""
    return ".".join(part for part in name.split(".") if part != "base_layer")


def adapted_weights(base: torch.nn.Module) -> dict[str, list[Any]]:
    """Each base-model weight an adapter changes (under the base model's name) -> the LoRA layers whose deltas merge
    into it: a linear layer's `weight` (lora.Linear), and a parameter that PEFT wraps by itself (ParamWrapper: on a
    mixture-of-experts model, `all-linear` also adapts the router's `weight` and the experts' stacked 3-D
    `gate_up_proj` and `down_proj`). Another kind of LoRA layer is a ValueError: its merge is not known here."""
    from peft.tuners.lora import Linear, ParamWrapper

    out: dict[str, list[Any]] = {}
    for name, layer in _lora_layers(base):
        if isinstance(layer, ParamWrapper):
            leaf = layer.parameter_name
        elif isinstance(layer, Linear):
            leaf = "weight"
        else:
            raise ValueError(f"LoRA layer {name} ({type(layer).__name__}) cannot be merged for the engines: "
                             "name linear layers in model.lora_target_modules, or set rollout.lora_sync=adapter")
        if ADAPTER in layer.lora_A:
            out.setdefault(f"{_unwrapped(name)}.{leaf}", []).append(layer)
    return out


def adapter_params(peft_model: Any) -> dict[str, torch.Tensor]:
    """The live adapter tensors by name (the trainable parameters)."""
    return {n: p for n, p in peft_model.named_parameters() if p.requires_grad}


@torch.no_grad()
def rollout_state(peft_model: Any, *, merged: bool, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """The weights a rollout engine loads, as CPU tensors (floating ones in `dtype`).

    merged: the state dict of the merged model (what PEFT's `merge_and_unload` leaves: every weight of the base model
    under its own names, each adapted one `W + (alpha / r) B A`, added in W's dtype as PEFT adds it, then cast): what
    an engine without adapters loads. On a mixture-of-experts model that includes the router's weight and each
    expert's slice of the stacked expert parameters. Otherwise: the adapter tensors alone under the names an engine's
    injected adapters have (`inject_adapters`)."""

    base = peft_model.get_base_model()
    if not merged:
        return cpu_state(((n, t) for n, t in base.state_dict().items() if ".lora_" in n), dtype)
    adapted = adapted_weights(base)

    def merged_weights():
        for name, tensor in base.state_dict().items():
            if ".lora_" in name:
                continue
            name = _unwrapped(name)
            for layer in adapted.get(name, ()):
                tensor = tensor + layer.get_delta_weight(ADAPTER).to(tensor.dtype)
            yield name, tensor

    return cpu_state(merged_weights(), dtype)


def base_fingerprint(peft_model: Any) -> str:
    """A digest of the frozen base weights (names, shapes, dtypes and every value), so that a checkpoint of adapters
    is never resumed or exported on another base."""
    h = hashlib.sha256()
    for name, tensor in sorted(peft_model.get_base_model().state_dict().items()):
        if ".lora_" in name:
            continue
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        if t.numel():
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # the bytes in place, no copy
    return h.hexdigest()


def model_identity(model_cfg: Any) -> dict[str, Any]:
    """How the run named its base model (recorded beside the fingerprint, for the message of a mismatch)."""
    return {"name": model_cfg.name, "source": model_cfg.source, "path": model_cfg.path}


def check_base(directory: Any, fingerprint: str, model_cfg: Any) -> None:
    """Raise CheckpointFileError unless the checkpoint in `directory` holds adapters of this very base model."""
    import json
    from pathlib import Path


    file = Path(directory) / BASE_FILE
    if not file.is_file() or not (Path(directory) / ADAPTER_WEIGHTS).is_file():
        raise CheckpointFileError(f"checkpoint {str(directory)!r} holds no LoRA adapters ({BASE_FILE}, "
                                  f"{ADAPTER_WEIGHTS}), but model.lora_rank={model_cfg.lora_rank}: it was written "
                                  "by a run that trained every parameter")
    try:
        saved = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointFileError(f"checkpoint file {file} cannot be read: {e}") from None
    if saved.get("fingerprint") != fingerprint:
        raise CheckpointFileError(f"checkpoint {str(directory)!r} holds adapters of another base model "
                                  f"({saved.get('model')}) than this run's ({model_identity(model_cfg)}): its base "
                                  "weights differ, so the adapters would not reproduce the trained policy")


def load_adapters(peft_model: Any, weights: dict[str, torch.Tensor]) -> None:
    """Adapter tensors (as `PeftModel.save_pretrained` wrote them) into `peft_model`, every one of them: a missing or
    an unexpected one is a KeyError naming it."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    expected = set(get_peft_model_state_dict(peft_model))
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise KeyError(f"adapters do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    set_peft_model_state_dict(peft_model, weights)


def check_targets(model_cfg: Any, vocab_size: int, pad_token_id: int) -> None:
    """Raise ValueError unless every `model.lora_target_modules` name is a linear layer of the model, checked on its
    architecture alone (an empty model on the meta device: no weights are read)."""
    targets = list(model_cfg.lora_target_modules)
    if targets == [ALL_LINEAR]:
        return
    from transformers import AutoConfig, AutoModelForCausalLM


    if model_cfg.source == "config":
        config = qwen3_config(model_cfg, vocab_size, pad_token_id)
    else:
        path = resolve_model_path(model_cfg)
        config = (AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
                  if model_cfg.source == "gguf" else AutoConfig.from_pretrained(str(path), local_files_only=True))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    missing = missing_targets(model, targets)
    if missing:
        raise ValueError(f"model.lora_target_modules={targets}: {missing} are not linear layers of {model_cfg.name} "
                         f"({type(model).__name__}); its linear layers are {linear_layer_names(model)}")


PEFT_PREFIX = "base_model.model."


def write_adapter_dir(directory: Any, adapters: dict[str, torch.Tensor], model_cfg: Any) -> None:
    """Adapters named as an engine's injected ones (`rollout_state(merged=False)`) as a PEFT adapter directory
    (adapter_config.json, adapter_model.safetensors): what SGLang's `/load_lora_adapter` reads."""
    from pathlib import Path

    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lora_config(model_cfg).save_pretrained(str(directory))
    named = {PEFT_PREFIX + k.replace(f".{ADAPTER}.", "."): v.contiguous() for k, v in adapters.items()}
    save_file(named, str(directory / ADAPTER_WEIGHTS))


def read_adapter_dir(directory: Any) -> dict[str, torch.Tensor]:
    """A PEFT adapter directory's tensors under the names an engine's injected adapters have."""
    from pathlib import Path

    from safetensors.torch import load_file

    out = {}
    for k, v in load_file(str(Path(directory) / ADAPTER_WEIGHTS)).items():
        name = k.removeprefix(PEFT_PREFIX)
        for part in ("lora_A", "lora_B"):
            name = name.replace(f".{part}.weight", f".{part}.{ADAPTER}.weight")
        out[name] = v
    return out
