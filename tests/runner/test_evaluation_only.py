"""Evaluation without training (docs/training.md, "Evaluation"): `train.num_rollout=0` evaluates the starting weights
once, and a run resumed at its end evaluates its final weights once. Checked against the evaluations a training run
logged of the same weights (evaluation draws fixed random streams, so the same weights give the same numbers), with
the tiny model, in-process roles and a real MLflow store."""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from relax.cli import verify_run
from relax.config import load_config
from relax.config.validate import ConfigError
from relax.metrics import EVAL_STEP_TAG, EVAL_STEP_WEIGHTS
from relax.runner.checkpoint import STATE, config_differences, resume_point, step_dir
from relax.runner.errors import RunError
from relax.runner.train import run
from relax.tracking.params import flatten_config

# the eval config of every run here: 4 sampled responses per prompt, so that a change of the weights shows
EVAL = ("train.eval_interval=1", "data.num_eval_prompts=4", "rollout.eval_n_samples_per_prompt=4",
        "rollout.eval_temperature=1.0", "train.lr=0.05", "model.dtype=float32")


def eval_history(client: MlflowClient, run_id: str) -> dict[int, dict[str, float]]:
    """step -> {eval/...: value} as the MLflow run holds them."""
    out: dict[int, dict[str, float]] = {}
    for key in (k for k in client.get_run(run_id).data.metrics if k.startswith("eval/")):
        for m in client.get_metric_history(run_id, key):
            out.setdefault(m.step, {})[key] = m.value
    return out


@pytest.mark.slow
def test_each_checkpoint_evaluated_alone_logs_the_training_runs_evaluation_of_it_at_the_same_step(
        in_process, small_run, tmp_path, capsys):
    """Train 2 steps, evaluating after each and saving each (steps 1 and 2 kept); then each checkpoint is resumed with
    nothing left to train, with one more eval set. An evaluation is logged at the number of training steps in the
    weights it evaluated, in both kinds of run: checkpoint k's evaluation alone is logged at step k with, bit for
    bit, the values the training run logged at step k; the other checkpoint's differ (the control). Evaluating the
    older checkpoint leaves the run's ledger as the training wrote it: relax-verify-run passes after each."""
    extra = tmp_path / "extra.jsonl"
    extra.write_text("".join(json.dumps({"prompt": f"repeat {d}", "label": str(d)}) + "\n" for d in range(3, 7)))
    trained = run(load_config(small_run(*EVAL, "train.save_interval=1")), output_dir=tmp_path / "out")
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    before = eval_history(client, trained.run_id)
    assert client.get_run(trained.run_id).data.tags[EVAL_STEP_TAG] == EVAL_STEP_WEIGHTS
    # each checkpoint records the prompt sets as the MLflow run's dataset log holds them (name, digest, size), which
    # the resumes below are checked against (`checkpoint.check_run_data`: the files are unchanged, so they continue)
    logged = {(i.dataset.name, i.dataset.digest, json.loads(i.dataset.profile)["num_prompts"])
              for i in client.get_run(trained.run_id).inputs.dataset_inputs}
    for k in (1, 2):
        recorded = json.loads((step_dir(tmp_path / "ckpt", k) / STATE).read_text())["run_data"]
        assert {(r["name"], r["digest"], r["num_prompts"]) for r in recorded} == logged
        assert {r["context"] for r in recorded} == {"train", "eval"}

    alone: dict[int, dict[str, float]] = {}
    # checkpoint 2 with another interval: it may change on resume (only evaluation reads it)
    for k, interval in ((1, 1), (2, 5)):
        capsys.readouterr()
        again = run(load_config(small_run(*EVAL, f"train.eval_interval={interval}",
                                          f"+data.eval_sets={{extra:'{extra}'}}",
                                          f"train.resume={step_dir(tmp_path / 'ckpt', k)}", "tracking.progress=true",
                                          steps=k)),
                    output_dir=tmp_path / f"out{k}")
        assert again.run_id == trained.run_id  # the same MLflow run, reopened
        assert [step for step, _ in again.history] == [k]  # logged at the checkpoint's step
        alone[k] = {key: v for key, v in again.history[0][1].items() if key.startswith("eval/digits/")}
        # the training run's evaluation of the same weights, at the same step: bit for bit
        assert alone[k] == before.get(k), (k, alone[k], before)
        # MLflow keeps the training run's values at step k (the same ones) and the run says so; the added set is new
        # there, and recorded at step k
        err = capsys.readouterr().err
        assert f"MLflow run {trained.run_id} already holds an earlier evaluation of these weights at step {k} for " \
               f"eval set(s) digits ({len(before[k])} of this evaluation's metrics" in err
        after = eval_history(client, trained.run_id)
        assert {key: v for key, v in after[k].items() if key.startswith("eval/extra/")} == \
            {key: v for key, v in again.history[0][1].items() if key.startswith("eval/extra/")} != {}
        summary = err[err.index("Relax run finished"):]
        assert summary.startswith("Relax run finished (evaluation only: nothing trained)")
        assert f"the checkpoint of step {k}" in summary and f"eval digits (step {k})" in summary
        assert not any(key.startswith(("train/", "rollout/")) for _, m in again.history for key in m)
        # the run's record of what it trained stays (checkpoint 1's ledger holds 1 of its 2 steps): it verifies
        report = verify_run.verify(trained.run_id, f"sqlite:///{tmp_path}/mlflow.db")
        assert report.ok, (k, report.text())
    assert alone[1] != alone[2]  # the control: the training changed what evaluation measures
    assert sorted(before) == sorted(eval_history(client, trained.run_id)) == [1, 2]  # no evaluation on another step
    tags = client.get_run(trained.run_id).data.tags
    assert "train.eval_interval: 1 -> 5" in tags["relax.resumed"]
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_000001", "step_000002"]  # no new one
    report = verify_run.verify(trained.run_id, f"sqlite:///{tmp_path}/mlflow.db")  # the run with them verifies
    assert report.ok, report.text()


