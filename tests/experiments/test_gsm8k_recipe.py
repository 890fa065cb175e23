"""The GSM8K recipe end to end on this CPU: `+experiment=rloo_smollm2_gsm8k_cpu` (RLOO on SmolLM2-135M), one step,
from the fixture in the file format of the HF dataset `openai/gsm8k` (Parquet, generated here from
tests/fixtures/gsm8k), through `relax-train -m` as the recipe's users launch it; and the message of a run without the
data. Its GRPO control arm is the same launch with `algorithm=rloo,grpo`: the arms of one sweep side by side in
`relax-compare` are tested in test_relax_sweep.py (seed pairs and the comparison's tables in test_compare.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relax.data.gsm8k import CACHE_VERSION, INSTRUCTION, extract_final_answer

REPO = Path(__file__).resolve().parents[2]
RECIPE = "rloo_smollm2_gsm8k_cpu"


def _fixture_module():
    spec = importlib.util.spec_from_file_location("gsm8k_hf_parquet", REPO / "tests/fixtures/gsm8k/hf_parquet.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _env(data_dir: Path, cache_dir: Path) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "DATA_DIR": str(data_dir), "RLOO_DATA_CACHE_DIR": str(cache_dir), "PYTHONPATH": path,
            "PYTHONUNBUFFERED": "1"}


@pytest.mark.slow
def test_the_rloo_recipe_on_gsm8k_parquet(tmp_path, fresh_store):
    fixture = _fixture_module()
    written = fixture.write_hf_parquet(tmp_path / "data")
    assert sorted(p.relative_to(tmp_path / "data").as_posix() for p in written.values()) == [
        "gsm8k/main/test-00000-of-00001.parquet", "gsm8k/main/train-00000-of-00001.parquet"]
    fresh_store(tmp_path)  # the run's default store, sqlite:///mlflow.db in its working directory
    env = _env(tmp_path / "data", tmp_path / "cache")
    # the recipe at the smallest sizes its claim allows, overridden as a user would: one step of one group of two
    # samples (RLOO's baseline needs two; one update per rollout), four tokens per answer, one eval prompt
    cmd = [sys.executable, "-m", "relax.cli.train", "-m", f"+experiment={RECIPE}", "algorithm=rloo",
           "train.num_rollout=1", "rollout.max_response_len=4", "data.num_eval_prompts=1", "tracking.progress=false",
           "rollout.rollout_batch_size=1", "rollout.n_samples_per_prompt=2", "train.global_batch_size=2",
           "train.micro_batch_size=2"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "1 of 1 jobs finished" in proc.stdout

    # The data: prepared once into the cache, in the normalized form, from the Parquet rows.
    cache = tmp_path / "cache" / "gsm8k"
    assert sorted(p.name for p in cache.iterdir()) == [f"source.{CACHE_VERSION}.json", f"test.{CACHE_VERSION}.jsonl",
                                                       f"train.{CACHE_VERSION}.jsonl"]
    manifest = json.loads((cache / f"source.{CACHE_VERSION}.json").read_text())  # prepared from the Parquet files
    assert manifest["source"] == str((tmp_path / "data" / "gsm8k" / "main").resolve())
    assert [f[0] for f in manifest["files"]] == ["train-00000-of-00001.parquet", "test-00000-of-00001.parquet"]
    for split in ("train", "test"):
        records = [json.loads(line) for line in (cache / f"{split}.{CACHE_VERSION}.jsonl").read_text().splitlines()]
        rows = fixture.jsonl_rows(split)
        assert [r["prompt"] for r in records] == [f"{row['question']}\n{INSTRUCTION}" for row in rows]
        assert [r["label"] for r in records] == [extract_final_answer(row["answer"]) for row in rows]
        assert [r["solution"] for r in records] == [row["answer"] for row in rows]
    assert [json.loads(line)["label"] for line in (cache / f"test.{CACHE_VERSION}.jsonl").read_text().splitlines()] \
        == ["7", "39", "165"]

    # MLflow: the job's run, FINISHED, the rewards of its step, the evaluation after the last step.
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name(RECIPE)
    assert exp is not None, out[-3000:]
    runs = client.search_runs([exp.experiment_id])
    children = {r.data.tags["algorithm"]: r for r in runs if "mlflow.parentRunId" in r.data.tags}
    assert set(children) == {"rloo"}
    for algorithm, run in children.items():
        tags, params = run.data.tags, run.data.params
        assert run.info.status == "FINISHED", algorithm
        assert tags["seed"] == "1" and tags["data"] == "gsm8k"
        assert tags["model"] == "SmolLM2-135M-Instruct"
        assert (params["rollout.rollout_batch_size"], params["rollout.n_samples_per_prompt"],
                params["train.global_batch_size"]) == ("1", "2", "2")
        rewards = client.get_metric_history(run.info.run_id, "rollout/raw_reward")
        assert sorted(m.step for m in rewards) == [0]
        assert all(0.0 <= m.value <= 1.0 for m in rewards)
        evals = client.get_metric_history(run.info.run_id, "eval/gsm8k/mean_at_1")
        assert [m.step for m in evals] == [1]  # eval_interval=5: once, after the last step (the weights of 1 step)
        assert run.data.tags["relax.eval_step"] == "trained_steps"
        assert "eval/gsm8k/pass_at_1" in run.data.metrics and "eval/gsm8k/response_len" in run.data.metrics
        inputs = {(d.dataset.name, d.dataset.source) for d in run.inputs.dataset_inputs}
        assert any(name == "gsm8k" and f"train.{CACHE_VERSION}.jsonl" in source for name, source in inputs), inputs
    assert "rollout/rloo/baseline_mean" in children["rloo"].data.metrics  # the recipe's algorithm ran


def test_without_the_data_one_message_names_the_files(tmp_path):
    env = _env(tmp_path / "data", tmp_path / "cache")  # DATA_DIR names a directory that does not exist
    proc = subprocess.run([sys.executable, "-m", "relax.cli.train", f"+experiment={RECIPE}"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr
    assert "Traceback" not in err and err.startswith("relax-train: error: GSM8K data not found: the data directory")
    target = tmp_path / "data" / "gsm8k"
    assert f"  {target}/main/train-00000-of-00001.parquet\n  {target}/main/test-00000-of-00001.parquet\n" in err
    assert f"hf download openai/gsm8k --repo-type dataset --include 'main/*' --local-dir {target}" in err
    assert not (tmp_path / "cache" / "gsm8k").exists() and not (tmp_path / "mlflow.db").exists()
