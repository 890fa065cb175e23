"""A checkpoint's policy as a Hugging Face model directory: what `relax-export` and `train.save_hf=true` run.

`export_checkpoint(source, out_dir)` finds the checkpoint `source` designates (a committed `step_NNNNNN/` or a save
dir's latest, as `train.resume=auto` finds it), checks it before anything is read (`relax.runner.checkpoint.verify`:
every file's size and SHA-256 against state.json), reads the run's model and sampling settings from its config.yaml,
and writes the directory (`relax.train.export.write_hf_directory`) next to `out_dir` first, renamed into place,
so that a failed export leaves no half-written directory. `relax-export` (relax/cli/export.py) is its command line;
a run with `train.save_hf=true` calls it on its final checkpoint (`relax.runner.session.Session.finish`).
"""

from __future__ import annotations

import dataclasses
import shutil
import uuid
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

from relax.config.schema import ModelConfig, RolloutConfig
from relax.data.tokenizer import ModelFileError, ModelPathError, resolve_model_path
from relax.models.peft_merge import ensure_merged
from relax.runner import checkpoint
from relax.runner.errors import RunError
from relax.runner.model_record import FIELDS, RUN_MODEL, differences, model_record, shown
from relax.train.export import Exported, ExportError, write_hf_directory

RUN_EXPORT_DIR = "hf"  # train.save_hf=true: the final checkpoint's export, <save_dir>/hf
BASE_DIR = "base"  # a model.source=config LoRA run's adapters: the base model they go on, <out>/base


class ExportRefused(Exception):
    """Nothing was written: the checkpoint, the run's model files or OUT_DIR cannot be used (the message says which)."""


@dataclass
class ExportResult:
    """A finished export: where from, where to, and what `relax.train.export` wrote."""

    checkpoint: Path
    out_dir: Path
    step: int
    run_id: Optional[str]
    algorithm: str
    exported: Exported
    # relax.runner.model_record: "checked" (the model files are the run's), or why the check could not be made
    model_check: Optional[str] = None
    prompts: dict[str, Any] = dataclasses.field(default_factory=dict)  # RunSettings.prompts


@dataclass(frozen=True)
class RunSettings:
    """What an export needs of the run's resolved config (the checkpoint's config.yaml)."""

    model: ModelConfig
    rollout: RolloutConfig
    algorithm: str
    backend: str
    seed: int = 1  # builds a model.source=config base (a LoRA checkpoint merged on export)
    # how the run built its prompts: data.apply_chat_template, data.system_prompt (None: an older config without them)
    prompts: dict[str, Any] = dataclasses.field(default_factory=dict)


def find_checkpoint(path: Path) -> Path:
    """The checkpoint `path` designates: itself (a `step_*` directory with state.json) or a save dir's latest."""
    if not path.exists():
        raise ExportRefused(f"{path} does not exist")
    if not path.is_dir():
        raise ExportRefused(f"{path} is not a directory (expected a checkpoint {checkpoint.PREFIX}NNNNNN/ or a save "
                            "dir)")
    if path.name.startswith((checkpoint.STAGING_PREFIX, checkpoint.REPLACED_PREFIX)):
        raise ExportRefused(f"{path} is not a committed checkpoint: a save that never finished (or a checkpoint "
                            f"being replaced or removed) leaves such a directory; export a committed "
                            f"{checkpoint.PREFIX}NNNNNN/ directory or the save dir")
    if (path / checkpoint.STATE).is_file():
        return path
    try:
        found = checkpoint.latest(path, strict=True)
    except RunError as e:
        raise ExportRefused(_export_problem(e)) from None
    if found is None:
        raise ExportRefused(f"no checkpoint in {path} (expected {checkpoint.STATE} or committed "
                            f"{checkpoint.PREFIX}NNNNNN/ directories)")
    return found


