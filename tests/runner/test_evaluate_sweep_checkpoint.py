"""Evaluating a sweep job's checkpoint with its saved config, without `-m` (docs/training.md, "Reusing a run's
config" and "MLflow across a resume"; tryout 'week', defects 1 and 4), with the tiny model, in-process roles and a
real MLflow sqlite store.

- The checkpoint's `config.yaml` names the sweep that saved it (`tracking.sweep_id`, `tracking.parent_run_id`); a
  later sweep's job that reopened the run moved it to that later sweep. An evaluation-only run of the checkpoint
  that no sweep launcher started keeps the run in the later sweep ("A job resumed on its own (no `-m`) keeps its
  sweep and parent"), so that sweep's `relax-compare` selection still finds it; a sweep job still moves it.
- An evaluation-only run of weights the run already evaluated at that step records an eval set whole or not at all:
  a sampled evaluation's pass@4 never lands beside the greedy evaluation's pass@1 at one step."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir
from mlflow import MlflowClient

from relax.config import load_config, to_relax_config
from relax.runner.checkpoint import step_dir
from relax.runner.train import run
from relax.tracking.compare import CompareError, select_runs
from relax.tracking.mlflow_run import PARENT_RUN_ID_TAG, PREVIOUS_SWEEP_TAG
from relax.tracking.params import TAG_SWEEP_ID

JOB_TAG = "relax.sweep_job"  # what the sweep launcher puts in each job's MLflow run context (its launcher.JOB_TAG)
GREEDY = ("train.eval_interval=1", "data.num_eval_prompts=4", "model.dtype=float32", "train.save_interval=1")
# the evaluation-only run's eval config: 4 sampled responses per prompt, pass@1 and pass@4
SAMPLED = ("rollout.eval_n_samples_per_prompt=4", "rollout.eval_temperature=1.0", "train.eval_pass_k=[1,4]",
           "tracking.progress=true")


def metric_steps(client: MlflowClient, run_id: str, prefix: str) -> dict[str, list[tuple[int, float]]]:
    """key -> [(step, value), ...] of the run's metrics under `prefix`, as the store holds them."""
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
            for key in client.get_run(run_id).data.metrics if key.startswith(prefix)}


def sweep_parent(client: MlflowClient, sweep_id: str, artifacts) -> str:
    """A sweep's parent run, as the launcher makes one (run name sweep-<id>, tagged sweep_id), in the experiment
    the jobs log to (made here, its artifacts under `artifacts`, where none is yet)."""
    experiment = client.get_experiment_by_name("relax")
    experiment_id = experiment.experiment_id if experiment else \
        client.create_experiment("relax", artifact_location=str(artifacts))
    parent = client.create_run(experiment_id, run_name=f"sweep-{sweep_id}", tags={TAG_SWEEP_ID: sweep_id})
    client.set_terminated(parent.info.run_id)
    return parent.info.run_id


def as_job(monkeypatch, sweep_id: str, parent_id: str, index: int) -> list[str]:
    """What the sweep launcher does for job `index` of its sweep: its run context names the job, and its command
    line gets the sweep's tracking overrides (hydra_plugins/relax_ray_launcher/sweep.py, tracking_overrides)."""
    monkeypatch.setenv("MLFLOW_RUN_CONTEXT", json.dumps({JOB_TAG: f"{sweep_id}/{index}"}))
    return [f"tracking.sweep_id='{sweep_id}'", f"tracking.parent_run_id='{parent_id}'"]


def evaluate_with_saved_config(ckpt, *extra: str):
    """`relax-train -cp <ckpt> -cn config train.resume=<ckpt> train.num_rollout=0 <extra>` as relax-train reads it
    (relax/cli/train.py: the composed config and its command line's overrides)."""
    overrides = [f"train.resume='{ckpt}'", "train.num_rollout=0", *extra]
    with initialize_config_dir(config_dir=str(ckpt), version_base=None):
        dc = compose(config_name="config", overrides=overrides)
    return to_relax_config(dc, overrides=overrides)


