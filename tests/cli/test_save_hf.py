"""`train.save_hf=true` and `tracking.log_model=true`: at the end of a run its final checkpoint is exported to
`<save_dir>/hf` and that directory is logged into the MLflow run as a transformers model.

One short run of the tiny model (its roles in this process: tests/inprocess_ray.py), shared by the tests of what it
leaves: the export, compared with the final checkpoint's policy by log-probs (the trainer's own, from a fresh actor
loaded from the checkpoint, against transformers on the exported directory: `test_export`'s helpers), and the MLflow
model, loaded back with `mlflow.transformers.load_model` and compared with the export tensor for tensor. The failures
(the final checkpoint missing, an export that cannot be written, a model the store does not take) are checked on the
`Session` that runs the export, with a committed checkpoint made as `test_export` makes it, without Ray.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from inprocess_ray import inprocess_ray
from test_export import PROMPTS, RESPONSES, assert_trainer_logprobs, batch_of, commit, hf_logprobs, trainer_logprobs

from relax.config import load_config
from relax.data.tokenizer import load_tokenizer, stop_token_ids
from relax.roles.workers import ModelInfo, PolicyWorker
from relax.runner import checkpoint
from relax.runner.errors import RunError

# its tests share module-scoped fixtures: one xdist worker runs them in a row
pytestmark = [pytest.mark.xdist_group("save_hf"),
              pytest.mark.slow]


@dataclass
class Trained:
    cfg: object
    save_dir: Path
    run_id: str
    stderr: str


@pytest.fixture(scope="module")
def trained(tmp_path_factory, run_overrides) -> Trained:
    """A 2-step run of the tiny model (fp32: the trainer's log-probs are those of the exported weights) with
    train.save_hf=true and tracking.log_model=true."""
    from relax.runner.train import run

    tmp = tmp_path_factory.mktemp("save_hf")
    cfg = load_config(run_overrides(tmp, "model.dtype=float32", "train.save_hf=true", "tracking.log_model=true"))
    err = io.StringIO()
    with inprocess_ray(), contextlib.redirect_stderr(err):
        result = run(cfg, output_dir=tmp / "out")
    return Trained(cfg, tmp / "ckpt", result.run_id, err.getvalue())


def client_of(cfg):
    from mlflow import MlflowClient

    return MlflowClient(cfg.tracking.uri)


def test_save_hf_exports_the_final_checkpoint_with_its_policys_logprobs(trained):
    hf, final = trained.save_dir / "hf", trained.save_dir / "step_000002"
    assert checkpoint.latest(trained.save_dir) == final
    checkpoint.verify(final, checkpoint.read_state(final))  # the checkpoint itself is left as it was committed
    record = json.loads((hf / "relax_export.json").read_text())
    assert (record["checkpoint"], record["step"], record["mlflow_run_id"]) == (str(final.resolve()), 2,
                                                                                trained.run_id)
    assert sorted(p.name for p in hf.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "relax_export.json",
        "tokenizer.json", "tokenizer_config.json"]
    assert not [p for p in trained.save_dir.iterdir() if p.name.startswith(".tmp-")]  # no staging left
    # transformers on the export gives the log-probs the trainer gives with the final checkpoint's weights
    cfg = trained.cfg
    tokenizer = load_tokenizer(cfg.model)
    info = ModelInfo(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                     eos_token_ids=stop_token_ids(cfg.model, tokenizer))
    pairs = list(zip(PROMPTS, RESPONSES, strict=True))
    batch = batch_of(tokenizer, pairs, tokenizer.pad_token_id)
    trainer = trainer_logprobs(cfg, info, final, batch)
    assert_trainer_logprobs(trainer, batch, hf_logprobs(hf, pairs))
    # ... and not those of the initial weights: the two steps trained
    initial = PolicyWorker(cfg, info, threads=1).logprobs(batch)
    assert not torch.allclose(initial, trainer, atol=1e-5)
    # one line says where it is; the MLflow run records it
    assert f"final policy (step 2, step_000002) exported as a Hugging Face model to {hf}\n" in trained.stderr
    assert client_of(cfg).get_run(trained.run_id).data.tags["relax.hf_dir"] == str(hf)


def test_log_model_logs_the_export_as_a_transformers_model_of_the_run(trained, monkeypatch):
    import mlflow
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    client = client_of(trained.cfg)
    run = client.get_run(trained.run_id)
    uri = run.data.tags["relax.model_uri"]
    model_id = uri.removeprefix("models:/")
    logged = client.get_logged_model(model_id)
    assert (logged.name, logged.source_run_id, str(logged.status)) == ("model", trained.run_id, "READY")
    assert logged.tags["relax.step"] == "2" and logged.tags["relax.checkpoint"].endswith("step_000002")
    assert logged.params == run.data.params  # the run's config
    assert [(o.model_id, o.step) for o in run.outputs.model_outputs] == [(model_id, 2)]
    assert f"as the model {uri} (mlflow.transformers)" in trained.stderr
    # loaded back by its URI, as a user does: the export's weights, tokenizer and chat template
    monkeypatch.setenv("MLFLOW_TRACKING_URI", trained.cfg.tracking.uri)
    parts = mlflow.transformers.load_model(uri, return_type="components")
    assert parts["task"] == "text-generation"
    exported = load_file(str(trained.save_dir / "hf" / "model.safetensors"))
    state = parts["model"].state_dict()
    assert set(exported) <= set(state)
    for name, tensor in exported.items():
        assert torch.equal(state[name], tensor), name
    theirs = AutoTokenizer.from_pretrained(str(trained.save_dir / "hf"))
    messages = [{"role": "user", "content": "repeat 5"}]
    assert parts["tokenizer"].apply_chat_template(messages, add_generation_prompt=True)["input_ids"] == \
        theirs.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    pipeline = mlflow.pyfunc.load_model(uri)  # servable as a pyfunc model too
    assert pipeline.metadata.flavors["transformers"]["task"] == "text-generation"
    # where it came from, and whose license applies
    record = Path(mlflow.artifacts.download_artifacts(f"{logged.artifact_location}/relax_export.json"))
    assert json.loads(record.read_text()) == json.loads((trained.save_dir / "hf" / "relax_export.json").read_text())
    license_file = Path(mlflow.artifacts.download_artifacts(f"{logged.artifact_location}/LICENSE.txt"))
    assert "from a randomly initialized model (tiny, model.source=config)" in license_file.read_text()


def test_logging_a_model_connects_to_nothing(trained, monkeypatch):
    """MLflow looks for a model card and a license on the Hugging Face Hub by the model's name: logging the export
    must not reach out (a cluster node is often offline). Every connection attempt is recorded and refused."""
    from relax.tracking.model import log_hf_model

    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError(errno.ENETUNREACH, "the network is off in this test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    client = client_of(trained.cfg)
    run = client.create_run(client.get_run(trained.run_id).info.experiment_id)
    uri = log_hf_model(client, run.info.run_id, trained.save_dir / "hf")
    assert attempts == []
    assert str(client.get_logged_model(uri.removeprefix("models:/")).status) == "READY"


def committed_final(tmp: Path, *extra: str):
    """The config (train.resume=auto) of a save dir whose checkpoint of the final step (train.num_rollout=2) is
    committed: a Session that resumes it runs no step and exports that checkpoint."""
    overrides = ["model.dtype=float32", f"train.save_dir={tmp / 'ckpt'}", "tracking.progress=false",
                 f"tracking.uri=sqlite:///{tmp}/mlflow.db", "train.num_rollout=2", "train.save_hf=true", *extra]
    cfg = load_config(overrides)
    tokenizer = load_tokenizer(cfg.model)
    info = ModelInfo(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                     eos_token_ids=stop_token_ids(cfg.model, tokenizer))
    actor = PolicyWorker(cfg, info, threads=1)
    commit(cfg, 2, lambda d: actor.save(str(d)))
    return load_config([*overrides, "train.resume=auto"])


@contextlib.contextmanager
def session_of(cfg, out: Path):
    """The Session of a run of `cfg`, as `relax.runner.train` opens it (its output on stderr kept quiet)."""
    from relax.runner.checkpoint import Checkpoints
    from relax.runner.plan import build_plan
    from relax.runner.session import Session

    with contextlib.redirect_stderr(io.StringIO()), Checkpoints(cfg) as ckpts, \
            Session(cfg, build_plan(cfg), out, checkpoints=ckpts) as session:
        yield session


def test_a_final_checkpoint_that_was_not_written_fails_the_run(tmp_path):
    """train.save_failures=continue goes on when a checkpoint cannot be written; the final one missing, there is
    nothing to export, and the run says so instead of leaving an older policy (or none) in hf/."""
    cfg = load_config(["train.num_rollout=2", "train.save_hf=true", "tracking.enabled=false",
                       f"train.save_dir={tmp_path / 'ckpt'}"])
    with session_of(cfg, tmp_path / "out") as session:
        with pytest.raises(RunError) as err:
            session.export_final()
    assert str(err.value) == (f"train.save_hf=true: the checkpoint of the final step (2) was not written, so the "
                              f"final policy could not be exported to {tmp_path / 'ckpt' / 'hf'}; no checkpoint was "
                              "committed")


def test_a_failed_export_fails_the_run_names_the_checkpoint_and_the_command_that_exports_it(tmp_path):
    from relax.cli import export

    cfg = committed_final(tmp_path, "tracking.enabled=false")
    save_dir = tmp_path / "ckpt"
    final, hf = save_dir / "step_000002", save_dir / "hf"
    hf.write_text("something in the way")
    with session_of(cfg, tmp_path / "out") as session:
        with pytest.raises(RunError) as err:
            session.export_final()
    message = str(err.value)
    assert f"exporting the final checkpoint {final} to {hf} failed: OUT_DIR {hf} exists and is not a directory" in \
        message
    assert message.endswith(f"The checkpoint is committed and unchanged; export it again with `relax-export {final} "
                            f"{hf} --force`")
    checkpoint.verify(final, checkpoint.read_state(final))
    hf.unlink()  # the way cleared, the command it names exports it
    export.main([str(final), str(hf), "--force"])
    assert (hf / "model.safetensors").read_bytes() == (final / "policy" / "model.safetensors").read_bytes()


def test_a_model_the_store_does_not_take_fails_the_run_with_the_command_that_logs_it(tmp_path, fresh_store,
                                                                                     monkeypatch):
    import mlflow.transformers
    from mlflow import MlflowClient

    from relax.tracking import model

    fresh_store(tmp_path)
    cfg = committed_final(tmp_path, "tracking.log_model=true")
    hf = tmp_path / "ckpt" / "hf"

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", kwargs.get("path"))

    with monkeypatch.context() as patch:
        patch.setattr(mlflow.transformers, "save_model", disk_full)
        with session_of(cfg, tmp_path / "out") as session:
            with pytest.raises(RunError) as err:
                session.export_final()
            run_id = session.run_id
    message = str(err.value)
    assert f"the final policy, exported to {hf}, could not be logged into MLflow run {run_id} as a model (OSError: " \
           "[Errno 28] No space left on device" in message
    assert message.endswith(f"log it with `python -m relax.tracking.model {hf} --run-id {run_id} --uri "
                            f"sqlite:///{tmp_path}/mlflow.db`")
    assert (hf / "model.safetensors").is_file()  # the export is done
    client = MlflowClient(cfg.tracking.uri)
    experiment = client.get_run(run_id).info.experiment_id
    assert [str(m.status) for m in client.search_logged_models(experiment_ids=[experiment])] == ["FAILED"]
    assert "relax.model_uri" not in client.get_run(run_id).data.tags
    # the command it names logs it
    assert model.main([str(hf), "--run-id", run_id, "--uri", cfg.tracking.uri]) == 0
    uri = client.get_run(run_id).data.tags["relax.model_uri"]
    assert str(client.get_logged_model(uri.removeprefix("models:/")).status) == "READY"


def test_lora_with_log_model_is_refused_before_the_run_and_the_way_it_names_logs_the_merged_model(tmp_path, capsys,
                                                                                                  fresh_store):
    """A LoRA run's train.save_hf export is a PEFT adapter directory, which MLflow's transformers flavor does not
    take: tracking.log_model is refused before anything starts, naming relax-export --merge and the command that
    logs its directory. Both work: the adapter directory is refused by that command with one line saying why, the
    merged one is logged."""
    from mlflow import MlflowClient

    from relax.cli import export
    from relax.config.validate import ConfigError
    from relax.tracking import model

    with pytest.raises(ConfigError) as err:
        load_config(["model.lora_rank=4", "train.save_hf=true", "tracking.log_model=true"])
    message = str(err.value)
    assert "tracking.log_model=true with model.lora_rank=4: a LoRA run's train.save_hf export is a PEFT adapter " \
           "directory" in message
    assert "`relax-export <save_dir> <dir> --merge`" in message and "`python -m relax.tracking.model <dir> " \
           "--run-id <run id> --uri <tracking.uri>`" in message
    load_config(["model.lora_rank=4", "train.save_hf=true"])  # the control: without log_model it is accepted

    fresh_store(tmp_path)
    cfg = committed_final(tmp_path, "model.lora_rank=4", "train.lr=0.05")
    client = MlflowClient(cfg.tracking.uri)
    # its artifacts under tmp_path: MLflow's default artifact root is ./mlruns of the cwd
    experiment = client.create_experiment("lora", artifact_location=str(tmp_path / "artifacts"))
    run_id = client.create_run(experiment).info.run_id
    export.main([str(tmp_path / "ckpt"), str(tmp_path / "adapters")])
    capsys.readouterr()
    assert model.main([str(tmp_path / "adapters"), "--run-id", run_id, "--uri", cfg.tracking.uri]) == 2
    err_line = capsys.readouterr().err
    assert err_line == (f"python -m relax.tracking.model: error: {tmp_path / 'adapters'} is a LoRA adapter directory "
                        "(PEFT: adapter_config.json, no config.json), which MLflow's transformers flavor does not "
                        "log; write the merged model with `relax-export <checkpoint> <dir> --merge` and log <dir>\n")
    export.main([str(tmp_path / "ckpt"), str(tmp_path / "merged"), "--merge"])
    assert model.main([str(tmp_path / "merged"), "--run-id", run_id, "--uri", cfg.tracking.uri]) == 0
    uri = client.get_run(run_id).data.tags["relax.model_uri"]
    assert str(client.get_logged_model(uri.removeprefix("models:/")).status) == "READY"
