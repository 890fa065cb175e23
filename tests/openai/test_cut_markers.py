"""An answer cut by max_tokens inside the opening marker of a call it was starting (`<tool_ca`, a piece of DeepSeek's
`<｜tool▁calls▁begin｜>`: markers of several tokens, here a byte-level vocabulary): the piece of the marker is no
content. A forced answer (tool_choice "required") keeps its complete calls with no content (None for the client, as
for an uncut forced answer); an `auto` answer keeps the text before the marker as its content, without the piece.
Through the official `openai` client against the training gateway (its stream is written from the finished answer)
and relax-serve's stream written as the tokens are drawn, streamed and not, for the Hermes and the DeepSeek-V3
parser, over an engine that answers a hand-written cut text (finish length).

Negative control: before this change the forced answers' content was the marker's piece ('<tool_ca' for Hermes,
'<｜tool▁call▁' for DeepSeek) beside their two calls, and the auto answers' content ended with it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agents"))
from templates import _byte_level_tokenizer  # noqa: E402

from relax.agents.parsers import (  # noqa: E402
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_SEP,
    parse_deepseek_v3,
    parse_hermes,
)
from tests.openai.scripted import CutEngine, limits  # noqa: E402

openai = pytest.importorskip("openai")

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def hermes(city: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'


def deepseek(city: str) -> str:
    return f'{DS_CALL_BEGIN}function{DS_SEP}get_weather\n```json\n{{"city": "{city}"}}\n```{DS_CALL_END}'


# (parser, tool_choice, the cut answer, the content the client gets, the cities of its calls)
CASES = {
    "hermes-forced": (parse_hermes, "required", hermes("Rome") + "\n" + hermes("Paris") + "\n<tool_ca",
                      None, ["Rome", "Paris"]),
    "hermes-auto-call": (parse_hermes, "auto", "Let me check.\n" + hermes("Rome") + "\n<tool_ca",
                         "Let me check.", ["Rome"]),
    "hermes-auto-text": (parse_hermes, "auto", "Let me check the weather <tool_ca",
                         "Let me check the weather ", []),
    "deepseek-forced": (parse_deepseek_v3, "required",
                        DS_CALLS_BEGIN + deepseek("Rome") + deepseek("Paris") + DS_CALL_BEGIN[:12],
                        None, ["Rome", "Paris"]),
    "deepseek-auto-text": (parse_deepseek_v3, "auto", "Let me check." + DS_CALLS_BEGIN[:9], "Let me check.", []),
}


def _cities(calls) -> list[str]:
    return [json.loads(c["function"]["arguments"] if isinstance(c, dict) else c.function.arguments)["city"]
            for c in calls or []]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_piece_of_a_call_marker_is_no_content(case):
    from relax.data.tokenizer import CHATML_TEMPLATE
    from relax.serve.openai.chat import ChatFormat
    from relax.serve.openai.gateway import Gateway
    from relax.serve.openai.service import OpenAIService

    parser, tool_choice, text, content, cities = CASES[case]
    tok = _byte_level_tokenizer()
    tok.chat_template = CHATML_TEMPLATE
    fmt = ChatFormat(tok, (tok.eos_token_id,), tool_parser=parser)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    engine = CutEngine(ids)
    request = dict(model="m", messages=[{"role": "user", "content": "Weather in Rome and Paris?"}], tools=WEATHER,
                   tool_choice=tool_choice, max_tokens=len(ids))
    gw = Gateway(OpenAIService(fmt, engine.send, model="m", context_length=None, max_tokens=64)).start()
    try:
        client = openai.OpenAI(base_url=gw.base_url, api_key=gw.open(0, limits()).key, max_retries=0)
        choice = client.chat.completions.create(**request).choices[0]
        assert (choice.message.content, _cities(choice.message.tool_calls)) == (content, cities)
        assert choice.finish_reason == ("length" if tool_choice == "required" or not cities else "tool_calls")
        chunks = list(client.chat.completions.create(**request, stream=True))
        streamed = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
        calls = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
        assert (streamed, _cities(calls)) == (content or "", cities)
    finally:
        gw.close()
    serve = OpenAIService(fmt, engine.send, model="m", context_length=None, stream=engine.stream)
    deltas = [c["delta"] for ch in serve.chat_stream({**request, "stream": True}) for c in ch["choices"]]
    streamed = "".join(d.get("content") or "" for d in deltas)
    assert (streamed, _cities([tc for d in deltas for tc in d.get("tool_calls") or []])) == (content or "", cities)
