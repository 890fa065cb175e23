"""The launcher's pure parts: arm names, per-job overrides, the table; the sweep tags of a run."""

import io
import os
import sys
from types import SimpleNamespace

from hydra.core.override_parser.overrides_parser import OverridesParser
from terminal_streams import TerminalOrNot

from hydra_plugins.relax_ray_launcher.sweep import (
    JobRow,
    derive_arms,
    format_table,
    quote,
    swept_keys,
    tracking_overrides,
)
from relax.runner.ray_logs import plain_ray_log_prefix
from relax.tracking.params import TAG_OVERRIDES, TAG_SWEEP_ID, overrides_text, standard_tags


def test_arm_is_the_swept_keys_other_than_seed():
    jobs = [["algorithm=rloo", "seed=1", "train.lr=1"], ["algorithm=rloo", "seed=2", "train.lr=1"],
            ["algorithm=grpo", "seed=1", "train.lr=1"], ["algorithm=grpo", "seed=2", "train.lr=1"]]
    assert swept_keys(jobs) == ["algorithm"]
    assert derive_arms(jobs) == ["algorithm=rloo", "algorithm=rloo", "algorithm=grpo", "algorithm=grpo"]


def test_several_swept_keys_are_joined_with_a_comma():
    jobs = [["algorithm=m2po", "algorithm.kl2_budget=0.01", "seed=1"],
            ["algorithm=m2po", "algorithm.kl2_budget=0.02", "seed=1"],
            ["algorithm=grpo", "+algorithm.kl2_budget=0.02", "seed=1"]]
    assert derive_arms(jobs) == ["algorithm=m2po,algorithm.kl2_budget=0.01", "algorithm=m2po,algorithm.kl2_budget=0.02",
                                 "algorithm=grpo,algorithm.kl2_budget=0.02"]


def test_a_seed_only_sweep_has_no_arm():
    assert derive_arms([["seed=1", "algorithm=rloo"], ["seed=2", "algorithm=rloo"]]) == [None, None]


def test_tracking_overrides_survive_hydra_parsing():
    arm = "algorithm=m2po,algorithm.kl2_budget=0.02 it's"
    parser = OverridesParser.create()
    parsed = parser.parse_overrides(tracking_overrides(sweep_id="s-1", parent_run_id="abc", arm=arm))
    values = {o.key_or_group: o.value() for o in parsed}
    assert values == {"tracking.parent_run_id": "abc", "tracking.sweep_id": "s-1", "tracking.arm": arm}
    assert not any(o.is_sweep_override() for o in parsed)
    assert quote("a") == "'a'"


def test_table_lists_every_job_and_the_errors():
    text = format_table([JobRow(1, "seed=2", "FAILED", None, None, 3.0, "boom"),
                         JobRow(0, "seed=1", "FINISHED", "r0", 0.5, 12.0)], sweep_id="S", parent_run_id="P")
    lines = text.splitlines()
    assert "1 of 2 jobs finished" in lines[0] and "P" in lines[0]
    assert lines[3].split()[:3] == ["0", "seed=1", "FINISHED"] and "r0" in lines[3] and "0.5000" in lines[3]
    assert lines[4].split()[:3] == ["1", "seed=2", "FAILED"]
    assert lines[-1] == "job 1 failed: boom"


def test_standard_tags_carry_the_sweep_id_only_in_a_sweep():
    cfg = SimpleNamespace(algorithm=SimpleNamespace(name="rloo"), model=SimpleNamespace(name="tiny"), seed=3,
                          data=SimpleNamespace(name="digits"), cluster=SimpleNamespace(name="local"),
                          tracking=SimpleNamespace(arm=None, sweep_id=None))
    assert TAG_SWEEP_ID not in standard_tags(cfg) and standard_tags(cfg)["arm"] == "rloo"
    cfg.tracking = SimpleNamespace(arm="algorithm=rloo", sweep_id="S")
    tags = standard_tags(cfg)
    assert tags[TAG_SWEEP_ID] == "S" and tags["arm"] == "algorithm=rloo" and tags["seed"] == "3"


def test_overrides_tag_leaves_out_the_launcher_bookkeeping():
    assert TAG_OVERRIDES == "overrides"
    assert overrides_text(["algorithm=rloo", "seed=1", "tracking.parent_run_id='x'", "tracking.sweep_id='s'",
                           "tracking.arm='algorithm=rloo'"]) == "algorithm=rloo seed=1"