@pytest.mark.slow
def test_num_rollout_0_evaluates_the_initial_weights_once(in_process, small_run, tmp_path, capsys):
    result = run(load_config(small_run("data.num_eval_prompts=4", "tracking.progress=true", steps=0)),
                 output_dir=tmp_path / "out")
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    logged = client.get_run(result.run_id)
    assert logged.info.status == "FINISHED"
    names = set(logged.data.metrics)
    assert {"eval/digits/mean_at_1", "eval/digits/pass_at_1", "eval/digits/response_len"} <= names
    assert not [k for k in names if not k.startswith(("eval/", "system/"))]  # no train/*, rollout/*, perf/*
    assert [m.step for m in client.get_metric_history(result.run_id, "eval/digits/mean_at_1")] == [0]
    assert logged.data.tags[EVAL_STEP_TAG] == EVAL_STEP_WEIGHTS  # step 0: the weights of no training step
    assert [step for step, _ in result.history] == [0]
    assert not (tmp_path / "ckpt").exists()  # nothing trained: no checkpoint, not even its directory
    err = capsys.readouterr().err
    summary = err[err.index("Relax run finished"):]
    assert summary.startswith("Relax run finished (evaluation only: nothing trained)")
    assert "the initial weights of model tiny" in summary and "eval digits (step 0)" in summary
    assert "reward" not in summary.replace("reward_errors", "") and "nan" not in summary


