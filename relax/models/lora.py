"""LoRA on a Hugging Face causal LM, with PEFT: adapters on the target linear layers, the base weights frozen.

Each target linear layer computes `x W^T + (alpha / r) (x A^T) B^T` (A: [r, in], B: [out, r], B zero at the start,
so the adapted model starts as the base). What the rest of Relax needs from an adapted model lives here:
- `apply_lora`: the adapters, initialised under the run's seed (the global RNG untouched);
- `linear_layer_names` / `missing_targets` / `check_targets`: which `model.lora_target_modules` names the model has
  (PEFT's matching: a name targets each module whose full name is it or ends with "." + it), for a message that names
  them; the output head of a model with tied embeddings and a frozen vision tower's layers are refused as targets;
- `rollout_state`: the weights for the engines, merged (`W + (alpha / r) B A` under the base model's names, what PEFT's
  `merge_and_unload` gives, the routers and stacked experts of a mixture-of-experts model included) or the adapters
  alone (the names the engine's own injected adapters have);
- `adapter_params`: the live adapter tensors (old log-probs of stale samples swap only these);
- `base_fingerprint`: what a checkpoint of adapters records about the base it needs, checked on resume.
"""

from __future__ import annotations

import hashlib
import re
import warnings
from typing import Any, Optional

import torch

from relax.models import vision
from relax.models.checkpoint_files import CheckpointFileError
from relax.models.gguf_cache import gguf_config
from relax.models.hf import qwen3_config, resolve_model_path
from relax.models.weight_buffers import cpu_state

ADAPTER = "default"  # PEFT's adapter name
ALL_LINEAR = "all-linear"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # what PeftModel.save_pretrained writes, with ADAPTER_CONFIG
ADAPTER_CONFIG = "adapter_config.json"
BASE_FILE = "lora_base.json"  # the base model a checkpoint's adapters were trained on


# PEFT's `exclude_modules` of a run whose vision tower is frozen (`model.freeze_vision_tower`, the default with LoRA):
# every module under the tower (`model.visual` in transformers' Qwen-VL classes). A string is matched by PEFT with
# re.fullmatch against each module's full name, on injection and again when an adapter directory is loaded.
VISION_TOWER = r"(.*\.)?visual(\..*)?"


def lora_config(model_cfg: Any) -> Any:
    """PEFT's LoraConfig of `model.lora_*`; with the vision tower frozen, the tower excluded from the targets (its
    adapters would never train: B stays zero)."""
    from peft import LoraConfig

    targets = list(model_cfg.lora_target_modules)
    return LoraConfig(r=int(model_cfg.lora_rank), lora_alpha=float(model_cfg.lora_alpha),
                      lora_dropout=float(model_cfg.lora_dropout), bias="none",
                      target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else targets,
                      exclude_modules=VISION_TOWER if vision.frozen_tower(model_cfg) else None)


def _targets(name: str, target: str) -> bool:
    """Whether `target` (a `model.lora_target_modules` entry) names the module `name`, as PEFT matches a list entry."""
    return name == target or name.endswith("." + target)


