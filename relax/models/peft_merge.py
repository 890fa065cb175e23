"""A PEFT adapter directory as a model: its base model with the adapters merged, written once as a full model.

`model.path` (or `teacher.path`) may name a PEFT adapter directory (adapter_config.json and adapter weights, no
config.json), as `PeftModel.save_pretrained`, TRL and Relax's own LoRA exports write it. It stands for what PEFT's
`AutoPeftModelForCausalLM.from_pretrained(dir)` loads: the base model that adapter_config.json's
`base_model_name_or_path` names, its embeddings grown to the adapter directory's tokenizer where that tokenizer is
larger, with the adapters applied. `ensure_merged` merges them into the base (`merge_and_unload`, in fp32, saved in
the base's own dtype) and writes the result as a Hugging Face model directory, where
`relax.data.tokenizer.merged_adapter_dir` says (in `$RELAX_MODEL_CACHE_DIR`), so that every role, backend and
engine (SGLang servers, Megatron's weight loading, the tokenizer and generation config) reads a plain model
directory. It is written under a lock and renamed into place whole; a later call reuses it while the adapter files
and the base's files are unchanged.

The merged directory holds the tokenizer and the generation config of the adapter directory where it has them, else
the base's, and the base's processor files. Nothing is downloaded: the base is found on this
machine (`find_base`), or a ModelPathError names it and where to put it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from relax.data.tokenizer import (
    ADAPTER_CONFIG_FILE,
    HF_WEIGHT_FILES,
    MERGE_RECORD,
    ModelFileError,
    ModelPathError,
    is_adapter_dir,
    merged_adapter_dir,
    quiet_transformers,
    resolve_model_path,
)
from relax.models.gguf_cache import cache_lock

# the files of a tokenizer (and of a vision-language model's processor) that `save_pretrained` writes
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt", "chat_template.jinja",
                   "chat_template.json")
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
# a Hugging Face Hub model id: `name` or `owner/name`
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def adapter_path(model_cfg: Any) -> Optional[Path]:
    """The PEFT adapter directory `model_cfg` names (`source=hf`), None for any other model."""
    if getattr(model_cfg, "source", None) != "hf":
        return None
    path = resolve_model_path(model_cfg, merged=False)
    return path if path is not None and is_adapter_dir(path) else None


def read_adapter_config(adapter_dir: Path) -> dict[str, Any]:
    """adapter_config.json as a dict; ModelFileError naming the file when it is not a JSON object naming a base."""
    file = adapter_dir / ADAPTER_CONFIG_FILE
    try:
        config = json.loads(file.read_bytes())
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{file} cannot be read as JSON: {e}") from None
    if not isinstance(config, dict):
        raise ModelFileError(f"{file} is not a JSON object")
    base = config.get("base_model_name_or_path")
    if not isinstance(base, str) or not base.strip():
        raise ModelFileError(f"{file} names no base model (base_model_name_or_path is {base!r}): set it to the base "
                             "model's local directory")
    if not any((adapter_dir / name).is_file() for name in ("adapter_model.safetensors", "adapter_model.bin")):
        raise ModelFileError(f"PEFT adapter directory {str(adapter_dir)!r} has no adapter weights "
                             "(adapter_model.safetensors or adapter_model.bin)")
    return config


def _is_model_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def find_base(adapter_dir: Path, name: str) -> Path:
    """The local directory of the base model that adapter_config.json names (`name`), looked for where PEFT would
    find it without a download: the path itself (relative ones from the working directory, then from the adapter
    directory); `<adapter_dir>/base` (Relax's adapter export of a base built from config, moved with its adapters);
    for a Hub id, `$MODEL_DIR/<id>` and `$MODEL_DIR/<its last part>` (Relax's place for models) and the Hugging Face
    cache. ModelPathError naming the base, where it looked and how to point at a local copy."""
    p = Path(name).expanduser()
    looked: list[Path] = [p] if p.is_absolute() else [Path.cwd() / p, adapter_dir / p]
    looked.append(adapter_dir / "base")
    model_dir = os.environ.get("MODEL_DIR")
    hub_id = not p.is_absolute() and _HUB_ID.match(name) is not None
    if model_dir and hub_id:
        looked += [Path(model_dir).expanduser() / name, Path(model_dir).expanduser() / p.name]
    if looked[0].is_file() and looked[0].suffix == ".gguf":  # Relax's adapter export of a model.source=gguf run
        return looked[0].resolve()
    for candidate in looked:
        if _is_model_dir(candidate):
            return candidate.resolve()
    if hub_id:
        try:
            from huggingface_hub import snapshot_download

            cached = Path(snapshot_download(name, local_files_only=True))
        except Exception:  # noqa: BLE001  (not in the cache: huggingface_hub's LocalEntryNotFoundError and kin)
            cached = None
        if cached is not None and _is_model_dir(cached):
            return cached
    where = ", ".join(str(c) for c in dict.fromkeys(looked)) + (", the Hugging Face cache" if hub_id else "")
    put = f"at $MODEL_DIR/{p.name} or in the Hugging Face cache, " if hub_id else ""
    raise ModelPathError(f"{str(adapter_dir)!r} is a PEFT adapter directory whose base model {name!r} "
                         f"({ADAPTER_CONFIG_FILE}'s base_model_name_or_path) is not on this machine (looked at "
                         f"{where}; nothing is downloaded): put the base model {put}or set base_model_name_or_path in "
                         f"{adapter_dir / ADAPTER_CONFIG_FILE} to its local directory")


def _files_signature(directory: Path) -> dict[str, list[int]]:
    """Name -> [size, mtime_ns] of the files of a model directory that define its weights and config (of a .gguf
    file: the file's)."""
    if directory.is_file():
        stat = directory.stat()
        return {directory.name: [stat.st_size, stat.st_mtime_ns]}
    out = {}
    for name in ("config.json", *HF_WEIGHT_FILES):
        f = directory / name
        if f.is_file():
            stat = f.stat()
            out[name] = [stat.st_size, stat.st_mtime_ns]
    index = directory / "model.safetensors.index.json"
    if index.is_file():  # the shards an index names
        try:
            shards = set(json.loads(index.read_bytes()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError):
            shards = set()
        for name in sorted(shards):
            if (directory / name).is_file():
                stat = (directory / name).stat()
                out[name] = [stat.st_size, stat.st_mtime_ns]
    return out


def _read_record(out: Path) -> Optional[dict[str, Any]]:
    try:
        record = json.loads((out / MERGE_RECORD).read_bytes())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def ensure_merged(model_cfg: Any) -> Optional[Path]:
    """For a `model_cfg` whose path is a PEFT adapter directory: the directory of its base with the adapters merged,
    written now unless an up-to-date one is there (`relax.data.tokenizer.merged_adapter_dir`); None for any other
    model. Raises ModelPathError / ModelFileError naming what is wrong (the base not found, unreadable files,
    adapters that do not fit the base or cannot be merged)."""
    adapter_dir = adapter_path(model_cfg)
    if adapter_dir is None:
        return None
    name = read_adapter_config(adapter_dir)["base_model_name_or_path"]
    base = find_base(adapter_dir, name)
    out = merged_adapter_dir(adapter_dir)
    wanted = {"base": str(base), "base_files": _files_signature(base)}

    def fresh() -> bool:
        record = _read_record(out)
        return record is not None and all(record.get(k) == v for k, v in wanted.items())

    if fresh():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelPathError(f"cannot create the directory of merged adapters {out.parent} ($RELAX_MODEL_CACHE_DIR): "
                             f"{e.strerror or e}") from None
    with cache_lock(out.parent / f".{out.name}.lock"):
        if fresh():  # another process merged it while this one waited
            return out
        print(f"relax: {adapter_dir} is a PEFT adapter directory: merging its adapters into the base model {base} "
              f"({name!r}), once, into {out}", file=sys.stderr, flush=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            with quiet_transformers():
                tokenizer_from = merge_into(adapter_dir, base, tmp)
            record = {**wanted, "adapter_dir": str(adapter_dir.resolve()), "base_model_name_or_path": name,
                      "tokenizer_from": str(tokenizer_from)}
            (tmp / MERGE_RECORD).write_text(json.dumps(record, indent=1))  # last: the merge is complete
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)
        except OSError as e:
            raise ModelPathError(f"cannot write the merged model of {adapter_dir} into {out}: {e.strerror or e}"
                                 ) from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _save_dtype(config: Any) -> torch.dtype:
    """The dtype the base's config.json records (`dtype`, or `torch_dtype` of older files); fp32 where it says none."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else torch.float32


def merge_into(adapter_dir: Path, base: Path, out: Path) -> Path:
    """Write into `out` the model of the adapter directory: the base loaded in fp32 (embeddings grown to the adapter
    directory's tokenizer where it is larger, as AutoPeftModelForCausalLM does), the adapters merged with PEFT's
    `merge_and_unload`, saved in the base's dtype; the tokenizer of the adapter directory if it has one, else the
    base's; the generation config of the adapter directory if it has one, else the base's; the base's processor
    files. A .gguf base (Relax's adapter export of a model.source=gguf run names one) is de-quantized to fp32 first.
    Returns where the tokenizer came from."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from relax.models.lora import _CHECKPOINTING_DEPRECATION, _FUSED_PATTERN_WARNING, check_merge
    from relax.models.vision import VISION_MODEL_TYPES, load_vision_model

    try:
        if base.is_file():  # a .gguf file: de-quantized to fp32 (relax.models.gguf_cache)
            from relax.models.gguf_cache import load_gguf_model

            config, model = None, load_gguf_model(base, local_files_only=True)
        else:
            config = AutoConfig.from_pretrained(str(base), local_files_only=True)
            if getattr(config, "model_type", None) in VISION_MODEL_TYPES:
                model = load_vision_model(base, torch.float32)
            else:
                model = AutoModelForCausalLM.from_pretrained(str(base), local_files_only=True, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001  (transformers', torch's, safetensors' own errors of files they cannot use)
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelFileError(f"the base model {base} of the PEFT adapter directory {str(adapter_dir)!r} cannot be "
                             f"loaded: {type(e).__name__}: {detail}") from None
    own_tokenizer = (adapter_dir / "tokenizer_config.json").is_file()
    if own_tokenizer:
        n_tokens = len(AutoTokenizer.from_pretrained(str(adapter_dir), local_files_only=True))
        if n_tokens > model.get_input_embeddings().weight.shape[0]:
            model.resize_token_embeddings(n_tokens)
    try:
        with warnings.catch_warnings():  # PEFT's reads that transformers deprecates, as around lora.apply_lora
            warnings.filterwarnings("ignore", message=_FUSED_PATTERN_WARNING, category=RuntimeWarning)
            warnings.filterwarnings("ignore", message=_CHECKPOINTING_DEPRECATION, category=FutureWarning)
            peft_model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=False)
        check_merge(peft_model)  # an adapter on a weight tied to another (a tied output head) would change both
        merged = peft_model.merge_and_unload()
    except (ValueError, RuntimeError, KeyError, TypeError, AttributeError) as e:
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelFileError(f"the adapters of {str(adapter_dir)!r} cannot be merged into their base model {base}: "
                             f"{type(e).__name__}: {detail}") from None
    # a .gguf base is its fp32 de-quantized weights to Relax (relax.models.gguf_cache): kept in fp32
    merged.to(torch.float32 if base.is_file() else _save_dtype(config)).save_pretrained(str(out))
    if base.is_file() and not own_tokenizer:  # the tokenizer inside the .gguf file
        AutoTokenizer.from_pretrained(str(base.parent), gguf_file=base.name, local_files_only=True
                                      ).save_pretrained(str(out))
    tokenizer_from = adapter_dir if own_tokenizer else base
    base_files = () if base.is_file() else (base,)
    # byte for byte: the tokenizer's files; the adapter directory's own generation config where it has one (a Relax
    # export's: the run's stop tokens and sampling), else the base's; the base's processor files
    for name, sources in ([(n, (tokenizer_from,)) for n in TOKENIZER_FILES]
                          + [("generation_config.json", (adapter_dir, *base_files))]
                          + [(n, base_files) for n in PROCESSOR_FILES]):
        found = next((d / name for d in sources if d.is_dir() and (d / name).is_file()), None)
        if found is not None:
            shutil.copyfile(found, out / name)
    return tokenizer_from
