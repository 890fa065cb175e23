"""A reward model beside a vision-language policy: a reward model on its own role reads text only, so one that reads
the prompt (a classifier; an embedded judge whose template names {prompt}) would score the responses without the
prompts' images; it is refused before anything starts, as a text-only distillation teacher is. A judge of the response
alone is allowed (the control); a judge at a URL is sent the images (tests/rewards/test_judge_images.py). And where a
reward model reads a message whose content is a list of parts, it reads their text (an image part as
IMAGE_PLACEHOLDER), never the Python repr of the parts (the reviewer's case)."""

from __future__ import annotations

from types import SimpleNamespace

from relax.data.shapes import generate_shapes
from relax.data.tokenizer import build_tiny_tokenizer
from relax.models.reward_model import IMAGE_PLACEHOLDER, conversation_text, prompt_text
from relax.runner.reward_model import prompt_words

from .reward_models import refusals

VL = ["model=tiny_vl", "data=shapes"]


def test_a_classifier_beside_a_vision_language_policy_is_refused():
    found = [m for m in refusals("reward_model=classifier", "reward_model.path=/rm", *VL) if "images" in m]
    assert len(found) == 1, found
    assert found[0].startswith("reward_model=classifier (reward_model.path=/rm) reads text only: it would score the "
                               "responses without the prompts' images that model=tiny_vl")
    # the control: the same reward model beside a text policy is accepted
    assert refusals("reward_model=classifier", "reward_model.path=/rm") == []


def test_a_judge_reading_the_prompt_beside_a_vision_language_policy_is_refused_one_of_the_response_alone_is_not():
    judge = ["reward_model=judge", "reward_model.path=/judge"]
    found = refusals(*judge, "reward_model.template='{prompt} answered: {response}'", *VL)
    assert len(found) == 1 and found[0].startswith("reward_model.template names {prompt}, but the judge on "
                                                   "reward_model.engine=embedded reads text only: it would judge the "
                                                   "responses without the prompts' images")
    assert refusals(*judge, "reward_model.template='is {response} the colour {label}?'", *VL) == []
    assert refusals(*judge, "reward_model.template='{prompt} answered: {response}'") == []


def test_image_parts_are_read_as_text_with_a_placeholder_never_as_a_repr():
    record = generate_shapes(1, 0)[0]  # [{"role": "user", "content": [image part, text part]}]
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    question = record["prompt"][0]["content"][1]["text"]
    text = conversation_text(tokenizer, record["prompt"], "red")
    assert text == f"user: {IMAGE_PLACEHOLDER}{question}\nassistant: red\n"
    assert prompt_text(record["prompt"]) == IMAGE_PLACEHOLDER + question
    item = SimpleNamespace(messages=record["prompt"], prompt_text="(unused)")
    assert prompt_words(item) == IMAGE_PLACEHOLDER + question
    # text parts alone read as the text they hold (a prompt given as parts beside a text policy)
    parts = [{"role": "user", "content": [{"type": "text", "text": "repeat "}, {"type": "text", "text": "7"}]}]
    assert conversation_text(tokenizer, parts, "7") == "user: repeat 7\nassistant: 7\n"
