"""What identifies a run's model beyond its weights: recorded in every checkpoint, checked by `relax-export` and by a
resume (`relax.runner.checkpoint.check_run_model`: a run continued on a replaced model directory is refused too).

An export takes the tokenizer, the chat template and a vision model's processor from the run's model files
(`model.path`, or `relax-export --model-path` where they are elsewhere now), not from the checkpoint. So that a
different model there (the Base checkpoint instead of the Instruct one: same vocabulary, another chat template and
EOS; a vision model's directory for a text run) is refused instead of shipped, each checkpoint's state.json holds
`run_model`: the model's config `architectures` and `vocab_size`, and SHA-256 digests of its tokenizer (vocabulary
and special tokens) and of its chat template, all as loaded (`relax.data.tokenizer.load_tokenizer`, transformers'
`AutoConfig`): the same model in another format or copied elsewhere gives the same record. A `model.source=config`
run has no model files: no record.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

from relax.config.schema import ModelConfig

RUN_MODEL = "run_model"  # the state.json key

# what each field is called in a refusal, in the order they are compared
FIELDS = {
    "architectures": "config architectures",
    "vocab_size": "vocab_size",
    "tokenizer_sha256": "tokenizer (vocabulary and special tokens)",
    "chat_template_sha256": "chat template",
}

# one record per model files per process (a run commits many times): keyed by the files' names, sizes and mtimes
_cache: dict[tuple[Any, ...], dict[str, Any]] = {}


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def model_record(model_cfg: ModelConfig, *, key: str = "model.path") -> Optional[dict[str, Any]]:
    """The record of `model_cfg`'s model files (None for model.source=config). Raises what loading them raises
    (`relax.data.tokenizer`'s ModelPathError / ModelFileError, naming `key`, the option the path was given as;
    transformers' OSError / ValueError)."""
    from transformers import AutoConfig

    from relax.data.tokenizer import load_tokenizer, require_hf_config, resolve_model_path

    if model_cfg.source == "config":
        return None
    path = resolve_model_path(model_cfg, key=key)
    assert path is not None
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    # model.chat_template replaces the files' template (load_tokenizer): its file is part of what is recorded
    own = [Path(model_cfg.chat_template).expanduser()] if getattr(model_cfg, "chat_template", None) else []
    cache_key = (model_cfg.source, str(path.resolve()),
                 *((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files),
                 *((str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in own if p.is_file()))
    if cache_key in _cache:
        return dict(_cache[cache_key])
    tokenizer = load_tokenizer(model_cfg, key=key)
    if model_cfg.source == "gguf":
        # here, like the imports above: gguf_cache imports torch, and this module keeps torch and transformers out of
        # its own import (it needs them only to read model files)
        from relax.models.gguf_cache import gguf_config

        config = gguf_config(path)
    else:
        require_hf_config(path, key)  # transformers' own error names neither the option nor the missing file's role
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    vocab_size = getattr(config.get_text_config(), "vocab_size", None)
    special = {name: str(value) for name, value in tokenizer.special_tokens_map.items()}
    record = {
        "architectures": list(getattr(config, "architectures", None) or []),
        "vocab_size": int(vocab_size) if vocab_size is not None else None,
        "tokenizer_sha256": _digest({"vocab": sorted(tokenizer.get_vocab().items()), "special": special}),
        "chat_template_sha256": _digest(tokenizer.chat_template),
    }
    _cache[cache_key] = record
    return dict(record)


def recorded_model(model_cfg: ModelConfig) -> Optional[dict[str, Any]]:
    """`model_record` for a checkpoint: None where the model's files cannot be read (the run read them; an export
    of such a checkpoint then says the check could not be made, as for a checkpoint of an older Relax)."""
    try:
        return model_record(model_cfg)
    except Exception:  # noqa: BLE001 - a record is a check for later, never a reason to lose a checkpoint
        return None


def differences(recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The keys of FIELDS whose values differ between a checkpoint's record and the model now; a field one side
    does not have (another Relax version's record) is not compared."""
    return [k for k in FIELDS if k in recorded and k in now and recorded[k] != now[k]]


def shown(key: str, value: Any) -> str:
    """A field's value as a refusal shows it (a digest by its first 12 hex digits)."""
    if key.endswith("_sha256") and isinstance(value, str):
        return f"sha256 {value[:12]}"
    return str(value)
