"""`relax.serve.openai.deltas.TextDeltas`, token by token, against the unstreamed answer: on a byte-level vocabulary
(every character split into its bytes, so `<think>`, `</think>`, `<tool_call>`, a stop string and a multi-byte
character all arrive in pieces), after every token what was sent is the start of the finished answer's reasoning and
content (`OpenAIService._chat_choice`, the code that answers without stream), never a marker, never text at or after
a stop string; at the end the deltas put together are that answer, and the log-probs of the chunks are every token's,
once, in order."""

from __future__ import annotations

import pytest

from relax.agents.parsers import get_parser
from relax.batch import FinishReason
from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.protocol import Params
from relax.serve.openai.service import OpenAIService, Sampled
from tests.agents.templates import QWEN3, _byte_level_tokenizer

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
ANSWERS = [
    "Hello there, plain text é ü 漢字",
    "<think>\nlet me think\n</think>\n\nThe answer is 7.",
    "  <think>two blanks before</think>after",
    "<thinking> is not a block",
    "<think>never closed, cut at the limit </thi",
    f"I will call it. {CALL}",
    f"{CALL}\nand text after the call",
    "<think>\nfirst\n</think>\n\n" + CALL,
    "<tool_call>{bad json}</tool_call> stays text",
    "Text then a half marker <tool_ca",
    "  starts with blank, then " + CALL,
    "a < b and <tool_call is not closed",
]
STOPS = [[], ["STOP"], ["is 7", "zz"], ["</think>"], ["call"]]


@pytest.fixture(scope="module")
def service() -> OpenAIService:
    tok = _byte_level_tokenizer()
    tok.chat_template = QWEN3  # a template with <think> blocks: answers may open one
    fmt = ChatFormat(tok, (tok.eos_token_id,), get_parser("hermes", tok))
    return OpenAIService(fmt, lambda payloads: [], model="m", context_length=None)


def check(service: OpenAIService, text: str, p: Params, prompt: list[int]) -> str:
    """Returns the content sent before the answer finished."""
    fmt = service.fmt
    tokens = fmt.encode(text) + [fmt.tokenizer.eos_token_id]
    logps = [-(k + 1) / 100 for k in range(len(tokens))]  # one distinct value per token
    final = service._chat_choice(Sampled(tokens, logps, FinishReason.STOP, 0), prompt, p)
    reasoning, content = final.reasoning or "", final.text
    splitter = service._deltas(p, prompt, chat=True)
    sent = {"reasoning_content": "", "content": ""}
    lps = []
    for k in range(1, len(final.tokens) + 1):
        for d in splitter.feed(final.tokens[:k], logps[:k]):
            sent[d.field] += d.text
            lps += d.logprobs or []
        where = f"{text!r} stop={p.stop} tools={bool(p.tools)} after {k} tokens: {sent}"
        assert reasoning.startswith(sent["reasoning_content"]) and content.startswith(sent["content"]), where
        for marker in ("<think>", "</think>", "<tool_call>", "[TOOL_CALLS]"):
            assert marker not in sent["content"] or marker in content, where
    early = sent["content"]
    for d in splitter.finish(final, final.reasoning, final.text):
        sent[d.field] += d.text
        lps += d.logprobs or []
    assert sent == {"reasoning_content": reasoning, "content": content}, (text, p.stop)
    assert lps == [(piece, lp, []) for piece, lp in zip(final.pieces, final.logprobs, strict=True)]
    return early


@pytest.mark.parametrize("tools", [False, True])
@pytest.mark.parametrize("stop", STOPS)
@pytest.mark.parametrize("text", ANSWERS)
def test_what_is_sent_is_always_the_start_of_the_answer(service, text, stop, tools):
    p = Params(model="m", stop=stop, stream=True, logprobs=True, tools=TOOLS if tools else None)
    check(service, text, p, service.fmt.encode("<|im_start|>assistant\n"))


@pytest.mark.parametrize("text", ["thinking on\n</think>\n\nand the answer", "cut before the end </thi"])
def test_a_block_the_prompt_opened_goes_to_reasoning(service, text):
    """Qwen3.5's generation prompt writes `<think>\\n`: the answer's text up to `</think>` is reasoning."""
    prompt = service.fmt.encode("<|im_start|>assistant\n<think>\n")
    assert service.fmt.opens_reasoning(prompt)
    for stream_reasoning in (True, False):
        check(service, text, Params(model="m", stream=True, logprobs=True, stream_reasoning=stream_reasoning), prompt)


MISTRAL_CALL = '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}]'


@pytest.mark.parametrize("text", [f"Let me add. {MISTRAL_CALL}", 'Let me add. [TOOL_CALLS]add[ARGS]{"a": 1}',
                                  "Let me add. [TOOL_CA", "Let me add. no call"])
def test_a_mistral_answer_streams_its_text_before_the_call(text):
    """Mistral's `[TOOL_CALLS]` is where a call may start: the text before it streams as it is drawn (a parser
    without its start would hold the whole message to the end), the marker itself never."""
    tok = _byte_level_tokenizer()
    tok.chat_template = QWEN3
    service = OpenAIService(ChatFormat(tok, (tok.eos_token_id,), get_parser("mistral", tok)), lambda payloads: [],
                            model="m", context_length=None)
    early = check(service, text, Params(model="m", stream=True, logprobs=True, tools=TOOLS),
                  service.fmt.encode("<|im_start|>assistant\n"))
    assert early.startswith("Let me add."), early
