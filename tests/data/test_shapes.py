"""Images in prompts (relax.data.images), the shapes task (relax.data.shapes) and its reward, and the validation of
vision-language runs (relax.config.vision_rules)."""

from __future__ import annotations

import base64
import io
import json

import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from relax.config.compose import compose
from relax.config.derive import resolve
from relax.config.validate import validate
from relax.data.datasets import PromptDataset, load_prompt_file
from relax.data.files import DataError
from relax.data.images import VisionData, build_tiny_vl_processor, build_tiny_vl_tokenizer, image_token_count
from relax.data.shapes import BACKGROUND, COLOURS, generate_shapes
from relax.rewards.shapes import shapes_reward


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_vl_tokenizer()


@pytest.fixture(scope="module")
def vision(tokenizer):
    return VisionData(build_tiny_vl_processor(tokenizer))


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_shapes_are_drawn_in_the_labelled_colour():
    """Every image holds pixels of its label's colour and of no other colour; records are the same for a seed."""
    records = generate_shapes(40, seed=3)
    assert [r["label"] for r in records] == [r["label"] for r in generate_shapes(40, seed=3)]
    assert {r["label"] for r in records} == set(COLOURS)
    for r in records:
        image = r["prompt"][0]["content"][0]["image"]
        colours = {c for _, c in image.getcolors()}
        assert COLOURS[r["label"]] in colours and colours <= {COLOURS[r["label"]], BACKGROUND}
    assert generate_shapes(3, seed=3, split="eval") != generate_shapes(3, seed=3)


def test_shapes_reward_by_hand():
    assert shapes_reward("red", "red") == 1.0
    assert shapes_reward("blue", "red") == 0.5  # a colour word, the wrong one
    assert shapes_reward("red shape", "red") == 0.75  # half the words are colours, the first is right
    assert shapes_reward("the", "red") == 0.0
    assert shapes_reward("", "red") == 0.0


def test_every_image_form_gives_the_same_prompt(tmp_path, tokenizer, vision):
    """A file path (relative to the data file), base64, a data URL, HF-datasets bytes, OpenAI image_url parts and an
    <image> marker all give the same token ids and pixel values as the built-in task's PIL image."""
    record = generate_shapes(1, seed=0)[0]
    image = record["prompt"][0]["content"][0]["image"]
    png = _png(image)
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png)
    b64 = base64.b64encode(png).decode()
    q = "what colour is the shape?"
    rows = [
        {"prompt": q, "images": ["img/a.png"], "label": "red"},
        {"prompt": q, "images": [b64], "label": "red"},
        {"prompt": "<image>" + q, "images": [f"data:image/png;base64,{b64}"], "label": "red"},
        {"prompt": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
            {"type": "text", "text": q}]}], "label": "red"},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_prompt_file(path, tokenizer, vision=vision)
    reference = PromptDataset.from_records([(record, "task")], tokenizer, vision=vision)[0]
    assert len(data) == 4
    for item in data:
        assert item.prompt_ids == reference.prompt_ids
        assert torch.equal(item.vision["pixel_values"], reference.vision["pixel_values"])
        assert item.vision["image_grid_thw"].tolist() == [[1, 4, 4]]
    parquet = PromptDataset.from_records([({"prompt": q, "images": [{"bytes": png, "path": None}], "label": "red"},
                                           "row 1")], tokenizer, vision=vision)
    assert parquet[0].prompt_ids == reference.prompt_ids


