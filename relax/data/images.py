"""Images in prompts: reading them from data rows, the processor of a vision-language model, and encoding a prompt
with images into token ids with the image placeholders expanded.

Where images come from (docs/training.md, "Vision-language"):

- chat messages whose `content` is a list of parts, in the OpenAI form (`{"type": "text", "text": ...}`,
  `{"type": "image_url", "image_url": {"url": ...}}`) or the Hugging Face form (`{"type": "image", "image": ...}`);
- a string or chat prompt plus a column of images (`data.image_key`, default `images`): each `<image>` in the text
  marks where the next image goes; without a marker, the images come first in the (first) user message.

An image value is a file path (relative paths are read from the data file's directory), a `data:image/...;base64,`
URL, base64 text, raw bytes, `{"bytes": ..., "path": ...}` (the Hugging Face datasets' Image feature in Parquet), or
a PIL image (built-in tasks). Nothing is fetched from the network: an http(s) URL is a DataError.

The processor is the model family's own transformers processor class (Qwen2.5-VL's): its image processor turns images
into `pixel_values` and `image_grid_thw`, and it expands each image's placeholder into as many image tokens as the
grid has merged patches; nothing here counts or places image tokens itself. The tiny model's processor is built from
arguments (`build_tiny_vl_processor`); a real model's is read from `model.path`.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch

from relax.data.files import DataError
from relax.data.tokenizer import (  # noqa: F401  (the vision tokens and the tiny tokenizer live with the tokenizers)
    IMAGE_PAD,
    QWEN_VL_CHAT_TEMPLATE,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    VISION_TOKENS,
    VL_WORDS,
    ModelFileError,
    build_tiny_vl_tokenizer,
    resolve_model_path,
)

IMAGE_MARKER = "<image>"  # in a prompt's text with an image column: where the next image goes


# The tiny model's image geometry: 8-pixel patches merged 2x2, images resized to 32x32 -> a 4x4 grid -> 4 tokens
TINY_PATCH_SIZE = 8
TINY_MERGE_SIZE = 2
TINY_IMAGE_SIZE = 32

def _field(model_cfg: Any, name: str, default: Any = None) -> Any:
    return getattr(model_cfg, name, default) if not isinstance(model_cfg, dict) else model_cfg.get(name, default)


def is_vision_model_config(model_cfg: Any) -> bool:
    """Whether `model_cfg` names a vision-language model: `model.arch` one of VISION_ARCHS (source=config), or a
    `source=hf` directory whose config.json's model_type is one of VISION_MODEL_TYPES. Reads no weights."""
    from relax.config.vision_rules import is_vision_model

    return is_vision_model(model_cfg)


def _processor_class() -> type:
    """Qwen2.5-VL's processor without a video processor (transformers' video processors need torchvision, and video
    is not an input here): placeholder expansion and `image_grid_thw` are the parent class's own code."""
    from transformers import Qwen2_5_VLProcessor

    class ImageOnlyQwenVLProcessor(Qwen2_5_VLProcessor):
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Optional[str] = None,
                     **kwargs: Any) -> None:
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return ImageOnlyQwenVLProcessor


