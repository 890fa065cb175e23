"""A grammar's dead end on a vocabulary with no token holding '"' (the tiny model's built-in one) says that this is
why and what to serve instead; on a vocabulary that has one, or for a grammar that writes no '"', the generic words
stay. The dead end is reached by sampling under `mask_logits` and `advance` as the engine does (every token of the
vocabulary tried in turn, greedily), not assumed. Negative control: before, every dead end read DEAD_END's generic
"(e.g. a character of the JSON, such as '\"', that no token holds)"."""

from __future__ import annotations

import pytest
import torch

from relax.data.tokenizer import TINY_VOCAB, build_tiny_tokenizer
from relax.rollout.grammar import (
    DEAD_END,
    DEAD_END_NO_QUOTE,
    Grammars,
    GrammarSpec,
    advance,
    json_schema_spec,
    mask_logits,
    tool_call_ebnf,
)

pytest.importorskip("xgrammar")

ANSWER = json_schema_spec({"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]})
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
SPECIFIC = "this model's vocabulary has no token holding '\"', so no JSON"


def _sample_to_dead_end(grammars: Grammars, spec: GrammarSpec, limit: int = 40) -> tuple[str, int]:
    """Greedy sampling under the grammar (logits favouring the lowest id), as the engine masks and advances rows;
    the dead end's error and the number of tokens before it. Fails if the grammar never dead-ends."""
    tok = grammars.tokenizer
    m = grammars.matcher(spec, [tok.eos_token_id])
    n = 0
    for _ in range(limit):
        logits = -torch.arange(len(tok), dtype=torch.float32)[None].clone()
        masked = mask_logits(logits, [m])
        token = masked.argmax(-1)
        if m.dead:
            return m.dead_end_error(n), n
        done = advance([m], token, torch.tensor([True]))
        assert not bool(done[0]), "the grammar completed: no dead end"
        n += 1
    raise AssertionError("no dead end within the limit")


@pytest.mark.parametrize("spec", [ANSWER, GrammarSpec("ebnf", tool_call_ebnf(TOOLS, "hermes"))],
                         ids=["json_schema", "forced_tool_call"])
def test_a_vocabulary_without_a_quote_is_named_as_the_cause(spec):
    tok = build_tiny_tokenizer()
    assert not any('"' in t for t in tok.get_vocab())  # independent of the code under test: the vocabulary's words
    grammars = Grammars(tok, len(tok))
    message, n = _sample_to_dead_end(grammars, spec)
    assert message == DEAD_END_NO_QUOTE.format(n=n), message
    assert SPECIFIC in message and "serve a model whose tokenizer has one" in message and "e.g. a character" \
        not in message


def test_a_vocabulary_with_a_quote_keeps_the_generic_words():
    """The tiny vocabulary plus '"': the answer gets as far as `{"answer"` (tokens '{', '"', 'answer', '"') and
    dead-ends there for another reason than the quote (no token holds ':')."""
    tok = build_tiny_tokenizer(vocab=list(TINY_VOCAB) + ['"'])
    grammars = Grammars(tok, len(tok))
    assert grammars.has_quote
    message, n = _sample_to_dead_end(grammars, ANSWER)
    assert (n, message) == (4, DEAD_END.format(n=4)), (n, message)
    assert SPECIFIC not in message


def test_a_grammar_that_writes_no_quote_keeps_the_generic_words():
    tok = build_tiny_tokenizer()
    grammars = Grammars(tok, len(tok))
    message, n = _sample_to_dead_end(grammars, GrammarSpec("regex", "[0-9]x"))
    assert (n, message) == (1, DEAD_END.format(n=1))