def test_image_tokens_are_what_the_processor_says(tokenizer):
    """Images of other sizes through a Qwen2-VL-like image processor (14-pixel patches, 2x2 merge): each prompt has as
    many image tokens as the processor's own count (`_get_num_multimodal_tokens`), one image or two."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from relax.data.images import _processor_class

    processor = _processor_class()(
        image_processor=Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, min_pixels=56 * 56,
                                                 max_pixels=28 * 28 * 64),
        tokenizer=tokenizer, chat_template=tokenizer.chat_template)
    data = VisionData(processor)
    sizes = [(60, 90), (200, 120), (28, 300)]
    images = [Image.new("RGB", s, (10, 200, 30)) for s in sizes]
    for chosen in ([images[0]], [images[1], images[2]]):
        record = {"prompt": "<image>" * len(chosen) + "what colour is the shape?", "images": chosen, "label": "x"}
        item = PromptDataset.from_records([(record, "r")], tokenizer, vision=data)[0]
        expected = processor._get_num_multimodal_tokens(image_sizes=[(im.height, im.width) for im in chosen])
        found = item.prompt_ids.count(processor.image_token_id)
        assert found == sum(expected["num_image_tokens"]) == image_token_count(processor,
                                                                               item.vision["image_grid_thw"])


def test_bad_images_are_named(tmp_path, tokenizer, vision):
    cases = [
        ({"prompt": "q", "images": ["https://example.com/a.png"], "label": "x"}, "nothing is downloaded"),
        ({"prompt": "q", "images": ["missing.png"], "label": "x"}, "neither an existing file nor base64"),
        ({"prompt": "q", "images": [base64.b64encode(b"not an image" * 10).decode()], "label": "x"},
         "not a readable image"),
        ({"prompt": "<image><image>q", "images": ["missing.png"], "label": "x"}, "2 <image> markers but 'images'"),
        ({"prompt": [{"role": "user", "content": [{"type": "audio"}]}], "label": "x"}, "unsupported content part"),
    ]
    for record, message in cases:
        with pytest.raises(DataError, match=message):
            PromptDataset.from_records([(record, "p.jsonl:1")], tokenizer, vision=vision.at(tmp_path))


def test_images_for_a_text_model_are_rejected_naming_the_field(tokenizer):
    record = generate_shapes(1, seed=0)[0]
    with pytest.raises(DataError, match=r"p.jsonl:3: the record has images \('prompt' image parts or 'images'\) but "
                                        "the model is text-only"):
        PromptDataset.from_records([(record, "p.jsonl:3")], tokenizer)


def test_blank_images_keep_the_prompt_and_drop_the_picture(tokenizer):
    records = [(r, f"t:{i}") for i, r in enumerate(generate_shapes(4, seed=0))]
    seen = PromptDataset.from_records(records, tokenizer, vision=VisionData(build_tiny_vl_processor(tokenizer)))
    blind = PromptDataset.from_records(records, tokenizer,
                                       vision=VisionData(build_tiny_vl_processor(tokenizer), blank=True))
    assert [i.prompt_ids for i in seen] == [i.prompt_ids for i in blind]
    assert not torch.equal(seen[0].vision["pixel_values"], seen[1].vision["pixel_values"])
    assert all(torch.equal(blind[0].vision["pixel_values"], b.vision["pixel_values"]) for b in blind)


@pytest.mark.parametrize("overrides,fields", [
    (["data=shapes"], ("data.task", "model.arch")),
    (["data.blank_images=true"], ("data.blank_images", "model.arch")),
    (["model.freeze_vision_tower=true"], ("model.freeze_vision_tower", "model.arch")),
    (["model=tiny_vl", "data=shapes", "train.backend=megatron"], ("train.backend", "model.arch")),
    # a text-only teacher would score the responses without the images the policy saw
    (["model=tiny_vl", "data=shapes", "algorithm=opd", "teacher=smollm2_135m"], ("teacher.path", "model.arch")),
    (["model=tiny_vl", "data=shapes", "train.save_hf=true", "tracking.log_model=true"],
     ("tracking.log_model", "model.arch")),
])
def test_validation_rejects_what_is_not_built(overrides, fields):
    found = _violations(overrides)
    assert [v.fields for v in found].count(fields) == 1, found


def _violations(overrides: list[str]) -> list:
    return validate(resolve(OmegaConf.to_object(compose(overrides))))


def test_a_vision_run_validates():
    assert _violations(["model=tiny_vl", "data=shapes"]) == []
    assert _violations(["model=tiny_vl", "data=shapes", "model.arch=qwen3_vl", "model.lora_rank=4"]) == []
    assert _violations(["model=tiny_vl", "data=shapes", "rollout=sglang", "rollout.sglang.server=embedded"]) == []
    assert _violations(["model=tiny_vl", "data=shapes", "data.env=grid_walk"]) == []
    # image observations over SGLang's protocol (tests/sglang/test_image_episodes.py), partial rollout included
    assert _violations(["model=tiny_vl", "data=grid_walk", "rollout=sglang", "rollout.sglang.server=embedded",
                        "train.mode=fully_async", "rollout.partial_rollout=true"]) == []
    assert _violations(["model=tiny_vl", "data=shapes", "train.pack_sequences=true"]) == []
    # PPO's critic and a vision-language teacher take the images (tests/runner/test_vision_critic_teacher.py)
    assert _violations(["model=tiny_vl", "data=shapes", "algorithm=ppo", "train.pack_sequences=true"]) == []