def build_tiny_vl_processor(tokenizer: Any) -> Any:
    """The tiny model's processor: Qwen2-VL's image processor (PIL backend) built from arguments (8-pixel patches,
    2x2 merge, images resized to 32x32) + `tokenizer` + the Qwen-VL chat template."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pixels = TINY_IMAGE_SIZE * TINY_IMAGE_SIZE
    image_processor = Qwen2VLImageProcessorPil(patch_size=TINY_PATCH_SIZE, merge_size=TINY_MERGE_SIZE,
                                               temporal_patch_size=2, min_pixels=pixels, max_pixels=pixels)
    return _processor_class()(image_processor=image_processor, tokenizer=tokenizer,
                              chat_template=tokenizer.chat_template)


def load_processor(model_cfg: Any, tokenizer: Any) -> Any:
    """The processor of a vision-language `model_cfg` (`is_vision_model_config`), offline: the tiny one for
    source=config, else the image processor of `model.path` (preprocessor_config.json) with `tokenizer` and the
    directory's chat template (the tokenizer's, or chat_template.json / chat_template.jinja)."""
    if _field(model_cfg, "source", "config") == "config":
        return build_tiny_vl_processor(tokenizer)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil


    path = resolve_model_path(model_cfg)
    try:
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelFileError(f"model.path={str(path)!r}: cannot load the image processor "
                             f"(preprocessor_config.json): {e}") from None
    template = _directory_chat_template(Path(path)) or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ModelFileError(f"model.path={str(path)!r}: no chat template (tokenizer_config.json, chat_template.json "
                             "or chat_template.jinja) to place images with")
    return _processor_class()(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)


def _directory_chat_template(path: Path) -> Optional[str]:
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    if (path / "chat_template.json").is_file():
        try:
            return json.loads((path / "chat_template.json").read_text()).get("chat_template")
        except (OSError, ValueError, AttributeError):
            return None
    return None


# ---- reading images ------------------------------------------------------------------------------------------------

_DATA_URL = re.compile(r"^data:image/[A-Za-z0-9.+-]+;base64,(.*)$", re.S)


def load_image(value: Any, where: str, base_dir: Optional[Path] = None) -> Any:
    """An RGB PIL image from one image value (see the module docstring); DataError naming `where` otherwise."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    data: Optional[bytes] = None
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            value = value["bytes"]
        elif value.get("path"):
            value = value["path"]
        elif isinstance(value.get("url"), str):
            value = value["url"]
        else:
            raise DataError(f"{where}: an image given as an object needs 'bytes', 'path' or 'url', got keys "
                            f"{sorted(value)}")
    source = "the image bytes"  # what the bytes were read from, for an error about them
    if isinstance(value, (bytes, bytearray)):
        data = bytes(value)
    elif isinstance(value, str):
        if value.startswith(("http://", "https://")):
            raise DataError(f"{where}: image URL {value[:60]!r}: nothing is downloaded; give a file path, a data: URL "
                            "or base64 bytes")
        match = _DATA_URL.match(value)
        if match:
            data, source = _b64(match.group(1), where), "the data: URL's image"
        else:
            p = Path(value[len("file://"):] if value.startswith("file://") else value).expanduser()
            if not p.is_absolute() and base_dir is not None:
                p = base_dir / p
            if len(value) < 4096 and p.is_file():
                data, source = p.read_bytes(), f"image file {value!r}"
            elif len(value) >= 64 and re.fullmatch(r"[A-Za-z0-9+/=\s]+", value):
                data, source = _b64(value, where), "the base64 image data"
            else:
                raise DataError(f"{where}: image {value[:60]!r} is neither an existing file nor base64 data")
    else:
        raise DataError(f"{where}: an image must be a path, base64 text, bytes or a data: URL, got "
                        f"{type(value).__name__}")
    buffer = io.BytesIO(data)
    try:
        image = Image.open(buffer)
        image.load()
    except Image.DecompressionBombError as e:  # PIL's pixel limit (Image.MAX_IMAGE_PIXELS): an image too large
        raise DataError(f"{where}: image too large to read ({type(e).__name__}: {e}); downscale it") from None
    except (UnidentifiedImageError, OSError, ValueError) as e:
        # PIL names the buffer it read ("cannot identify image file <_io.BytesIO object at 0x...>"): `source` says
        why = str(e).replace(f" {buffer!r}", "").replace(repr(buffer), "the bytes")
        raise DataError(f"{where}: {source}: not a readable image ({type(e).__name__}: {why})") from None
    return image.convert("RGB")


