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


def _older_checkpoint(tmp_path, drop: str, *overrides: str):
    """A checkpoint whose config lacks `drop`, as one written by a Relax version before that field was added."""
    save = tmp_path / "save"
    ckpt = save / "step_000002"
    ckpt.mkdir(parents=True)
    saved = flatten_config(load_config([f"train.save_dir={save}", *overrides]))
    del saved[drop]
    (ckpt / STATE).write_text(json.dumps({"step": 2, "config": saved}))
    return save, ckpt


def test_a_field_added_since_the_checkpoint_at_its_default_does_not_block_the_resume(tmp_path, capsys):
    """Upgrading Relax (a commit that adds a config field) must not strand every checkpoint written before: the
    field is missing from their config, and at its default (which keeps what runs did before it) it is no change."""
    save, ckpt = _older_checkpoint(tmp_path, "data.max_failed_reward_steps", "algorithm=rloo")
    cfg = load_config([f"train.save_dir={save}", "algorithm=rloo", f"train.resume={ckpt}"])
    point = resume_point(cfg, save)
    assert point is not None and point.path == ckpt and set(point.changed) == {"train.resume"}
    err = capsys.readouterr().err
    assert f"checkpoint {ckpt} was written before data.max_failed_reward_steps (now 3) existed" in err
    # an algorithm's own field (algorithm.*: its config class's default)
    save, ckpt = _older_checkpoint(tmp_path / "a", "algorithm.eps_clip", "algorithm=rloo")
    assert resume_point(load_config([f"train.save_dir={save}", "algorithm=rloo", f"train.resume={ckpt}"]), save)


def test_controls_an_added_field_set_to_another_value_or_a_removed_field_still_refuse(tmp_path):
    save, ckpt = _older_checkpoint(tmp_path, "data.max_failed_reward_steps")
    cfg = load_config([f"train.save_dir={save}", "data.max_failed_reward_steps=5", f"train.resume={ckpt}"])
    with pytest.raises(RunError, match=r"data.max_failed_reward_steps: None -> 5\n"):
        resume_point(cfg, save)
    # a field the checkpoint has and this version lacks (removed since): refused as before
    save, ckpt = _older_checkpoint(tmp_path / "b", "data.max_failed_reward_steps")
    state = json.loads((ckpt / STATE).read_text())
    state["config"]["train.gone_field"] = "1"
    state["config"]["data.max_failed_reward_steps"] = "3"
    (ckpt / STATE).write_text(json.dumps(state))
    with pytest.raises(RunError, match=r"train.gone_field: 1 -> None\n"):
        resume_point(load_config([f"train.save_dir={save}", f"train.resume={ckpt}"]), save)
