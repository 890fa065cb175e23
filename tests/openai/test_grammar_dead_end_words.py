"""A grammar's dead end on a vocabulary with no token holding '"' (the tiny model's built-in one) says that this is
why and what to serve instead; on a vocabulary that has one, or for a grammar that writes no '"', the generic words
stay. The dead end is reached by sampling under `mask_logits` and `advance` as the engine does (every token of the
vocabulary tried in turn, greedily), not assumed. Negative control: before, every dead end read DEAD_END's generic
"(e.g. a character of the JSON, such as '\"', that no token holds)"; and a regex whose source has a '"' only in a
negated class, `[^"]:`, got the specific words at ':' (the choice read the grammar's source, not what it allows at the
dead end)."""

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


@pytest.mark.parametrize("spec", [ANSWER, GrammarSpec("ebnf", tool_call_ebnf(TOOLS, "llama3_json"))],
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


@pytest.mark.parametrize("spec, at", [(GrammarSpec("regex", "[0-9]x"), 1),
                                      (GrammarSpec("ebnf", tool_call_ebnf(TOOLS, "hermes")), 0)],
                         ids=["regex", "hermes_tool_call"])
def test_a_dead_end_before_any_quote_keeps_the_generic_words(spec, at):
    """A grammar that writes no '"', and a hermes forced tool call, which dead-ends on the tiny vocabulary at its
    first character, the '<' of `<tool_call>` (no token holds '<'), before any '"'."""
    tok = build_tiny_tokenizer()
    assert not any("<" in t for t in tok.get_vocab() if t not in tok.all_special_tokens)
    grammars = Grammars(tok, len(tok))
    message, n = _sample_to_dead_end(grammars, spec)
    assert (n, message) == (at, DEAD_END.format(n=at)), (n, message)


def test_a_dead_end_that_allows_no_quote_keeps_the_generic_words_and_reads_no_vocabulary():
    """`[^"]:` on the tiny vocabulary: its first character is written, and it dead-ends at ':' (no token holds one),
    where a '"' is not allowed either: the missing '"' is not why, so the generic words. The vocabulary is not scanned
    for '"' at such a dead end (nor at compile): only a dead end that allows a '"' asks."""
    tok = build_tiny_tokenizer()
    assert not any(":" in t for t in tok.get_vocab())
    grammars = Grammars(tok, len(tok))
    grammars.compile(GrammarSpec("regex", '[^"]:'))
    assert grammars._quote is None  # not read at compile
    message, n = _sample_to_dead_end(grammars, GrammarSpec("regex", '[^"]:'))
    assert (n, message) == (1, DEAD_END.format(n=1)), (n, message)
    assert grammars._quote is None  # nor at a dead end that allows no '"'