def _count(n: int, noun: str) -> str:
    """`n` and `noun`, plural unless n is 1 ("1 image", "2 images")."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _b64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=False)
    except (binascii.Error, ValueError) as e:
        raise DataError(f"{where}: invalid base64 image data ({e})") from None


def image_prompt(obj: dict, prompt_key: str, image_key: str, where: str,
                 base_dir: Optional[Path] = None) -> Optional[tuple[list[dict], list[Any]]]:
    """(chat messages with image parts `{"type": "image"}`, the PIL images in order) of a record that has images, or
    None when it has none (no image parts, no `image_key` column or an empty one). The field at fault is named in
    every DataError.

    The column's images go, in order, to the prompt's slots: each `<image>` marker (in a string prompt, a message's
    string content or a text part) and each bare image part (`{"type": "image"}` without an image: TRL's and
    transformers' chat format); the number of slots must be the number of images. Without a slot, they come first in
    the first user message."""
    prompt = obj.get(prompt_key)
    column = obj.get(image_key)
    if column is not None and not isinstance(column, (list, tuple)):
        column = [column]
    column = list(column or [])
    has_parts = isinstance(prompt, (list, tuple)) and any(isinstance(m, dict) and isinstance(m.get("content"), list)
                                                           for m in prompt)
    if not has_parts and not column:
        return None
    images: list[Any] = []
    if isinstance(prompt, str):
        messages: list[dict] = [{"role": "user", "content": _parts([{"type": "text", "text": prompt}], where,
                                                                    prompt_key, images, base_dir)}]
    elif isinstance(prompt, (list, tuple)) and prompt:
        messages = []
        for m in prompt:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise DataError(f"{where}: {prompt_key!r}: each message needs a string 'role', got {m!r}"[:300])
            content = m.get("content")
            if isinstance(content, str):
                content = [{"type": "text", "text": content}] if IMAGE_MARKER in content else content
            messages.append({"role": m["role"], "content": _parts(content, where, prompt_key, images, base_dir)})
    else:
        raise DataError(f"{where}: {prompt_key!r} must be a string or a non-empty chat message list")
    slots = [p for m in messages if isinstance(m["content"], list) for p in m["content"] if "_slot" in p]
    if slots and len(slots) != len(column):
        markers = sum(1 for p in slots if p["_slot"] == "marker")
        bare = len(slots) - markers
        what = _count(markers, f"{IMAGE_MARKER} marker") + (
            f" and {_count(bare, 'image part')} without an image ({{'type': 'image'}}, each taking the next image of "
            f"{image_key!r})" if bare else "")
        raise DataError(f"{where}: the prompt has {what} but {image_key!r} holds {_count(len(column), 'image')}"
                        + ("" if column else f" ({image_key!r}, data.image_key, is missing or empty)"))
    if not column:
        return (messages, _ordered(messages, images, [])) if images else None
    column_images = [load_image(v, f"{where} ({image_key!r}[{i}])", base_dir) for i, v in enumerate(column)]
    if slots:
        for k, part in enumerate(slots):
            del part["_slot"]
            part["_column"] = k
    else:
        messages = _first(messages, len(column), where, image_key)
    return messages, _ordered(messages, images, column_images)


def _parts(content: Any, where: str, key: str, images: list, base_dir: Optional[Path]) -> Any:
    """A message's content: a string as it is, or a list of text/image parts normalised to `{"type": "text",
    "text"}` / `{"type": "image"}`, the images appended to `images`. A text part is split at its `<image>` markers
    and a bare image part (no image value) kept: each is a slot for the next image of the column (`"_slot"`)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise DataError(f"{where}: {key!r}: a message's content must be a string or a list of parts")
    out: list[dict] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            for i, piece in enumerate(part["text"].split(IMAGE_MARKER)):
                if i:
                    out.append({"type": "image", "_slot": "marker"})
                if piece:
                    out.append({"type": "text", "text": piece})
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            images.append(load_image(url, f"{where} ({key!r} image_url part)", base_dir))
            out.append({"type": "image", "_index": len(images) - 1})
        elif kind == "image" and all(part.get(k) is None for k in ("image", "url", "path")):
            out.append({"type": "image", "_slot": "bare"})
        elif kind == "image":
            value = next(part[k] for k in ("image", "url", "path") if part.get(k) is not None)
            images.append(load_image(value, f"{where} ({key!r} image part)", base_dir))
            out.append({"type": "image", "_index": len(images) - 1})
        else:
            raise DataError(f"{where}: {key!r}: unsupported content part {str(part)[:80]!r} (expected text, "
                            "image_url or image)")
    return out


def _first(messages: list[dict], n: int, where: str, image_key: str) -> list[dict]:
    """Messages with `n` column images put first in the first user message (a prompt without slots)."""
    out, placed = [], False
    for m in messages:
        content = m["content"]
        if not placed and m["role"] == "user":
            text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
            content = [{"type": "image", "_column": j} for j in range(n)] + text
            placed = True
        out.append({"role": m["role"], "content": content})
    if not placed:
        raise DataError(f"{where}: {image_key!r} has images but the prompt has no user message to put them in")
    return out


def _ordered(messages: list[dict], inline: list[Any], column: list[Any]) -> list[Any]:
    """The images in the order their parts appear (what the processor pairs with the placeholders); the parts lose
    their bookkeeping keys."""
    out = []
    for m in messages:
        if isinstance(m["content"], list):
            for part in m["content"]:
                if part["type"] == "image":
                    out.append(column[part.pop("_column")] if "_column" in part else inline[part.pop("_index")])
    return out


def prompt_has_images(obj: dict, prompt_key: str, image_key: str) -> bool:
    """Whether a raw record carries images (image parts or a non-empty image column), without reading them."""
    prompt = obj.get(prompt_key)
    if obj.get(image_key):
        return True
    return isinstance(prompt, (list, tuple)) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in ("image", "image_url") for p in m["content"])
        for m in prompt)


def check_text_prompt(vision: Optional[VisionData], text: str, ids: list[int], where: str) -> None:
    """Refuse a prompt without images (rendered `text`, token `ids`) that a vision-language model (`vision` not None)
    would misread: one holding the model's vision special tokens as literal text (the engine would take them for
    image slots with no image and fail mid-rollout), or `<image>` markers with no images in the column (they would
    stay literal text and be trained on). A text-only model (`vision` None) reads both as plain text."""
    if vision is None:
        return
    tokenizer = getattr(vision.processor, "tokenizer", None)
    if tokenizer is not None:
        special = {int(tokenizer.convert_tokens_to_ids(t)): t for t in VISION_TOKENS}
        special.pop(getattr(tokenizer, "unk_token_id", None), None)
        found = sorted({special[t] for t in ids if t in special})
        if found:
            raise DataError(f"{where}: the prompt holds the model's vision tokens {', '.join(found)} as text but has "
                            f"no images: give its images in {vision.image_key!r} (data.image_key) with an "
                            f"{IMAGE_MARKER} marker where each goes, or as image parts, instead of pre-rendered "
                            "placeholders")
    markers = text.count(IMAGE_MARKER)
    if markers:
        raise DataError(f"{where}: the prompt has {markers} {IMAGE_MARKER} marker(s) but no images: "
                        f"{vision.image_key!r} (data.image_key) is missing or empty; give one image per marker, or "
                        f"remove the markers")


# ---- encoding ------------------------------------------------------------------------------------------------------

def encode_image_prompt(processor: Any, messages: list[dict], images: list[Any],
                        system_prompt: Optional[str] = None) -> tuple[str, list[int], dict[str, torch.Tensor]]:
    """(prompt text, token ids with each image's placeholder expanded by the processor, vision inputs
    {"pixel_values", "image_grid_thw", "image_tokens": how many image tokens the ids hold}) of messages with image
    parts and their images."""
    if system_prompt:
        if any(m.get("role") == "system" for m in messages):
            raise ValueError("data.system_prompt is set but this prompt has its own system message")
        messages = [{"role": "system", "content": system_prompt}, *messages]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids, vision = encode_observation(processor, text, images, what="prompt")
    return text, ids, vision


def encode_observation(processor: Any, text: str, images: list[Any],
                       what: str = "observation") -> tuple[list[int], dict[str, torch.Tensor]]:
    """(token ids of `text` with each image placeholder expanded by the processor, vision inputs as
    `encode_image_prompt` gives them) of a text already rendered with the chat template and its images."""
    out = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
    ids = out["input_ids"][0].tolist()
    vision = {"pixel_values": out["pixel_values"].float().contiguous(),
              "image_grid_thw": out["image_grid_thw"].long().contiguous()}
    expected = image_token_count(processor, vision["image_grid_thw"])
    found = sum(1 for t in ids if t == processor.image_token_id)
    if found != expected:  # the template placed a different number of placeholders than images
        raise ValueError(f"the {what} has {found} image tokens but its {len(images)} images need {expected} "
                         "(the chat template must render one placeholder per image part)")
    vision["image_tokens"] = found
    return ids, vision


def image_token_count(processor: Any, image_grid_thw: torch.Tensor) -> int:
    """Image tokens the processor's model expects for these grids: each grid's patches over merge_size^2."""
    merge = int(processor.image_processor.merge_size)
    return int((image_grid_thw.prod(-1) // (merge * merge)).sum())


BLANK_GREY = (128, 128, 128)


def seen_images(images: list[Any], blank: bool) -> list[Any]:
    """The images a policy sees of `images`: themselves, or with `blank` (`data.blank_images`, the blind control
    arm) each replaced by a grey one of its size. The one place the blind arm's images are made: a dataset prompt's
    (`VisionData.encode`, `draw_vision`) and an environment's image observations (`relax.agents.render`) alike."""
    if not blank:
        return list(images)
    from PIL import Image

    return [Image.new("RGB", im.size, BLANK_GREY) for im in images]


@dataclass(frozen=True)
class VisionData:
    """How a dataset's records with images become prompt items: the model's `processor`, the image column
    (`data.image_key`), the directory relative image paths are read from, and `blank` (`data.blank_images`: every
    image replaced by a grey one of its size, the blind control arm: `seen_images`; the episodes' image
    observations take it from here too, `relax.agents.episode.EpisodeMaker.for_config`). `wire`: the drawn vision
    inputs also hold each image as a lossless PNG data URL (`vision["image_data"]`), what rollout=sglang sends as
    SGLang's `image_data` (the server then reads the very pixels the trainer's pixel values come from).

    A dataset keeps no pixels: `encode` runs the processor (the prompt's ids with the image tokens, the grids, the
    length) and keeps a reference to the images (`is_image_reference`); `draw_vision` reads them again and computes
    the pixel values when the item is drawn."""

    processor: Any
    image_key: str = "images"
    base_dir: Optional[Path] = None
    blank: bool = False
    wire: bool = False

    def at(self, base_dir: Optional[Path]) -> VisionData:
        return replace(self, base_dir=base_dir)

    def encode(self, obj: dict, prompt_key: str, where: str, apply_chat_template: bool,
               system_prompt: Optional[str]) -> Optional[tuple[str, list[int], list[dict], dict]]:
        """(text, token ids, messages, image reference: `is_image_reference`, no pixel values) of a record with images;
        None without images."""
        found = image_prompt(obj, prompt_key, self.image_key, where, self.base_dir)
        if found is None:
            return None
        if not apply_chat_template:
            raise DataError(f"{where}: a prompt with images needs the chat template to place them "
                            "(data.apply_chat_template=true)")
        messages, images = found
        try:
            text, ids, vision = encode_image_prompt(self.processor, messages, seen_images(images, self.blank),
                                                    system_prompt)
        except ValueError as e:
            raise DataError(f"{where}: {e}") from None
        return text, ids, messages, self.reference(obj, prompt_key, where, vision)

    def reference(self, obj: dict, prompt_key: str, where: str, vision: dict) -> dict:
        """What a prompt item keeps of a record's images (`draw_vision` reads it): see `is_image_reference`."""
        key = sys.intern(self.processor.image_processor.to_json_string())
        _IMAGE_PROCESSORS.setdefault(key, self.processor.image_processor)
        fields = {k: _portable(obj[k]) for k in (prompt_key, self.image_key) if obj.get(k) is not None}
        base = Path(self.base_dir if self.base_dir is not None else Path.cwd()).expanduser().absolute()
        return {"record": fields, "prompt_key": prompt_key, "image_key": self.image_key, "where": where,
                "base_dir": str(base), "blank": self.blank, "wire": self.wire, "image_processor": key,
                "image_grid_thw": vision["image_grid_thw"], "image_tokens": int(vision["image_tokens"])}


def vision_data(cfg: Any, tokenizer: Any) -> Optional[VisionData]:
    """The `VisionData` of a run whose model is a vision-language model (`is_vision_model_config`), else None."""
    if not is_vision_model_config(cfg.model):
        return None
    return VisionData(load_processor(cfg.model, tokenizer), image_key=getattr(cfg.data, "image_key", "images"),
                      blank=bool(getattr(cfg.data, "blank_images", False)),
                      wire=getattr(getattr(cfg, "rollout", None), "backend", "embedded") == "sglang")


def image_data_url(image: Any) -> str:
    """A PIL image as a `data:image/png;base64,` URL (PNG is lossless: whoever reads it gets the very pixels)."""
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


# ---- drawing: the pixel values of a kept image reference -----------------------------------------------------------

# image processors by their JSON (`to_json_string`): the loaded one in the process that read the data, rebuilt from
# its JSON in any other
_IMAGE_PROCESSORS: dict[str, Any] = {}


def is_image_reference(vision: Optional[dict]) -> bool:
    """Whether `vision` is a prompt item's image reference (what `PromptItem.images` holds: the record's image fields,
    `record`, as read from the data, paths or inline bytes, a PIL image as PNG bytes; `prompt_key`, `image_key`,
    `where`, `base_dir`; `blank`, `wire`; the image processor's JSON; the grids and image-token count found at load),
    rather than vision inputs with pixel values. Only plain values and tensors: a checkpoint's weights-only load
    reads it back."""
    return vision is not None and "pixel_values" not in vision


def draw_vision(ref: dict) -> dict:
    """The vision inputs of an image reference (`is_image_reference`): {"pixel_values", "image_grid_thw",
    "image_tokens"}, and "image_data" (PNG data URLs) with `wire`. The images are read again from the record and
    go through the same image processor, so the pixel values are the processor's at load; images whose grids differ
    from the ones found at load (a file changed since) are a DataError naming the record. Vision inputs that already
    hold pixel values (a checkpoint written before references) are returned as they are."""
    if not is_image_reference(ref):
        return dict(ref)
    where = ref["where"]
    found = image_prompt(ref["record"], ref["prompt_key"], ref["image_key"], where, Path(ref["base_dir"]))
    if found is None:
        raise DataError(f"{where}: the record's images are gone")
    images = seen_images(found[1], ref["blank"])
    processor = _image_processor(ref["image_processor"])
    try:
        out = processor(images=images, return_tensors="pt")
    except ValueError as e:
        raise DataError(f"{where}: {e}") from None
    grid = out["image_grid_thw"].long().contiguous()
    if not torch.equal(grid, ref["image_grid_thw"]):
        raise DataError(f"{where}: its images changed since the data was loaded (image grids "
                        f"{ref['image_grid_thw'].tolist()} then, {grid.tolist()} now): the prompt's image tokens no "
                        "longer fit them")
    vision = {"pixel_values": out["pixel_values"].float().contiguous(), "image_grid_thw": grid,
              "image_tokens": int(ref["image_tokens"])}
    if ref["wire"]:
        vision["image_data"] = [image_data_url(im) for im in images]
    return vision


def _image_processor(key: str) -> Any:
    found = _IMAGE_PROCESSORS.get(key)
    if found is None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        found = _IMAGE_PROCESSORS.setdefault(key, Qwen2VLImageProcessorPil.from_dict(json.loads(key)))
    return found


def _portable(value: Any) -> Any:
    """A record's field with each PIL image (built-in tasks) as PNG bytes of its RGB pixels (what `load_image` reads
    back as the same pixels): plain values only, which a checkpoint and Ray carry."""
    from PIL import Image

    if isinstance(value, Image.Image):
        buf = io.BytesIO()
        value.convert("RGB").save(buf, format="PNG")
        return {"bytes": buf.getvalue()}
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_portable(v) for v in value]
    return value


# ---- images for a reward: OpenAI image_url parts -------------------------------------------------------------------

def reference_images(ref: Optional[dict]) -> list[Any]:
    """The task's images of a prompt item's image reference (`is_image_reference`), as PIL images in the order of
    the prompt's image parts: read again from the record, never blanked (`data.blank_images` changes what the policy
    sees, not the task a reward scores); [] for None. Vision inputs with pixel values only (a checkpoint written
    before references) no longer hold the images: ValueError."""
    if ref is None:
        return []
    if not is_image_reference(ref):
        raise ValueError(f"{ref.get('where', 'a prompt')}: its images are kept only as pixel values (a checkpoint "
                         "written before image references), which a reward cannot be sent")
    found = image_prompt(ref["record"], ref["prompt_key"], ref["image_key"], ref["where"], Path(ref["base_dir"]))
    return [] if found is None else found[1]


def image_url_messages(messages: list[dict], prompt_images: list[str]) -> list[dict]:
    """`messages` with each image part as an OpenAI `image_url` part holding a PNG data URL (what a reward service or
    a reward function reads, as a VLM's OpenAI-protocol server takes it): a bare `{"type": "image"}` part (a dataset
    prompt's, whose images the item keeps apart) takes the next of `prompt_images` (data URLs, in order); a part
    holding its image (an environment's observation: `{"type": "image", "image": ...}`) its own image. Other parts
    and string contents are kept; new dicts, `messages` is not changed. ValueError when the bare parts outnumber
    `prompt_images`."""
    pending = iter(prompt_images)
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image":
                value = next((part[k] for k in ("image", "url", "path") if part.get(k) is not None), None)
                if value is None:
                    url = next(pending, None)
                    if url is None:
                        raise ValueError(f"message {i}: an image part without an image beyond the prompt's "
                                         f"{_count(len(prompt_images), 'image')}")
                else:
                    url = image_data_url(load_image(value, f"message {i} image part"))
                part = {"type": "image_url", "image_url": {"url": url}}
            parts.append(part)
        out.append({**m, "content": parts})
    return out
