"""A checkpoint's policy as a Hugging Face model directory (what `relax-export` writes).

The directory holds everything `transformers` needs to load and sample the policy as the run did:

- `config.json` and `model.safetensors` (or the shards and index that `save_pretrained` wrote): the policy's weights
  exactly as the checkpoint holds them (the trainer's fp32 master weights on the torch backend), so the exported
  model's log-probs are the trainer's. Their source, in this order: `hf/` (a Megatron run with `train.save_hf=true`),
  `policy/` in Hugging Face layout (the torch backend; weight files copied byte for byte), or the Megatron backend's
  per-rank shards in `policy/` (converted with `relax.train.megatron.convert`, on the CPU, without a process
  group or megatron-core). `use_cache` is switched back on in config.json (the trainer turns the KV cache off).
- the run's tokenizer (`tokenizer.save_pretrained`: tokenizer.json, tokenizer_config.json and the chat template,
  which transformers writes to chat_template.jinja), loaded as the run loaded it (`relax.data.tokenizer`):
  the built-in tiny tokenizer for `model.source=config`, the model directory's or the .gguf file's otherwise.
- a vision-language model's processor (`model.arch` / config.json `model_type` qwen2_5_vl or qwen3_vl): the family's
  transformers processor class (`Qwen2_5_VLProcessor`, `Qwen3VLProcessor`) named in processor_config.json with the
  run's image processor (patch and merge sizes, pixel bounds) nested in it, and the image processor alone in
  preprocessor_config.json, as the real checkpoints ship it (transformers reads the video processor's settings from
  it too; its video processor needs torchvision). The run's image processor and chat template, so that
  `AutoProcessor` + `AutoModelForImageTextToText` on the directory give the trainer's log-probs on image prompts.
- `generation_config.json`: eos = the run's stop tokens (`stop_token_ids`), pad = its pad token, a VL model's image
  and video placeholder tokens as `suppress_tokens` (the run neither samples nor scores them), and the run's
  sampling (`rollout.temperature`, `top_p`, `top_k`; top_k -1 is written as 0, "off" in transformers, whose
  default is 50). The trainer's log-probs are of `softmax(logits / rollout.temperature)`: the exported model's
  `log_softmax(logits / generation_config.temperature)`.
- `relax_export.json`: where it came from (the caller's metadata) and what was exported.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from dataclasses import replace as dataclass_replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import GenerationConfig, PreTrainedTokenizerBase

from relax.config.schema import ModelConfig, RolloutConfig
from relax.config.vision_rules import hf_model_type, is_vision_model
from relax.data.tokenizer import ModelFileError, ModelPathError, load_tokenizer, stop_token_ids
from relax.models.checkpoint_files import CheckpointFileError, load_safetensors_file
from relax.models.gguf_cache import gguf_config
from relax.models.hf import build_model, qwen3_config, resolve_model_path
from relax.models.write_errors import os_write_errors

EXPORT_FILE = "relax_export.json"
POLICY_DIR = "policy"
HF_DIR = "hf"  # a Megatron checkpoint's Hugging Face copy of the policy (train.save_hf=true)
CONFIG_FILE = "config.json"
SINGLE_WEIGHTS = "model.safetensors"
SHARDED_INDEX = "model.safetensors.index.json"


class ExportError(ValueError):
    """A checkpoint that cannot be exported as it is; the message names the file or the config field."""


@dataclass
class Exported:
    """What `write_hf_directory` wrote."""

    weights_from: str  # "hf/", "policy/", or "policy/ (Megatron tp=.. pp=.. shards, converted)"
    dtype: str  # of the weights, e.g. "float32"
    num_parameters: int  # stored parameters (a tied lm_head counted once)
    stop_tokens: list[tuple[int, str]]  # (id, token) of every stop token
    sampling: dict[str, Any]  # the sampling defaults of generation_config.json
    files: list[str] = field(default_factory=list)  # the directory's files, sorted


def _json_object(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_bytes())
    except OSError as e:
        raise ExportError(f"{file} cannot be read ({e.strerror or e})") from None
    except ValueError as e:
        raise ExportError(f"{file} is damaged (not JSON: {e})") from None
    if not isinstance(data, dict):
        raise ExportError(f"{file} is damaged (not a JSON object)")
    return data


def _hf_weight_files(src: Path) -> list[str]:
    """The weight files of a Hugging Face directory `save_pretrained` wrote: model.safetensors, or the index and
    the shards it names."""
    if (src / SINGLE_WEIGHTS).is_file():
        return [SINGLE_WEIGHTS]
    index = src / SHARDED_INDEX
    if index.is_file():
        weight_map = _json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ExportError(f"{index} is damaged (no 'weight_map')")
        shards = sorted({str(v) for v in weight_map.values()})
        for name in shards:
            if Path(name).name != name or not (src / name).is_file():
                raise ExportError(f"{index} names the shard {name!r}, which is not a file of {src}")
        return [SHARDED_INDEX, *shards]
    raise ExportError(f"{src} has no weights in safetensors format (neither {SINGLE_WEIGHTS} nor {SHARDED_INDEX})")


def _tensor_stats(files: list[Path]) -> tuple[int, str]:
    """(number of parameters, dtype) from safetensors headers, without reading the tensors."""
    count, dtypes = 0, set()
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as st:
                for key in st.keys():
                    piece = st.get_slice(key)
                    n = 1
                    for d in piece.get_shape():
                        n *= d
                    count += n
                    dtypes.add(piece.get_dtype())
        except Exception as e:  # SafetensorError: a header that does not parse
            raise ExportError(f"{file} is damaged or truncated: {e}") from None
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    return count, ", ".join(sorted(names.get(d, d) for d in dtypes))


def _copy_hf_weights(src: Path, out: Path) -> tuple[int, str]:
    """Copy config.json (KV cache on) and the weight files of an HF directory; (parameters, dtype)."""
    config_file = src / CONFIG_FILE
    if not config_file.is_file():
        raise ExportError(f"{src} has no {CONFIG_FILE}")
    config = _json_object(config_file)
    names = _hf_weight_files(src)
    for name in names:
        shutil.copyfile(src / name, out / name)
    count, dtype = _tensor_stats([out / n for n in names if n.endswith(".safetensors")])
    config["use_cache"] = True  # the trainer's models run without a KV cache; generation wants it
    if not config.get("dtype") and not config.get("torch_dtype") and "," not in dtype:
        config["dtype"] = dtype  # Megatron's hf/ records none: the weights' own
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return count, dtype


def megatron_hf_config(model_cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> Any:
    """The transformers config the Megatron trainer built its model from (`MegatronPolicy._hf_source`): the
    source=config Qwen3 config for the tokenizer's vocabulary, else the config of the model's files."""
    from transformers import AutoConfig

    if model_cfg.source == "config":
        return qwen3_config(model_cfg, len(tokenizer), int(tokenizer.pad_token_id))
    path = resolve_model_path(model_cfg)
    if model_cfg.source == "gguf":
        config = gguf_config(path)
        if hasattr(config, "quantization_config"):  # the weights are de-quantized (relax.models.gguf_cache)
            del config.quantization_config
    else:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    if config.pad_token_id is None:
        config.pad_token_id = int(tokenizer.pad_token_id)
    return config


def _convert_megatron(policy: Path, out: Path, model_cfg: ModelConfig,
                      tokenizer: PreTrainedTokenizerBase) -> tuple[int, str, str]:
    """The Megatron shards of `policy/` as one HF model.safetensors + config.json; (parameters, dtype, sizes)."""
    from relax.train.megatron import convert
    from relax.train.megatron.model import arch_from_hf_config
    from relax.train.megatron.policy import MODEL_FILE, STATE_FILE

    meta_file = policy / STATE_FILE
    meta = _json_object(meta_file)
    try:
        tp, pp = int(meta["tensor_parallel_size"]), int(meta["pipeline_parallel_size"])
    except (KeyError, TypeError, ValueError):
        raise ExportError(f"{meta_file} is damaged (no tensor_parallel_size / pipeline_parallel_size)") from None
    if tp < 1 or pp < 1:
        raise ExportError(f"{meta_file} is damaged (tensor_parallel_size={tp}, pipeline_parallel_size={pp})")
    config = megatron_hf_config(model_cfg, tokenizer)
    try:
        spec = arch_from_hf_config(config)
    except ValueError as e:
        raise ExportError(str(e)) from None
    state: dict[str, torch.Tensor] = {}
    names: set[str] = set()
    for stage in range(pp):
        files = [policy / MODEL_FILE.format(tp=rank, pp=stage, dp=0) for rank in range(tp)]
        for file in files:
            if not file.is_file():
                raise ExportError(f"{file} is missing (the checkpoint says tensor_parallel_size={tp}, "
                                  f"pipeline_parallel_size={pp})")
        try:
            shards = [load_safetensors_file(f) for f in files]
        except CheckpointFileError as e:
            raise ExportError(str(e)) from None
        if any(set(s) != set(shards[0]) for s in shards):
            raise ExportError(f"the tensor-parallel shards of pipeline stage {stage} ({files[0].name}, ...) do not "
                              "hold the same tensors")
        names |= set(shards[0])
        try:
            state.update(convert.megatron_to_hf(spec, shards))
        except (KeyError, RuntimeError, ValueError) as e:
            raise ExportError(f"the Megatron weights of {policy} do not fit the model of this run's config "
                              f"({spec.arch}, {spec.num_layers} layers, vocab {spec.vocab_size}): {e}") from None
    expected = set(convert.megatron_names(spec, layers=range(spec.num_layers), pre_process=True, post_process=True))
    missing = sorted(expected - names)
    extra = sorted(names - expected - {"output_layer.weight"})  # a last pipeline stage's copy of a tied embedding
    if missing or extra:
        raise ExportError(f"the Megatron weights of {policy} do not fit the model of this run's config: missing "
                          f"{missing[:5]}, unexpected {extra[:5]}")
    vocab_rows = state["model.embed_tokens.weight"].shape[0]
    if vocab_rows != spec.vocab_size:
        raise ExportError(f"the Megatron embedding of {policy} has {vocab_rows} rows, the model's config "
                          f"{spec.vocab_size}")
    dtypes = {t.dtype for t in state.values()}
    dtype = next(iter(dtypes)) if len(dtypes) == 1 else torch.float32
    config.dtype = dtype
    config.use_cache = True
    save_file({k: v.detach().to(dtype).contiguous().clone() for k, v in state.items()}, str(out / SINGLE_WEIGHTS),
              metadata={"format": "pt"})
    config.save_pretrained(str(out))
    count = sum(t.numel() for t in state.values())
    return count, str(dtype).removeprefix("torch."), f"tp={tp} pp={pp}"


def generation_config(tokenizer: PreTrainedTokenizerBase, stops: tuple[int, ...], rollout: RolloutConfig,
                      suppress: tuple[int, ...] = ()) -> GenerationConfig:
    """Stop and pad tokens and the sampling of the run (top_k -1, off, is 0 for transformers); `suppress`: tokens
    the run never samples nor scores (a VL model's image and video placeholders)."""
    return GenerationConfig(
        **({"suppress_tokens": list(suppress)} if suppress else {}),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=list(stops) if len(stops) > 1 else stops[0],
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=float(rollout.temperature),
        top_p=float(rollout.top_p),
        top_k=int(rollout.top_k) if rollout.top_k > 0 else 0,
    )


def _write_lora(policy: Path, out: Path, model_cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, *, merge: bool,
                seed: int) -> tuple[int, str, str]:
    """A LoRA checkpoint's adapters as a PEFT adapter directory, or merged into the base model (rebuilt from the run's
    model config, then checked against the base the adapters were trained on): (parameters, dtype, source)."""
    from relax.models import lora

    if not merge:
        for name in (lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS):
            shutil.copyfile(policy / name, out / name)
        count, dtype = _tensor_stats([out / lora.ADAPTER_WEIGHTS])
        return count, dtype, f"{POLICY_DIR}/ (LoRA adapters, PEFT layout)"
    base = build_model(model_cfg, len(tokenizer), int(tokenizer.pad_token_id), seed=seed, dtype=torch.float32)
    peft_model = lora.apply_lora(base, dataclass_replace(model_cfg, lora_dropout=0.0), seed=seed)
    try:
        lora.check_base(policy, lora.base_fingerprint(peft_model), model_cfg)
    except CheckpointFileError as e:
        raise ExportError(str(e)) from None
    lora.load_adapters(peft_model, load_safetensors_file(policy / lora.ADAPTER_WEIGHTS))
    try:
        lora.check_merge(peft_model)  # an adapter on a tied output head: merged, it would change the embeddings too
    except ValueError as e:
        raise ExportError(f"--merge: {e}; export without --merge (a PEFT adapter directory: PEFT applies the "
                          "adapter to that layer alone)") from None
    merged = peft_model.merge_and_unload()
    merged.config.use_cache = True
    merged.save_pretrained(str(out))
    count, dtype = _tensor_stats(sorted(out.glob("*.safetensors")))
    return count, dtype, f"{POLICY_DIR}/ (LoRA adapters merged into the base)"


# the transformers processor class of each vision-language family (config.json model_type)
PROCESSOR_CLASSES = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor",
                     "qwen3_vl_moe": "Qwen3VLProcessor"}  # Qwen3-VL-MoE checkpoints ship Qwen3-VL's processor