def messages(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        load_config(list(overrides))
    return [v.message for v in exc.value.violations]


def test_num_rollout_0_needs_an_eval_set_and_refuses_what_only_training_does():
    assert messages("train.num_rollout=0", "data.num_eval_prompts=0") == [
        "train.num_rollout=0 (an evaluation-only run) needs eval prompts, but data.num_eval_prompts=0"]
    found = messages("train.num_rollout=0", "data=jsonl", "data.path=/tmp/prompts.jsonl", "train.save_interval=5",
                     "train.save_hf=true")
    assert "train.num_rollout=0 (an evaluation-only run) needs eval prompts: set data.eval_path or data.eval_sets " \
           "for data.task=file" in found
    assert "train.save_interval=5 has no effect: train.num_rollout=0 (evaluation only) trains nothing and writes no " \
           "checkpoint" in found
    assert any(m.startswith("train.save_hf=True has no effect: train.num_rollout=0") for m in found)
    assert messages("train.num_rollout=-1") == ["train.num_rollout=-1 must be >= 0"]
    # any train.eval_interval: num_rollout=0 evaluates once whatever it holds, and the eval options act
    for interval in (0, 3):
        cfg = load_config(["train.num_rollout=0", f"train.eval_interval={interval}", "rollout.eval_temperature=1.0"])
        assert cfg.train.num_rollout == 0


def checkpoint_of(tmp_path, *overrides: str, step: int = 2):
    """A checkpoint directory whose state.json records the config of `overrides` (a resume reads only that)."""
    ckpt = step_dir(tmp_path / "save", step)
    ckpt.mkdir(parents=True)
    saved = flatten_config(load_config([f"train.save_dir={tmp_path / 'save'}", *overrides]))
    (ckpt / STATE).write_text(json.dumps({"step": step, "config": saved, "sampler": {}}))
    return ckpt


def test_evaluation_fields_may_change_on_resume(tmp_path):
    eval_file = tmp_path / "a.jsonl"
    eval_file.write_text(json.dumps({"prompt": "repeat 3", "label": "3"}) + "\n")
    ckpt = checkpoint_of(tmp_path, "train.eval_interval=1")
    cfg = load_config([f"train.save_dir={tmp_path / 'save'}", f"train.resume={ckpt}", "train.eval_interval=7",
                       "data.num_eval_prompts=8", "rollout.eval_n_samples_per_prompt=4", "rollout.eval_temperature=1.0",
                       "rollout.eval_top_p=0.9", "train.eval_pass_k=[1,4]", "train.eval_correct_threshold=0.5",
                       "train.eval_save_samples=true",
                       f"+data.eval_sets={{b:'{eval_file}',c:{{path:'{eval_file}',prompt_key:prompt}}}}"])
    point = resume_point(cfg, tmp_path / "save", hashes=False)
    assert {"train.eval_interval", "data.num_eval_prompts", "rollout.eval_n_samples_per_prompt",
            "rollout.eval_temperature", "rollout.eval_top_p", "train.eval_correct_threshold",
            "train.eval_save_samples", "data.eval_sets.b", "data.eval_sets.c.path",
            "data.eval_sets.c.prompt_key"} <= set(point.changed)
    assert any(k.startswith("train.eval_pass_k") for k in point.changed)
    # data.eval_path (a file task's eval set; the digits task above refuses it): allowed the same way
    refused, allowed = config_differences({"data.eval_path": "a.jsonl"}, {"data.eval_path": "b.jsonl"})
    assert refused == {} and allowed == {"data.eval_path": ("a.jsonl", "b.jsonl")}
    # the control: a field that changes what a step computes is still refused
    refused, _ = config_differences({"train.lr": "0.001"}, {"train.lr": "0.01"})
    assert refused == {"train.lr": ("0.001", "0.01")}


def test_the_interval_stays_where_evaluation_publishes_weights_the_rollouts_use(tmp_path):
    """fully_async with weight_sync_interval > 1: the weights published before an evaluation reach later rollouts, so
    a new interval would change the remaining steps: refused while steps are left, accepted at the end."""
    mode = ("train.mode=fully_async", "train.max_staleness=2", "train.weight_sync_interval=2")
    ckpt = checkpoint_of(tmp_path, *mode, "train.eval_interval=1", "train.num_rollout=4")
    base = [f"train.save_dir={tmp_path / 'save'}", f"train.resume={ckpt}", *mode, "train.eval_interval=2"]
    with pytest.raises(RunError) as exc:
        resume_point(load_config([*base, "train.num_rollout=4"]), tmp_path / "save", hashes=False)
    assert "train.eval_interval: 1 -> 2" in str(exc.value)
    assert "train.eval_interval cannot change here: with train.mode=fully_async" in str(exc.value)
    point = resume_point(load_config([*base, "train.num_rollout=2"]), tmp_path / "save", hashes=False)
    assert "train.eval_interval" in point.changed  # nothing left to train: only the evaluation reads it
