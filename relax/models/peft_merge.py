"""A PEFT adapter directory as a model: its base model with the adapters merged, written once as a full model.

`model.path`, `teacher.path` or `reward_model.path` may name a PEFT adapter directory (adapter_config.json and adapter
weights, no config.json), as `PeftModel.save_pretrained`, TRL and Relax's own LoRA exports write it. It stands for
what PEFT's `AutoPeftModelForCausalLM.from_pretrained(dir)` loads: the base model (`<section>.base_path` where set,
else what adapter_config.json's `base_model_name_or_path` names), its embeddings grown to the adapter directory's
tokenizer where that tokenizer is larger, with the adapters applied; for a classifier reward model
(`CLASSIFIER`) the base as a sequence-classification model of one label, its head from the adapters. `ensure_merged`
merges them into the base (`merge_and_unload`, in fp32, saved in the base's own dtype) and writes the result as a
Hugging Face model directory, where `relax.data.tokenizer.merged_adapter_dir` says (in `$RELAX_MODEL_CACHE_DIR`), so
that every role, backend and engine (SGLang servers, Megatron's weight loading, the tokenizer and generation config)
reads a plain model directory. It is written under a lock and renamed into place whole; a later call reuses it while
the adapter files and the base's files are unchanged; none is ever deleted (docs/training.md says where they are).
A dry run writes none: `plan_merge` checks what the merge reads and `merge_preview` stands in for the merged
directory's config and tokenizer.

The merged directory holds the tokenizer and the generation config of the adapter directory where it has them, else
the base's, and the base's processor files. Nothing is downloaded: the base is found on this
machine (`find_base`), or a ModelPathError names it and where to put it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
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
    merged_stand_in,
    named,
    quiet_transformers,
    read_json_object,
    resolve_model_path,
)
from relax.models.gguf_cache import cache_lock, gguf_config

# the files of a tokenizer (and of a vision-language model's processor) that `save_pretrained` writes
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt", "chat_template.jinja",
                   "chat_template.json")
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
# a Hugging Face Hub model id: `name` or `owner/name`
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def adapter_path(model_cfg: Any, key: str = "model.path") -> Optional[Path]:
    """The PEFT adapter directory `model_cfg` names (`source=hf`), None for any other model. `key`: the option the
    path was given as, which a missing path's message names (`relax.data.tokenizer.resolve_model_path`'s)."""
    if getattr(model_cfg, "source", None) != "hf":
        return None
    path = resolve_model_path(model_cfg, merged=False, key=key)
    return path if path is not None and is_adapter_dir(path) else None


def read_adapter_config(adapter_dir: Path) -> dict[str, Any]:
    """adapter_config.json as a dict; ModelFileError naming the file when it is not a JSON object naming a base."""
    file = adapter_dir / ADAPTER_CONFIG_FILE
    config = read_json_object(file)
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


def find_base(adapter_dir: Path, name: str, option: str = "model") -> Path:
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
                         f"{where}; nothing is downloaded): set {option}.base_path to its local directory, or put "
                         f"the base model {put}or set base_model_name_or_path in {adapter_dir / ADAPTER_CONFIG_FILE} "
                         "to its local directory")


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


# what a merge makes of the adapters: a causal LM (model.path, teacher.path, a judge's reward_model.path) or a
# sequence-classification reward model of one label (reward_model=classifier)
CAUSAL_LM, CLASSIFIER = "causal_lm", "classifier"
# adapter_config.json's task_type each accepts (None: PEFT's default, no task)
_TASK_TYPES = {CAUSAL_LM: ("CAUSAL_LM", None), CLASSIFIER: ("SEQ_CLS", None)}


@dataclass(frozen=True)
class MergePlan:
    """The merge of one adapter directory: its base (`base`, from `base_model_name_or_path` = `name`, or the
    config's `base_path`), where the merged model goes (`out`) and whether an up-to-date one is there (`fresh`)."""

    adapter_dir: Path
    name: str
    base: Path
    out: Path
    wanted: dict[str, Any]
    task: str

    @property
    def fresh(self) -> bool:
        record = _read_record(self.out)
        return record is not None and all(record.get(k) == v for k, v in self.wanted.items())


def _given_base(model_cfg: Any, adapter_dir: Path, option: str) -> Optional[Path]:
    """The base the config names (`<option>.base_path`), checked to be a model directory or a .gguf file; None: not
    set."""
    base_path = getattr(model_cfg, "base_path", None)
    if not base_path:
        return None
    p = Path(base_path).expanduser()
    if _is_model_dir(p) or (p.is_file() and p.suffix == ".gguf"):
        return p.resolve()
    what = "has no config.json" if p.is_dir() else "does not exist"
    raise ModelPathError(f"{option}.base_path={base_path!r} {what}: it must be the local directory of the base model "
                         f"of the PEFT adapter directory {str(adapter_dir)!r} (a Hugging Face model directory with "
                         "config.json and weights)")


def _check_task(adapter_dir: Path, config: dict[str, Any], task: str) -> None:
    task_type = config.get("task_type")
    if task_type in _TASK_TYPES[task]:
        return
    if task == CAUSAL_LM:
        wanted = "a causal LM's (task_type CAUSAL_LM)"
        hint = " (a reward model's adapters are reward_model.path's with reward_model=classifier)" \
            if task_type == "SEQ_CLS" else ""
    else:
        wanted = "a sequence-classification reward model's (task_type SEQ_CLS, as TRL's RewardTrainer writes them)"
        hint = " (a causal LM's adapters can be a judge's: reward_model=judge)" if task_type == "CAUSAL_LM" else ""
    raise ModelFileError(f"{adapter_dir / ADAPTER_CONFIG_FILE}: task_type {task_type!r} is not {wanted}{hint}")


def _check_readable(adapter_dir: Path, base: Path, task: str) -> None:
    """That the adapter weights' header, the base's config and its safetensors files' headers read, without loading
    any weights (a dry run's check of what the merge reads)."""
    weights = adapter_dir / "adapter_model.safetensors"
    if weights.is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(weights), framework="pt") as f:
                f.keys()
        except Exception as e:  # noqa: BLE001  (safetensors' own errors of a file it cannot read)
            raise ModelFileError(f"{weights} cannot be read as safetensors: {type(e).__name__}: {e}") from None
    if base.is_file():
        if task == CLASSIFIER:
            raise ModelFileError(f"the base {base} of {str(adapter_dir)!r} is a .gguf file: a reward model's base "
                                 "must be a Hugging Face model directory")
        return
    from safetensors import safe_open
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(str(base), local_files_only=True)
        for name in _files_signature(base):  # config.json, the weight files and an index's shards
            if name.endswith(".safetensors"):
                with safe_open(str(base / name), framework="pt") as f:
                    f.keys()
    except Exception as e:  # noqa: BLE001  (transformers', safetensors' own errors of files they cannot use)
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelFileError(f"the base model {base} of the PEFT adapter directory {str(adapter_dir)!r} cannot be "
                             f"loaded: {type(e).__name__}: {detail}") from None


