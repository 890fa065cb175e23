"""A resume checks that model.path still holds the model the run trained from (`checkpoint.check_run_model`): each
checkpoint's state.json records the run's model (`relax.runner.model_record`: config architectures, vocab_size,
tokenizer and chat template digests); a model directory replaced since the run by another model (another chat
template, another vocabulary) is refused before anything starts, in one line naming each field that differs with
its value in the run and now. An older checkpoint without the record resumes with a note. The checkpoint is
committed as a run commits it (`Checkpoints.commit`) on a Hugging Face directory of the tiny model; the refusal is
seen both where a start enters `Checkpoints` and in a `relax-train dry_run=true`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from relax_train_inprocess import relax_train

from relax.config import load_config
from relax.data.tokenizer import load_tokenizer
from relax.models.hf import build_model
from relax.runner import checkpoint, model_record
from relax.runner.errors import RunError

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def _overrides(tmp_path: Path, *extra: str) -> list[str]:
    return ["model.source=hf", f"model.path={tmp_path / 'model'}", f"train.save_dir={tmp_path / 'ckpt'}",
            "tracking.enabled=false", *extra]


@pytest.fixture
def run_checkpoint(tmp_path) -> tuple[Path, dict]:
    """(a committed checkpoint of a model.source=hf run on tmp_path/model, the model's record when it was written)."""
    model_dir = tmp_path / "model"
    tiny = load_config([])
    tokenizer = load_tokenizer(tiny.model)
    build_model(tiny.model, len(tokenizer), tokenizer.pad_token_id, seed=5).save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    cfg = load_config(_overrides(tmp_path))
    with checkpoint.Checkpoints(cfg) as ckpts:
        staging = ckpts.staging(2)
        (staging / "policy").mkdir()
        (staging / "policy" / "weights.json").write_text("{}")  # what the resume's checks read: the manifest
        path = ckpts.commit(staging, 2, {"sampler": {}})
    record = checkpoint.read_state(path)[model_record.RUN_MODEL]
    assert record["vocab_size"] == json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return path, record


def _start_refusal(tmp_path: Path, path: Path) -> str | None:
    """What entering `Checkpoints` (a start's last check before Ray) says of train.resume=`path`; None: it resumes."""
    cfg = load_config(_overrides(tmp_path, f"train.resume={path}", "train.save_dir=" + str(tmp_path / "ckpt2")))
    try:
        with checkpoint.Checkpoints(cfg) as ckpts:
            assert ckpts.resume is not None and ckpts.resume.step == 2
    except RunError as exc:
        return str(exc)
    return None


def test_a_model_directory_replaced_by_another_model_is_refused_naming_the_field(run_checkpoint, tmp_path, capfd):
    path, record = run_checkpoint
    model_dir = tmp_path / "model"
    original = tmp_path / "original"
    shutil.copytree(model_dir, original)
    assert _start_refusal(tmp_path, path) is None  # the control: the run's own model resumes

    (model_dir / "chat_template.jinja").write_text(TEMPLATE)  # the Base model's template instead of the Instruct one
    now = model_record.model_record(load_config(_overrides(tmp_path)).model)
    assert now["chat_template_sha256"] != record["chat_template_sha256"]
    err = _start_refusal(tmp_path, path)
    assert err == (f"train.resume={path}: model.path={model_dir} no longer holds the model that checkpoint {path} was "
                   f"trained from (chat template: sha256 {record['chat_template_sha256'][:12]} in the run, sha256 "
                   f"{now['chat_template_sha256'][:12]} now): its files were replaced since the run; point model.path "
                   "at the run's model to continue it, or start a new run")

    # another vocabulary (config and tokenizer): each differing field with both values, still one line
    shutil.rmtree(model_dir)
    shutil.copytree(original, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["vocab_size"] += 8
    (model_dir / "config.json").write_text(json.dumps(config))
    err = _start_refusal(tmp_path, path)
    assert err is not None and "\n" not in err
    assert f"(vocab_size: {record['vocab_size']} in the run, {record['vocab_size'] + 8} now)" in err
    assert "chat template" not in err and "tokenizer" not in err

    # the dry run says the same before anything starts (exit 2)
    code, out, err = relax_train([*_overrides(tmp_path, f"train.resume={path}"), "dry_run=true"], capfd)
    assert code == 2, out + err
    assert "failed   checkpoints" in out and "relax-train: error: dry run: a start would stop before Ray" in err
    assert f"(vocab_size: {record['vocab_size']} in the run, {record['vocab_size'] + 8} now)" in out + err
    assert "Traceback" not in out + err

    shutil.rmtree(model_dir)  # the run's model put back: it resumes again
    shutil.copytree(original, model_dir)
    assert _start_refusal(tmp_path, path) is None


def test_an_older_checkpoint_without_the_record_resumes_with_a_note(run_checkpoint, tmp_path, capsys):
    path, _ = run_checkpoint
    state = checkpoint.read_state(path)
    del state[model_record.RUN_MODEL]  # as an older Relax wrote it (state.json is not in its own manifest)
    (path / checkpoint.STATE).write_text(json.dumps(state))
    (tmp_path / "model" / "chat_template.jinja").write_text(TEMPLATE)
    capsys.readouterr()
    assert _start_refusal(tmp_path, path) is None
    err = capsys.readouterr().err
    assert (f"relax-train: note: checkpoint {path} was written by an older Relax: it does not say which model the run "
            f"trained from, so model.path={tmp_path / 'model'} is not checked against it\n") in err
