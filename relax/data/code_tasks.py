"""The `code_tests` task: small Python functions checked by unit tests, generated deterministically from the seed.

Each problem asks for the expression a function returns, for example

    Complete the Python function so that it returns x * 3 + 4.
    def f(x):
        return

with the label (JSON) {"prefix": "def f(x):\\n    return ", "tests": [{"call": "f(0)", "expected": 4}, ...]}: the
`code_tests` reward (`relax.rewards.code_tests`) runs the response after the prefix (or, when the response defines
the function itself, the response alone) in the sandbox and scores the share of tests passed. Five families (a
linear function, a square plus a constant, a scaled list sum, a repeated string, a letter count) with their
constants give 5 * 90 = 450 distinct problems; ARITHMETIC_EVAL_SHARE of them are held out for evaluation. Each
problem has a test whose answer is a constant the prompt shows (f(0) = the constant, f([]) = 0, ...), so a policy
that only writes digits, as the tiny model can, earns part of the reward and can learn to earn it.
"""

from __future__ import annotations

import json
import random
from typing import Any

CODE_EVAL_SHARE = 0.2  # share of the distinct problems held out for evaluation
PROMPT = "Complete the Python function so that it returns {what}.\n{prefix}"


def problems() -> list[tuple[str, str, list[dict], str]]:
    """Every distinct problem: (what it returns, the code before the expression, its tests, a reference expression
    (never shown; the tests check that it passes))."""
    out = []
    for a in range(1, 10):
        for b in range(10):
            c = a * 10 + b
            out.append((f"x * {a} + {b}", "def f(x):\n    return ",
                        [{"call": f"f({x})", "expected": x * a + b} for x in (0, 1, 2, 5)], f"x * {a} + {b}"))
            out.append((f"x * x + {c}", "def f(x):\n    return ",
                        [{"call": f"f({x})", "expected": x * x + c} for x in (0, 1, 3, 4)], f"x * x + {c}"))
            out.append((f"the sum of the list xs times {a} plus {b}", "def f(xs):\n    return ",
                        [{"call": f"f({xs})", "expected": sum(xs) * a + b} for xs in ([], [1], [2, 3], [4, 5, 6])],
                        f"sum(xs) * {a} + {b}"))
            out.append((f"the string s repeated {a} times, then the digit {b}", "def f(s):\n    return ",
                        [{"call": f"f({s!r})", "expected": s * a + str(b)} for s in ("", "ab", "x", "cd")],
                        f"s * {a} + '{b}'"))
            out.append((f"how many times the letter 'a' occurs in s, plus {c}", "def f(s):\n    return ",
                        [{"call": f"f({s!r})", "expected": s.count("a") + c} for s in ("", "a", "banana", "xyz")],
                        f"s.count('a') + {c}"))
    return out


def generate_code_tests(num: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    """`num` records {"prompt", "label" (JSON: prefix and tests)}, drawn with replacement from `split`'s share of the
    distinct problems (partitioned once per seed, so an eval problem never occurs in train)."""
    every = problems()
    random.Random(f"code_tests-split:{seed}").shuffle(every)
    n_eval = max(1, int(len(every) * CODE_EVAL_SHARE))
    pool = every[:n_eval] if split == "eval" else every[n_eval:]
    rng = random.Random(f"code_tests:{seed}:{split}")
    out = []
    for _ in range(num):
        what, prefix, tests, _ = pool[rng.randrange(len(pool))]
        out.append({"prompt": PROMPT.format(what=what, prefix=prefix),
                    "label": json.dumps({"prefix": prefix, "tests": tests})})
    return out