def plan_merge(model_cfg: Any, task: str = CAUSAL_LM, option: str = "model",
               key: str = "model.path") -> Optional[MergePlan]:
    """For a `model_cfg` whose path is a PEFT adapter directory: its merge (the base found, adapter_config.json's
    task_type checked against `task`, the adapter weights' header and the base's config read), nothing written;
    None for any other model (which must not name a `base_path`). `option`: the config section messages name (model,
    teacher, reward_model); `key`: a command-line flag the path was given as instead (relax-export's --model-path),
    which the messages on the path name. ModelPathError / ModelFileError naming what is wrong."""
    adapter_dir = adapter_path(model_cfg, key)
    if adapter_dir is None:
        base_path = getattr(model_cfg, "base_path", None)
        if base_path:  # refused rather than ignored, by every command (relax-train, relax-serve, relax-export)
            where = getattr(model_cfg, "path", None) or f"$MODEL_DIR/{model_cfg.name}"
            path = named(key, where) if key.startswith("--") else f"{option}.path={where}"
            raise ModelFileError(f"{option}.base_path={base_path!r} has no effect: {path} is not a "
                                 "PEFT adapter directory (adapter_config.json and no config.json), so it has no base "
                                 f"to merge into; leave {option}.base_path out")
        return None
    config = read_adapter_config(adapter_dir)
    _check_task(adapter_dir, config, task)
    name = config["base_model_name_or_path"]
    base = _given_base(model_cfg, adapter_dir, option) or find_base(adapter_dir, name, option)
    _check_readable(adapter_dir, base, task)
    wanted = {"base": str(base), "base_files": _files_signature(base), "task": task}
    return MergePlan(adapter_dir, name, base, merged_adapter_dir(adapter_dir), wanted, task)


