"""Reading the eval sets of `data.eval_sets` (relax.data.datasets.build_eval_sets): each file with its own record keys
or data.prompt_key / data.label_key, and every unreadable set named at once, each message naming the field that
sets the missing key (docs/training.md, "Evaluation")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax.config import load_config
from relax.data.datasets import DataError, build_eval_sets
from relax.data.tokenizer import load_tokenizer


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sets(*overrides: str):
    cfg = load_config(["train.eval_interval=1", *overrides])
    return build_eval_sets(cfg, load_tokenizer(cfg.model), None)


def test_files_with_keys_of_their_own_are_read_on_a_generated_task(tmp_path):
    math = write(tmp_path / "math.jsonl", [{"problem": "repeat 12", "answer": "12"}, {"problem": "repeat 3",
                                                                                       "answer": 3}])
    aime = write(tmp_path / "aime.jsonl", [{"question": "repeat 7", "solution": "7"}])
    plain = write(tmp_path / "plain.jsonl", [{"prompt": "repeat 5", "solution": "5"}])
    found = sets("data.label_key=solution", f"+data.eval_sets={{math:{{path:'{math}',prompt_key:problem,"
                 f"label_key:answer}},aime:{{path:'{aime}',prompt_key:question}},plain:'{plain}'}}")
    assert list(found) == ["math", "aime", "plain"]
    assert [(i.label, i.source) for i in found["math"]] == [("12", f"{math}:1"), ("3", f"{math}:2")]
    assert "repeat 12" in found["math"][0].prompt_text
    assert [(i.label, "repeat 7" in i.prompt_text) for i in found["aime"]] == [("7", True)]
    assert [i.label for i in found["plain"]] == ["5"]
    # the same file read with data.prompt_key / data.label_key, accepted on the digits task since an eval file is read
    again = sets("data.prompt_key=problem", "data.label_key=answer", f"+data.eval_sets={{math:'{math}'}}")
    assert [(i.label, i.prompt_text) for i in again["math"]] == [(i.label, i.prompt_text) for i in found["math"]]


def test_every_unreadable_set_is_named_with_the_field_that_sets_its_key(tmp_path):
    math = write(tmp_path / "math.jsonl", [{"problem": "repeat 12", "answer": "12"}])
    with pytest.raises(DataError) as exc:
        sets(f"+data.eval_sets={{a:'{math}',b:{{path:'{math}',prompt_key:question}},c:'{tmp_path}/none.jsonl'}}")
    assert str(exc.value).splitlines() == [
        f"data.eval_sets.a: {math}:1: missing key 'prompt' (data.prompt_key, or for this set alone "
        "data.eval_sets={a:{path:...,prompt_key:<field>}}); record has keys ['answer', 'problem']",
        f"data.eval_sets.b: {math}:1: missing key 'question' (data.eval_sets.b.prompt_key); record has keys "
        "['answer', 'problem']",
        f"data.eval_sets.c: data file {tmp_path}/none.jsonl does not exist",
    ]