@pytest.mark.slow
def test_an_evaluation_without_m_keeps_the_run_in_the_sweep_that_last_reopened_it(
        in_process, small_run, tmp_path, monkeypatch, capsys):
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    small = small_run(*GREEDY, steps=1)  # the store first (small_run copies it in)
    first, second = "20260101-000000-aaaaaa", "20260102-000000-bbbbbb"
    p1 = sweep_parent(client, first, tmp_path / "mlruns")
    # sweep 1's job 0 trains and saves step 1: the checkpoint's config.yaml names sweep 1
    trained = run(load_config([*small, *as_job(monkeypatch, first, p1, 0)]), output_dir=tmp_path / "out1")
    ckpt = step_dir(tmp_path / "ckpt", 1)
    assert f"sweep_id: {first}" in (ckpt / "config.yaml").read_text()
    # sweep 2 (`-m ... train.resume=auto`) resumes it at its end: its job moves the run to sweep 2 (as before)
    p2 = sweep_parent(client, second, tmp_path / "mlruns")
    resumed = run(load_config([*small, "train.resume=auto", *as_job(monkeypatch, second, p2, 0)]),
                  output_dir=tmp_path / "out2")
    assert resumed.run_id == trained.run_id
    tags = client.get_run(trained.run_id).data.tags
    assert (tags[TAG_SWEEP_ID], tags[PARENT_RUN_ID_TAG], tags[PREVIOUS_SWEEP_TAG]) == (second, p2, first)
    assert tags[JOB_TAG] == f"{second}/0"

    # the documented evaluation of the checkpoint with its saved config, no -m: no launcher in this process
    monkeypatch.delenv("MLFLOW_RUN_CONTEXT")
    capsys.readouterr()
    cfg = evaluate_with_saved_config(ckpt)
    assert f"the saved config's tracking.sweep_id={first}, tracking.parent_run_id={p1} (the sweep that ran it) do " \
           "not apply to this run" in capsys.readouterr().err
    assert cfg.tracking.sweep_id is None and cfg.tracking.parent_run_id is None
    evaluated = run(cfg, output_dir=tmp_path / "out3")
    assert evaluated.run_id == trained.run_id  # the run, reopened
    tags = client.get_run(trained.run_id).data.tags
    # it stays in sweep 2, with sweep 2's parent; what it had before sweep 2 stays recorded as it was
    assert (tags[TAG_SWEEP_ID], tags[PARENT_RUN_ID_TAG], tags[PREVIOUS_SWEEP_TAG]) == (second, p2, first)
    # relax-compare's selection of sweep 2 (its default: the latest sweep) still holds the run; sweep 1's does not
    runs, _, found = select_runs(client)
    assert found == second and [r.info.run_id for r in runs] == [trained.run_id]
    with pytest.raises(CompareError, match="no runs match sweep"):
        select_runs(client, sweep=first)

    # the control: a job of a third sweep that evaluates the same checkpoint with the same saved config still moves
    # the run to its own sweep (the launcher's overrides are on its command line)
    third = "20260103-000000-cccccc"
    p3 = sweep_parent(client, third, tmp_path / "mlruns")
    cfg = evaluate_with_saved_config(ckpt, *as_job(monkeypatch, third, p3, 0))
    assert (cfg.tracking.sweep_id, cfg.tracking.parent_run_id) == (third, p3)
    run(cfg, output_dir=tmp_path / "out4")
    tags = client.get_run(trained.run_id).data.tags
    assert (tags[TAG_SWEEP_ID], tags[PARENT_RUN_ID_TAG], tags[PREVIOUS_SWEEP_TAG]) == (third, p3, second)


