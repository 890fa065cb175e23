"""A label column only where something reads it (`relax.config.derive.label_reader`): `data.reward` (a function or a
service is called with the label; the eval sets are scored by it too) or a judge whose `reward_model.template` names
{label}. A run whose environment gives the rewards (`data.reward=none`, as TRL's GRPO reads no label column) trains
on a file without labels, its items' label "" (the environment reads the record's other fields); where the reward
reads labels, a record without one is refused at start naming what reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax.config import load_config
from relax.runner.preflight import preflight

SEEN: list[dict] = []  # the items the environment below was reset with (the in-process run's roles are objects here)


class FieldEnv:
    """One turn: reward 1 where the answer holds the record's `target` field, which the environment reads instead of
    a label (there is none)."""

    def reset(self, item: dict) -> None:
        SEEN.append({"label": item["label"], "fields": item["fields"]})
        self.target = str(item["fields"]["target"])

    def step(self, action: str):
        return None, float(self.target in action), True


def unlabelled(path: Path, n: int = 4) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"repeat {i}", "target": i}) + "\n" for i in range(n)))
    return path


def test_a_file_without_labels_needs_none_where_nothing_reads_them(tmp_path):
    data = unlabelled(tmp_path / "train.jsonl")
    evals = unlabelled(tmp_path / "held.jsonl", 2)
    cfg = load_config(["data=jsonl", f"data.path={data}", f"data.env={__name__}:FieldEnv", "data.reward=none",
                       f"+data.eval_sets={{held:{evals}}}", "train.eval_interval=5"])
    pre = preflight(cfg, only=("model", "tokenizer", "data"))
    assert pre.ok, pre.problems
    assert [(item.label, item.fields) for item in pre.train_set] == [("", {"target": i}) for i in range(4)]
    assert [item.label for item in pre.eval_sets["held"]] == ["", ""]
    from relax.config.derive import label_reader

    assert label_reader(cfg) is None


@pytest.mark.parametrize("overrides, reader", [
    (["data.reward=digits"], "data.reward=digits"),
    (["data.reward=[digits,arithmetic]"], "data.reward=['digits', 'arithmetic']"),
    (["data.reward=none", "reward_model=judge", "reward_model.engine=openai", "reward_model.url=http://127.0.0.1:9/v1",
      "reward_model.model=m", "reward_model.template='Is {response} {label}?'"], "reward_model.template's {label}"),
])
def test_a_record_without_the_label_its_reward_reads_is_refused_naming_the_reader(tmp_path, overrides, reader):
    data = unlabelled(tmp_path / "train.jsonl")
    cfg = load_config(["data=jsonl", f"data.path={data}", *overrides])
    pre = preflight(cfg, only=("model", "tokenizer", "data"))
    assert pre.problems["data"] == (f"{data}:1: missing key 'label' (data.label_key), the label {reader} reads; "
                                    "record has keys ['prompt', 'target']")


def test_a_judge_or_classifier_that_reads_no_label_needs_none():
    judge = ["data.reward=none", "reward_model=judge", "reward_model.engine=openai", "reward_model.url=http://h:9/v1",
             "reward_model.model=m", "reward_model.template='Is {response} right?'"]
    from relax.config.derive import label_reader

    assert label_reader(load_config(judge)) is None
    assert label_reader(load_config(["data.reward=none", "reward_model=classifier", "reward_model.path=/m"])) is None


def test_an_environment_trains_on_a_file_without_labels(in_process, small_run, tmp_path):
    """The whole run, on the tiny model: the environment is reset with label "" and its record's fields, scores the
    answers itself, and the run trains its steps."""
    from relax.runner.train import run

    SEEN.clear()
    data = unlabelled(tmp_path / "train.jsonl")
    result = run(load_config(small_run("data=jsonl", f"data.path={data}", f"data.env={__name__}:FieldEnv",
                                       "data.reward=none", "rollout.max_response_len=8", steps=2)),
                 output_dir=tmp_path / "out")
    assert [s for s, _ in result.history] == [0, 1]
    assert SEEN and all(seen["label"] == "" and set(seen["fields"]) == {"target"} for seen in SEEN)
