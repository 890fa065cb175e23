"""gpt-oss (harmony) through the training gateway (the OpenAI endpoint an agent episode's session calls), two turns
with a tool call, driven by the official `openai` client: the engine (scripted: a random tiny model never writes
harmony) answers a call ending with `<|call|>`, then, after the tool's result, an answer ending with `<|return|>`.

The session's sample is one segment whose tokens are the prompt, the first answer's sampled tokens as sampled, the
tool message the template writes after that call (not sampled), then the second answer's sampled tokens; the mask is
1 exactly on the sampled ones, with the engine's log-probs. What the engine saw for each turn is the template's own
rendering: the first prompt is gpt-oss's template applied to the conversation; the second is the first prompt, the
call as sampled and then exactly the text the template writes after that call (the tool's `functions.get_weather`
message and the generation prompt). Nothing is re-tokenized.

Negative control: in a copy of the repo whose observation after a call is rendered for a probe call instead of the
turn's own call (`relax.agents.render.ObservationRenderer._after_call` given no names), the tool message sent was
`<|start|>functions.relax_probe_tool to=assistant...` and the test failed there. (Leaving the call turn's reasoning out
of the history changes nothing the gateway sends: it continues the sampled tokens and renders only what follows.)
"""

from __future__ import annotations

import json

import pytest

from tests.agents.templates import gpt_oss_tokenizer
from tests.openai.harmony_turns import ANSWERING, CALLING, TOOLS, USER

openai = pytest.importorskip("openai")

RESULT = "sunny, 24 C"


def test_two_harmony_turns_with_a_call_train_the_sampled_tokens_in_the_template_s_history():
    from relax.serve.openai.chat import ChatFormat
    from relax.serve.openai.gateway import Gateway
    from relax.serve.openai.service import OpenAIService
    from tests.openai.scripted import limits

    tok = gpt_oss_tokenizer()
    stops = (tok.convert_tokens_to_ids("<|return|>"), tok.convert_tokens_to_ids("<|call|>"))
    fmt = ChatFormat(tok, stops)  # data.tool_parser auto: harmony
    answers = [tok(text, add_special_tokens=False)["input_ids"] for text in (CALLING, ANSWERING)]
    seen: list[list[int]] = []

    def send(payloads: list[dict]) -> list[dict]:
        seen.append(list(payloads[0]["input_ids"]))
        ids = answers[len(seen) - 1]
        return [{"meta_info": {"output_token_logprobs": [[-0.01 * (k + 1), t, None] for k, t in enumerate(ids)],
                               "finish_reason": {"type": "stop"}, "weight_version": "5"}}]

    gw = Gateway(OpenAIService(fmt, send, model="policy", context_length=None, max_tokens=64)).start()
    try:
        session = gw.open(0, limits())
        client = openai.OpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0)
        first = client.chat.completions.create(model="m", messages=USER, tools=TOOLS).choices[0]
        assert first.finish_reason == "tool_calls" and first.message.model_extra["reasoning_content"] == (
            "Need the weather.")
        [call] = first.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        messages = USER + [first.message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
        second = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0]
        assert (second.message.content, second.finish_reason) == ("Sunny in Paris.", "stop")
        assert second.message.model_extra["reasoning_content"] == "It is sunny there."
        t = session.trajectory()
        assert session.segments == 1 and len(t.answers) == 2
    finally:
        gw.close()

    # the template's own rendering, in transformers' convention (the analysis as `thinking`, arguments a mapping)
    said = {"role": "assistant", "content": "", "thinking": "Need the weather.", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    prompt = tok.apply_chat_template(USER, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    upto_call = tok.apply_chat_template(USER + [said], tools=TOOLS, tokenize=False)
    history = tok.apply_chat_template(USER + [said, {"role": "tool", "content": RESULT}], tools=TOOLS,
                                      tokenize=False, add_generation_prompt=True)
    after_call = history[len(upto_call):]
    assert history.startswith(upto_call) and after_call.startswith("<|start|>functions.get_weather")
    assert seen[0] == tok(prompt, add_special_tokens=False)["input_ids"]
    delta = seen[1][len(seen[0]) + len(answers[0]):]
    assert seen[1][:len(seen[0]) + len(answers[0])] == seen[0] + answers[0]  # the call as sampled
    assert tok.decode(delta) == after_call

    # the sample: the sampled tokens trained with their log-probs, the tool message between them not
    assert t.prompt == seen[0]
    assert t.tokens == answers[0] + delta + answers[1]
    assert t.sampled == [1] * len(answers[0]) + [0] * len(delta) + [1] * len(answers[1])
    sampled_logprobs = [lp for lp, s in zip(t.logprobs, t.sampled, strict=True) if s]
    assert sampled_logprobs == pytest.approx([-0.01 * (k + 1) for a in answers for k in range(len(a))])
    assert t.tokens[-1] == tok.convert_tokens_to_ids("<|return|>")