def linear_layer_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (`q_proj`, ...), the output head included."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def missing_targets(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """The targets that name no module of `model`, or a module that is not a linear layer (PEFT would adapt an
    embedding or refuse an attention block; [] for all-linear)."""
    if targets == [ALL_LINEAR]:
        return []
    modules = [(name, m) for name, m in model.named_modules() if name]
    missing = []
    for t in targets:
        named = [m for name, m in modules if _targets(name, t)]
        if not named or not all(isinstance(m, torch.nn.Linear) for m in named):
            missing.append(t)
    return missing


def _module_name(model: torch.nn.Module, module: Optional[torch.nn.Module]) -> Optional[str]:
    return next((name for name, m in model.named_modules() if m is module), None) if module is not None else None


def tied_head_targets(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """The targets naming the output head when it shares its weight with the input embeddings
    (`tie_word_embeddings`): merged, its adapter would change the embeddings too. ([] for all-linear, which PEFT
    never applies to the output head.)"""
    if targets == [ALL_LINEAR]:
        return []
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embed is None or head.weight is not embed.weight:
        return []
    name = _module_name(model, head)
    return [t for t in targets if name is not None and _targets(name, t)]


def tower_targets(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """The targets whose every linear layer is in the vision tower (nothing left to adapt once it is excluded)."""
    core = vision.vision_core(model)
    if core is None or targets == [ALL_LINEAR]:
        return []
    tower = _module_name(model, core.visual)
    linear = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    return [t for t in targets if (named := [n for n in linear if _targets(n, t)])
            and all(n.startswith(f"{tower}.") for n in named)]


def _shortest_suffixes(targeted: list[str], others: list[str]) -> list[str]:
    """For each targeted module name, its shortest dotted suffix that no other module's name equals or ends with:
    a target list that PEFT matches to exactly `targeted` (what adapter_config.json then says trained)."""
    out = set()
    for name in targeted:
        parts = name.split(".")
        for i in range(len(parts) - 1, -1, -1):
            suffix = ".".join(parts[i:])
            if not any(_targets(o, suffix) for o in others):
                out.add(suffix)
                break
    return sorted(out)


# PEFT 0.21 adapts an MoE model's fused `gate_up_proj` experts parameter at rank 2r (alpha 2 alpha) through a
# rank_pattern / alpha_pattern entry it writes itself; its check for unused patterns looks at targeted modules only,
# not targeted parameters, so it warns that this entry matched nothing although it applied it (the adapters' shapes
# show rank 2r; tested). Only this exact warning is silenced, and only around Relax's own injections.
_FUSED_PATTERN_WARNING = (r"The following (rank|alpha)_pattern keys did not match any targeted module and were "
                          r"ignored: " + re.escape(repr([r".*\.gate_up_proj"])) + r"\.")
# PeftModel's constructor reads `model.is_gradient_checkpointing`, which transformers 5 deprecates with a
# FutureWarning on every read: a LoRA run would warn of a feature it may not use, from code that is not Relax's.
# Silenced only around get_peft_model.
_CHECKPOINTING_DEPRECATION = r"`is_gradient_checkpointing` is deprecated"


def apply_lora(model: torch.nn.Module, model_cfg: Any, *, seed: int) -> Any:
    """`model` with adapters injected in place (a PeftModel around it); its base parameters frozen. A's random
    initialisation draws from `seed` (B starts at zero), so every process builds the same adapters. With the vision
    tower excluded, the config's `target_modules` name the layers adapted (shortest unambiguous suffixes), so that
    adapter_config.json says what trained."""
    from peft import get_peft_model

    targets = list(model_cfg.lora_target_modules)
    missing = missing_targets(model, targets)
    if missing:
        raise ValueError(f"model.lora_target_modules: {missing} are not linear layers of the model; it has "
                         f"{linear_layer_names(model)}")
    config = lora_config(model_cfg)
    before = [name for name, _ in model.named_modules() if name]
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_FUSED_PATTERN_WARNING, category=RuntimeWarning)
        warnings.filterwarnings("ignore", message=_CHECKPOINTING_DEPRECATION, category=FutureWarning)
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    if config.exclude_modules:
        adapted = [_unwrapped(name) for name, _ in _lora_layers(peft_model.get_base_model())]
        others = sorted(set(before) - set(adapted))
        peft_model.peft_config[ADAPTER].target_modules = _shortest_suffixes(adapted, others)
    return peft_model


def inject_adapters(model: torch.nn.Module, model_cfg: Any) -> list[str]:
    """Adapters injected into `model` itself (an engine's model: no wrapper, same forward), B zero so the outputs are
    the base's; returns the names of their tensors in `model.state_dict()`."""
    from peft import inject_adapter_in_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_FUSED_PATTERN_WARNING, category=RuntimeWarning)
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
    shared = _shared_weights(base)
    for name, layer in _lora_layers(base):
        if isinstance(layer, ParamWrapper):
            leaf = layer.parameter_name
        elif isinstance(layer, Linear):
            leaf = "weight"
            others = shared.get(id(layer.get_base_layer().weight), [])
            if len(others) > 1:
                raise ValueError(f"LoRA layer {_unwrapped(name)} cannot be merged: its weight is also {others} "
                                 "(tied embeddings), so the merged weight would change those too and the merged "
                                 "model would not be the trained one")
        else:
            raise ValueError(f"LoRA layer {name} ({type(layer).__name__}) cannot be merged for the engines: "
                             "name linear layers in model.lora_target_modules, or set rollout.lora_sync=adapter")
        if ADAPTER in layer.lora_A:
            out.setdefault(f"{_unwrapped(name)}.{leaf}", []).append(layer)
    return out


