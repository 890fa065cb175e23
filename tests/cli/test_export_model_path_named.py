"""relax-export's messages on the model files at `--model-path` name that flag and the path as typed
(`--model-path '/x'`), and relax-train's same messages keep naming `model.path='/x'`: the library's messages name the
option they are given (`key`), rather than relax-export rewriting their text.

The cases: a directory that is not there, one without config.json (the checkpoint records its run's model, so the
export reads the model's config), one without tokenizer files, and a .gguf file for a model.source=hf run (whose fix
relax-export cannot take: the source is the run's). Their typed paths lie under a directory named
`model.path`, a name a rewrite of the text `model.path` would change in the path itself.
"""

from __future__ import annotations

from pathlib import Path

from test_export import commit, overrides, refused

from relax.config import load_config
from relax.data.tokenizer import build_tiny_tokenizer
from relax.runner import checkpoint
from relax.runner.model_record import RUN_MODEL
from relax.runner.preflight import preflight


def _model_dir(directory: Path, *, config: bool = True, tokenizer: bool = True) -> Path:
    """A model directory with the tiny model's config.json, tokenizer files and an (empty) weight file, less what
    is asked for: what the checks read, and no weights to build (nothing here loads them)."""
    from relax.models.hf import qwen3_config

    directory.mkdir(parents=True)
    tok = build_tiny_tokenizer()
    if config:
        model = load_config(overrides(directory.parent / "unused")).model
        qwen3_config(model, len(tok), tok.pad_token_id).save_pretrained(str(directory))
    if tokenizer:
        tok.save_pretrained(str(directory))
    (directory / "model.safetensors").write_bytes(b"")
    return directory


def _stub(d: Path) -> None:
    """A checkpoint's policy/ that nothing loads: the refusals come before any weights are read."""
    d.mkdir()
    (d / "config.json").write_text("{}")


def test_export_names_model_path_as_typed_and_relax_train_names_its_key(tmp_path, capsys):
    root = tmp_path / "model.path"  # a directory so named: the typed paths must come back as typed
    run_model = _model_dir(tmp_path / "run_model")
    cfg = load_config(overrides(tmp_path / "ckpt", "model.source=hf", f"model.path={run_model}"))
    path = commit(cfg, 1, _stub)
    assert isinstance(checkpoint.read_state(path)[RUN_MODEL], dict)  # so the export reads the model's config.json

    gone = root / "gone"
    no_config = _model_dir(root / "no_config", config=False)
    no_tokenizer = _model_dir(root / "no_tokenizer", tokenizer=False)
    # a config.json, no tokenizer files (relax.data.tokenizer.missing_tokenizer_files refuses it, whatever the config)
    (no_tokenizer / "config.json").write_text("{}")
    gguf = root / "m.gguf"  # the right file for a model.source=gguf run; this run's is a directory
    gguf.write_bytes(b"GGUF")
    head = "relax-export: error: the run's tokenizer cannot be loaded from --model-path {0}: "
    expected = {
        gone: "model.source=hf: --model-path '{0}' is not an existing directory (expected a local Hugging Face model "
              "directory with config.json)",
        no_config: "--model-path '{0}': model.source=hf needs a directory with config.json",
        no_tokenizer: "model.source=hf: cannot load the tokenizer of --model-path '{0}': the model directory has no "
                      "tokenizer files: none of tokenizer.json, tokenizer_config.json, tokenizer.model, spiece.model, "
                      "sentencepiece.bpe.model, vocab.json, vocab.txt is there (it holds config.json, "
                      "model.safetensors)",
        # the source is the run's, which relax-export cannot change: the advice is the flag's, not model.source's
        gguf: "model.source=hf: --model-path '{0}' is not an existing directory: it is a .gguf file, which "
              "model.source=gguf loads (the model is model.source=hf: point --model-path at its Hugging Face "
              "directory)",
    }
    for typed, message in expected.items():
        err = refused([str(path), str(tmp_path / "out"), "--model-path", str(typed)], capsys)
        assert err == (head + message).format(typed) + "\n", err
        assert "model.path" not in err.replace(str(root), ""), err
        assert not (tmp_path / "out").exists()

    # the control: relax-train's checks of the same directories (model.path=...) name model.path, as they did
    train = {
        gone: ("model", "model.source=hf: model.path='{0}' is not an existing directory (expected a local Hugging "
                        "Face model directory with config.json)"),
        no_config: ("model", "model.source=hf: model.path='{0}' has no config.json (expected a local Hugging Face "
                             "model directory)"),
        no_tokenizer: ("tokenizer", expected[no_tokenizer].replace("--model-path '{0}'", "model.path='{0}'")),
        gguf: ("model", "model.source=hf: model.path='{0}' is not an existing directory: it is a .gguf file, which "
                        "model.source=gguf loads (set model.source=gguf)"),
    }
    for typed, (check, message) in train.items():
        pre = preflight(load_config(["model.source=hf", f"model.path={typed}"]), only=("model", "tokenizer"))
        assert pre.problems == {check: message.format(typed)}, pre.problems
