"""Each evaluation's samples (`train.eval_save_samples`, docs/training.md "Evaluation"): an eval set's responses with
their rewards, written as eval/<set>/step_<k>.jsonl in the job's output directory and among the MLflow run's
artifacts. The logged metrics are recomputed here from the written records alone, by brute force (every k-subset of
a prompt's responses), independently of `relax.runner.step_metrics`; with the tiny model, in-process roles and a real
MLflow store. The eval set is a file keyed problem/answer on the generated digits task (its keys named per set)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from relax.cli import verify_run
from relax.config import load_config
from relax.runner.train import run

N, KS, THRESHOLD, PROMPTS = 4, (1, 2, 4), 0.5, 4


def problem_file(path: Path) -> Path:
    """A MATH-style eval file: keys problem/answer (not Relax's prompt/label), 6 two-digit prompts."""
    path.write_text("".join(json.dumps({"problem": f"repeat {d}", "answer": str(d)}) + "\n" for d in range(10, 16)))
    return path


def brute_pass_at_k(correct: list[bool], k: int) -> float:
    """The share of k-subsets of the responses that hold a correct one (what pass@k estimates, enumerated)."""
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


def recomputed(records: list[dict]) -> dict[str, float]:
    """mean@n, pass@k, response length and truncated share of one set, from its records alone."""
    by_prompt: dict[int, list[dict]] = {}
    for r in records:
        by_prompt.setdefault(r["prompt_index"], []).append(r)
    out = {f"mean_at_{N}": sum(sum(r["reward"] for r in rs) / len(rs) for rs in by_prompt.values()) / len(by_prompt)}
    for k in KS:
        out[f"pass_at_{k}"] = sum(brute_pass_at_k([r["reward"] >= THRESHOLD for r in rs], k)
                                  for rs in by_prompt.values()) / len(by_prompt)
    out["response_len"] = sum(r["response_len"] for r in records) / len(records)
    out["truncated_frac"] = sum(r["truncated"] for r in records) / len(records)
    return out


@pytest.mark.slow
def test_an_evaluation_only_run_writes_each_sample_and_its_metrics_follow_from_them(in_process, small_run, tmp_path,
                                                                                     capsys):
    data = problem_file(tmp_path / "math.jsonl")
    cfg = load_config(small_run(f"data.num_eval_prompts={PROMPTS}", f"rollout.eval_n_samples_per_prompt={N}",
                                "rollout.eval_temperature=1.0", f"train.eval_pass_k=[{','.join(map(str, KS))}]",
                                f"train.eval_correct_threshold={THRESHOLD}", "tracking.progress=true",
                                f"+data.eval_sets={{math:{{path:'{data}',prompt_key:problem,label_key:answer}}}}",
                                steps=0))
    assert cfg.train.eval_save_samples is None  # on by default for an evaluation-only run
    result = run(cfg, output_dir=tmp_path / "out")
    logged = dict(result.history[0][1])
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    seen_correct = 0
    for eval_set in ("digits", "math"):
        local = tmp_path / "out" / "eval" / eval_set / "step_000000.jsonl"
        text = local.read_text()
        # the MLflow artifact holds the same lines
        assert Path(client.download_artifacts(result.run_id, f"eval/{eval_set}/step_000000.jsonl",
                                              str(tmp_path / f"dl_{eval_set}"))).read_text() == text
        records = [json.loads(line) for line in text.splitlines()]
        assert len(records) == PROMPTS * N
        assert [(r["prompt_index"], r["sample"]) for r in records] == [(i, j) for i in range(PROMPTS) for j in range(N)]
        assert not any(r["reward_error"] for r in records)
        assert all(r["correct"] == (r["reward"] >= THRESHOLD) for r in records)
        assert all(r["truncated"] == (r["finish_reason"] == "length") for r in records)
        seen_correct += sum(r["correct"] for r in records)
        for metric, value in recomputed(records).items():
            assert logged[f"eval/{eval_set}/{metric}"] == pytest.approx(value, abs=1e-12), (eval_set, metric)
    math = [json.loads(line) for line in (tmp_path / "out/eval/math/step_000000.jsonl").read_text().splitlines()]
    # the file's own keys were read: its prompts and answers, where they came from
    assert {(r["label"], r["source"]) for r in math} == {(str(10 + i), f"{data}:{i + 1}") for i in range(PROMPTS)}
    assert all(f"repeat {r['label']}" in r["prompt"] for r in math)
    assert 0 < seen_correct  # the pass@k checks above compare something (threshold 0.5: digits' partial credit)
    err = capsys.readouterr().err
    assert "eval samples" in err and "step_<k>.jsonl (2 files, also among the MLflow run's artifacts)" in err
    # relax-verify-run says what the run is: one evaluation, no training step
    report = verify_run.verify(result.run_id, f"sqlite:///{tmp_path}/mlflow.db")
    assert report.ok, report.text()
    assert ("evaluation only", f"{len(logged)} eval metrics at step 0 (train.num_rollout=0: no step trained)") \
        in report.facts
    assert "samples a step" not in report.text() and "checkpoint directory" not in report.text()


@pytest.mark.slow
def test_a_training_run_writes_the_samples_of_each_evaluation_when_asked(in_process, small_run, tmp_path):
    """eval_save_samples=true in a training run: one file per evaluation, at the step its metrics are logged."""
    result = run(load_config(small_run("train.eval_interval=1", "data.num_eval_prompts=2",
                                       "train.eval_save_samples=true", steps=2)),
                 output_dir=tmp_path / "out")
    files = sorted(p.name for p in (tmp_path / "out" / "eval" / "digits").iterdir())
    assert files == ["step_000001.jsonl", "step_000002.jsonl"]  # the weights of 1 and 2 training steps
    artifacts = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").list_artifacts(result.run_id, "eval/digits")
    assert sorted(Path(a.path).name for a in artifacts) == files
    for step, metrics in result.history:
        if "eval/digits/mean_at_1" in metrics:
            text = (tmp_path / "out" / "eval" / "digits" / f"step_{step:06d}.jsonl").read_text()
            rewards = [json.loads(line)["reward"] for line in text.splitlines()]
            assert metrics["eval/digits/mean_at_1"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-12)


@pytest.mark.slow
def test_a_fully_async_run_writes_the_samples_of_each_evaluation_as_the_sync_run_does(in_process, small_run, tmp_path):
    """train.mode=fully_async: each evaluation's samples are written, at the step its metrics are logged, and they are
    the sync run's to the byte: with train.max_staleness=0 a fully_async run trains exactly the sync run's data
    (tests/runner/test_async_training.py), so each evaluation sees the same weights, and its samples draw from the same
    random streams."""
    common = ["cluster.cpus_per_node=1", "train.eval_interval=1", "data.num_eval_prompts=2",
              "train.eval_save_samples=true", "rollout.eval_temperature=1.0", "rollout.eval_n_samples_per_prompt=2",
              "train.lr=0.05"]  # sampled (not greedy) and weights that move: samples that tell runs apart
    sync = run(load_config(small_run(*common, steps=2)), output_dir=tmp_path / "sync")
    fully = run(load_config(small_run(*common, "train.mode=fully_async", "train.max_staleness=0", steps=2)),
                output_dir=tmp_path / "async")
    names = ["step_000001.jsonl", "step_000002.jsonl"]
    assert sorted(p.name for p in (tmp_path / "async" / "eval" / "digits").iterdir()) == names
    texts = [(tmp_path / "async" / "eval" / "digits" / name).read_text() for name in names]
    assert texts == [(tmp_path / "sync" / "eval" / "digits" / name).read_text() for name in names]
    assert texts[0] != texts[1]  # the two evaluations' weights differ: the equality pins which ones each used
    artifacts = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").list_artifacts(fully.run_id, "eval/digits")
    assert sorted(Path(a.path).name for a in artifacts) == names
    evaluated = []
    for step, metrics in fully.history:
        if "eval/digits/mean_at_2" in metrics:
            evaluated.append(step)
            text = (tmp_path / "async" / "eval" / "digits" / f"step_{step:06d}.jsonl").read_text()
            rewards = [json.loads(line)["reward"] for line in text.splitlines()]
            assert metrics["eval/digits/mean_at_2"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-12)
    assert evaluated == [1, 2]
    assert [m.get("eval/digits/mean_at_2") for _, m in fully.history] == \
        [m.get("eval/digits/mean_at_2") for _, m in sync.history]