def test_table_shows_in_full_the_overrides_that_tell_jobs_apart():
    """The overrides column held the first 60 characters of each job's overrides, so a sweep with a long common
    prefix (+experiment=..., algorithm=...) lost its seeds: `4  +experiment=rloo_vs_grpo_cpu algorithm=reinforce_pp
    seed=...`. Now the column holds, whole, the overrides that differ between the jobs, and those they share are said
    once above the table. Control: a sweep whose jobs all have the same overrides still shows them."""
    common = "+experiment=rloo_vs_grpo_cpu train.num_rollout=25 train.eval_interval=5"
    jobs = [(a, s) for a in ("rloo", "reinforce_pp") for s in (1, 2)]
    rows = [JobRow(i, f"+experiment=rloo_vs_grpo_cpu algorithm={a} seed={s} train.num_rollout=25 "
                      "train.eval_interval=5", "FINISHED", f"run{i}", 0.5, 10.0) for i, (a, s) in enumerate(jobs)]
    lines = format_table(rows, sweep_id="S").splitlines()
    assert f"overrides of every job: {common}" in lines
    body = {line.split()[0]: line.split() for line in lines if line[:1].isdigit()}
    for i, (a, s) in enumerate(jobs):
        assert body[str(i)][1:4] == [f"algorithm={a}", f"seed={s}", "FINISHED"], body[str(i)]
    same = format_table([JobRow(0, "seed=1 x=2", "FAILED"), JobRow(1, "seed=1 x=2", "FINISHED")]).splitlines()
    assert [line.split()[:3] for line in same if line[:1].isdigit()] == [["0", "seed=1", "x=2"], ["1", "seed=1", "x=2"]]


def test_ray_prints_the_jobs_line_prefix_without_colour_unless_both_streams_are_terminals(monkeypatch):
    """A sweep's output sent to a file carries no ANSI codes around Ray's `(_execute_job pid=...)` prefix; on a
    terminal, and where the user set RAY_COLOR_PREFIX, Ray's own choice stays. Checked with Ray's printer itself."""
    from ray._private.worker import print_worker_logs

    line = {"pid": "4242", "ip": "127.0.0.1", "localhost": "127.0.0.1", "task_name": "_execute_job",
            "lines": ["step 1"]}

    def printed(environ: dict) -> str:
        monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
        for k, v in environ.items():
            monkeypatch.setenv(k, v)
        out = io.StringIO()
        print_worker_logs(line, out)
        return out.getvalue()

    tty, pipe = TerminalOrNot(True), TerminalOrNot(False)
    for streams in [(pipe, tty), (tty, pipe), (object(), object())]:
        env: dict = {}
        plain_ray_log_prefix(env, streams)
        assert env == {"RAY_COLOR_PREFIX": "0"}
        assert printed(env) == "(_execute_job pid=4242) step 1\n"
    env = {}
    plain_ray_log_prefix(env, (tty, tty))  # a terminal: Ray colours the prefix, as before
    assert env == {} and "\x1b[" in printed(env)
    env = {"RAY_COLOR_PREFIX": "1"}
    plain_ray_log_prefix(env, (pipe, pipe))  # the user's setting wins
    assert env == {"RAY_COLOR_PREFIX": "1"}


def test_the_sweeps_ray_starts_without_colour_when_output_is_not_a_terminal(monkeypatch):
    """The launcher decides through plain_ray_log_prefix (relax.runner.ray_logs, which a single run's RayRuntime
    also calls: tests/runner/test_ray_runtime.py): with stdout a file, ray.init runs with RAY_COLOR_PREFIX=0; on a
    terminal, it stays unset."""
    import ray
    from omegaconf import OmegaConf

    from hydra_plugins.relax_ray_launcher.launcher import RelaxRayLauncher

    seen: list = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda address=None, **kwargs: seen.append(os.environ.get("RAY_COLOR_PREFIX")))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    sweep = RelaxRayLauncher()
    sweep.config = OmegaConf.create({})
    for tty, expected in ((False, "0"), (True, None)):
        monkeypatch.setenv("RAY_COLOR_PREFIX", "unset")
        monkeypatch.delenv("RAY_COLOR_PREFIX")  # restored (unset) after the test, whatever the start sets
        monkeypatch.setattr(sys, "stdout", TerminalOrNot(tty))
        monkeypatch.setattr(sys, "stderr", TerminalOrNot(tty))
        sweep._init_ray()
        assert seen[-1] == expected, tty
    assert len(seen) == 2
