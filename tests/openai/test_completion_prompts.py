"""`/v1/completions` with a list of prompts (relax-serve in this process, the official `openai` client): n choices per
prompt, prompt-major (choice i*n + k is prompt i's k-th, as OpenAI orders them), each the sample the server's own
`/generate` draws for that prompt with the documented seed of choice k."""

from __future__ import annotations

import openai
import pytest
import requests

from relax.serve.sglang.request import row_stream

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("completion_prompts")]

PROMPTS = ["The capital of France is", "1 2 3 4"]
N, SEED, MAX = 2, 7, 5


@pytest.fixture(scope="module")
def client(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def generated(engine, ids: list[int], k: int) -> str:
    """The text /generate gives `ids` with choice k's stream (every token kept: ignore_eos)."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX, "sampling_seed": row_stream(SEED, k),
                                                  "ignore_eos": True}}
    out = requests.post(engine.url + "/generate", json=body, timeout=120).json()["output_ids"]
    return engine.tokenizer.decode(out, skip_special_tokens=True)


@pytest.mark.parametrize("as_ids", [False, True])
def test_a_list_of_prompts_answers_n_choices_per_prompt_prompt_major(engine, client, as_ids):
    ids = [engine.tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    r = client.completions.create(model="tiny", prompt=ids if as_ids else PROMPTS, n=N, seed=SEED, max_tokens=MAX,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == list(range(len(PROMPTS) * N))
    texts = [c.text for c in r.choices]
    assert texts == [generated(engine, ids[i], k) for i in range(len(PROMPTS)) for k in range(N)]
    assert r.usage.prompt_tokens == sum(len(q) for q in ids)
    assert r.usage.completion_tokens == len(PROMPTS) * N * MAX
    # the control: the prompts' answers differ, so an answer in another prompt's place would fail the comparison
    assert texts[:N] != texts[N:]
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model="tiny", prompt=PROMPTS, n=N, seed=SEED, max_tokens=MAX,
                                           stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(len(texts))] == texts


@pytest.mark.parametrize("prompt", [[], ["a", ""], [["x"]], [[1, 2], []], ["a", [1, 2], 3]])
def test_a_bad_list_of_prompts_is_a_400_naming_prompt(client, prompt):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert err.value.param == "prompt"


def test_a_training_session_takes_one_prompt_per_call():
    """A session records each call as one continuation of its agent's context: a list of prompts is refused there
    before anything is generated (nothing is sent)."""
    from relax.serve.openai.protocol import APIError
    from relax.serve.openai.service import OpenAIService

    sent = []
    service = OpenAIService(None, sent.append, model="tiny", context_length=None)
    with pytest.raises(APIError) as err:
        service.completion({"model": "tiny", "prompt": ["a", "b"]}, session=object())
    assert err.value.status == 400 and err.value.param == "prompt" and sent == []
