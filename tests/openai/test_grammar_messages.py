"""A response_format schema xgrammar cannot compile is refused with xgrammar's own words, without the time stamp and
C++ source path its messages start with (`relax.rollout.grammar._xgrammar_detail`). Negative control: before, the
message read "the json_schema does not compile: [04:31:56] /project/cpp/json_schema_converter.cc:5082: ..."."""

from __future__ import annotations

import pytest

from relax.data.tokenizer import build_tiny_tokenizer
from relax.rollout.grammar import GrammarError, Grammars, GrammarSpec

pytest.importorskip("xgrammar")


@pytest.mark.parametrize("spec", [GrammarSpec("json_schema", '{"type": "nope"}'), GrammarSpec("regex", "(")])
def test_an_uncompilable_grammar_is_named_without_xgrammars_log_prefix(spec):
    tok = build_tiny_tokenizer()
    with pytest.raises(GrammarError) as caught:
        Grammars(tok, len(tok)).matcher(spec, [0])
    message = str(caught.value)
    assert message.startswith(f"the {spec.kind} does not compile: ") and ".cc:" not in message and "[" not in \
        message.split(": ", 1)[1][:1], message