def _shared_weights(base: torch.nn.Module) -> dict[int, list[str]]:
    """id of each parameter -> every name it has in `base` (several for a tied weight), the base's own names."""
    names: dict[int, list[str]] = {}
    for name, p in base.named_parameters(remove_duplicate=False):
        if ".lora_" not in name:
            names.setdefault(id(p), []).append(_unwrapped(name))
    return names


def check_merge(peft_model: Any) -> None:
    """Raise ValueError unless merging every adapter into its weight gives the adapted model (what
    `merge_and_unload` and `rollout_state(merged=True)` do): not when an adapted weight is tied to another."""
    adapted_weights(peft_model.get_base_model())


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


def _dead_tower_adapter(key: str, weights: dict[str, torch.Tensor]) -> bool:
    """Whether `key` is an adapter tensor on the vision tower whose B is zero: what a checkpoint written before a
    frozen tower was excluded from the targets holds there. It adds nothing to the model, so it is dropped."""
    module, _, leaf = key.partition(".lora_")
    b = weights.get(f"{module}.lora_B{leaf.removeprefix('A').removeprefix('B')}")
    return bool(leaf) and re.fullmatch(VISION_TOWER, module) is not None and b is not None and not bool(b.any())


def load_adapters(peft_model: Any, weights: dict[str, torch.Tensor]) -> None:
    """Adapter tensors (as `PeftModel.save_pretrained` wrote them) into `peft_model`, every one of them: a missing or
    an unexpected one is a KeyError naming it."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    expected = set(get_peft_model_state_dict(peft_model))
    weights = {k: v for k, v in weights.items() if k in expected or not _dead_tower_adapter(k, weights)}
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise KeyError(f"adapters do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    set_peft_model_state_dict(peft_model, weights)


def _empty_model(model_cfg: Any, vocab_size: int, pad_token_id: int) -> torch.nn.Module:
    """The model's architecture on the meta device (no weights read), in the class a run builds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    is_vision = vision.is_vision_config(model_cfg)
    if model_cfg.source == "config":
        config = (vision.vision_config(model_cfg, vocab_size, pad_token_id) if is_vision
                  else qwen3_config(model_cfg, vocab_size, pad_token_id))
    else:
        path = resolve_model_path(model_cfg)
        config = (gguf_config(path) if model_cfg.source == "gguf"
                  else AutoConfig.from_pretrained(str(path), local_files_only=True))
    with torch.device("meta"):
        return vision._model_class(config)(config) if is_vision else AutoModelForCausalLM.from_config(config)


