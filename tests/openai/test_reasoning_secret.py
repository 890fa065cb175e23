"""The key of the Responses reasoning items' `encrypted_content` derived from a configured secret
(`$RELAX_SERVE_REASONING_SECRET`, or the file `$RELAX_SERVE_REASONING_SECRET_FILE` names): servers given the same
secret (several behind a router, or one restarted) read each other's reasoning items, a stateless client's follow-up
answering as if the reasoning came back to the server that wrote it; a server with another secret, or with none (its
own random key, the default), answers a clear 400 naming the item's encrypted_content. Through the official `openai`
client against training gateways over a scripted reasoning engine (each gateway makes its seal when it is made, as
relax-serve does at its first Responses call). The secret itself never appears in an answer or a repr.

Negative control: with `Responses` making `ReasoningSeal()` (a random key per server, the old code) the follow-up
on the second server with the same secret was a 400 (`test_servers_with_one_secret_read_each_other_s_reasoning`
failed with BadRequestError: "not reasoning this server process wrote").
"""

from __future__ import annotations

import pytest

from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.gateway import Gateway
from relax.serve.openai.protocol import APIError
from relax.serve.openai.responses import REASONING_SECRET_ENV, REASONING_SECRET_FILE_ENV, ReasoningSeal
from relax.serve.openai.service import OpenAIService
from tests.agents.templates import family_tokenizer
from tests.openai.scripted import Script, limits

openai = pytest.importorskip("openai")

ENCRYPTED = "reasoning.encrypted_content"
SECRET = "correct horse battery staple"


@pytest.fixture
def servers(monkeypatch):
    """make(secret) -> the official client of a new gateway over a reasoning engine (Qwen3's template), made with
    `$RELAX_SERVE_REASONING_SECRET` set to `secret` (None: unset), and the engine's script."""
    made = []
    tok = family_tokenizer("qwen3")
    fmt = ChatFormat(tok, (tok.eos_token_id,))

    def make(secret):
        if secret is None:
            monkeypatch.delenv(REASONING_SECRET_ENV, raising=False)
        else:
            monkeypatch.setenv(REASONING_SECRET_ENV, secret)
        script = Script(fmt, ["<think>\nadd them\n</think>\n\n7"])
        gw = Gateway(OpenAIService(fmt, script, model="policy", context_length=None, max_tokens=32)).start()
        made.append(gw)
        session = gw.open(0, limits(max_calls=8))
        return openai.OpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0), script

    monkeypatch.delenv(REASONING_SECRET_FILE_ENV, raising=False)
    yield make, fmt
    for gw in made:
        gw.close()


def first(client) -> dict:
    """The reasoning item (as the client dumps it, without its text: as Codex keeps it) of a stateless call."""
    r = client.responses.create(model="m", input="What is 3 + 4?", store=False, include=[ENCRYPTED])
    item = r.output[0].model_dump(exclude_none=True)
    assert item["type"] == "reasoning" and item["content"][0]["text"] == "add them"
    return {"type": "reasoning", "id": item["id"], "summary": [], "encrypted_content": item["encrypted_content"]}


TOOL = {"type": "function", "name": "calculator", "parameters": {"type": "object", "properties": {
    "expression": {"type": "string"}}}}
CALL = {"type": "function_call", "call_id": "call_1", "name": "calculator", "arguments": '{"expression": "3 + 4"}'}


def follow_up(client, item: dict):
    """The tool loop's next call with the reasoning `item` before its call (Qwen3's template renders the reasoning of
    an assistant turn after the last user message)."""
    return client.responses.create(model="m", store=False, include=[ENCRYPTED], tools=[TOOL], input=[
        {"role": "user", "content": "What is 3 + 4?"}, item, CALL,
        {"type": "function_call_output", "call_id": "call_1", "output": "7"}])


def test_servers_with_one_secret_read_each_other_s_reasoning(servers):
    make, fmt = servers
    (a, script_a), (b, script_b) = make(SECRET), make(SECRET)
    item = first(a)
    follow_up(b, item)  # another server (or the same one restarted) with the same secret reads it
    follow_up(a, item)  # and the one that wrote it, to the same prompt
    assert script_b.calls[-1][0]["input_ids"] == script_a.calls[-1][0]["input_ids"]
    assert "add them" in fmt.decode(script_b.calls[-1][0]["input_ids"])  # the reasoning is in the prompt
    assert follow_up(a, first(b)).output_text == "7"  # both ways


@pytest.mark.parametrize("other", ["another secret", None], ids=["another-secret", "no-secret"])
def test_another_secret_or_none_is_a_clear_400(servers, other):
    make, _ = servers
    (a, _), (c, _) = make(SECRET), make(other)
    item = first(a)
    with pytest.raises(openai.BadRequestError) as info:
        follow_up(c, item)
    body = info.value.body
    assert body["param"] == "input[1].encrypted_content"
    assert REASONING_SECRET_ENV in body["message"] and SECRET not in body["message"]
    assert ("another key" in body["message"]) == (other is not None)
    with pytest.raises(openai.BadRequestError):  # and the other way
        follow_up(a, first(c))


def test_the_secret_from_a_file_is_the_same_key(servers, tmp_path, monkeypatch):
    make, _ = servers
    item = first(make(SECRET)[0])
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")  # the trailing newline an editor or `echo` writes is not part of it
    monkeypatch.setenv(REASONING_SECRET_FILE_ENV, str(path))
    monkeypatch.delenv(REASONING_SECRET_ENV)
    client, _ = make(None)
    assert follow_up(client, item).output_text == "7"


@pytest.mark.parametrize("env, words", [
    ({REASONING_SECRET_ENV: "  "}, f"${REASONING_SECRET_ENV} is empty"),
    ({REASONING_SECRET_FILE_ENV: "/nonexistent/secret"}, "/nonexistent/secret: cannot be read"),
    ({REASONING_SECRET_ENV: SECRET, REASONING_SECRET_FILE_ENV: "/x"}, "give one"),
])
def test_a_misconfigured_secret_is_a_server_error_naming_the_variable(env, words):
    with pytest.raises(APIError) as info:
        ReasoningSeal.from_environment(env)
    assert words in str(info.value) and info.value.status == 500 and SECRET not in str(info.value)
    assert SECRET not in repr(ReasoningSeal.from_environment({REASONING_SECRET_ENV: SECRET}))
