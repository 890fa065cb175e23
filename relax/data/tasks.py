"""Synthetic tasks, generated deterministically from the seed (no files, no download).

- `digits` (default): prompt "repeat 7", label "7". Made for a tiny randomly initialised model and the
  tiny tokenizer: learnable from scratch by RL in ~60 steps with responses of <= 8 tokens, and a random
  policy already earns partial reward (see `relax.rewards.digits`). There are only 10 distinct prompts,
  so its eval split is an independent draw from the same distribution (same prompts, different order).
- `arithmetic`: "What is 3 + 4? Put the final answer in \\boxed{}." with label "7" (sums of single digits
  and non-negative differences): 155 distinct problems, split so that eval problems never occur in train.
- `guess_number` (agentic, `relax.agents.guess_number`): one prompt ("guess the digit"), the secret digit as the
  label, uniform over 0-9; the eval split is an independent draw.
- `code_tests` (`relax.data.code_tasks`): small Python functions checked by unit tests in the sandbox (the
  `code_tests` reward), "Complete the Python function so that it returns x * 3 + 4." with the tests as the label.
- `calculator` (agentic, with the `calculator` tool): products of two two-digit numbers, "What is 37 * 48?", with the
  product as the label; split like arithmetic (eval products never occur in train). The prompt is a chat: a system
  message naming the tool and its call format, one worked example (a call, its result, the boxed answer), then the
  question: small instruct models (SmolLM2-135M) call the tool from such a prompt, and hardly without one.
- `shapes` (images, a vision-language model: `relax.data.shapes`): an image of a coloured shape and "what colour is
  the shape?", the colour as the label.
- `grid_walk` (images, agentic, a vision-language model: `relax.data.grid_walk`, `relax.agents.grid_walk`): the
  image of a grid with the agent and the goal, "what is the move?"; each move is answered with the new grid's image.
  The label is "<agent cell>,<goal cell>".
"""

from __future__ import annotations

import random
from typing import Any

ARITHMETIC_TEMPLATE = "What is {a} {op} {b}? Put the final answer in \\boxed{{}}."
ARITHMETIC_EVAL_SHARE = 0.2  # share of the distinct arithmetic problems held out for evaluation
TASKS = ("digits", "arithmetic", "guess_number", "calculator", "shapes", "code_tests", "grid_walk")
# Kept to symbols and digits for the tiny tokenizer (its other words would be <|unk|>): + means the secret is higher.
GUESS_PROMPT = "Guess the digit 0-9. + means higher, - means lower."
CALCULATOR_SYSTEM = ('You can call a calculator tool: write <tool_call>{"name": "calculator", "arguments": '
                     '{"expression": "..."}}</tool_call> and its result comes back. Then give the final answer in '
                     '\\boxed{}.')
CALCULATOR_EXAMPLE = [  # one worked example before the question
    {"role": "user", "content": "What is 12 * 13?"},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 13"}}'
                                     '</tool_call>'},
    {"role": "tool", "content": "156"},
    {"role": "assistant", "content": "12 * 13 = \\boxed{156}"},
]
CALCULATOR_TEMPLATE = "What is {a} * {b}?"


def _record(prompt: str, label: str) -> dict[str, Any]:
    return {"prompt": prompt, "label": label}


def digits_prompt(digit: int) -> str:
    """The digits task prompt for one digit."""
    return f"repeat {digit}"


def generate_digits(num: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    """`num` records {"prompt": "repeat d", "label": "d"}, d uniform over 0-9, from (seed, split)."""
    rng = random.Random(f"digits:{seed}:{split}")
    out = []
    for _ in range(num):
        d = rng.randrange(10)
        out.append(_record(digits_prompt(d), str(d)))
    return out


def arithmetic_problems() -> list[tuple[int, str, int, int]]:
    """Every distinct problem (a, op, b, answer): a + b and a - b with a >= b, single digits."""
    problems = []
    for a in range(10):
        for b in range(10):
            problems.append((a, "+", b, a + b))
            if a >= b:
                problems.append((a, "-", b, a - b))
    return problems


def generate_arithmetic(num: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    """`num` single-digit arithmetic records, drawn with replacement from this split's problems.

    The distinct problems are partitioned once per seed (ARITHMETIC_EVAL_SHARE held out for eval), so an
    eval problem never appears in train.
    """
    return [_record(ARITHMETIC_TEMPLATE.format(a=a, op=op, b=b), str(ans))
            for a, op, b, ans in _draw_split(arithmetic_problems(), "arithmetic", num, seed, split)]


def _draw_split(problems: list, task: str, num: int, seed: int, split: str) -> list:
    """`num` problems drawn with replacement from `split`'s share of `problems`: the distinct problems are
    partitioned once per seed (ARITHMETIC_EVAL_SHARE held out for eval), so an eval problem never appears in train."""
    problems = list(problems)
    random.Random(f"{task}-split:{seed}").shuffle(problems)
    n_eval = max(1, int(len(problems) * ARITHMETIC_EVAL_SHARE))
    pool = problems[:n_eval] if split == "eval" else problems[n_eval:]
    rng = random.Random(f"{task}:{seed}:{split}")
    return [pool[rng.randrange(len(pool))] for _ in range(num)]


def generate_guess_number(num: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    """`num` records {"prompt": GUESS_PROMPT, "label": secret digit}, the secret uniform over 0-9."""
    rng = random.Random(f"guess_number:{seed}:{split}")
    return [_record(GUESS_PROMPT, str(rng.randrange(10))) for _ in range(num)]


def generate_calculator(num: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    """`num` records "What is a * b? ..." (a, b in 11..99) with the product as the label; ARITHMETIC_EVAL_SHARE of
    the distinct problems held out for eval."""
    problems = [(a, b) for a in range(11, 100) for b in range(11, 100)]
    return [{"prompt": [{"role": "system", "content": CALCULATOR_SYSTEM}, *CALCULATOR_EXAMPLE,
                        {"role": "user", "content": CALCULATOR_TEMPLATE.format(a=a, b=b)}],
             "label": str(a * b)}
            for a, b in _draw_split(problems, "calculator", num, seed, split)]


def _generate_shapes(num: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    from relax.data.shapes import generate_shapes  # Pillow, for the image task only

    return generate_shapes(num, seed, split)


def _generate_grid_walk(num: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    from relax.data.grid_walk import generate_grid_walk  # Pillow, for the image task only

    return generate_grid_walk(num, seed, split)


def _generate_code_tests(num: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    from relax.data.code_tasks import generate_code_tests

    return generate_code_tests(num, seed, split)


_GENERATORS = {"digits": generate_digits, "arithmetic": generate_arithmetic, "guess_number": generate_guess_number,
               "calculator": generate_calculator, "shapes": _generate_shapes,
               "code_tests": _generate_code_tests, "grid_walk": _generate_grid_walk}


def generate_task(task: str, num: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    """Records of a synthetic task (`TASKS`) for `split` (`train` | `eval`)."""
    if num < 0:
        raise ValueError(f"number of prompts must be >= 0, got {num}")
    if task in _GENERATORS:
        return _GENERATORS[task](num, seed, split)
    raise ValueError(f"data.task={task!r}: unknown synthetic task; expected one of {list(TASKS)} "
                     "(or gsm8k, or set data.path to a JSONL/Parquet file)")