def check_targets(model_cfg: Any, vocab_size: int, pad_token_id: int) -> None:
    """Raise ValueError unless every `model.lora_target_modules` name is a linear layer of the model (PEFT's
    matching: the full name or its ending after a dot, `q_proj` or `self_attn.q_proj`), not the output head of a model
    with tied embeddings, and not only layers of a frozen vision tower; checked on the architecture alone (an empty
    model on the meta device: no weights are read)."""
    targets = list(model_cfg.lora_target_modules)
    if targets == [ALL_LINEAR]:
        return  # PEFT's all-linear: every linear layer but the output head (the frozen tower excluded)
    model = _empty_model(model_cfg, vocab_size, pad_token_id)
    field = f"model.lora_target_modules={targets}"
    missing = missing_targets(model, targets)
    if missing:
        raise ValueError(f"{field}: {missing} are not linear layers of {model_cfg.name} ({type(model).__name__}); "
                         f"its linear layers are {linear_layer_names(model)} (a name matches a layer whose full "
                         "name is it or ends with '.' + it, as in PEFT)")
    head = tied_head_targets(model, targets)
    if head:
        raise ValueError(f"{field}: {head} is the output head of {model_cfg.name}, which shares its weight with the "
                         "input embeddings (tie_word_embeddings: true): merging its adapter (rollout.lora_sync=merged, "
                         "relax-export --merge) would change the input embeddings too, so the rollouts and the merged "
                         f"model would not be the trained policy; leave {head} out (all-linear adapts every linear "
                         "layer but the output head)")
    tower = tower_targets(model, targets) if vision.frozen_tower(model_cfg) else []
    if tower:
        raise ValueError(f"{field}: {tower} name only layers of the vision tower, which is frozen "
                         "(model.freeze_vision_tower, true by default with LoRA) and gets no adapters; name layers "
                         "of the language model, or set model.freeze_vision_tower=false to train the tower's")


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


# ---- continuing to train a PEFT adapter directory (model.lora_adapter_path) ---------------------------------------

ADAPTER_BIN = "adapter_model.bin"  # the older pickle PEFT still reads
# adapter_config.json fields whose non-default values would change what the adapters compute or which parameters
# train, beyond r, lora_alpha, lora_dropout and target_modules (what model.lora_* can say): such adapters are refused
_UNSUPPORTED = {"use_dora": (False, None, "DoRA (use_dora)"), "use_rslora": (False, None, "rank-stabilised scaling "
                "(use_rslora)"), "lora_bias": (False, None, "trained biases (lora_bias)"),
                "bias": ("none", None, "trained biases (bias)"), "modules_to_save": (None, [], "fully trained modules "
                "(modules_to_save)"), "layers_to_transform": (None, [], "layers_to_transform"),
                "layers_pattern": (None, [], "layers_pattern"), "rank_pattern": ({}, None, "per-layer ranks "
                "(rank_pattern)"), "alpha_pattern": ({}, None, "per-layer alphas (alpha_pattern)"),
                "fan_in_fan_out": (False, None, "fan_in_fan_out"), "target_parameters": (None, [], "adapted "
                "parameters (target_parameters: a mixture-of-experts model's experts)"),
                "trainable_token_indices": (None, {}, "trained token embeddings (trainable_token_indices)"),
                "layer_replication": (None, [], "layer_replication"), "use_qalora": (False, None, "QALoRA"),
                "alora_invocation_tokens": (None, [], "activated LoRA (alora_invocation_tokens)")}
# what model.lora_adapter_path's config and model report about the base, compared with model.path's
_BASE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")


def _adapter_weights(directory: Any) -> tuple[Any, dict[str, tuple[int, ...]]]:
    """(the weights file, name -> shape) of an adapter directory, shapes read without loading the tensors where it is
    safetensors."""
    from pathlib import Path

    directory = Path(directory)
    st, binary = directory / ADAPTER_WEIGHTS, directory / ADAPTER_BIN
    if st.is_file():
        from safetensors import safe_open

        with safe_open(str(st), framework="pt") as f:
            return st, {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    if binary.is_file():
        weights = torch.load(str(binary), map_location="cpu", weights_only=True, mmap=True)
        return binary, {k: tuple(v.shape) for k, v in weights.items()}
    raise ValueError(f"model.lora_adapter_path={str(directory)!r} has no adapter weights ({ADAPTER_WEIGHTS} or "
                     f"{ADAPTER_BIN}): it is not a PEFT adapter directory")


def read_adapter_weights(directory: Any) -> dict[str, torch.Tensor]:
    """An adapter directory's tensors, as `PeftModel.save_pretrained` named them."""
    file, _ = _adapter_weights(directory)
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(file))
    return torch.load(str(file), map_location="cpu", weights_only=True)


