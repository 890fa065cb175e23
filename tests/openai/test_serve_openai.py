"""`relax-serve`'s OpenAI endpoints, driven by the official `openai` client over real HTTP: each answer checked against
what is known independently of the API layer: the chat template applied locally, the server's own `/generate` with
the documented seed of each choice, the trainer's log-probs of the tokens, a brute-force top-k."""

from __future__ import annotations

import openai
import pytest
import requests
import torch
from sglang.test_conformance import every_next_logprob, logps, relax_serve, trainer_logprobs

from relax.serve.sglang.request import row_stream

# an engine server, real HTTP; its tests share the module-scoped server: one xdist worker runs them in a row
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serve_openai")]

OVERRIDES = ["model=tiny", "model.dtype=float32", "seed=3"]
USER = [{"role": "user", "content": "What is 3 + 4?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """relax-serve (the CLI, in its own process) with the tiny model, and the model and tokenizer built here."""
    from relax.config import load_config
    from relax.data.tokenizer import load_tokenizer
    from relax.models.hf import build_model

    cfg = load_config(OVERRIDES)
    tok = load_tokenizer(cfg.model)
    model = build_model(cfg.model, len(tok), tok.pad_token_id, seed=cfg.seed).eval()
    with relax_serve(tmp_path_factory.mktemp("serve"), OVERRIDES) as url:
        yield url, model, tok


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def template(tok, messages) -> list[int]:
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def native(url: str, prompt: list[int], seed: int, k: int, **sp) -> dict:
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"sampling_seed": row_stream(seed, k), "no_stop_trim": True, **sp}}
    return requests.post(url + "/generate", json=body, timeout=120).json()


def test_chat_choices_are_the_engines_seeded_samples_with_the_trainers_logprobs(served, client):
    """n=3 with a seed: choice k is /generate on the locally templated prompt with the stream row_stream(seed, k)
    (so a repeat gives the same answers), and its log-probs are the trainer's at the temperature."""
    url, model, tok = served
    r = client.chat.completions.create(model="tiny", messages=USER, n=3, seed=11, max_tokens=6, temperature=0.7,
                                       logprobs=True)
    prompt = template(tok, USER)
    assert r.object == "chat.completion" and r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    for k, choice in enumerate(r.choices):
        ref = native(url, prompt, 11, k, max_new_tokens=6, temperature=0.7)
        ids = ref["output_ids"]
        assert choice.message.role == "assistant" and choice.index == k
        ended = choice.finish_reason == "stop"
        assert ended == (ref["meta_info"]["finish_reason"]["type"] == "stop")
        assert choice.message.content == tok.decode(ids[:-1] if ended else ids, skip_special_tokens=True)
        # the n=3 request runs its choices as one batch, /generate one row: float32 rounds the two matmul shapes
        # apart by up to one step (4.8e-7 at these log-probs' size, measured), too close to the 1e-6 this compared
        # at; 1e-5 still holds them ten times closer than the trainer's log-probs below
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(logps(ref), abs=1e-5)
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(
            trainer_logprobs(model, prompt, ids, 0.7).tolist(), abs=1e-4)
        assert [t.token for t in choice.logprobs.content] == [tok.decode([i]) for i in ids]
    assert len({c.message.content for c in r.choices}) > 1
    again = client.chat.completions.create(model="tiny", messages=USER, n=3, seed=11, max_tokens=6, temperature=0.7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_top_logprobs_are_the_likeliest_tokens(served, client):
    url, model, tok = served
    r = client.chat.completions.create(model="tiny", messages=USER, seed=2, max_tokens=3, logprobs=True,
                                       top_logprobs=2)
    prompt = template(tok, USER)
    ids = native(url, prompt, 2, 0, max_new_tokens=3)["output_ids"]
    for i, t in enumerate(r.choices[0].logprobs.content):
        every = torch.tensor(every_next_logprob(model, prompt + ids[:i], len(tok), 1.0))
        best = every.topk(2)
        assert [a.token for a in t.top_logprobs] == [tok.decode([int(v)]) for v in best.indices]
        assert [a.logprob for a in t.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)


def test_streaming_sends_the_same_answer_as_events_ending_with_done(served, client):
    kw = dict(model="tiny", messages=USER, seed=5, max_tokens=8)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    raw = requests.post(served[0] + "/v1/chat/completions", json={**kw, "stream": True}, timeout=60)
    assert raw.headers["Content-Type"] == "text/event-stream" and raw.text.endswith("data: [DONE]\n\n")


def test_a_stop_sequence_ends_the_answer_before_it(served, client):
    url, _, tok = served
    free = client.chat.completions.create(model="tiny", messages=USER, seed=7, max_tokens=24, temperature=1.0)
    text = free.choices[0].message.content
    stop = next(ch for ch in text[1:] if not ch.isspace())  # a character the free answer has after its first
    cut = client.chat.completions.create(model="tiny", messages=USER, seed=7, max_tokens=24, stop=[stop])
    assert cut.choices[0].message.content == text[:text.index(stop, 1) if text[0] == stop else text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_completions_with_a_text_or_token_prompt(served, client):
    url, model, tok = served
    r = client.completions.create(model="tiny", prompt="What is", max_tokens=4, seed=1, logprobs=2)
    ids = tok("What is", add_special_tokens=False)["input_ids"]
    ref = native(url, ids, 1, 0, max_new_tokens=4)
    assert r.object == "text_completion" and r.usage.prompt_tokens == len(ids)
    assert r.choices[0].logprobs.token_logprobs == pytest.approx(logps(ref), abs=1e-6)
    assert all(len(alts) == 2 for alts in r.choices[0].logprobs.top_logprobs)
    same = client.completions.create(model="tiny", prompt=ids, max_tokens=4, seed=1)
    assert same.choices[0].text == r.choices[0].text


def test_tools_are_offered_in_the_prompt(served, client):
    tool = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
    plain = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    offered = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, tools=[tool])
    refused = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, tools=[tool],
                                             tool_choice="none")
    assert offered.usage.prompt_tokens > plain.usage.prompt_tokens == refused.usage.prompt_tokens


@pytest.mark.parametrize("kw, param", [
    (dict(frequency_penalty=1.0), "frequency_penalty"), (dict(n=0), "n"), (dict(temperature=3), "temperature"),
    (dict(tool_choice={"type": "function", "function": {"name": "g"}},
          tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice"),
    (dict(top_logprobs=2), "top_logprobs"), (dict(max_tokens=10**6), "max_tokens"),
])
def test_bad_requests_get_an_openai_shaped_400(client, kw, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=USER, **kw)
    assert info.value.status_code == 400
    assert info.value.body["type"] == "invalid_request_error" and info.value.body["param"] == param


def test_malformed_bodies_and_unknown_paths_are_refused(served):
    url = served[0]
    r = requests.post(url + "/v1/chat/completions", data=b"{not json", timeout=10)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = requests.post(url + "/v1/chat/completions", json={"model": "tiny"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert requests.post(url + "/v1/embeddings", json={}, timeout=10).status_code == 404
    models = openai.OpenAI(base_url=url + "/v1", api_key="x").models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_beyond_loopback_every_endpoint_but_health_and_info_needs_the_servers_key():
    """With a key, a request without it (or with another) is a 401 and one with it is answered, on the OpenAI
    endpoints and SGLang's own alike (the ones that generate, load weights, join a weight-update group, pause); bound to
    every address without a key, they refuse (403). Health alone answers either way: information (/get_model_info,
    /get_server_info) needs the key too, as on SGLang."""
    from relax.config import load_config
    from relax.serve.sglang.server import EmbeddedServer

    cfg = load_config(OVERRIDES)
    generate = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    guarded = [("/generate", generate), ("/pause_generation", {"mode": "abort"}), ("/continue_generation", {}),
               ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/etc"}),
               ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2}),
               ("/update_weights_from_disk", {"model_path": "/etc"})]
    for host, key in (("127.0.0.1", "s3cret"), ("0.0.0.0", None)):
        server = EmbeddedServer(cfg, host=host, port=0, threads=1, api_key=key)
        server.start()
        try:
            server.wait_ready(60)
            base = f"http://127.0.0.1:{server.port}"
            url = base + "/v1"
            assert requests.get(base + "/health", timeout=60).status_code == 200
            for path in ("/get_model_info", "/get_server_info"):  # information too, as SGLang: health alone is open
                assert requests.get(base + path, timeout=60).status_code == (401 if key else 403), path
            for path, body in guarded:
                r = requests.post(base + path, json=body, timeout=60)
                assert r.status_code == (401 if key else 403), (path, r.status_code, r.text)
            if key is not None:
                for wrong in ("other", "-"):
                    with pytest.raises(openai.AuthenticationError):
                        openai.OpenAI(base_url=url, api_key=wrong, max_retries=0).chat.completions.create(
                            model="tiny", messages=USER, max_tokens=2)
                    assert requests.post(base + "/generate", json=generate, timeout=60,
                                         headers={"Authorization": f"Bearer {wrong}"}).status_code == 401
                ok = openai.OpenAI(base_url=url, api_key=key, max_retries=0).completions.create(
                    model="tiny", prompt="What is", max_tokens=2)
                assert ok.choices[0].finish_reason in ("stop", "length")
                assert requests.post(base + "/generate", json=generate, timeout=60,
                                     headers={"Authorization": f"Bearer {key}"}).status_code == 200
            else:
                with pytest.raises(openai.PermissionDeniedError, match="--api-key"):
                    openai.OpenAI(base_url=url, api_key="-", max_retries=0).chat.completions.create(
                        model="tiny", messages=USER, max_tokens=2)
        finally:
            server.shutdown()
