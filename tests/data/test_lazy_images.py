"""A dataset with images keeps references, not pixels (relax.data.images.VisionData.reference, draw_vision;
relax.data.datasets.PromptItem): the pixel values an engine gets for a drawn item are the processor's own, bit for
bit, whichever way the item travels (drawn in this process, sent to another by pickling as Ray does, restored from a
checkpoint's rollout state), and a dataset of large images holds no pixel tensors.

`test_a_dataset_of_large_images_holds_no_pixels` is written against what both designs expose (the items' fields and
the process's memory), so it also runs on the code from before references, where it fails (the negative control:
PYTHONPATH=<a checkout of that code> pytest tests/data/test_lazy_images.py -k holds_no_pixels).
"""

from __future__ import annotations

import base64
import dataclasses
import gc
import io
import json
import pickle
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from real_vl import QWEN2_5_VL_PREPROCESSOR, QWEN3_VL_PREPROCESSOR, qwen_vl_tokenizer

from relax.config.schema import ModelConfig
from relax.data import images as images_module
from relax.data.datasets import PromptItem, PromptSampler, load_prompt_file
from relax.data.files import DataError
from relax.data.images import VisionData, load_processor

SETTINGS = {"qwen2_5_vl": QWEN2_5_VL_PREPROCESSOR, "qwen3_vl": QWEN3_VL_PREPROCESSOR}


def _processor(arch: str, directory):
    """The processor `load_processor` reads from a Hugging Face directory with the published image processor
    settings of `arch` and its chat template (what a real model directory gives)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = qwen_vl_tokenizer(arch)
    Qwen2VLImageProcessorPil(**SETTINGS[arch]).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return load_processor(ModelConfig(name=arch, source="hf", path=str(directory)), tokenizer), tokenizer


def _noise(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _jpeg_b64(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _write_data(tmp_path):
    """A JSONL of prompts with several images each, as paths and inline data, one in a later user turn; with the
    images each prompt's placeholders take, in order, read straight from the files with PIL (independently of
    relax's reading)."""
    (tmp_path / "imgs").mkdir()
    files = {}
    for k, (h, w) in enumerate([(300, 420), (97, 61), (640, 480), (128, 128)]):
        _noise(h, w, k).save(tmp_path / "imgs" / f"{k}.png")
        files[k] = tmp_path / "imgs" / f"{k}.png"
    inline = _noise(200, 150, 9)
    inline_b64 = _jpeg_b64(inline)
    records = [
        # an image column with <image> markers: two images
        {"prompt": "first <image> then <image>: which is brighter?", "images": ["imgs/0.png", "imgs/1.png"],
         "label": "a"},
        # chat parts, an image in the first turn and one in a later user turn (inline base64, a data: URL)
        {"prompt": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(files[2])}},
                                                 {"type": "text", "text": "what is this?"}]},
                    {"role": "assistant", "content": "noise."},
                    {"role": "user", "content": [{"type": "text", "text": "and this one?"},
                                                 {"type": "image", "image": inline_b64},
                                                 {"type": "image_url",
                                                  "image_url": {"url": "data:image/jpeg;base64," + inline_b64}}]}],
         "label": "b"},
        # an image column without markers: first in the first user message
        {"prompt": "describe it", "images": ["imgs/3.png"], "label": "c"},
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))

    def pil(p):
        return Image.open(p).convert("RGB")

    def decoded(b64):
        return Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")

    expected = [[pil(files[0]), pil(files[1])], [pil(files[2]), decoded(inline_b64), decoded(inline_b64)],
                [pil(files[3])]]
    return path, expected


def _checkpointed(items):
    """The items as a resume reads them back: the rollout stream's state written and read as a checkpoint does
    (torch.save, torch.load(weights_only=True)), rebuilt with PromptItem(**d)."""
    from relax.runner.checkpoint import read_rollout_state, write_rollout_state
    from relax.runner.rollout_driver.stream import _items_state

    with tempfile.TemporaryDirectory() as d:
        write_rollout_state(Path(d), {"items": _items_state(items)})
        state = read_rollout_state(Path(d))
    assert _tensor_bytes(state["items"]) <= 64 * len(items)  # the grids alone: no pixel values in the state
    return [PromptItem(**d) for d in state["items"]]


