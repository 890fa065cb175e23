"""OpenAI image content parts on relax-serve with a vision-language model (tiny_vl), through the official `openai`
client over real HTTP: the chat answer is the engine's answer to the prompt the model's processor builds from the
same message and image (token ids with the image tokens expanded, as the trainer scores them; `/generate`'s parity
with the trainer: tests/sglang/test_image_data.py); another image changes it (the negative control)."""

from __future__ import annotations

import openai
import pytest
import requests

from relax.data.datasets import PromptDataset
from relax.data.images import VisionData, build_tiny_vl_processor, build_tiny_vl_tokenizer, image_data_url
from relax.data.shapes import QUESTION, blank_image, generate_shapes
from relax.serve.openai.protocol import APIError, parse_chat

SEED = 11


@pytest.fixture(scope="module")
def server(tiny_vl_server):
    return tiny_vl_server


def _message(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]}]


def test_image_parts_through_the_openai_client_are_the_processors_prompt(server):
    record = generate_shapes(1, seed=0)[0]
    image = record["prompt"][0]["content"][0]["image"]
    tokenizer = build_tiny_vl_tokenizer()
    item = next(iter(PromptDataset.from_records([(record, "shape")], tokenizer,
                                                vision=VisionData(build_tiny_vl_processor(tokenizer), wire=True))))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)

    def ask(url: str):
        return client.chat.completions.create(model="tiny_vl", messages=_message(url), max_tokens=4, seed=SEED,
                                              logprobs=True)

    answer = ask(image_data_url(image))
    assert answer.usage.prompt_tokens == len(item.prompt_ids)  # the processor's count, image tokens included
    direct = requests.post(server.url + "/generate", timeout=60, json={
        "input_ids": item.prompt_ids, "image_data": item.vision["image_data"], "return_logprob": True,
        "sampling_params": {"max_new_tokens": 4, "sampling_seed": SEED, "stop_token_ids": [tokenizer.eos_token_id],
                            "no_stop_trim": True, "skip_special_tokens": False}}).json()
    theirs = [lp[0] for lp in direct["meta_info"]["output_token_logprobs"]]
    ours = [t.logprob for t in answer.choices[0].logprobs.content]
    assert len(ours) >= 1 and ours == pytest.approx(theirs[:len(ours)], abs=1e-6)
    other = ask(image_data_url(blank_image()))  # negative control: another image, another answer
    assert [t.logprob for t in other.choices[0].logprobs.content][:1] != pytest.approx(ours[:1], abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="nothing is downloaded"):
        ask("https://example.com/a.png")


def test_image_parts_for_a_text_model_are_refused_naming_the_part():
    with pytest.raises(APIError, match="only text parts") as exc:
        parse_chat({"model": "tiny", "messages": _message("data:image/png;base64,AAAA")})
    assert exc.value.param == "messages[0].content[0]"


def test_a_streamed_answer_to_an_image_is_the_unstreamed_one(server):
    """Streamed as its tokens are drawn (relax.serve.openai.deltas: the engine shows each token of a watched row, an
    empty observation to the vision decoder): the deltas put together, the log-probs and the usage (the image tokens
    counted in the prompt) are the unstreamed answer's."""
    record = generate_shapes(1, seed=1)[0]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
    kw = dict(model="tiny_vl", messages=_message(image_data_url(record["prompt"][0]["content"][0]["image"])),
              max_tokens=6, seed=SEED, logprobs=True, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == plain.choices[0].message.content
    assert [t.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs
            for t in ch.choices[0].logprobs.content] == [t.logprob for t in plain.choices[0].logprobs.content]
    assert chunks[-1].usage == plain.usage


@pytest.mark.parametrize("stream", [False, True])
def test_an_image_the_engine_refuses_is_a_400_naming_its_message_part(server, stream):
    """The engine names a refused image by its place in `image_data` (the second here); the chat route's 400 names
    the message part it came from (the third message's second part), its param included, streamed or not."""
    good, bad = image_data_url(blank_image()), "data:image/png;base64,AAAA"
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                             {"type": "image_url", "image_url": {"url": good}}]},
                {"role": "assistant", "content": "A square."},
                {"role": "user", "content": [{"type": "text", "text": "And this one?"},
                                             {"type": "image_url", "image_url": {"url": bad}}]}]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny_vl", messages=messages, max_tokens=2, stream=stream)
    assert info.value.body["param"] == "messages[2].content[1]", info.value.body
    assert info.value.body["message"].startswith("messages[2].content[1]: "), info.value.body
    assert "image_data" not in info.value.body["message"]


