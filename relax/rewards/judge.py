"""A generative judge's text side: its question (`judge_question`, from `reward_model.template`) and reading a score
from its answer (`JUDGE_PARSERS`, `get_parser`, `read_scores`).

A parser is `fn(answer: str) -> float | None`; None means the answer holds no score (a parse failure, counted in
`rollout/judge_parse_fail_frac`; the response's group is left out as for a failed reward call, never scored 0).
Built-ins: `number` (the last number in the answer: a judge that reasons first ends with its verdict) and
`score_tag` (the number after the last "score:", any case); any other parser is named by import path
`package.module:function`.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from relax.imports import resolve_component

JudgeParser = Callable[[str], Optional[float]]

_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_SCORE_TAG = re.compile(r"score\s*[:=]\s*([-+]?(?:\d+\.?\d*|\.\d+))", re.IGNORECASE)


def last_number(answer: str) -> float | None:
    """The last number written in `answer` ("8", "I'd say 7.5 out of 10" reads 10: put the verdict last), or None."""
    found = _NUMBER.findall(answer)
    return float(found[-1]) if found else None


def score_tag(answer: str) -> float | None:
    """The number after the last "score:" (or "score ="), any case, or None."""
    found = _SCORE_TAG.findall(answer)
    return float(found[-1]) if found else None


JUDGE_PARSERS: dict[str, JudgeParser] = {"number": last_number, "score_tag": score_tag}


class JudgeSpecError(ValueError):
    """A parser name that does not resolve."""


def get_parser(spec: str) -> JudgeParser:
    """The parser named by `spec` (a built-in name or `package.module:function`); import problems raise here, at
    start."""
    fn = resolve_component(JUDGE_PARSERS, "reward_model.parser", spec, error=JudgeSpecError,
                           unknown="{option}={spec!r}: unknown parser; expected one of {builtins} or an import path "
                                   "'package.module:function'")
    if not callable(fn):
        raise JudgeSpecError(f"reward_model.parser={spec!r} is not callable")
    return fn


def judge_question(template: str, prompt: str, response: str, label: str) -> str:
    """The question asked about one response (the template's fields filled; validation checked its fields)."""
    return template.format(prompt=prompt, response=response, label=label)


def judge_content(template: str, prompt_parts: Sequence[dict], response: str, label: str) -> list[dict]:
    """The question asked about one response as OpenAI content parts, for a judge that reads images (an
    OpenAI-protocol vision-language model): the template's text with {prompt} as the prompt's own parts, its text
    parts' text and its images as they come (`image_url` parts), where the prompt has them; neighbouring texts are
    one text part. Its text, each image written IMAGE_PLACEHOLDER, is `judge_question`'s with the prompt read so."""
    fmt, out = string.Formatter(), []

    def text(value: str) -> None:
        if not value:
            return
        if out and out[-1].get("type") == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + value}
        else:
            out.append({"type": "text", "text": value})

    for literal, name, spec, conversion in fmt.parse(template):
        text(literal)
        if name is None:
            continue
        if name == "prompt":
            for part in prompt_parts:
                if part.get("type") == "text":
                    text(str(part.get("text") or ""))
                else:
                    out.append(part)
            continue
        value = {"response": response, "label": label}[name]
        text(fmt.format_field(fmt.convert_field(value, conversion) if conversion else value, spec or ""))
    return out


@dataclass
class Verdicts:
    """Scores read from judge answers: `scores[i]` None where answer i held none (or one outside the range) or the
    call failed; `parse_failed[i]` only for the former."""

    scores: list[Optional[float]] = field(default_factory=list)
    parse_failed: list[bool] = field(default_factory=list)
    first_error: Optional[str] = None


def read_scores(parser: JudgeParser, answers: Sequence[Optional[str]], lo: float, hi: float,
                errors: Sequence[Optional[str]] | None = None) -> Verdicts:
    """Each answer's score by `parser`, within [lo, hi]. An answer None is a failed call (its error in `errors`); an
    answer without a readable, finite score in range is a parse failure. A parser that raises counts as a parse
    failure too (its message kept as the first error)."""
    out = Verdicts()
    for i, answer in enumerate(answers):
        if answer is None:
            out.scores.append(None)
            out.parse_failed.append(False)
            if out.first_error is None:
                out.first_error = (errors[i] if errors else None) or "the judge gave no answer"
            continue
        why = None
        try:
            value = parser(answer)
        except Exception as exc:  # a user's parser: its failure is this answer's, not the run's
            value, why = None, f"reward_model.parser raised {type(exc).__name__}: {exc}"
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
            lo <= value <= hi
        out.scores.append(float(value) if ok else None)
        out.parse_failed.append(not ok)
        if not ok and out.first_error is None:
            out.first_error = why or (f"the judge's answer holds no score in [{lo:g}, {hi:g}] "
                                      f"(reward_model.parser): {answer[:200]!r}")
    return out
