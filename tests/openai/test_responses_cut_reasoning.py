"""The Responses API: an answer cut by max_output_tokens inside its reasoning (a Qwen3 <think> block never closed)
is the reasoning item alone, status incomplete, with no message item of empty text after it, streamed (the items the
events add and finish) and not, as OpenAI's reasoning models answer then. An answer cut after its reasoning, in its
text, still has its message (the control), and so does one whose log-probs were asked for (the message carries
them).

Through the official `openai` client against the training gateway over an engine answering a hand-written cut text
in the Qwen3 fixture's vocabulary (finish length).

Negative control: before this change the output was ['reasoning', 'message'] (the message's text ''), and the stream
added that message item too.
"""

from __future__ import annotations

import pytest

from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.gateway import Gateway
from relax.serve.openai.service import OpenAIService
from tests.agents.templates import family_tokenizer
from tests.openai.scripted import CutEngine, limits

openai = pytest.importorskip("openai")


@pytest.mark.parametrize("text, items, output_text", [
    ("<think>\nThe user asks about the weather in", ["reasoning"], ""),
    ("<think>\nThe weather.\n</think>\n\nIt is sunny in", ["reasoning", "message"], "It is sunny in"),
], ids=["cut-in-reasoning", "cut-in-text"])
def test_an_answer_cut_inside_its_reasoning_has_no_message_item(text, items, output_text):
    tok = family_tokenizer("qwen3")
    fmt = ChatFormat(tok, (tok.convert_tokens_to_ids("<|im_end|>"),))
    ids = fmt.encode(text)
    engine = CutEngine(ids)
    gw = Gateway(OpenAIService(fmt, engine.send, model="m", context_length=None, max_tokens=64)).start()
    try:
        client = openai.OpenAI(base_url=gw.base_url, api_key=gw.open(0, limits()).key, max_retries=0)
        r = client.responses.create(model="m", input="Weather in Paris?", max_output_tokens=len(ids))
        assert (r.status, [i.type for i in r.output], r.output_text) == ("incomplete", items, output_text)
        events = list(client.responses.create(model="m", input="Weather in Paris?", max_output_tokens=len(ids),
                                              stream=True))
        added = [e.item.type for e in events if e.type == "response.output_item.added"]
        finished = [e.item.type for e in events if e.type == "response.output_item.done"]
        final = events[-1]
        assert (added, finished, final.type) == (items, items, "response.incomplete")
        assert [i.type for i in final.response.output] == items
        # with the log-probs asked for, the message of no text still carries every sampled token's log-prob
        r = client.responses.create(model="m", input="Weather in Paris?", max_output_tokens=len(ids),
                                    include=["message.output_text.logprobs"])
        assert [i.type for i in r.output] == ["reasoning", "message"]
        assert len(r.output[-1].content[0].logprobs) == len(ids)
    finally:
        gw.close()
