"""Math answer rewards: the last `\\boxed{...}` of a response checked against the label.

Checking uses `math-verify` (`parse` + `verify`, so "\\frac{1}{2}", "0.5" and "1/2" agree) with a
normalized string comparison as fallback. math-verify's timeouts use SIGALRM, which only works in the
main thread; outside it (Ray actors call rewards from worker threads) the timeouts are disabled.
"""

from __future__ import annotations

import re
import threading
from typing import Optional

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
MATH_VERIFY_TIMEOUT_S = 5


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last `\\boxed{...}` (braces may nest), or None when there is no complete box."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            ch = text[i]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def normalize_answer(answer: str) -> str:
    """Loose canonical form for string comparison: no spaces, `$`, `\\!`, `\\left/\\right`, thousands commas,
    trailing period, or `\\text{}` wrapper; `\\dfrac`/`\\tfrac` -> `\\frac`; "7.0" -> "7"."""
    s = str(answer).strip()
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    for a, b in (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", ""), ("\\!", ""),
                 ("$", ""), (" ", "")):
        s = s.replace(a, b)
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if re.fullmatch(r"-?\d+\.0*", s):
        s = s.split(".")[0]
    return s


def _verify(answer: str, label: str) -> Optional[bool]:
    """math-verify's verdict, or None when it cannot parse either side (or is unavailable)."""
    try:
        from math_verify import parse, verify
    except ImportError:  # pragma: no cover - math-verify is a dependency
        return None
    main = threading.current_thread() is threading.main_thread()
    parse_timeout = MATH_VERIFY_TIMEOUT_S if main else None
    verify_timeout = MATH_VERIFY_TIMEOUT_S if main else None
    try:
        gold = parse(f"${label}$", parsing_timeout=parse_timeout)
        pred = parse(f"${answer}$", parsing_timeout=parse_timeout)
        if not gold or not pred:
            return None
        return bool(verify(gold, pred, timeout_seconds=verify_timeout))
    except Exception:  # math-verify/sympy failures fall back to string comparison
        return None


def answers_match(answer: str, label: str) -> bool:
    """True when `answer` equals `label` mathematically (math-verify) or after normalization."""
    if normalize_answer(answer) == normalize_answer(label):
        return True
    return bool(_verify(answer, label))


def math_reward(response: str, label: str) -> float:
    """1.0 when the last `\\boxed{...}` of the response equals the label, else 0.0 (also without a box)."""
    answer = extract_boxed(response)
    if answer is None:
        return 0.0
    return 1.0 if answers_match(answer, label) else 0.0


def arithmetic_reward(response: str, label: str) -> float:
    """`math` reward, with partial credit for small models that forget the box: 1.0 for a correct
    `\\boxed{}` answer; without any box, 0.5 when the last number in the response equals the label."""
    answer = extract_boxed(response)
    if answer is not None:
        return 1.0 if answers_match(answer, label) else 0.0
    numbers = _NUMBER.findall(response)
    if numbers and normalize_answer(numbers[-1]) == normalize_answer(label):
        return 0.5
    return 0.0


def prepare_math_verify() -> None:
    """Import math-verify and compare once (sympy builds its parsers on first use: most of a second), so that a
    reward worker process does this when it starts (`prepare`, see relax.rewards.registry) instead of charging it
    to its first call's time limit."""
    _verify("1/2", "0.5")


math_reward.prepare = prepare_math_verify  # type: ignore[attr-defined]
arithmetic_reward.prepare = prepare_math_verify  # type: ignore[attr-defined]
