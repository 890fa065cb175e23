"""Evaluation's config: its fields act with train.eval_interval only, pass@k's k and the eval sets' names are
checked before anything starts, and the names and k the runner uses (relax.config.evaluation)."""

from __future__ import annotations

import dataclasses

import pytest

from relax.config import ConfigError, load_config, validate
from relax.config.evaluation import (
    EvalSetFile,
    default_eval_set_name,
    eval_pass_ks,
    eval_set_files,
    saves_eval_samples,
)

EVAL = ["train.eval_interval=2"]


def problems(overrides: list[str]) -> list[str]:
    try:
        load_config(overrides)
    except ConfigError as exc:
        return [v.message for v in exc.violations]
    return []


def test_a_full_evaluation_config_is_accepted():
    cfg = load_config([*EVAL, "rollout.eval_n_samples_per_prompt=8", "rollout.eval_temperature=0.6",
                       "rollout.eval_top_p=0.95", "train.eval_pass_k=[1,4,8]", "train.eval_correct_threshold=0.5",
                       "+data.eval_sets={math500:/data/math500.jsonl,aime:/data/aime.parquet}"])
    assert cfg.data.eval_sets == {"math500": "/data/math500.jsonl", "aime": "/data/aime.parquet"}
    assert eval_pass_ks(cfg) == [1, 4, 8]
    # data.task=file: an eval set of data.eval_sets is enough
    load_config([*EVAL, "data=jsonl", "data.path=p.jsonl", "+data.eval_sets={test:t.jsonl}"])


@pytest.mark.parametrize("override", ["rollout.eval_top_p=0.9", "train.eval_pass_k=[1]",
                                      "train.eval_correct_threshold=0.5", "+data.eval_sets={extra:e.jsonl}"])
def test_evaluation_fields_without_evaluation_are_rejected(override):
    field = override.lstrip("+").split("=")[0]
    assert any(m.startswith(f"{field}=") and "train.eval_interval=0 runs no evaluation" in m
               for m in problems([override, "rollout.eval_temperature=1.0"]))


@pytest.mark.parametrize("overrides,problem", [
    (["rollout.eval_top_p=0.9"], "rollout.eval_top_p=0.9 has no effect with rollout.eval_temperature=0"),
    (["rollout.eval_temperature=1", "rollout.eval_top_p=0"], "rollout.eval_top_p=0.0 must be in (0, 1]"),
    (["rollout.eval_n_samples_per_prompt=4", "train.eval_pass_k=[1,8]"],
     "train.eval_pass_k=[1, 8]: each k must be in 1..rollout.eval_n_samples_per_prompt=4"),
    (["rollout.eval_n_samples_per_prompt=4", "train.eval_pass_k=[0]"], "each k must be in 1..rollout"),
    (["rollout.eval_n_samples_per_prompt=4", "train.eval_pass_k=[4,1]"],
     "train.eval_pass_k=[4, 1] must be ascending without repeats"),
    (["rollout.eval_n_samples_per_prompt=4", "train.eval_pass_k=[1,1]"], "must be ascending without repeats"),
    (["train.eval_pass_k=[]"], "train.eval_pass_k=[] logs no pass@k"),
    (["train.eval_correct_threshold=nan"], "train.eval_correct_threshold=nan must be a finite number"),
    (["+data.eval_sets={digits:d.jsonl}"], "data.eval_sets.digits: the name is taken by the default eval set "
                                           "(data.task=digits)"),
    (["data=jsonl", "data.path=p.jsonl", "data.eval_path=/x/test.jsonl", "+data.eval_sets={test:t.jsonl}"],
     "data.eval_sets.test: the name is taken by the default eval set (data.eval_path=/x/test.jsonl)"),
    (["data=jsonl", "data.path=p.jsonl", "data.eval_path='/x/my test.jsonl'"],
     "the eval set is named after the file's stem, 'my test'"),
    (["+data.eval_sets={extra:''}"], "data.eval_sets.extra='' must be the path of a JSONL or Parquet file"),
    (["data=jsonl", "data.path=p.jsonl"], "set data.eval_path or data.eval_sets for data.task=file"),
])
def test_evaluation_problems_are_reported(overrides, problem):
    found = problems([*EVAL, *overrides])
    assert any(problem in m for m in found), found


