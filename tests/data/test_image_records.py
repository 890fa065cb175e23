"""Image records the review found mishandled (relax.data.images): each prompt form is checked against the same prompt
written in a form that already worked (explicit image parts with their images), token for token and pixel for pixel;
and what cannot be a prompt is a DataError naming the record and the field at load time, not later."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch
from PIL import Image

from relax.data.datasets import PromptDataset
from relax.data.files import DataError
from relax.data.images import VisionData, build_tiny_vl_processor, build_tiny_vl_tokenizer

QUESTION = "which is red?"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_vl_tokenizer()


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("imgs")
    for name, rgb, size in (("red.png", (255, 0, 0), (32, 32)), ("blue.png", (0, 0, 255), (40, 24))):
        Image.new("RGB", size, rgb).save(folder / name)
    return folder


@pytest.fixture(scope="module")
def vision(tokenizer, images):
    return VisionData(build_tiny_vl_processor(tokenizer)).at(images)


def _load(record, tokenizer, vision, where="p.jsonl:1"):
    return PromptDataset.from_records([(record, where)], tokenizer, vision=vision)[0]


def _same(a, b) -> None:
    assert a.prompt_ids == b.prompt_ids
    assert a.prompt_text == b.prompt_text
    assert torch.equal(a.vision["pixel_values"], b.vision["pixel_values"])
    assert torch.equal(a.vision["image_grid_thw"], b.vision["image_grid_thw"])


def _explicit(*content):
    """The reference: a chat prompt whose image parts carry their images (the Hugging Face form)."""
    return {"prompt": [{"role": "user", "content": list(content)}], "label": "red"}


def _text(t):
    return {"type": "text", "text": t}


def _image(name):
    return {"type": "image", "image": name}


def test_bare_image_parts_take_the_columns_images_in_order(tokenizer, vision):
    """TRL's / transformers' VLM format: `{"type": "image"}` parts plus an `images` column."""
    record = {"prompt": [{"role": "user", "content": [{"type": "image"}, _text("first, then"), {"type": "image"},
                                                      _text(QUESTION)]}],
              "images": ["red.png", "blue.png"], "label": "red"}
    ref = _explicit(_image("red.png"), _text("first, then"), _image("blue.png"), _text(QUESTION))
    _same(_load(record, tokenizer, vision), _load(ref, tokenizer, vision))
    swapped = _explicit(_image("blue.png"), _text("first, then"), _image("red.png"), _text(QUESTION))
    assert not torch.equal(_load(record, tokenizer, vision).vision["pixel_values"],
                           _load(swapped, tokenizer, vision).vision["pixel_values"])  # the order is the column's


def test_bare_image_parts_and_the_column_must_agree(tokenizer, vision):
    bare = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, _text(QUESTION)]}]
    with pytest.raises(DataError, match=r"p.jsonl:1: the prompt has 0 <image> markers and 2 image parts without an "
                                        r"image .* but 'images' holds 1 image$"):
        _load({"prompt": bare, "images": ["red.png"], "label": "red"}, tokenizer, vision)
    with pytest.raises(DataError, match=r"p.jsonl:1: .*2 image parts without an image.*holds 0 images .*missing or "
                                        "empty"):
        _load({"prompt": bare, "label": "red"}, tokenizer, vision)


def test_image_markers_in_text_parts_place_the_images(tokenizer, vision):
    record = {"prompt": [{"role": "user", "content": [_text(f"first <image> then <image> {QUESTION}")]}],
              "images": ["red.png", "blue.png"], "label": "red"}
    item = _load(record, tokenizer, vision)
    ref = _explicit(_text("first "), _image("red.png"), _text(" then "), _image("blue.png"), _text(f" {QUESTION}"))
    _same(item, _load(ref, tokenizer, vision))
    assert "<image>" not in item.prompt_text
    # the same markers in a string prompt and in a message's string content give the same prompt
    for prompt in (f"first <image> then <image> {QUESTION}",
                   [{"role": "user", "content": f"first <image> then <image> {QUESTION}"}]):
        _same(_load({**record, "prompt": prompt}, tokenizer, vision), item)
    with pytest.raises(DataError, match="the prompt has 2 <image> markers but 'images' holds 1 image$"):
        _load({**record, "images": ["red.png"]}, tokenizer, vision)


def test_markers_without_images_are_refused_for_a_vision_model(tokenizer, vision):
    for record in ({"prompt": f"<image> {QUESTION}", "images": [], "label": "red"},
                   {"prompt": f"<image> {QUESTION}", "label": "red"},
                   {"prompt": [{"role": "user", "content": [_text(f"<image> {QUESTION}")]}], "label": "red"}):
        with pytest.raises(DataError, match=r"p.jsonl:1: the prompt has 1 <image> marker\(s\) but no images: 'images' "
                                            r"\(data.image_key\) is missing or empty"):
            _load(record, tokenizer, vision)
    # a text-only model reads the marker as the text it is
    item = PromptDataset.from_records([({"prompt": f"<image> {QUESTION}", "label": "red"}, "p.jsonl:1")], tokenizer)[0]
    assert "<image> " + QUESTION in item.prompt_text


@pytest.mark.parametrize("token", ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"])
def test_vision_tokens_in_a_text_prompt_are_refused_at_load(tokenizer, vision, token):
    record = {"prompt": f"{token} what colour?", "label": "red"}
    assert tokenizer.convert_tokens_to_ids(token) in tokenizer(record["prompt"])["input_ids"]  # it is the token
    with pytest.raises(DataError, match=rf"p.jsonl:7: the prompt holds the model's vision tokens "
                                        rf"{token.replace('|', '[|]')} as text but has no images"):
        _load(record, tokenizer, vision, where="p.jsonl:7")
    chat = {"prompt": [{"role": "user", "content": f"look {token}"}], "label": "red"}
    with pytest.raises(DataError, match="p.jsonl:1: the prompt holds the model's vision tokens"):
        _load(chat, tokenizer, vision)
    # a text-only model has no image slots: the same prompt is text to it
    assert PromptDataset.from_records([(record, "p.jsonl:7")], tokenizer)[0].prompt_ids


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares `width` x `height` pixels (no pixel data: PIL refuses it from the header alone)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def test_an_oversized_image_is_a_data_error_naming_the_record_and_field(tokenizer, vision, tmp_path):
    (tmp_path / "huge.png").write_bytes(_png_header(14000, 14000))  # 196M pixels: over PIL's bomb limit
    record = {"prompt": QUESTION, "images": ["ok.png", "huge.png"], "label": "red"}
    Image.new("RGB", (32, 32), (255, 0, 0)).save(tmp_path / "ok.png")
    with pytest.raises(DataError, match=r"p.jsonl:4 \('images'\[1\]\): image too large to read "
                                        r"\(DecompressionBombError"):
        _load(record, tokenizer, vision.at(tmp_path), where="p.jsonl:4")
    part = {"prompt": [{"role": "user", "content": [_image("huge.png"), _text(QUESTION)]}], "label": "red"}
    with pytest.raises(DataError, match=r"p.jsonl:1 \('prompt' image part\): image too large"):
        _load(part, tokenizer, vision.at(tmp_path))


def test_an_unreadable_image_file_is_named_by_its_path_not_by_a_buffer(tokenizer, vision, images):
    """PIL's own message names the in-memory buffer it read ("<_io.BytesIO object at 0x...>"); the error names the
    record, the column entry and the file the user wrote."""
    (images / "notimg.png").write_text("this is text, not a PNG")
    with pytest.raises(DataError) as exc:
        _load({"prompt": "<image> what colour?", "images": ["notimg.png"], "label": "red"}, tokenizer, vision)
    assert str(exc.value) == ("p.jsonl:1 ('images'[0]): image file 'notimg.png': not a readable image "
                              "(UnidentifiedImageError: cannot identify image file)")
    with pytest.raises(DataError, match=r"the prompt has 1 <image> marker but 'images' holds 2 images$"):
        _load({"prompt": "<image> what colour?", "images": ["red.png", "blue.png"], "label": "red"}, tokenizer, vision)
