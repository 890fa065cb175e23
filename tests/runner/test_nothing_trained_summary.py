"""A run shorter than `data.max_failed_reward_steps` whose every step left every group out (an agent program, an
environment or a reward function failing every episode) finishes, as docs/agents.md says; its closing summary says
that nothing was trained and which steps lost every group, instead of a bare "final reward nan". Checked on the
`Session` that logs the steps and prints the summary, without Ray; the control is a run with one step that kept a
group, whose summary is the usual one."""

from __future__ import annotations

import contextlib
import io
import math
import re
from pathlib import Path

from relax.config import load_config
from relax.metrics import RAW_REWARD


def summary_of(tmp: Path, kept: list[bool], *overrides: str) -> str:
    """The summary block a Session prints after logging one step per `kept` (False: every group left out, so the
    step's raw reward is NaN, as rollout_metrics gives it)."""
    from relax.runner.plan import build_plan
    from relax.runner.session import Session

    cfg = load_config(["tracking.enabled=false", "tracking.progress=true", f"train.num_rollout={len(kept)}",
                       *overrides])
    err = io.StringIO()
    with contextlib.redirect_stderr(err), Session(cfg, build_plan(cfg), tmp / "out") as session:
        for step, k in enumerate(kept):
            session.log({RAW_REWARD: 0.5 if k else math.nan, "rollout/reward_dropped_frac": 0.0 if k else 1.0},
                        step, kept=k)
        session.finish()
    text = err.getvalue()
    return text[text.index("Relax run finished"):]


def row(block: str, label: str) -> str | None:
    found = re.search(rf"^  {re.escape(label)}  +(.+)$", block, re.M)
    return found.group(1) if found else None


def test_a_run_whose_every_group_was_left_out_says_nothing_was_trained(tmp_path):
    block = summary_of(tmp_path, [False, False])
    assert block.splitlines()[0] == "Relax run finished (nothing trained: every group of every step was left out)"
    assert row(block, "left out") == ("every group of steps 1-2: their reward calls or episodes failed (the warnings "
                                      "above name each step's first failure); data.max_failed_reward_steps=3 in a "
                                      "row stop a run")
    assert "nan" not in block and row(block, "final reward") is None, block
    assert row(block, "steps") == "2"
    one = summary_of(tmp_path / "b", [False], "data.max_failed_reward_steps=0")
    assert row(one, "left out") == ("every group of step 1: their reward calls or episodes failed (the warnings above "
                                    "name each step's first failure)")


def test_a_run_with_a_kept_group_has_the_usual_summary(tmp_path):
    """The control: one step of two kept a group, so a step trained: its reward is the run's."""
    block = summary_of(tmp_path, [False, True])
    assert block.splitlines()[0] == "Relax run finished"
    assert row(block, "left out") is None
    assert row(block, "final reward") == "0.5" and row(block, "best reward") == "0.5"


def test_a_resumed_run_whose_new_steps_left_every_group_out_says_the_earlier_steps_trained(tmp_path):
    """A run resumed at step 3 (steps 1-3 trained, in the checkpoint it starts from) whose steps 4-5 lose every
    group: no step of this job trained, but the run did, so the title is not "nothing trained" (which contradicted
    its own "steps 5" row and the trained weights it exports). The resume is a stand-in `checkpoints` whose
    `resume.step` is 3, as Checkpoints gives a Session. Before: the "nothing trained" title."""
    import types

    from relax.runner.plan import build_plan
    from relax.runner.session import Session

    cfg = load_config(["tracking.enabled=false", "tracking.progress=true", "train.num_rollout=5"])
    resume = types.SimpleNamespace(step=3, path=tmp_path / "ckpt", tracker_state={}, tracking_uri=None, run_id=None,
                                   ledger=None, state={})
    checkpoints = types.SimpleNamespace(resume=resume, uses_dir=True, save_dir=tmp_path / "ckpts", attachments={})
    err = io.StringIO()
    with contextlib.redirect_stderr(err), Session(cfg, build_plan(cfg), tmp_path / "out",
                                                  checkpoints=checkpoints) as session:
        for step in (3, 4):
            session.log({RAW_REWARD: math.nan, "rollout/reward_dropped_frac": 1.0}, step, kept=False)
        session.finish()
    block = err.getvalue()[err.getvalue().index("Relax run finished"):]
    assert block.splitlines()[0] == ("Relax run finished (no step of this job trained: every group of steps 4-5 was "
                                     "left out; steps 1-3 trained before the resume)"), block
    assert row(block, "left out").startswith("every group of steps 4-5: ")
    assert row(block, "steps") == "5" and "nan" not in block
