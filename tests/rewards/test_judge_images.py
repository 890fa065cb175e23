"""A judge behind an OpenAI-compatible API (reward_model=judge reward_model.engine=openai) beside a vision-language
policy, whose template names {prompt}, is sent the prompt's images as a reward service is: the user message's content
is OpenAI parts, the template's text with each image of the prompt an `image_url` part holding a PNG data URL of the
task's image where the prompt has it (the blind arm's too: `data.blank_images` blanks what the policy sees, not what
is scored). Checked by a real loopback chat-completions server that records each request and decodes the images,
against the records' own images and, for the text, against the question the text path writes (`judge_question` with
the prompt read as `prompt_words`). The control: a text policy's judge gets the plain string as before. The embedded
judge (a text-only causal LM on its own role) is still refused before start, naming the options.

Negative control, the code before: the configuration was refused before start ("the judge reads text only"), and a
judge at a URL was never sent an image (its question a string with `[image]` for each)."""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace

import pytest
from PIL import Image

from relax.config import load_config
from relax.data.datasets import PromptDataset, PromptItem
from relax.data.images import VisionData, build_tiny_vl_processor, build_tiny_vl_tokenizer
from relax.data.shapes import generate_shapes
from relax.data.tokenizer import build_tiny_tokenizer
from relax.models.reward_model import IMAGE_PLACEHOLDER
from relax.rewards.judge import judge_question
from relax.runner.errors import RunError
from relax.runner.reward_model import make_scorer, prompt_words
from relax.runner.rollout_driver.scoring import Scorer

from .reward_models import batch, recording_server, refusals

TEMPLATE = "Q: {prompt} A: {response} (expected {label}). Score 0-9."


@pytest.fixture()
def judge():
    """A loopback chat-completions server answering "7"; every request body kept."""
    answer = {"choices": [{"message": {"role": "assistant", "content": "7"}, "finish_reason": "stop"}]}
    with recording_server(lambda body: answer) as (url, bodies):
        yield f"{url}/v1", bodies


def config(url: str, *extra: str):
    return load_config(["reward_model=judge", "reward_model.engine=openai", f"reward_model.url={url}",
                        f"reward_model.template='{TEMPLATE}'", "data.reward=none", "rollout.n_samples_per_prompt=2",
                        "tracking.enabled=false", *extra])


def pixels(url: str) -> bytes:
    head, data = url.split(",", 1)
    assert head == "data:image/png;base64"
    return Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB").tobytes()


def score(cfg, tokenizer, items, responses):
    scorer = make_scorer(cfg, None)
    try:
        return Scorer(cfg, tokenizer, None, scorer).score(items, batch(tokenizer, responses))
    finally:
        scorer.close()


@pytest.mark.parametrize("blank", [False, True], ids=["sighted", "blind"])
def test_a_judge_at_a_url_is_sent_the_prompts_images(judge, blank):
    url, bodies = judge
    cfg = config(url, "model=tiny_vl", "data=shapes", f"data.blank_images={str(blank).lower()}")
    tokenizer = build_tiny_vl_tokenizer()
    records = generate_shapes(2, seed=0)
    vision = VisionData(build_tiny_vl_processor(tokenizer), blank=blank)
    items = list(PromptDataset.from_records([(r, "shapes") for r in records], tokenizer, vision=vision))
    responses = ["red", "blue", "green", "red"]
    scores = score(cfg, tokenizer, items, responses)
    assert scores.failed == [False] * 4 and scores.rewards == [7.0] * 4, scores.first_error
    assert len(bodies) == 4
    sent = {}  # the response each request judged -> its content
    for body in bodies:
        (message,) = body["messages"]
        assert message["role"] == "user" and isinstance(message["content"], list), message
        text = "".join(p["text"] if p["type"] == "text" else IMAGE_PLACEHOLDER for p in message["content"])
        sent[text] = message["content"]
    for k, response in enumerate(responses):
        item, record = items[k // 2], records[k // 2]
        # the text is the text path's question, the image where the prompt has it
        content = sent[judge_question(TEMPLATE, prompt_words(item), response, item.label)]
        assert [p["type"] for p in content] == ["text", "image_url", "text"], content
        assert content[0]["text"] == "Q: " and content[2]["text"].endswith(f" A: {response} (expected "
                                                                           f"{item.label}). Score 0-9.")
        # the task's image, bit for bit (PNG is lossless), in the blind arm too
        assert pixels(content[1]["image_url"]["url"]) == record["prompt"][0]["content"][0]["image"].convert(
            "RGB").tobytes()


def test_control_a_text_policys_judge_gets_the_question_as_text(judge):
    url, bodies = judge
    tokenizer = build_tiny_tokenizer()
    items = [PromptItem([1], "7", "repeat 7", 0)]
    scores = score(config(url), tokenizer, items, ["7", "8"])
    assert scores.rewards == [7.0, 7.0]
    assert sorted(b["messages"][0]["content"] for b in bodies) == [
        judge_question(TEMPLATE, "repeat 7", r, "7") for r in ("7", "8")]


def test_images_that_cannot_be_given_to_the_judge_stop_the_run_in_one_line(judge):
    url, bodies = judge
    cfg = config(url, "model=tiny_vl", "data=shapes")
    # an item whose images are kept as pixel values only (a checkpoint written before image references)
    item = SimpleNamespace(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}],
                           images={"pixel_values": None}, label="red", prompt_text="?")
    scorer = make_scorer(cfg, None)
    try:
        with pytest.raises(RunError, match=r"reward_model.template names \{prompt\}, whose images cannot be given "
                                           "to the judge: .*pixel values"):
            scorer.score([item], ["red"])
    finally:
        scorer.close()
    assert bodies == []


def test_the_embedded_judge_reading_the_prompt_is_refused_naming_the_options():
    vl = ["model=tiny_vl", "data=shapes", "reward_model=judge", f"reward_model.template='{TEMPLATE}'"]
    (found,) = refusals(*vl, "reward_model.path=/judge")
    assert found.startswith("reward_model.template names {prompt}, but the judge on reward_model.engine=embedded "
                            "reads text only: it would judge the responses without the prompts' images"), found
    assert "reward_model.engine=openai" in found and "leave {prompt} out" in found and "data.reward" in found
    at_url = [*vl, "reward_model.engine=openai", "reward_model.url=http://127.0.0.1:9/v1"]
    assert refusals(*at_url) == []
    # a conversion of {prompt} cannot apply to the image parts sent in its place
    (found,) = refusals(*at_url[:-3], "reward_model.template='{prompt!r} A: {response}'", *at_url[-2:])
    assert found.startswith("reward_model.template formats {prompt} (a conversion or format spec)"), found
    assert refusals("reward_model=judge", "reward_model.engine=openai", "reward_model.url=http://127.0.0.1:9/v1",
                    "reward_model.template='{prompt!r} A: {response}'") == []  # a text policy: text, formatted