def _image_url() -> str:
    return image_data_url(blank_image())


def test_top_logprobs_with_an_image_is_refused_naming_top_logprobs(server):
    """The engine gives an image prompt's sampled tokens' log-probs, not their alternatives: on the chat route the 400
    names the field the request sent (top_logprobs, its param), not SGLang's top_logprobs_num the route would have
    sent; /generate keeps SGLang's names. The control: logprobs=true alone is answered."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model="tiny_vl", messages=_message(_image_url()), max_tokens=2,
                                           logprobs=True, top_logprobs=2, stream=stream)
        assert exc.value.body["param"] == "top_logprobs", exc.value.body
        assert exc.value.body["message"].startswith("top_logprobs=2: not supported with image parts")
        assert "top_logprobs_num" not in exc.value.body["message"] and "image_data" not in exc.value.body["message"]
    answer = client.chat.completions.create(model="tiny_vl", messages=_message(_image_url()), max_tokens=2,
                                            logprobs=True)
    assert answer.choices[0].logprobs.content and answer.choices[0].logprobs.content[0].top_logprobs == []
    r = requests.post(server.url + "/generate", timeout=60, json={
        "text": "<|vision_start|><|image_pad|><|vision_end|>what colour?", "image_data": [_image_url()],
        "return_logprob": True, "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and "top_logprobs_num" in r.json()["error"]["message"], r.text


def test_an_image_on_the_responses_route_of_a_vision_model_points_to_chat_completions(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model="tiny_vl", input=[{"role": "user", "content": [
            {"type": "input_text", "text": QUESTION}, {"type": "input_image", "image_url": _image_url()}]}])
    body = exc.value.body
    assert body["param"] == "input[0].content[1]"
    assert "takes images on /v1/chat/completions, as image_url parts" in body["message"], body
    assert "text-only" not in body["message"]


def test_an_image_for_a_text_model_says_the_served_model_is_text_only(engine):
    """On both routes of a text model's server: the 400 names the part and the served model, text-only."""
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="-", max_retries=0)
    served = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=served, messages=_message(_image_url()), max_tokens=2)
    assert exc.value.body["param"] == "messages[0].content[0]"
    assert f"an image part, and the served model ({served}) is text-only" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=served, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": _image_url()}]}])
    assert exc.value.body["param"] == "input[0].content[0]"
    assert f"an image part, and the served model ({served}) is text-only" in exc.value.body["message"]
    assert "only text parts (input_text, output_text)" in exc.value.body["message"]


def test_an_image_in_a_training_sessions_call_says_sessions_take_text_only(scripted_gateway):
    """The gateway of data.openai_agent (a training session): its episodes record text turns only, so an image part
    is refused as such on both routes, whatever the model (before: the chat route's plain 'only text parts', and
    on a vision-language model the Responses route pointed to /v1/chat/completions, which refused it too)."""
    from relax.data.tokenizer import CHATML_TEMPLATE
    from relax.serve.openai.chat import ChatFormat
    from tests.agents.templates import _byte_level_tokenizer

    tok = _byte_level_tokenizer()
    tok.chat_template = CHATML_TEMPLATE
    _, _, _, client = scripted_gateway(ChatFormat(tok, (tok.eos_token_id,)), ["fine"])
    said = "an image part: a training session's calls take text parts only"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="m", messages=_message(_image_url()), max_tokens=2)
    assert exc.value.body["param"] == "messages[0].content[0]" and said in exc.value.body["message"], exc.value.body
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model="m", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": _image_url()}]}])
    assert exc.value.body["param"] == "input[0].content[0]" and said in exc.value.body["message"], exc.value.body
