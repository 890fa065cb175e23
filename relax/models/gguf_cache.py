"""A `.gguf` model de-quantized once: the fp32 model is kept as safetensors and reloaded from there.

transformers de-quantizes a GGUF file tensor by tensor in Python, which takes seconds for a 135M model, and every
role (actor, rollout, reference, critic, `relax-export`) builds the model. The first build converts the file and
saves the result (atomically, under a lock, so that roles starting together convert it once); later builds load
the safetensors, holding the same values bit for bit. The cache is keyed by the file's name, size and mtime and
by the transformers version that de-quantized it. An unwritable cache only costs speed (a warning, then the
file is de-quantized in this process as before).

Where: `$RELAX_MODEL_CACHE_DIR`, else `~/.cache/relax/models`.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from relax.data.tokenizer import model_cache_dir

if TYPE_CHECKING:  # modeling_utils costs seconds to import; the driver only needs the names for hints
    from transformers import PretrainedConfig, PreTrainedModel

logger = logging.getLogger(__name__)

FORMAT = "v1"  # bump when what is saved changes, so that older entries are not reused
COMPLETE = "model.safetensors"  # written last by save_pretrained's rename: an entry without it is not used


def cache_entry(path: Path) -> Path:
    """The cache directory of the de-quantized `path`."""
    import transformers

    stat = path.stat()
    return model_cache_dir() / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}-tf{transformers.__version__}-{FORMAT}"


def gguf_config(path: Path) -> PretrainedConfig:
    """transformers' config of the .gguf file `path` (`AutoConfig.from_pretrained(its directory, gguf_file=its
    name)`), from the cache when it holds it. transformers reads it by parsing the whole file (every tensor's and
    every vocabulary entry's record: seconds for SmolLM2), and a run reads it at several points (the preflight, each
    process's checkpoint record, the context length); the first read saves it (config.json) in an entry of its own
    beside the de-quantized model's, keyed alike, atomically (concurrent writers replace it whole, never delete it),
    and later reads load that. An unwritable cache only costs speed; a file transformers cannot read raises what
    `AutoConfig.from_pretrained` raises."""
    from transformers import AutoConfig

    try:
        model_entry = cache_entry(path)
    except OSError:
        model_entry = None
    entry = None if model_entry is None else model_entry.with_name(f"{model_entry.name}-config")
    if entry is not None and (entry / "config.json").is_file():
        try:
            config = AutoConfig.from_pretrained(str(entry), local_files_only=True)
            config._name_or_path = str(path.parent)  # as read from the file: its directory, not the cache's
            return config
        except Exception as exc:  # a damaged entry: read the file again
            logger.warning("ignoring the model config cache entry %s: %s", entry, exc)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    if entry is not None:
        tmp = None
        try:
            entry.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
            config.save_pretrained(str(tmp))
            # one file replaced atomically, never deleted first: a reader sees the old config.json or this one, whole
            # (roles starting together on a cold cache each write the same config; a damaged one is overwritten)
            os.replace(tmp / "config.json", entry / "config.json")
        except OSError as exc:  # unwritable: only costs speed
            logger.debug("could not cache the config of %s under %s: %s", path, entry, exc)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    return config


def forget_gguf_quantization(model: PreTrainedModel) -> None:
    """A GGUF model is de-quantized on load; drop transformers' quantizer marks so that it saves (checkpoints,
    exports) as the plain model it now is, not as an unserializable "quantized" one."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _dequantize(path: Path, **kwargs) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    # the file's config from `gguf_config` (its cache, or one parse that fills it): given none, from_pretrained parses
    # the whole file once for the config and again for the weights
    kwargs.setdefault("config", gguf_config(path))
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
    forget_gguf_quantization(model)
    return model


@contextmanager
def cache_lock(lock: Path) -> Iterator[None]:
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_gguf_model(path: Path, **kwargs) -> PreTrainedModel:
    """The fp32 model of the .gguf file `path` (kwargs: `from_pretrained`'s, without dtype), from the cache when
    it holds it; converted and cached otherwise."""
    from transformers import AutoModelForCausalLM

    kwargs = {**kwargs, "dtype": torch.float32}  # de-quantized to fp32 whatever is asked
    try:
        entry = cache_entry(path)
        entry.parent.mkdir(parents=True, exist_ok=True)
        lock = cache_lock(entry.parent / f".{entry.name}.lock")
        lock.__enter__()
    except OSError as exc:
        logger.warning("model cache unavailable (%s): de-quantizing %s in this process", exc, path)
        return _dequantize(path, **kwargs)
    try:
        if (entry / COMPLETE).is_file():
            try:
                return AutoModelForCausalLM.from_pretrained(str(entry), **kwargs)
            except Exception as exc:  # a damaged entry: convert again
                logger.warning("ignoring the model cache entry %s: %s", entry, exc)
        model = _dequantize(path, **kwargs)
        _save(model, entry)
        return model
    finally:
        lock.__exit__(None, None, None)


def _save(model: PreTrainedModel, entry: Path) -> None:
    """`model` into the cache entry `entry`, replacing it whole (a failed write leaves no entry)."""
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        model.save_pretrained(str(tmp))
        shutil.rmtree(entry, ignore_errors=True)
        os.replace(tmp, entry)
    except OSError as exc:
        logger.warning("could not cache the de-quantized model under %s: %s", entry, exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