def check_adapter_dir(model_cfg: Any, vocab_size: int, pad_token_id: int) -> str:
    """Raise ValueError unless `model.lora_adapter_path` is a PEFT LoRA adapter directory of a causal LM that Relax
    trains as it was saved, on model.path's model: adapter_config.json readable, peft_type LORA with nothing but
    r / lora_alpha / lora_dropout / target_modules set (DoRA, rsLoRA, modules_to_save, per-layer ranks ... refused),
    and its base the model's: every adapted layer a linear layer of the model of the adapter's shapes (in, out, r), and
    where adapter_config.json's base_model_name_or_path is a local model directory, its model_type, vocabulary,
    hidden size and layers the model's (checked on the architecture: no weights read). Returns the dry run's line."""
    from pathlib import Path

    from relax.data.tokenizer import read_json_object

    where = f"model.lora_adapter_path={model_cfg.lora_adapter_path!r}"
    directory = Path(model_cfg.lora_adapter_path).expanduser()
    file = directory / ADAPTER_CONFIG
    if not directory.is_dir():
        raise ValueError(f"{where} is not a directory (a PEFT adapter directory: {ADAPTER_CONFIG} and "
                         f"{ADAPTER_WEIGHTS}, as PeftModel.save_pretrained writes them)")
    if not file.is_file():
        raise ValueError(f"{where} has no {ADAPTER_CONFIG}: it is not a PEFT adapter directory (what "
                         "PeftModel.save_pretrained, TRL and relax-export of a LoRA run write)")
    own = read_json_object(file)  # ModelFileError, a ValueError, naming the file
    if own.get("peft_type") != "LORA":
        raise ValueError(f"{where}: peft_type {own.get('peft_type')!r} in {ADAPTER_CONFIG}; only LoRA adapters "
                         "(peft_type LORA) can be trained on (model.lora_adapter_path)")
    unsupported = [what for key, (default, alt, what) in _UNSUPPORTED.items()
                   if key in own and own[key] != default and own[key] != alt]
    if unsupported:
        raise ValueError(f"{where}: its {ADAPTER_CONFIG} uses {', '.join(unsupported)}, which Relax's LoRA does not "
                         "train (plain LoRA only: r, lora_alpha, lora_dropout, target_modules); the adapters would "
                         "not compute what they were saved to")
    if own.get("task_type") not in ("CAUSAL_LM", None):
        raise ValueError(f"{where}: task_type {own.get('task_type')!r} in {ADAPTER_CONFIG} is not a causal LM's "
                         "(CAUSAL_LM)")
    targets = own.get("target_modules")
    if not (targets == ALL_LINEAR or (isinstance(targets, list) and targets and all(isinstance(t, str)
                                                                                    for t in targets))):
        raise ValueError(f"{where}: target_modules {targets!r} in {ADAPTER_CONFIG} is not a list of layer names "
                         "(a regular expression is not read by model.lora_target_modules)")
    if not isinstance(own.get("r"), int) or own["r"] <= 0 or model_cfg.lora_rank <= 0:
        raise ValueError(f"{where}: its {ADAPTER_CONFIG} gives no LoRA settings (r {own.get('r')!r}, lora_alpha "
                         f"{own.get('lora_alpha')!r}: a positive integer rank and a number are needed)")
    excluded = own.get("exclude_modules")
    if excluded not in (None, [], VISION_TOWER if vision.frozen_tower(model_cfg) else None):
        raise ValueError(f"{where}: exclude_modules {excluded!r} in {ADAPTER_CONFIG} is not read by Relax's LoRA")
    model = _empty_model(model_cfg, vocab_size, pad_token_id)
    ours = f"model.path's model ({model_cfg.path or model_cfg.name}, source={model_cfg.source})"
    base_name = own.get("base_model_name_or_path")
    if isinstance(base_name, str) and base_name:
        base_dir = next((p for p in (Path(base_name).expanduser(), directory / base_name)
                         if (p / "config.json").is_file()), None)
        if base_dir is not None:
            from transformers import AutoConfig

            theirs = AutoConfig.from_pretrained(str(base_dir), local_files_only=True)
            text_ours = getattr(model.config, "text_config", None) or model.config
            text_theirs = getattr(theirs, "text_config", None) or theirs
            differ = [f"{k} {getattr(text_theirs, k, None)} (theirs) vs {getattr(text_ours, k, None)}"
                      for k in _BASE_KEYS if getattr(text_theirs, k, None) != getattr(text_ours, k, None)]
            if differ:
                raise ValueError(f"{where} holds adapters of the base {base_name!r} ({ADAPTER_CONFIG}'s "
                                 f"base_model_name_or_path), which is not {ours}: {'; '.join(differ)}. Set model.path "
                                 "to the base the adapters were trained on")
    _, shapes = _adapter_weights(directory)
    modules = dict(model.named_modules())
    for key, shape in sorted(shapes.items()):
        module_name, _, leaf = key.removeprefix(PEFT_PREFIX).partition(".lora_")
        if leaf not in ("A.weight", "B.weight"):
            raise ValueError(f"{where}: tensor {key} is not a LoRA A or B weight of a linear layer (embedding "
                             "adapters and others are not trained by Relax's LoRA)")
        layer = modules.get(module_name)
        if not isinstance(layer, torch.nn.Linear):
            raise ValueError(f"{where}: the adapters adapt {module_name}, which is not a linear layer of {ours}: "
                             f"they were trained on another base (adapter_config.json names {base_name!r}); set "
                             "model.path to that base")
        want = (model_cfg.lora_rank, layer.in_features) if leaf == "A.weight" else \
            (layer.out_features, model_cfg.lora_rank)
        if tuple(shape) != want:
            raise ValueError(f"{where}: {key} is {list(shape)}, but on {ours} layer {module_name} "
                             f"({layer.in_features} -> {layer.out_features}, rank {model_cfg.lora_rank}) it would "
                             f"be {list(want)}: the adapters were trained on another base (adapter_config.json names "
                             f"{base_name!r}); set model.path to that base")
    return (f"continues training the LoRA adapters of {directory} (rank {model_cfg.lora_rank}, "
            f"{len(shapes) // 2} layers) on {model_cfg.path or model_cfg.name}")


