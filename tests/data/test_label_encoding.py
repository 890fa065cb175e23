"""How a record's label reaches the reward: a string as it is, any other JSON value as its JSON text (never Python's
repr), on every loader path (JSONL, Parquet, eval sets), so that code_tests reads a label written as an object."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relax.config.schema import DataConfig, RelaxConfig
from relax.data.datasets import build_eval_sets, load_prompt_file
from relax.data.tokenizer import build_tiny_tokenizer
from relax.rewards.code_tests import code_tests_reward

SPEC = {"prefix": "def f(x):\n    return ", "tests": [{"call": "f(1)", "expected": 0}, {"call": "f(0)", "expected": 0},
                                                      "assert f(3) == 0"]}


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def write_jsonl(path, labels):
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "label": lab}) + "\n" for i, lab in enumerate(labels)))
    return path


def test_jsonl_labels_of_every_json_type(tmp_path, tok):
    labels = [SPEC, [1, "a", None], True, 7, 2.5, "x*0", 'already {"json"}', {"ü": "é"}]
    ds = load_prompt_file(write_jsonl(tmp_path / "p.jsonl", labels), tok)
    got = [item.label for item in ds]
    assert all(isinstance(g, str) for g in got)
    # a string stays as it is; the rest is the JSON text of the value, which reads back as the file's value
    assert got[5] == "x*0" and got[6] == 'already {"json"}'
    assert [json.loads(g) for i, g in enumerate(got) if i not in (5, 6)] == [lab for i, lab in enumerate(labels)
                                                                          if i not in (5, 6)]
    assert got[1] == '[1, "a", null]' and got[2] == "true" and got[3] == "7" and got[4] == "2.5"
    assert got[7] == '{"ü": "é"}'  # text as written, not \u escapes


def test_an_object_label_scores_with_code_tests(tmp_path, tok):
    """The review's case: a label written as an object (the docs' form) scored every call as a failure (Python repr
    is not JSON); now the right answer passes all three tests and a wrong one none."""
    ds = load_prompt_file(write_jsonl(tmp_path / "c.jsonl", [SPEC]), tok)
    assert float(code_tests_reward("x*0", ds[0].label)) == 1.0
    assert float(code_tests_reward("x+1", ds[0].label)) == 0.0


def test_parquet_struct_and_list_labels(tmp_path, tok):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"],
                             "label": [{"prefix": "def f(x):\n    return ", "n": 1},
                                       {"prefix": "", "n": 2}]}), path)
    ds = load_prompt_file(path, tok)
    assert [json.loads(x.label) for x in ds] == [{"prefix": "def f(x):\n    return ", "n": 1}, {"prefix": "", "n": 2}]
    path2 = tmp_path / "l.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "label": [[1, 2]]}), path2)
    assert load_prompt_file(path2, tok)[0].label == "[1, 2]"


def test_eval_sets_encode_labels_the_same_way(tmp_path, tok):
    path = write_jsonl(tmp_path / "e.jsonl", [SPEC])
    cfg = RelaxConfig(data=DataConfig(eval_sets={"code": str(path)}))
    sets = build_eval_sets(cfg, tok, None)
    assert json.loads(sets["code"][0].label) == SPEC
