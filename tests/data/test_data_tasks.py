"""Synthetic tasks: deterministic from the seed, labels correct, eval split distinct."""

from __future__ import annotations

import re

import pytest

from relax.data.tasks import arithmetic_problems, generate_task


@pytest.mark.parametrize("task", ["digits", "arithmetic"])
def test_tasks_are_deterministic(task):
    a = generate_task(task, 50, seed=3)
    assert a == generate_task(task, 50, seed=3)
    assert a != generate_task(task, 50, seed=4)
    assert generate_task(task, 50, seed=3, split="eval") != a
    assert len(a) == 50 and all(set(r) == {"prompt", "label"} for r in a)


def test_digits_records():
    recs = generate_task("digits", 500, seed=1)
    for r in recs:
        assert r["prompt"] == f"repeat {r['label']}" and r["label"] in "0123456789"
    assert {r["label"] for r in recs} == set("0123456789")


def test_arithmetic_labels_and_disjoint_eval():
    train = generate_task("arithmetic", 2000, seed=1)
    evals = generate_task("arithmetic", 300, seed=1, split="eval")
    pattern = re.compile(r"What is (\d) ([+-]) (\d)\? Put the final answer in \\boxed\{\}\.")
    for r in train + evals:
        a, op, b = pattern.fullmatch(r["prompt"]).groups()
        assert int(r["label"]) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
    assert len(arithmetic_problems()) == 155


def test_unknown_task():
    with pytest.raises(ValueError, match="data.task"):
        generate_task("chess", 3, seed=1)