def _export_problem(error: RunError) -> str:
    """A refused checkpoint's message (`relax.runner.checkpoint` words its own for a resume) worded for an export."""
    if isinstance(error, checkpoint.CheckpointRefused):
        return f"checkpoint {error.path} cannot be exported: {error.problem}"
    return str(error)


def _structured(cls: type, data: Any, where: str) -> Any:
    """The dataclass `cls` from a config.yaml section, type-checked by OmegaConf. Keys `cls` does not know (a
    checkpoint of another Relax version) are left out and missing keys take their defaults: an export needs only
    the fields that find the tokenizer and the sampling settings."""
    from omegaconf import OmegaConf

    if not isinstance(data, dict):
        raise ValueError(f"'{where}' is not a mapping")
    known = {f.name: f for f in dataclasses.fields(cls)}
    kept = {}
    for key, value in data.items():
        if key in known:
            nested = known[key].default_factory  # a nested config section (rollout.sglang)
            kept[key] = (_structured(nested, value, f"{where}.{key}")
                         if dataclasses.is_dataclass(nested) and isinstance(value, dict) else value)
    return OmegaConf.to_object(OmegaConf.structured(cls(**kept)))  # validates and converts each value's type


def read_run_settings(path: Path) -> RunSettings:
    """The model, rollout, algorithm and backend of the run that wrote checkpoint `path`, from its config.yaml."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    file = path / checkpoint.CONFIG
    if not file.is_file():
        raise ExportRefused(f"{file} is missing: the checkpoint does not say which model and tokenizer it holds")
    try:
        node = OmegaConf.to_container(OmegaConf.load(file), resolve=True)
        model = _structured(ModelConfig, node["model"], "model")
        rollout = _structured(RolloutConfig, node["rollout"], "rollout")
        algorithm, backend = str(node["algorithm"]["name"]), str(node["train"]["backend"])
        seed = int(node.get("seed", 1))
        data = node.get("data") if isinstance(node.get("data"), dict) else {}
        prompts = {"apply_chat_template": data.get("apply_chat_template"), "system_prompt": data.get("system_prompt")}
    except (OmegaConfBaseException, OSError, ValueError, TypeError, KeyError) as e:
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportRefused(f"{file} cannot be read as a Relax config: {detail}") from None
    return RunSettings(model=model, rollout=rollout, algorithm=algorithm, backend=backend, seed=seed,
                       prompts=prompts)


def _check_out_dir(out: Path, ckpt: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportRefused(f"OUT_DIR {out} exists and is not a directory")
    real_out, real_ckpt = out.resolve(), ckpt.resolve()
    if real_out == real_ckpt or real_out in real_ckpt.parents or real_ckpt in real_out.parents:
        raise ExportRefused(f"OUT_DIR {out} overlaps the checkpoint {ckpt}; choose a directory outside it")
    held = _relax_run_files(out) if out.is_dir() else None
    if held is not None:
        what = f"is {held[1]}" if held[0] == out else f"holds {held[1]}, {held[0]}"
        raise ExportRefused(f"OUT_DIR {out} {what}: relax-export never writes over a checkpoint or a save directory, "
                            "with or without --force (which replaces an earlier export or files of your own); choose "
                            "another directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        entries = sorted(p.name for p in out.iterdir())
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise ExportRefused(f"OUT_DIR {out} is not empty ({len(entries)} entries: {shown}); choose another "
                            "directory or pass --force (relax-export) to replace its contents")


def _relax_run_files(out: Path) -> Optional[tuple[Path, str]]:
    """The first directory in `out` (itself included) that is a committed Relax checkpoint (a `step_*` directory
    with state.json, or any directory whose state.json has a checkpoint's step and file manifest) or a run's save
    directory (run.json naming the run that used it): (that directory, what it is). A whole walk, as the --force that
    would replace `out` walks it too."""
    import json
    import os

    for root, dirs, files in os.walk(out):
        here = Path(root)
        if checkpoint.STATE in files:
            if here.name.startswith(checkpoint.PREFIX):
                return here, f"a Relax checkpoint ({checkpoint.STATE})"
            try:
                state = json.loads((here / checkpoint.STATE).read_text())
            except (OSError, ValueError):
                state = None
            if isinstance(state, dict) and "step" in state and "files" in state:
                return here, f"a Relax checkpoint ({checkpoint.STATE})"
        if checkpoint.RUN_FILE in files:
            try:
                run = json.loads((here / checkpoint.RUN_FILE).read_text())
            except (OSError, ValueError):
                run = None
            if isinstance(run, dict) and ("mlflow_run_id" in run or "lineage" in run):
                return here, f"a run's save directory ({checkpoint.RUN_FILE})"
        dirs.sort()
    return None


def _version() -> str:
    try:
        return metadata.version("relax")
    except metadata.PackageNotFoundError:
        return "unknown"


def export_checkpoint(source: str | Path, out_dir: str | Path, *, force: bool = False,
                      model_path: Optional[str] = None, merge: bool = False) -> ExportResult:
    """Verify the checkpoint `source` designates and write its policy as a Hugging Face directory to `out_dir`.

    A LoRA run's checkpoint holds adapters: written as a PEFT adapter directory (`PeftModel.from_pretrained` on the
    base model), or with `merge` as a whole model with the adapters merged into the base (checked to be the base
    the adapters were trained on).

    `model_path`: where the run's model (`model.path`: an HF directory or a .gguf file) is on this machine, for
    its tokenizer, checked against what the checkpoint records of the run's model (`relax.runner.model_record`).
    Raises ExportRefused (nothing written) for a missing, unfinished, changed or unreadable checkpoint, a model that
    is not there or is not the run's, or a non-empty `out_dir` without `force`; an OSError when a write fails
    (nothing of the export is left then either).
    """

    ckpt = find_checkpoint(Path(source).expanduser())
    out = Path(out_dir).expanduser()
    _check_out_dir(out, ckpt, force)
    try:
        state = checkpoint.read_state(ckpt)
        checkpoint.verify(ckpt, state)
    except RunError as e:
        raise ExportRefused(_export_problem(e)) from None
    run = read_run_settings(ckpt)
    if model_path is not None and run.model.source == "config":
        raise ExportRefused(f"--model-path {model_path} has no effect on checkpoint {ckpt}: its run built its model "
                            f"from config (model.source=config, model.name={run.model.name}), so there is no model "
                            "file to find and the tokenizer is Relax's built-in one; leave --model-path out")
    model = run.model if model_path is None else dataclasses.replace(run.model, path=str(model_path))
    key = "model.path" if model_path is None else "--model-path"  # what the model-file messages name: as typed
    try:  # a run from a PEFT adapter directory trained its base with the adapters merged: merged again if gone
        ensure_merged(model, key=key)
    except (ModelPathError, ModelFileError) as e:
        raise ExportRefused(_unloadable(e, model_path)) from None
    model_check = _check_model(state.get(RUN_MODEL), model, model_path, key)
    info: dict[str, Any] = {
        "checkpoint": str(ckpt.resolve()), "step": state["step"], "mlflow_run_id": state.get("mlflow_run_id"),
        "lineage": state.get("lineage"), "algorithm": run.algorithm, "train_backend": run.backend,
        "model": {"name": model.name, "source": model.source, "path": model.path},
        "rollout": {"temperature": run.rollout.temperature, "top_p": run.rollout.top_p, "top_k": run.rollout.top_k,
                    "max_response_len": run.rollout.max_response_len},
        "prompts": run.prompts, "model_check": model_check,
        "relax_version": _version(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f"{checkpoint.STAGING_PREFIX}{out.name}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        try:
            exported = write_hf_directory(ckpt, staging, model, run.rollout, metadata=info, merge=merge,
                                          seed=run.seed, key=key)
        except (ModelPathError, ModelFileError) as e:
            raise ExportRefused(_unloadable(e, model_path)) from None
        except ExportError as e:
            raise ExportRefused(str(e)) from None
        if not merge and (staging / "adapter_config.json").is_file():
            if run.model.source == "config":
                exported = _write_config_base(ckpt, staging, out, run, exported)
            else:
                _name_base(staging, model)
        if out.exists():
            aside = out.parent / f"{checkpoint.REPLACED_PREFIX}{out.name}-{uuid.uuid4().hex[:8]}"
            out.rename(aside)
            staging.rename(out)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ExportResult(checkpoint=ckpt, out_dir=out, step=int(state["step"]), run_id=state.get("mlflow_run_id"),
                        algorithm=run.algorithm, exported=exported, model_check=model_check, prompts=run.prompts)


def _unloadable(error: Exception, model_path: Optional[str]) -> str:
    """The refusal for model files that cannot be read. The model-file errors name the option the path was given as
    (`--model-path '/x'` where given, else the run's `model.path='/x'`: the `key` export_checkpoint passes them)."""
    if model_path is None:
        return (f"the run's tokenizer cannot be loaded: {error} (relax-export --model-path names where the run's "
                "model is on this machine)")
    return f"the run's tokenizer cannot be loaded from --model-path {model_path}: {error}"


def _check_model(recorded: Any, model: ModelConfig, model_path: Optional[str],
                 key: str = "model.path") -> Optional[str]:
    """Refuse model files (`--model-path`, else the run's model.path) that are not the run's model: their record
    (`relax.runner.model_record`) differs from the one in the checkpoint's state.json, naming the fields. "checked"
    when they agree, None for a model.source=config run (no model files), or why the check could not be made."""
    if model.source == "config":
        return None
    if not isinstance(recorded, dict):
        return ("not checked: the checkpoint records nothing that identifies its run's model (a checkpoint of an "
                "older Relax, or model files it could not read), so the tokenizer and chat template are taken "
                "from the model files as they are")
    try:
        now = model_record(model, key=key)
    except (ModelPathError, ModelFileError) as e:
        raise ExportRefused(_unloadable(e, model_path)) from None
    except (OSError, ValueError, KeyError, TypeError) as e:  # transformers' errors of a config it cannot read
        detail = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ExportRefused(f"the config of the run's model cannot be read: {type(e).__name__}: {detail}") from None
    assert now is not None
    differ = differences(recorded, now)
    if differ:
        where = (f"--model-path {model_path}" if model_path else
                 f"model.path={model.path or '(default)'}, the run's model as it is now,")
        fields = "; ".join(f"{FIELDS[k]}: {shown(k, now[k])} there, {shown(k, recorded[k])} in the run"
                           for k in differ)
        fix = ("point --model-path at the model the run trained from" if model_path else
               "its files were replaced since the run; relax-export --model-path names where the run's model is")
        raise ExportRefused(f"{where} is not the model the run trained from ({fields}): {fix}")
    return "checked"


def _name_base(staging: Path, model: ModelConfig) -> None:
    """An hf or gguf LoRA run's adapters go on the run's model: adapter_config.json's `base_model_name_or_path` names
    it where it is on this machine (a gguf run's adapters recorded Relax's private cache of the de-quantized model,
    a directory that means nothing elsewhere), and relax_export.json says how to load it. A .gguf file is not
    something `AutoPeftModelForCausalLM` can load: transformers loads it with
    `AutoModelForCausalLM.from_pretrained(<its directory>, gguf_file=<its name>)`."""
    import json

    from relax.models import lora
    from relax.models.write_errors import os_write_errors
    from relax.train.export import EXPORT_FILE

    path = resolve_model_path(model)
    assert path is not None
    where = path.expanduser().resolve()
    if model.source == "gguf":
        base = {"gguf": where.as_posix(), "dir": where.parent.as_posix(), "gguf_file": where.name,
                "load": f'AutoModelForCausalLM.from_pretrained("{where.parent.as_posix()}", gguf_file="{where.name}")'}
    else:
        base = {"path": where.as_posix(), "load": f'{base_class(model)}.from_pretrained("{where.as_posix()}")'}
    with os_write_errors(staging):
        for name, key, value in ((lora.ADAPTER_CONFIG, "base_model_name_or_path", where.as_posix()),
                                 (EXPORT_FILE, "base_model", base)):
            record = json.loads((staging / name).read_text())
            record[key] = value
            (staging / name).write_text(json.dumps(record, indent=2, sort_keys=name == lora.ADAPTER_CONFIG) + "\n")


def base_class(model: ModelConfig) -> str:
    """The transformers class that loads the model LoRA adapters go on: a vision-language model is not a causal LM
    to transformers' Auto classes (`AutoModelForCausalLM` refuses its config)."""
    from relax.config.vision_rules import is_vision_model

    return "AutoModelForImageTextToText" if is_vision_model(model) else "AutoModelForCausalLM"


def _write_config_base(ckpt: Path, staging: Path, out: Path, run: RunSettings, exported: Exported) -> Exported:
    """LoRA adapters of a model.source=config run go on a base that exists nowhere else (built from the run's model
    config and seed): it is written to `<out>/base/` (transformers' layout), checked to be the base the adapters were
    trained on, and adapter_config.json's `base_model_name_or_path` names it (absolute, as PEFT records a local
    base), so that `AutoPeftModelForCausalLM.from_pretrained(<out>)` loads both while the directory stays where it was
    written, and `PeftModel.from_pretrained(<base_class>.from_pretrained(<out>/base), <out>)` wherever it is moved
    (`AutoModelForImageTextToText` for a vision-language model). The base is a whole model directory, so that it can
    be moved alone: the export's tokenizer, chat template, processor and generation config are copied into it.
    relax_export.json records it. What `write_hf_directory` wrote, with the new files."""
    import json

    import torch

    from relax.data.tokenizer import load_tokenizer
    from relax.models import lora
    from relax.models.checkpoint_files import CheckpointFileError
    from relax.models.hf import build_model
    from relax.models.write_errors import os_write_errors
    from relax.train.export import EXPORT_FILE, POLICY_DIR

    tokenizer = load_tokenizer(run.model)
    base = build_model(run.model, len(tokenizer), int(tokenizer.pad_token_id), seed=run.seed, dtype=torch.float32)
    peft_model = lora.apply_lora(base, dataclasses.replace(run.model, lora_dropout=0.0), seed=run.seed)
    try:
        lora.check_base(ckpt / POLICY_DIR, lora.base_fingerprint(peft_model), run.model)
    except CheckpointFileError as e:
        raise ExportRefused(str(e)) from None
    base = peft_model.unload()  # the base alone, as it was built
    base.config.use_cache = True
    where = (out.resolve() / BASE_DIR).as_posix()
    with os_write_errors(staging):
        base.save_pretrained(str(staging / BASE_DIR))
        for file in staging.iterdir():  # the run's tokenizer, template, processor and sampling: the adapters' own
            if file.is_file() and file.name not in (lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS, EXPORT_FILE):
                shutil.copyfile(file, staging / BASE_DIR / file.name)
        for name, key, value in ((lora.ADAPTER_CONFIG, "base_model_name_or_path", where),
                                 (EXPORT_FILE, "base_model", {"dir": BASE_DIR, "built_from": "model.source=config",
                                                              "seed": run.seed})):
            record = json.loads((staging / name).read_text())
            record[key] = value
            (staging / name).write_text(json.dumps(record, indent=2, sort_keys=name == lora.ADAPTER_CONFIG) + "\n")
    files = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file())
    return dataclasses.replace(exported, files=files)