@pytest.mark.slow
def test_a_set_evaluated_again_at_its_step_is_recorded_whole_or_not_at_all(in_process, small_run, tmp_path, capsys):
    """A greedy evaluation at step 1 (pass@1 of 1 sample), then an evaluation-only run of checkpoint 1 with 4 sampled
    responses and pass@4, plus a set the run never evaluated: the greedy set keeps exactly what the training run
    recorded (no pass_at_4 / mean_at_4 beside its pass_at_1), the new set is recorded whole, and the warning says
    that none of the held set's metrics were recorded."""
    extra = tmp_path / "extra.jsonl"
    extra.write_text("".join(json.dumps({"prompt": f"repeat {d}", "label": str(d)}) + "\n" for d in range(3, 7)))
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    trained = run(load_config(small_run(*GREEDY, steps=1)), output_dir=tmp_path / "out1")
    before = metric_steps(client, trained.run_id, "eval/")
    assert "eval/digits/pass_at_1" in before and "eval/digits/pass_at_4" not in before
    ckpt = step_dir(tmp_path / "ckpt", 1)
    capsys.readouterr()
    cfg = evaluate_with_saved_config(ckpt, *SAMPLED, f"+data.eval_sets={{extra:'{extra}'}}")
    again = run(cfg, output_dir=tmp_path / "out2")
    assert again.run_id == trained.run_id
    err = capsys.readouterr().err
    new = again.history[0][1]  # this evaluation's values (the summary's)
    assert again.history[0][0] == 1 and "eval/digits/pass_at_4" in new and "eval/extra/pass_at_4" in new
    after = metric_steps(client, trained.run_id, "eval/")
    # the held set: exactly what the greedy evaluation recorded, nothing of the sampled one
    assert {k: v for k, v in after.items() if k.startswith("eval/digits/")} == before
    # the new set: every metric of this evaluation, at step 1
    assert {k: v for k, v in after.items() if k.startswith("eval/extra/")} == \
        {k: [(1, v)] for k, v in new.items() if k.startswith("eval/extra/")}
    digits = sum(k.startswith("eval/digits/") for k in new)
    assert "already holds an earlier evaluation of these weights at step 1 for eval set(s) digits" in err
    assert f"none of this evaluation's {digits} metric(s) of digits is recorded (its values are shown in the " \
           "summary only, its samples are in the output directory only) and the earlier values stay" in err
    assert "Relax run finished (evaluation only: nothing trained)" in err
    # the held set's samples stay out of the MLflow run; the new set's are among its artifacts
    artifacts = {f.path for f in client.list_artifacts(trained.run_id, "eval")}
    assert artifacts == {"eval/extra"}


def test_a_saved_configs_sweep_is_a_runs_only_where_its_command_line_sets_it(tmp_path, capsys):
    """The saved config of a sweep's job, reused for a new training run without -m (no train.resume): the new run
    joins no sweep (it is not a child of that sweep's parent, and has no sweep_id); its arm stays. Set on the command
    line (as the launcher sets each job's), the sweep is the command line's."""
    from omegaconf import OmegaConf

    saved = load_config(["tracking.sweep_id='20260101-000000-aaaaaa'", "tracking.parent_run_id=p1",
                         "tracking.arm='algorithm=grpo'", "seed=3"])
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(saved)))

    def loaded(*overrides: str):
        with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
            return to_relax_config(compose(config_name="config", overrides=list(overrides)), overrides=list(overrides))

    capsys.readouterr()
    fresh = loaded("seed=4")
    assert (fresh.tracking.sweep_id, fresh.tracking.parent_run_id, fresh.tracking.arm, fresh.seed) == \
        (None, None, "algorithm=grpo", 4)
    assert "tracking.sweep_id=20260101-000000-aaaaaa, tracking.parent_run_id=p1 (the sweep that ran it) do not " \
           "apply to this run" in capsys.readouterr().err
    job = loaded("seed=4", "tracking.sweep_id='20260102-000000-bbbbbb'", "tracking.parent_run_id=p2")
    assert (job.tracking.sweep_id, job.tracking.parent_run_id) == ("20260102-000000-bbbbbb", "p2")
    assert "do not apply to this run" not in capsys.readouterr().err
    # without the command line's overrides (a caller that has none), every value counts as set, as before
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        kept = to_relax_config(compose(config_name="config", overrides=["seed=4"]))
    assert (kept.tracking.sweep_id, kept.tracking.parent_run_id) == ("20260101-000000-aaaaaa", "p1")
