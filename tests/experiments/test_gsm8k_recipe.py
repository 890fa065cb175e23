"""The GSM8K recipe end to end on this CPU: `+experiment=rloo_smollm2_gsm8k_cpu` (RLOO on SmolLM2-135M), one step,
from the fixture in the file format of the HF dataset `openai/gsm8k` (Parquet, generated here from
tests/fixtures/gsm8k), through `relax-train` with the recipe's overrides; and the message of a run without the data.
`relax-train` runs in this process with its roles (tests/relax_train_inprocess.py, `in_process`): what the recipe
holds is its data, model, evaluation and records, not the processes that run them. Its users launch it with `-m`
and its GRPO control arm (`algorithm=rloo,grpo`): a recipe's sweep through `relax-train -m`, its jobs on a real
Ray and the arms side by side in `relax-compare`, is test_relax_sweep.py's (seed pairs and the comparison's tables:
test_compare.py)."""

from __future__ import annotations

import importlib.util
import json
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


@pytest.mark.slow
def test_the_rloo_recipe_on_gsm8k_parquet(tmp_path, fresh_store, in_process, capfd, monkeypatch):
    from relax_train_inprocess import relax_train

    fixture = _fixture_module()
    written = fixture.write_hf_parquet(tmp_path / "data")
    assert sorted(p.relative_to(tmp_path / "data").as_posix() for p in written.values()) == [
        "gsm8k/main/test-00000-of-00001.parquet", "gsm8k/main/train-00000-of-00001.parquet"]
    fresh_store(tmp_path)  # the run's default store, sqlite:///mlflow.db in its working directory
    monkeypatch.setenv("DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("RLOO_DATA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    # the recipe at the smallest sizes its claim allows, overridden as a user would: one step of one group of two
    # samples (RLOO's baseline needs two; one update per rollout), four tokens per answer, one eval prompt
    code, out, err = relax_train([f"+experiment={RECIPE}", "algorithm=rloo", "train.num_rollout=1",
                                  "rollout.max_response_len=4", "data.num_eval_prompts=1", "tracking.progress=false",
                                  "rollout.rollout_batch_size=1", "rollout.n_samples_per_prompt=2",
                                  "train.global_batch_size=2", "train.micro_batch_size=2"], capfd)
    out = out + err
    assert code == 0, out[-6000:]

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
    runs = {r.data.tags["algorithm"]: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"rloo"}
    for algorithm, run in runs.items():
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
    assert "rollout/rloo/baseline_mean" in runs["rloo"].data.metrics  # the recipe's algorithm ran


def test_without_the_data_one_message_names_the_files(tmp_path, capfd, monkeypatch, ray_not_started):
    """`relax-train` runs in this process (tests/relax_train_inprocess.py): the refusal comes before anything
    starts, as a pre-Ray `RunError`, which the CLI turns into its message and exit code as for every other one (that
    path in a `relax-train` process of its own: tests/runner/test_training.py's
    `test_cli_reports_bad_data_without_traceback`)."""
    from relax_train_inprocess import relax_train

    monkeypatch.setenv("DATA_DIR", str(tmp_path / "data"))  # a directory that does not exist
    monkeypatch.setenv("RLOO_DATA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    code, out, err = relax_train([f"+experiment={RECIPE}"], capfd)
    assert code == 2, out + err
    assert "Traceback" not in err and err.startswith("relax-train: error: GSM8K data not found: the data directory")
    target = tmp_path / "data" / "gsm8k"
    assert f"  {target}/main/train-00000-of-00001.parquet\n  {target}/main/test-00000-of-00001.parquet\n" in err
    assert f"hf download openai/gsm8k --repo-type dataset --include 'main/*' --local-dir {target}" in err
    assert not (tmp_path / "cache" / "gsm8k").exists() and not (tmp_path / "mlflow.db").exists()
