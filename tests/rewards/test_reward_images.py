"""A vision-language policy's images reach its reward: a remote reward service (`data.reward=http://...`) and a
Python reward function's `messages` get each image the task shows as an OpenAI `image_url` part with a PNG data URL
(a dataset prompt's images and an environment's image observations alike), checked by a real loopback HTTP server
that decodes the bytes and compares them with the records' own images. Before, the parts came as bare
`{"type": "image"}` without data. The blind arm (`data.blank_images`) blanks what the policy sees, not what the reward
scores: the service still gets the task's image."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from relax.data.datasets import PromptDataset
from relax.data.grid_walk import QUESTION, generate_grid_walk, render_grid
from relax.data.images import VisionData, build_tiny_vl_processor, build_tiny_vl_tokenizer
from relax.data.shapes import generate_shapes
from relax.rewards.registry import score_responses
from relax.rewards.remote import RemoteReward
from relax.runner.rollout_driver.scoring import reward_contexts

from .reward_models import recording_server


def pixels(url: str) -> bytes:
    """The RGB pixels of a PNG data URL."""
    head, data = url.split(",", 1)
    assert head == "data:image/png;base64"
    return Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB").tobytes()


def urls(messages: list[dict]) -> list[str]:
    """The data URLs of the image parts, in order; a bare image part (no data) fails."""
    found = []
    for m in messages:
        for part in m["content"] if isinstance(m["content"], list) else []:
            assert part["type"] in ("text", "image_url"), part
            if part["type"] == "image_url":
                found.append(part["image_url"]["url"])
    return found


@pytest.fixture()
def service():
    """A loopback reward service: rewards 1.0 for each item, every request body kept."""
    with recording_server(lambda body: {"rewards": [1.0] * len(body["items"])}) as (url, bodies):
        yield f"{url}/score", bodies


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_vl_tokenizer()


@pytest.mark.parametrize("blank", [False, True], ids=["sighted", "blind"])
def test_a_reward_service_and_a_reward_function_get_the_prompts_images(service, tokenizer, blank):
    url, bodies = service
    records = generate_shapes(2, seed=0)
    vision = VisionData(build_tiny_vl_processor(tokenizer), blank=blank)
    items = list(PromptDataset.from_records([(r, "shapes") for r in records], tokenizer, vision=vision))
    contexts = reward_contexts(items, 2)
    rewards, errors, _ = RemoteReward(url).score_batch(["red", "blue"] * 2, [i.label for i in items for _ in "ab"],
                                                       contexts=contexts)
    assert rewards == [1.0] * 4, errors
    sent = [item for body in bodies for item in body["items"]]
    assert len(sent) == 4
    for k, item in enumerate(sent):
        record = records[k // 2]
        found = urls(item["messages"])
        # the task's image, bit for bit (PNG is lossless), in the blind arm too
        assert [pixels(u) for u in found] == [record["prompt"][0]["content"][0]["image"].convert("RGB").tobytes()]
        assert item["messages"][0]["content"][1] == {"type": "text", "text": record["prompt"][0]["content"][1]["text"]}
        assert item["prompt"].count("<|image_pad|>") == 1  # the prompt text keeps the template's placeholder
    # a Python reward function's messages are the same
    seen = []

    def fn(response, label, messages):
        seen.append([pixels(u) for u in urls(messages)])
        return 0.0

    scores = score_responses(fn, ["red"] * 4, ["red"] * 4, contexts=contexts)
    assert not any(scores.failed), scores.first_error
    assert seen == [[records[k // 2]["prompt"][0]["content"][0]["image"].convert("RGB").tobytes()] for k in range(4)]


def test_an_episodes_image_observations_reach_the_reward_service(service, tokenizer):
    url, bodies = service
    records = generate_grid_walk(1, seed=0)
    items = list(PromptDataset.from_records([(records[0], "grid")], tokenizer,
                                            vision=VisionData(build_tiny_vl_processor(tokenizer))))
    after = render_grid(5, 8)  # what the environment answered the move with
    episode = {"actions": ["4", "2"], "observations": [[{"role": "user", "content": [
        {"type": "image", "image": after}, {"type": "text", "text": QUESTION}]}]]}
    rewards, errors, _ = RemoteReward(url).score_batch(["2"], [items[0].label],
                                                       contexts=reward_contexts(items, 1, [episode]))
    assert rewards == [1.0], errors
    messages = bodies[0]["items"][0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert [pixels(u) for u in urls(messages)] == [records[0]["prompt"][0]["content"][0]["image"].tobytes(),
                                                   after.tobytes()]


def test_only_a_reward_that_reads_messages_has_the_images_encoded():
    """The data URLs are made for a reward that reads `messages` (a service; a function with a `messages` or
    `**kwargs` parameter, alone or in a list), not each step for one of the response and label alone."""
    from relax.rewards.combined import RewardList
    from relax.runner.rollout_driver.scoring import reads_messages

    def plain(response, label):
        return 0.0

    def chat(response, label, messages):
        return 0.0

    def rest(response, label, **kwargs):
        return 0.0

    assert not reads_messages(plain)
    assert reads_messages(chat) and reads_messages(rest) and reads_messages(RemoteReward("http://127.0.0.1:9/x"))
    assert reads_messages(RewardList(["a", "b"], ["a", "b"], [plain, chat]))
    assert not reads_messages(RewardList(["a"], ["a"], [plain]))


def test_images_that_cannot_be_given_to_the_reward_stop_the_run_in_one_line(tokenizer):
    """A prompt item whose images are pixel values only (a checkpoint written before image references) cannot give a
    reward that reads `messages` its images: the run stops with a RunError naming why (before: a ValueError traceback
    out of the driver). Control: a reward of the response and label alone scores it."""
    from types import SimpleNamespace

    import torch

    from relax.config import load_config
    from relax.runner.errors import RunError
    from relax.runner.rollout_driver.scoring import score

    def chat(response, label, messages):
        return 1.0

    def plain(response, label):
        return 1.0

    cfg = load_config(["data.reward_timeout_s=null"])
    item = SimpleNamespace(prompt_text="q", label="a", fields={}, images={"pixel_values": torch.zeros(4, 8)},
                           messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]}])
    samples = SimpleNamespace(episodes=None, response_ids=torch.tensor([[5, 6]]), response_mask=torch.ones(1, 2),
                              finish_reasons=None)
    with pytest.raises(RunError, match=r"the reward reads the conversation \(messages\), whose images cannot be given "
                                       r"to it: .*kept only as pixel values"):
        score(cfg, tokenizer, chat, samples, [item], 1)
    assert score(cfg, tokenizer, plain, samples, [item], 1).rewards == [1.0]