def test_eval_set_names_must_be_one_metric_name_segment():
    cfg = load_config(EVAL)
    for name in ("a/b", ".hidden", "", "a b"):
        bad = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_sets={name: "e.jsonl"}))
        assert any(f"data.eval_sets: the name {name!r} must be letters" in v.message for v in validate(bad)), name
    good = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_sets={"gsm8k-test_v1.2": "e.jsonl"}))
    assert validate(good) == []


def test_the_default_eval_set_and_pass_k():
    def data(**changes):
        return dataclasses.replace(load_config([]).data, **changes)

    assert default_eval_set_name(data()) == "digits"
    assert default_eval_set_name(data(task="arithmetic")) == "arithmetic"
    assert default_eval_set_name(data(task="gsm8k")) == "gsm8k"
    assert default_eval_set_name(data(task="file", path="p.jsonl", eval_path="/d/math500.jsonl")) == "math500"
    assert default_eval_set_name(data(task="file", path="p.jsonl")) is None
    assert eval_pass_ks(load_config(EVAL)) == [1]  # n = 1
    assert eval_pass_ks(load_config([*EVAL, "rollout.eval_n_samples_per_prompt=8"])) == [1, 8]


def test_an_eval_set_names_its_own_record_keys():
    """`name: path` and `name: {path, prompt_key, label_key}` side by side; a key an entry leaves out is
    data.prompt_key / data.label_key, which a built-in task accepts once an eval file is read."""
    cfg = load_config([*EVAL, "data.label_key=solution",
                       "+data.eval_sets={math500:{path:/d/math500.jsonl,prompt_key:problem,label_key:answer},"
                       "aime:{path:/d/aime.jsonl,prompt_key:question},plain:/d/plain.jsonl}"])
    files = eval_set_files(cfg.data)
    assert files == {"math500": EvalSetFile("/d/math500.jsonl", "problem", "answer", ("prompt_key", "label_key")),
                     "aime": EvalSetFile("/d/aime.jsonl", "question", "solution", ("prompt_key",)),
                     "plain": EvalSetFile("/d/plain.jsonl", "prompt", "solution")}


def test_data_keys_on_a_built_in_task_act_only_where_a_file_is_read():
    load_config([*EVAL, "data.prompt_key=question", "+data.eval_sets={x:/d/x.jsonl}"])
    load_config(["data.task=gsm8k", *EVAL, "data.prompt_key=question", "data.eval_path=/d/test.jsonl"])
    found = problems([*EVAL, "data.prompt_key=question"])  # no file: the digits task generates every prompt
    assert found == ["data.prompt_key='question' has no effect: it names the fields of the records of data.path, "
                     "data.eval_path and data.eval_sets, and data.task=digits reads none of them"]
    # without evaluation the eval sets are not read either: both are reported
    found = problems(["data.label_key=answer", "+data.eval_sets={x:/d/x.jsonl}"])
    assert len(found) == 2 and any(m.startswith("data.label_key='answer' has no effect") for m in found)


def test_every_malformed_eval_set_entry_is_reported_at_once():
    found = problems([*EVAL, "+data.eval_sets={a:{path:/d/a.jsonl,prompt:q},b:{prompt_key:q},"
                             "c:{path:/d/c.jsonl,label_key:''},d:5,e:/d/e.jsonl}"])
    assert found == [
        "data.eval_sets.a: unknown key(s) prompt: an entry holds path, prompt_key, label_key",
        "data.eval_sets.b has no path: must be the path of a JSONL or Parquet file, or {path: <file>, prompt_key: "
        "<key>, label_key: <key>} (the keys optional)",
        "data.eval_sets.c.label_key='' must be a non-empty string",
        "data.eval_sets.d=5 must be the path of a JSONL or Parquet file, or {path: <file>, prompt_key: <key>, "
        "label_key: <key>} (the keys optional)",
    ]


def test_eval_samples_are_saved_by_default_only_when_the_run_only_evaluates():
    assert saves_eval_samples(load_config(["train.num_rollout=0"]))
    assert not saves_eval_samples(load_config(EVAL))
    assert saves_eval_samples(load_config([*EVAL, "train.eval_save_samples=true"]))
    assert not saves_eval_samples(load_config(["train.num_rollout=0", "train.eval_save_samples=false"]))
    assert problems(["train.eval_save_samples=true"]) == [
        "train.eval_save_samples=True has no effect: train.eval_interval=0 runs no evaluation"]