def ensure_merged(model_cfg: Any, task: str = CAUSAL_LM, option: str = "model",
                  key: str = "model.path") -> Optional[Path]:
    """For a `model_cfg` whose path is a PEFT adapter directory: the directory of its base with the adapters merged,
    written now unless an up-to-date one is there (`relax.data.tokenizer.merged_adapter_dir`); None for any other
    model. The base is `model_cfg.base_path` where set, else found from adapter_config.json (`find_base`). `task`:
    a causal LM, or a sequence-classification reward model (`CLASSIFIER`); `option`, `key`: as `plan_merge`'s. Raises
    ModelPathError / ModelFileError naming what is wrong (the base not found, unreadable files, adapters that do not
    fit the base or cannot be merged)."""
    plan = plan_merge(model_cfg, task, option, key)
    if plan is None:
        return None
    adapter_dir, base, out = plan.adapter_dir, plan.base, plan.out
    if plan.fresh:
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelPathError(f"cannot create the directory of merged adapters {out.parent} ($RELAX_MODEL_CACHE_DIR): "
                             f"{e.strerror or e}") from None
    with cache_lock(out.parent / f".{out.name}.lock"):
        if plan.fresh:  # another process merged it while this one waited
            return out
        print(f"relax: {adapter_dir} is a PEFT adapter directory: merging its adapters into the base model {base} "
              f"({plan.name!r}), once, into {out}", file=sys.stderr, flush=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            with quiet_transformers():
                tokenizer_from = merge_into(adapter_dir, base, tmp, task)
            record = {**plan.wanted, "adapter_dir": str(adapter_dir.resolve()), "base_model_name_or_path": plan.name,
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


def _merged_config(base: Path, task: str) -> Any:
    """The config the merged model is saved with, before any embedding growth: the base's (a classifier's: a
    sequence-classification head of one label)."""
    from transformers import AutoConfig

    if base.is_file():
        return gguf_config(base)
    config = AutoConfig.from_pretrained(str(base), local_files_only=True)
    if task == CLASSIFIER:
        from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

        head = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(config.model_type)
        config.num_labels = 1
        config.architectures = [head] if head else config.architectures
    return config


def _merged_class_name(config: Any, base: Path, task: str) -> Optional[str]:
    """The class `merge_into` builds the merged model as, whose name its saved config.json gives as `architectures`
    (transformers' save_pretrained writes the model's class there, whatever the base's config said; a .gguf base's
    config says none): a classifier's sequence-classification class, a vision-language model's, else the causal LM
    that AutoModelForCausalLM picks. None where transformers maps the model type to none (the merge refuses it)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    from relax.models.vision import VISION_MODEL_TYPES, _model_class

    model_type = getattr(config, "model_type", None)
    if task == CLASSIFIER:
        return MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(model_type)
    if not base.is_file() and model_type in VISION_MODEL_TYPES:
        return _model_class(config).__name__
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)


@contextlib.contextmanager
def merge_preview(plan: MergePlan) -> Iterator[Path]:
    """A dry run's stand-in for the merge of `plan`, in a temporary directory removed on exit: what the merged
    directory will hold but its weights (the config, its vocabulary grown to a larger tokenizer of the adapters; the
    tokenizer, generation config and processor files `merge_into` copies), read by every later check in place of the
    merged model (`relax.data.tokenizer.merged_stand_in`) so that a dry run checks what a start would, writing no
    merged weights."""
    from transformers import AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix=".relax-merge-preview."))
    try:
        with quiet_transformers():
            config = _merged_config(plan.base, plan.task)
            # the merged directory's architectures, as the merge saves them: what a resume compares the checkpoint's
            # record with (`relax.runner.model_record`), and a dry run does here
            if (name := _merged_class_name(config, plan.base, plan.task)) is not None:
                config.architectures = [name]
            own_tokenizer = (plan.adapter_dir / "tokenizer_config.json").is_file()
            if own_tokenizer:
                n_tokens = len(AutoTokenizer.from_pretrained(str(plan.adapter_dir), local_files_only=True))
                if n_tokens > getattr(config, "vocab_size", n_tokens):
                    config.vocab_size = n_tokens
            config.save_pretrained(str(tmp))
            if plan.base.is_file() and not own_tokenizer:  # the tokenizer inside the .gguf file
                AutoTokenizer.from_pretrained(str(plan.base.parent), gguf_file=plan.base.name, local_files_only=True
                                              ).save_pretrained(str(tmp))
        _copy_side_files(plan.adapter_dir, plan.base, tmp, plan.adapter_dir if own_tokenizer else plan.base)
        with merged_stand_in(plan.adapter_dir, tmp):
            yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _save_dtype(config: Any) -> torch.dtype:
    """The dtype the base's config.json records (`dtype`, or `torch_dtype` of older files); fp32 where it says none."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else torch.float32


def merge_into(adapter_dir: Path, base: Path, out: Path, task: str = CAUSAL_LM) -> Path:
    """Write into `out` the model of the adapter directory: the base loaded in fp32 (embeddings grown to the adapter
    directory's tokenizer where it is larger, as AutoPeftModelForCausalLM does), the adapters merged with PEFT's
    `merge_and_unload`, saved in the base's dtype; the tokenizer of the adapter directory if it has one, else the
    base's; the generation config of the adapter directory if it has one, else the base's; the base's processor
    files. A .gguf base (Relax's adapter export of a model.source=gguf run names one) is de-quantized to fp32 first.
    `task=CLASSIFIER`: the base loaded as a sequence-classification model of one label (as
    AutoPeftModelForSequenceClassification with num_labels=1); a head the base has no weights for must come from the
    adapters (PEFT's modules_to_save), else ModelFileError. Returns where the tokenizer came from."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from relax.models.lora import _CHECKPOINTING_DEPRECATION, _FUSED_PATTERN_WARNING, check_merge
    from relax.models.vision import VISION_MODEL_TYPES, load_vision_model

    new_weights: list[str] = []  # a classifier's parameters the base has none of (a causal LM base's head)
    try:
        if base.is_file():  # a .gguf file: de-quantized to fp32 (relax.models.gguf_cache)
            from relax.models.gguf_cache import load_gguf_model

            config, model = None, load_gguf_model(base, local_files_only=True)
        else:
            config = AutoConfig.from_pretrained(str(base), local_files_only=True)
            if task == CLASSIFIER:
                model, info = AutoModelForSequenceClassification.from_pretrained(
                    str(base), local_files_only=True, dtype=torch.float32, num_labels=1, output_loading_info=True)
                new_weights = sorted(info.get("missing_keys", ()))
            elif getattr(config, "model_type", None) in VISION_MODEL_TYPES:
                model = load_vision_model(base, torch.float32)
            else:
                model = AutoModelForCausalLM.from_pretrained(str(base), local_files_only=True, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001  (transformers', torch's, safetensors' own errors of files they cannot use)
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelFileError(f"the base model {base} of the PEFT adapter directory {str(adapter_dir)!r} cannot be "
                             f"loaded: {type(e).__name__}: {detail}") from None
    before = {name: t.detach().clone() for name, t in model.state_dict().items() if name in set(new_weights)}
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
    after = merged.state_dict()
    # a weight neither the base nor the adapters hold would be transformers' random initialization: a reward model
    # whose scores are noise, refused rather than written
    unset = [name for name, t in before.items() if name in after and torch.equal(after[name], t)]
    if unset:
        raise ModelFileError(f"the adapters of {str(adapter_dir)!r} hold no weights for {', '.join(unset)}, which "
                             f"the base model {base} has none of either (a causal LM's checkpoint has no "
                             "classification head): a reward model trained with LoRA saves its head with its adapters "
                             "(PEFT's modules_to_save, as task_type SEQ_CLS adds); or set the base to the "
                             "sequence-classification model the adapters were trained on")
    # a .gguf base is its fp32 de-quantized weights to Relax (relax.models.gguf_cache): kept in fp32
    merged.to(torch.float32 if base.is_file() else _save_dtype(config)).save_pretrained(str(out))
    if base.is_file() and not own_tokenizer:  # the tokenizer inside the .gguf file
        AutoTokenizer.from_pretrained(str(base.parent), gguf_file=base.name, local_files_only=True
                                      ).save_pretrained(str(out))
    tokenizer_from = adapter_dir if own_tokenizer else base
    _copy_side_files(adapter_dir, base, out, tokenizer_from)
    return tokenizer_from


def _copy_side_files(adapter_dir: Path, base: Path, out: Path, tokenizer_from: Path) -> None:
    """Byte for byte into `out`: the tokenizer's files (of `tokenizer_from`); the adapter directory's own generation
    config where it has one (a Relax export's: the run's stop tokens and sampling), else the base's; the base's
    processor files."""
    base_files = () if base.is_file() else (base,)
    for name, sources in ([(n, (tokenizer_from,)) for n in TOKENIZER_FILES]
                          + [("generation_config.json", (adapter_dir, *base_files))]
                          + [(n, base_files) for n in PROCESSOR_FILES]):
        found = next((d / name for d in sources if d.is_dir() and (d / name).is_file()), None)
        if found is not None:
            shutil.copyfile(found, out / name)
