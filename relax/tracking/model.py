"""A run's exported policy as an MLflow model in its run (`tracking.log_model=true`), and the command that logs it
again: `python -m relax.tracking.model HF_DIR --run-id ID [--uri URI]`.

`log_hf_model` logs a Hugging Face model directory (what `relax-export` and `train.save_hf=true` write: weights,
config, tokenizer, chat template, generation config) with MLflow's `transformers` flavor, task `text-generation`. The
model and tokenizer are loaded from the directory on the CPU, in the dtype of its weights, and saved by MLflow (the
same tensors); MLflow's way of logging a directory without loading it does not run with transformers 5. It becomes an
MLflow 3 logged model (`models:/<model id>`, named `model`) whose source run is the training run, linked to it as an
output at the checkpoint's step, with the run's params; the model's tags name the checkpoint and step it was exported
from (`relax.checkpoint`, `relax.step`), its files include the directory's relax_export.json, and the run's tag
`relax.model_uri` holds its URI. Load it with `mlflow.transformers.load_model("models:/<model id>")` (a transformers
pipeline, or `return_type="components"`) or `mlflow.pyfunc.load_model`.

Offline: nothing is fetched from the Hugging Face Hub. MLflow looks up a model card and a license on the Hub by the
model's name, which is the directory's absolute path here, not a valid Hub repository id, so those look-ups fail
before any connection; the model card and LICENSE.txt written are Relax's own (`model_card`, `license_note`).

Only `MlflowClient` is used (no fluent API, no process-global active run), like `relax.tracking.mlflow_run`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from relax.data.tokenizer import quiet_transformers
from relax.tracking.mlflow_run import quiet_mlflow_logging

if TYPE_CHECKING:
    from mlflow import MlflowClient

MODEL_NAME = "model"  # the logged model's name in the run
TASK = "text-generation"  # the transformers pipeline task the model is logged for
HF_DIR_TAG = "relax.hf_dir"  # run tag: where train.save_hf=true exported the final checkpoint
MODEL_URI_TAG = "relax.model_uri"  # run tag: models:/<model id> of the logged model (tracking.log_model=true)
CHECKPOINT_TAG = "relax.checkpoint"  # logged-model tag: the checkpoint the directory was exported from
STEP_TAG = "relax.step"  # logged-model tag: that checkpoint's step
LICENSE_FILE = "LICENSE.txt"  # MLflow's name for it in a transformers model
EXPORT_RECORD = "relax_export.json"  # what relax.train.export writes into the directory (EXPORT_FILE there)
COMMAND = "python -m relax.tracking.model"


def model_card(hf_dir: Path, checkpoint: Optional[str], step: Optional[int], run_id: str) -> Any:
    """The model card written with the model (MLflow would otherwise look one up on the Hub)."""
    from huggingface_hub import ModelCard

    where = f"checkpoint {checkpoint} (step {step})" if checkpoint else f"{hf_dir}"
    return ModelCard(f"---\ntags:\n- relax\n- text-generation\n---\n\n# Relax policy\n\nThe policy of MLflow run "
                     f"{run_id}, exported from {where}. `{EXPORT_RECORD}` records where it came from: the run, its "
                     "algorithm, model and sampling settings.\n")


def license_note(record: dict[str, Any]) -> str:
    """LICENSE.txt of the logged model: the license that applies is that of the model the run started from."""
    model = record.get("model") if isinstance(record.get("model"), dict) else {}
    if model.get("source") == "config":
        return (f"Trained with Relax from a randomly initialized model ({model.get('name')}, model.source=config): no "
                "license of another model applies.\n")
    origin = f"{model.get('name')} ({model.get('path')})" if model else "the model the run started from"
    return f"Trained with Relax from {origin}: that model's license applies to these weights.\n"


def read_export_record(hf_dir: Path) -> dict[str, Any]:
    """The directory's relax_export.json ({} when it has none or it does not parse)."""
    try:
        record = json.loads((hf_dir / EXPORT_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _components(source: Path) -> dict[str, Any]:
    """The model and tokenizer of the directory, as they were saved (dtype included), without the Hub.

    (MLflow's own path for a directory, `transformers_model=<path>`, does not run with transformers 5: it reads the
    pipeline class from `pipelines.check_task`, which names it by a string there.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype="auto", local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    return {"model": model, "tokenizer": tokenizer}


def _requirements() -> list[str]:
    """The model's pip requirements: what loads it (MLflow would otherwise infer them in a subprocess that loads the
    model again)."""
    from importlib import metadata

    # without a local version label (torch's "+cpu"), which no package index serves
    return [f"{name}=={metadata.version(name).split('+')[0]}" for name in ("mlflow", "torch", "transformers",
                                                                            "safetensors")]


def log_hf_model(client: MlflowClient, run_id: str, hf_dir: str | Path, *, step: Optional[int] = None,
                 checkpoint: Optional[str] = None) -> str:
    """Log the Hugging Face directory `hf_dir` as an MLflow model (transformers flavor) of run `run_id`; its URI.

    `step` and `checkpoint`: where the directory was exported from (default: what its relax_export.json says). The
    logged model is created PENDING and finalized READY once its files are in the store, FAILED if they are not; the
    error is raised (an MlflowException, or an OSError for the local copy).
    """
    import mlflow.transformers
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.models import Model

    quiet_mlflow_logging()
    source = Path(hf_dir).expanduser().resolve()  # an absolute path: never taken for a Hub repository id
    problem = model_dir_problem(source)
    if problem is not None:
        raise FileNotFoundError(problem)
    record = read_export_record(source)
    step = step if step is not None else record.get("step")
    checkpoint = checkpoint if checkpoint is not None else record.get("checkpoint")
    run = client.get_run(run_id)
    tags = {k: str(v) for k, v in ((CHECKPOINT_TAG, checkpoint), (STEP_TAG, step)) if v is not None}
    logged = client.create_logged_model(run.info.experiment_id, name=MODEL_NAME, source_run_id=run_id,
                                        params=dict(run.data.params), tags=tags)
    try:
        with tempfile.TemporaryDirectory(prefix="relax-mlflow-model-") as tmp, quiet_transformers():
            local = Path(tmp) / MODEL_NAME
            meta = Model(artifact_path=logged.artifact_location, model_uuid=logged.model_id, run_id=run_id,
                         model_id=logged.model_id)
            mlflow.transformers.save_model(transformers_model=_components(source), path=str(local), task=TASK,
                                           mlflow_model=meta, model_card=model_card(source, checkpoint, step, run_id),
                                           pip_requirements=_requirements())
            if (source / EXPORT_RECORD).is_file():
                shutil.copyfile(source / EXPORT_RECORD, local / EXPORT_RECORD)
            (local / LICENSE_FILE).write_text(license_note(record))  # instead of MLflow's, about a Hub repo
            client.log_model_artifacts(logged.model_id, str(local))
        client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=int(step or 0))])
    except BaseException:
        try:
            client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
        except Exception:
            pass  # the store is down: the model stays PENDING (its files may be incomplete)
        raise
    client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    return f"models:/{logged.model_id}"


def logged_model_of_step(client: MlflowClient, run_id: str, step: int) -> Optional[str]:
    """The URI of the model the run's `relax.model_uri` tag names if it is READY and was exported from step `step`
    (a run resumed after its end exports the same checkpoint again: its model is not logged twice); else None. A store
    that cannot answer gives None (the model is then logged, as it would have been)."""
    try:
        uri = client.get_run(run_id).data.tags.get(MODEL_URI_TAG)
        if not uri or not uri.startswith("models:/"):
            return None
        logged = client.get_logged_model(uri.removeprefix("models:/"))
    except Exception:  # noqa: BLE001 - no such model, or the store is down
        return None
    ready = str(logged.status) == "READY"
    return uri if ready and (logged.tags or {}).get(STEP_TAG) == str(step) else None


def model_dir_problem(hf_dir: str | Path) -> Optional[str]:
    """Why `hf_dir` is not a directory this module can log (None when it is): it must be a whole Hugging Face model
    (config.json). A LoRA run's export (relax-export's default, train.save_hf's) is a PEFT adapter directory: logging
    it needs the merged model, which `relax-export --merge` writes."""
    path = Path(hf_dir)
    if (path / "config.json").is_file():
        return None
    if (path / "adapter_config.json").is_file():
        return (f"{hf_dir} is a LoRA adapter directory (PEFT: adapter_config.json, no config.json), which MLflow's "
                "transformers flavor does not log; write the merged model with `relax-export <checkpoint> <dir> "
                "--merge` and log <dir>")
    return f"{hf_dir} is not a Hugging Face model directory (no config.json)"


def retry_command(hf_dir: str | Path, run_id: str, uri: str) -> str:
    """The command that logs `hf_dir` into run `run_id` of the store `uri` (what a failed tracking.log_model says)."""
    return f"{COMMAND} {hf_dir} --run-id {run_id} --uri {uri}"


def main(argv: Optional[list[str]] = None) -> int:
    """Log an exported directory into a run (see the module docstring); exit 0 logged, 1 logging failed (the store,
    the directory's files), 2 refused (no such run, not a model directory)."""
    parser = argparse.ArgumentParser(prog=COMMAND, description="Log a Hugging Face model directory that Relax "
                                     "exported (train.save_hf, relax-export) as an MLflow transformers model of a run.")
    parser.add_argument("hf_dir", help="the exported directory (e.g. <save_dir>/hf)")
    parser.add_argument("--run-id", required=True, help="the MLflow run to log it into")
    parser.add_argument("--uri", default=None, help="tracking store URI (default: MLflow's, MLFLOW_TRACKING_URI)")
    args = parser.parse_args(argv)
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri=args.uri)
    try:
        client.get_run(args.run_id)
    except MlflowException as exc:
        print(f"{COMMAND}: error: run {args.run_id} is not in the store {client.tracking_uri}: {exc}", file=sys.stderr)
        return 2
    problem = model_dir_problem(args.hf_dir)
    if problem is not None:
        print(f"{COMMAND}: error: {problem}", file=sys.stderr)
        return 2
    try:
        uri = log_hf_model(client, args.run_id, args.hf_dir)
        client.set_tag(args.run_id, MODEL_URI_TAG, uri)
    except Exception as exc:
        print(f"{COMMAND}: error: logging {args.hf_dir} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"logged {args.hf_dir} into MLflow run {args.run_id} as {uri}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