def _tensor_bytes(value) -> int:
    """Bytes of every tensor inside `value` (dataclass fields, dicts, lists)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(_tensor_bytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_drawn_pixel_values_are_the_processors_own(tmp_path, arch):
    """For prompts with several images, in a later turn too, as paths and inline data: the vision inputs the engine
    gets (`prompt_vision` of the sampler's batch, as RolloutWorker.generate and SGLangEngines.generate take them) are
    bit for bit those of the processor run directly on the prompt's text and the images read with PIL; the same after
    the item crossed a process boundary (pickled, with the image processor rebuilt from its JSON as a fresh process
    does) and after a checkpoint's rollout state; and the items themselves hold no pixel values."""
    from relax.rollout.vision import prompt_vision

    processor, tokenizer = _processor(arch, tmp_path / "model")
    path, expected = _write_data(tmp_path)
    data = load_prompt_file(path, tokenizer, vision=VisionData(processor, wire=True))
    assert len(data) == 3
    assert _tensor_bytes(list(data)) <= 64 * len(data)  # grids only
    direct = [processor(text=[item.prompt_text], images=images, return_tensors="pt", add_special_tokens=False)
              for item, images in zip(data, expected, strict=True)]
    for item, out, images in zip(data, direct, expected, strict=True):
        assert item.prompt_ids == out["input_ids"][0].tolist()  # the placeholders expanded by the processor
        assert item.images["image_tokens"] == sum(t == processor.image_token_id for t in item.prompt_ids)
        assert len(images) == out["image_grid_thw"].shape[0]
    assert [len(e) for e in expected] == [2, 3, 1]

    def check(vision_list):
        assert len(vision_list) == len(direct)
        for vision, out, images in zip(vision_list, direct, expected, strict=True):
            assert vision["pixel_values"].dtype == torch.float32
            assert torch.equal(vision["pixel_values"], out["pixel_values"].float())
            assert torch.equal(vision["image_grid_thw"], out["image_grid_thw"].long())
            assert vision["image_tokens"] == int((out["input_ids"][0] == processor.image_token_id).sum())
            # rollout=sglang's image_data: lossless PNGs of the very images
            sent = [np.asarray(Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1])))) for u in
                    vision["image_data"]]
            assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(sent, images, strict=True))

    sampler = PromptSampler(data, batch_size=3, shuffle=False)
    drawn = sampler.next_batch()
    check(prompt_vision(drawn))
    # sent to another process (Ray pickles the items): drawn where it is sent from, the image files not needed there
    images_module._IMAGE_PROCESSORS.clear()  # a fresh process: the image processor rebuilt from its JSON
    sent = pickle.dumps(drawn)
    (tmp_path / "imgs").rename(tmp_path / "gone")
    check(prompt_vision(pickle.loads(sent)))
    (tmp_path / "gone").rename(tmp_path / "imgs")
    # a checkpoint's rollout state: references only, drawn again on resume
    images_module._IMAGE_PROCESSORS.clear()
    check(prompt_vision(_checkpointed(drawn)))


def test_blank_images_are_drawn_blank(tmp_path):
    """data.blank_images: the drawn pixel values are the processor's of grey images of each image's size."""
    processor, tokenizer = _processor("qwen2_5_vl", tmp_path / "model")
    path, expected = _write_data(tmp_path)
    data = load_prompt_file(path, tokenizer, vision=VisionData(processor, blank=True))
    for item, images in zip(data, expected, strict=True):
        grey = [Image.new("RGB", im.size, (128, 128, 128)) for im in images]
        out = processor(text=[item.prompt_text], images=grey, return_tensors="pt", add_special_tokens=False)
        assert torch.equal(item.vision["pixel_values"], out["pixel_values"].float())
        assert "image_data" not in item.vision


def test_an_image_changed_after_load_is_named(tmp_path):
    """An image file replaced after load by one of another size: its tokens no longer fit the prompt, a DataError
    naming the record when the item is drawn."""
    processor, tokenizer = _processor("qwen2_5_vl", tmp_path / "model")
    path, _ = _write_data(tmp_path)
    data = load_prompt_file(path, tokenizer, vision=VisionData(processor))
    _noise(900, 900, 0).save(tmp_path / "imgs" / "3.png")
    with pytest.raises(DataError, match=r"data.jsonl:3: its images changed since the data was loaded"):
        _ = data[2].vision


def test_a_checkpoint_item_from_before_references_still_draws(tmp_path):
    """A rollout state written before references holds each item's `vision` with its pixel values: rebuilt with
    PromptItem(**d), it draws them as they are."""
    processor, tokenizer = _processor("qwen2_5_vl", tmp_path / "model")
    path, _ = _write_data(tmp_path)
    item = load_prompt_file(path, tokenizer, vision=VisionData(processor))[0]
    old = {f.name: getattr(item, f.name) for f in dataclasses.fields(item) if f.name != "images"}
    old["vision"] = item.vision
    restored = PromptItem(**old)
    assert torch.equal(restored.vision["pixel_values"], item.vision["pixel_values"])


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_dataset_of_large_images_holds_no_pixels(tmp_path):
    """N large images (1000x1000, at Qwen2.5-VL's published settings each 5,184 patches of 1,176 floats, 24 MB of
    pixel values): after load the items hold no tensor beyond the grids, and the process's memory grows by far less
    than the pixel values would take (they were 10 x 24 MB = 240 MB when every item kept them)."""
    processor, tokenizer = _processor("qwen2_5_vl", tmp_path / "model")
    (tmp_path / "imgs").mkdir()
    n = 10
    for k in range(n):
        Image.linear_gradient("L").resize((1000, 1000)).convert("RGB").rotate(k * 30).save(
            tmp_path / "imgs" / f"{k}.png")
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"prompt": "what is it?", "images": [f"imgs/{k}.png"], "label": "x"}) + "\n"
                            for k in range(n)))
    vision = VisionData(processor)
    load_prompt_file(path, tokenizer, vision=vision, limit=1)  # warm up: the libraries' own one-time allocations
    gc.collect()
    before = _rss_bytes()
    data = load_prompt_file(path, tokenizer, vision=vision)
    gc.collect()
    grown = _rss_bytes() - before
    assert len(data) == n
    per_image = 5184 * 1176 * 4
    held = _tensor_bytes(list(data))
    assert held <= 64 * n, f"the items hold {held / 2**20:.0f} MiB of tensors"
    assert grown < 4 * per_image, f"loading {n} images grew the process by {grown / 2**20:.0f} MiB"