def load_adapter_dir(peft_model: Any, directory: Any) -> None:
    """The adapter weights of a PEFT adapter directory into `peft_model` (whose config is the directory's, as
    `derive.resolve` made model.lora_*), every tensor: a missing or an extra one is a KeyError naming it."""
    load_adapters(peft_model, read_adapter_weights(directory))


def check_adapter_tokenizer(model_cfg: Any, tokenizer: Any) -> None:
    """Raise ValueError where model.lora_adapter_path holds a tokenizer (SFT runs often save theirs with the
    adapters) that is not the run's (`tokenizer`, model.path's): another vocabulary (the adapters learned other token
    ids), or, without model.chat_template, another chat template (the prompts would not be rendered as in SFT). A
    directory without tokenizer files says nothing: the run's is used."""
    from pathlib import Path

    from transformers import AutoTokenizer

    directory = Path(model_cfg.lora_adapter_path).expanduser()
    if not (directory / "tokenizer_config.json").is_file():
        return
    where = f"model.lora_adapter_path={model_cfg.lora_adapter_path!r}"
    try:
        theirs = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:  # noqa: BLE001  (transformers' own errors of files it cannot read)
        raise ValueError(f"{where}: its tokenizer files cannot be loaded: {type(e).__name__}: {e}") from None
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"{where} holds a tokenizer of another vocabulary ({len(theirs)} tokens) than the run's, "
                         f"model.path's ({len(tokenizer)} tokens): the adapters were trained on other token ids; "
                         "train them on the model and tokenizer they were trained with")
    from relax.data.tokenizer import CHATML_TEMPLATE

    # without a template of its own a tokenizer gets ChatML in Relax (`load_tokenizer`), the adapters' one too
    if not model_cfg.chat_template and (theirs.chat_template or CHATML_TEMPLATE) != tokenizer.chat_template:
        raise ValueError(f"{where} holds a tokenizer whose chat template is not model.path's: the run would render "
                         "prompts otherwise than the adapters were trained on; set model.chat_template to the "
                         "template to use (the adapter directory's chat_template.jinja, where it has one)")
