"""The config check of a resume (`relax.runner.checkpoint.config_differences`, `resume_point`): the refusal lists
the real leaf changes only."""

from __future__ import annotations

import json

import pytest

from relax.config import load_config
from relax.runner.checkpoint import STATE, config_differences, resume_point
from relax.runner.errors import RunError
from relax.tracking.params import flatten_config


def _eval_file(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"prompt": "repeat 3", "label": "3"}) + "\n")
    return path


def test_an_eval_set_added_on_resume_is_one_field_not_two(tmp_path):
    """`data.eval_sets` is flattened to "{}" when empty and to its leaves when filled: a difference names
    `data.eval_sets.a` alone, not also a spurious `data.eval_sets: {} -> None` (checked here with nothing allowed to
    change; an eval set may change on resume, so by default it is an allowed difference, the same one leaf)."""
    path = _eval_file(tmp_path)
    before = flatten_config(load_config(["train.eval_interval=1"]))
    after = flatten_config(load_config(["train.eval_interval=1", f"+data.eval_sets={{a:{path}}}"]))
    assert before["data.eval_sets"] == "{}" and "data.eval_sets" not in after  # the two flattenings
    refused, allowed = config_differences(before, after, allowed=())
    assert refused == {"data.eval_sets.a": (None, str(path))} and allowed == {}
    refused, allowed = config_differences(before, after)
    assert refused == {} and allowed == {"data.eval_sets.a": (None, str(path))}
    refused, _ = config_differences(after, before, allowed=())  # and the other way round
    assert refused == {"data.eval_sets.a": (str(path), None)}
    # an empty list against its filled items (x.0.a): the items only
    refused, _ = config_differences({"x.l": "[]"}, {"x.l.0.a": "1"})
    assert refused == {"x.l.0.a": (None, "1")}


def test_the_refusal_message_lists_only_the_leaf(tmp_path):
    path = _eval_file(tmp_path)
    ckpt = tmp_path / "save" / "step_000002"
    ckpt.mkdir(parents=True)
    saved = flatten_config(load_config(["train.eval_interval=1", f"train.save_dir={tmp_path / 'save'}"]))
    (ckpt / STATE).write_text(json.dumps({"step": 2, "config": saved}))
    cfg = load_config(["train.eval_interval=1", f"train.save_dir={tmp_path / 'save'}", f"+data.eval_sets={{a:{path}}}",
                       f"train.resume={ckpt}", "train.lr=0.01"])
    with pytest.raises(RunError) as exc:
        resume_point(cfg, tmp_path / "save")
    text = str(exc.value)
    # the eval set may change on resume (only evaluation reads it): the one refused field is the learning rate
    assert "(1 field differs, checkpoint -> now):\n  train.lr: 0.001 -> 0.01\n" in text
    assert "data.eval_sets" not in text.split("Only")[0]


def test_controls_a_marker_without_leaves_and_a_real_change_are_still_differences():
    # an empty mapping against a field that is missing altogether (another version's schema): a real difference
    refused, _ = config_differences({"x.m": "{}"}, {})
    assert refused == {"x.m": ("{}", None)}
    # "{}" against a leaf of another key that only shares the prefix is not a parent of it
    refused, _ = config_differences({"x.m": "{}"}, {"x.mm": "1"})
    assert refused == {"x.m": ("{}", None), "x.mm": (None, "1")}
    # a changed leaf stays
    refused, _ = config_differences({"data.eval_sets.a": "p"}, {"data.eval_sets.a": "q"}, allowed=())
    assert refused == {"data.eval_sets.a": ("p", "q")}