PROCESSOR_FILE = "processor_config.json"
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"


def _write_processor(out: Path, model_cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """A vision-language run's processor, loaded as the run loaded it (`relax.data.images.load_processor`), saved
    under its family's transformers processor class: the run's own class is a local subclass without a video
    processor (which needs torchvision), a name transformers could not resolve. Returns the image and video
    placeholder tokens (config.json's, else the tokenizer's), which the run never samples nor scores
    (`relax.models.vision.placeholder_ids`): the generation config suppresses them."""
    from relax.data.images import load_processor

    model_type = model_cfg.arch if model_cfg.source == "config" else hf_model_type(model_cfg)
    if model_type not in PROCESSOR_CLASSES:
        raise ExportError(f"no processor class is known for the vision-language model_type {model_type!r} "
                          f"(known: {', '.join(PROCESSOR_CLASSES)})")
    processor = load_processor(model_cfg, tokenizer)
    processor.save_pretrained(str(out))  # processor_config.json, the tokenizer again, chat_template.jinja
    processor.image_processor.save_pretrained(str(out))  # preprocessor_config.json
    for name in (PROCESSOR_FILE, IMAGE_PROCESSOR_FILE, "tokenizer_config.json"):
        record = _json_object(out / name)
        record["processor_class"] = PROCESSOR_CLASSES[model_type]
        (out / name).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    config = _json_object(out / CONFIG_FILE) if (out / CONFIG_FILE).is_file() else {}
    ids = [config.get("image_token_id"), config.get("video_token_id")]
    if None in ids:  # LoRA adapters alone: no config.json; the processor's tokens
        ids = [processor.image_token_id, processor.video_token_id]
    return tuple(sorted({int(i) for i in ids}))


def write_hf_directory(checkpoint: Path, out: Path, model_cfg: ModelConfig, rollout: RolloutConfig, *,
                       metadata: dict[str, Any], merge: bool = False, seed: int = 1,
                       key: str = "model.path") -> Exported:
    """Write the Hugging Face directory of checkpoint `checkpoint` (already verified) into the empty directory `out`.

    `model_cfg` / `rollout`: the run's (its config.yaml), for the tokenizer, the stop tokens and the sampling.
    `metadata` goes into relax_export.json with what was exported. Raises ExportError naming the file or field;
    `relax.data.tokenizer`'s ModelPathError / ModelFileError when the run's tokenizer or model config cannot be loaded
    here, naming `key` (the option the model's path was given as: relax-export's `--model-path`); a failed write (disk
    full, unwritable) as a plain OSError naming the file.
    """
    try:
        tokenizer = load_tokenizer(model_cfg, key=key)
        if model_cfg.source != "config":  # config.json, which the conversions below read, checked once, named by key
            resolve_model_path(model_cfg, key=key)
        stops = stop_token_ids(model_cfg, tokenizer)
    except (ModelPathError, ModelFileError):
        raise
    except ValueError as e:  # a model.source this version does not know, a tokenizer without EOS
        raise ExportError(f"the run's tokenizer cannot be used: {e}") from None
    policy, hf = checkpoint / POLICY_DIR, checkpoint / HF_DIR
    from relax.models.lora import ADAPTER_CONFIG

    lora_checkpoint = (policy / ADAPTER_CONFIG).is_file()
    if merge and not lora_checkpoint:
        raise ExportError(f"--merge merges LoRA adapters, but {policy} holds a whole model (no {ADAPTER_CONFIG})")
    with os_write_errors(out):
        if lora_checkpoint:
            count, dtype, source = _write_lora(policy, out, model_cfg, tokenizer, merge=merge, seed=seed)
        elif (hf / CONFIG_FILE).is_file():
            count, dtype = _copy_hf_weights(hf, out)
            source = f"{HF_DIR}/"
        elif (policy / CONFIG_FILE).is_file():
            count, dtype = _copy_hf_weights(policy, out)
            source = f"{POLICY_DIR}/"
        elif (policy / "trainer_state.json").is_file():
            count, dtype, sizes = _convert_megatron(policy, out, model_cfg, tokenizer)
            source = f"{POLICY_DIR}/ (Megatron {sizes} shards, converted)"
        else:
            raise ExportError(f"{checkpoint} holds no policy weights: neither {policy / CONFIG_FILE} (a Hugging Face "
                              f"directory) nor {policy / 'trainer_state.json'} (Megatron shards)")
        # padding_side is an attribute the tokenizer's own config may not record (the tiny tokenizer's "left")
        tokenizer.init_kwargs["padding_side"] = tokenizer.padding_side
        tokenizer.save_pretrained(str(out))
        suppress: tuple[int, ...] = ()
        if is_vision_model(model_cfg):
            suppress = _write_processor(out, model_cfg, tokenizer)
        gen = generation_config(tokenizer, stops, rollout, suppress)
        gen.save_pretrained(str(out))
        sampling = {"temperature": gen.temperature, "top_p": gen.top_p, "top_k": gen.top_k}
        stop_tokens = [(i, str(tokenizer.convert_ids_to_tokens(i))) for i in stops]
        record = {**metadata, "weights_from": source, "dtype": dtype, "num_parameters": count,
                  "stop_token_ids": list(stops), "pad_token_id": tokenizer.pad_token_id, "sampling": sampling}
        (out / EXPORT_FILE).write_text(json.dumps(record, indent=2) + "\n")
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    return Exported(weights_from=source, dtype=dtype, num_parameters=count, stop_tokens=stop_tokens,
                    sampling=sampling, files=files)
