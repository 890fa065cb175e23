"""A Hugging Face model directory without tokenizer files is refused before anything starts, naming the option the
path was given as and the files looked for. transformers does not refuse it: from a real model config.json (Qwen3's)
and no tokenizer files, `AutoTokenizer.from_pretrained` builds a Qwen2Tokenizer of one token, and relax-train's dry
run, relax-serve, a teacher and a judge went on with it.

Each model directory here is what `Qwen3Config(...).save_pretrained` writes (config.json) and an
empty weight file (nothing here reads weights); the controls are the same directories with the tiny tokenizer saved
in them, and a tokenizer given apart (model.tokenizer) from such a directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from relax.config import load_config
from relax.data.tokenizer import ModelFileError, build_tiny_tokenizer, load_tokenizer
from relax.runner.preflight import preflight
from relax.runner.reward_model import check_reward_model

NONE_OF = ("none of tokenizer.json, tokenizer_config.json, tokenizer.model, spiece.model, sentencepiece.bpe.model, "
           "vocab.json, vocab.txt is there (it holds config.json, model.safetensors)")
QUIET = ["tracking.enabled=false", "tracking.progress=false", "cluster.cpus_per_node=1", "model.dtype=float32"]


def _model_dir(directory: Path, *, tokenizer: bool = False, **config: object) -> Path:
    from transformers import Qwen3Config

    tok = build_tiny_tokenizer()
    Qwen3Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, **config).save_pretrained(str(directory))
    (directory / "model.safetensors").write_bytes(b"")
    if tokenizer:
        tok.save_pretrained(str(directory))
    return directory


def test_a_model_directory_without_tokenizer_files_is_refused_naming_its_option(tmp_path, monkeypatch):
    bare = _model_dir(tmp_path / "bare", architectures=["Qwen3ForCausalLM"])  # a judge's check reads it too
    refusal = f"cannot load the tokenizer of {{}}='{bare}': the model directory has no tokenizer files: {NONE_OF}"

    # the policy (relax-train's model and tokenizer checks: what its dry run runs)
    pre = preflight(load_config([*QUIET, "model.source=hf", f"model.path={bare}"]), only=("model", "tokenizer"))
    assert pre.problems == {"tokenizer": "model.source=hf: " + refusal.format("model.path")}, pre.problems

    # a teacher: its own option, with no rewriting of the text (teacher.source is the loaders' model.source)
    pre = preflight(load_config([*QUIET, "algorithm=opd", f"teacher.path={bare}"]), only=("tokenizer", "teacher"))
    assert pre.problems == {"teacher": f"the teacher (teacher.path={bare}) cannot be loaded: teacher.source=hf: "
                                       + refusal.format("teacher.path")}, pre.problems

    # a judge: reward_model.path once (no "reward_reward_model.path"), no model.source prefix
    judge = [*QUIET, "reward_model=judge", "reward_model.template=\"{response}\"", f"reward_model.path={bare}"]
    with pytest.raises(ValueError) as judged:
        check_reward_model(load_config(judge))
    assert str(judged.value) == (f"the judge (reward_model.path={bare}) cannot be loaded: "
                                 + refusal.format("reward_model.path"))
    # the judge's role, should a run get past the preflight (the directory changed meanwhile): the same option
    from relax.roles.reward_model import JudgeWorker

    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # the role sets it for its process: restored after
    with pytest.raises(ModelFileError) as role:
        JudgeWorker(load_config(judge))
    assert str(role.value) == refusal.format("reward_model.path")

    # a classifier (which reads its tokenizer with transformers itself)
    head = _model_dir(tmp_path / "head", architectures=["Qwen3ForSequenceClassification"], num_labels=1)
    with pytest.raises(ValueError) as classified:
        check_reward_model(load_config([*QUIET, "reward_model=classifier", f"reward_model.path={head}"]))
    assert str(classified.value) == (f"reward_model.path='{head}': its tokenizer does not load: the model directory "
                                     f"has no tokenizer files: {NONE_OF}")

    # a tokenizer given apart: model.tokenizer is the option named, and no model.source (config: it says nothing of
    # the tokenizer's files), for a directory as for a .gguf file that does not load
    with pytest.raises(ModelFileError) as apart:
        load_tokenizer(load_config(["model.source=config", f"model.tokenizer={bare}"]).model)
    assert str(apart.value) == refusal.format("model.tokenizer")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(20))  # the magic, then version 0
    with pytest.raises(ModelFileError) as apart:
        load_tokenizer(load_config(["model.source=config", f"model.tokenizer={bad}"]).model)
    assert str(apart.value).startswith(f"cannot load the tokenizer of model.tokenizer='{bad}': "), apart.value


def test_a_gguf_file_in_it_is_named_as_the_option_given_the_directory_takes_one(tmp_path):
    """A directory without tokenizer files that holds a .gguf file: the refusal says how the option the directory
    was given as takes that file. A judge's reward_model.path and model.tokenizer take the file itself (its name
    says it is one: they have no source option), the policy's model.path with model.source=gguf (a teacher's with
    teacher.source=gguf), and a classifier none (it reads no .gguf file). Before, each said model.source=gguf."""
    bare = _model_dir(tmp_path / "bare", architectures=["Qwen3ForCausalLM"])
    gguf = bare / "m.gguf"
    gguf.write_bytes(b"GGUF")
    held = NONE_OF.replace("config.json, model.safetensors", "config.json, m.gguf, model.safetensors")
    refusal = f"cannot load the tokenizer of {{0}}='{bare}': the model directory has no tokenizer files: {held}"

    with pytest.raises(ValueError) as judged:
        check_reward_model(load_config([*QUIET, "reward_model=judge", "reward_model.template=\"{response}\"",
                                        f"reward_model.path={bare}"]))
    assert str(judged.value) == (f"the judge (reward_model.path={bare}) cannot be loaded: "
                                 + refusal.format("reward_model.path")
                                 + f"; a .gguf file is read with reward_model.path='{gguf}'"), judged.value
    with pytest.raises(ModelFileError) as apart:
        load_tokenizer(load_config(["model.source=config", f"model.tokenizer={bare}"]).model)
    assert str(apart.value) == refusal.format("model.tokenizer") + f"; a .gguf file is read with " \
                                                                   f"model.tokenizer='{gguf}'", apart.value
    pre = preflight(load_config([*QUIET, "model.source=hf", f"model.path={bare}"]), only=("model", "tokenizer"))
    assert pre.problems == {"tokenizer": "model.source=hf: " + refusal.format("model.path") + "; a .gguf file is "
                                         f"read with model.source=gguf and the file's path ({gguf})"}, pre.problems
    pre = preflight(load_config([*QUIET, "algorithm=opd", f"teacher.path={bare}"]), only=("tokenizer", "teacher"))
    assert pre.problems["teacher"].endswith("; a .gguf file is read with teacher.source=gguf and the file's path "
                                            f"({gguf})"), pre.problems
    head = _model_dir(tmp_path / "head", architectures=["Qwen3ForSequenceClassification"], num_labels=1)
    (head / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError) as classified:
        check_reward_model(load_config([*QUIET, "reward_model=classifier", f"reward_model.path={head}"]))
    assert str(classified.value).endswith("(it holds config.json, m.gguf, model.safetensors)"), classified.value


def test_relax_serve_refuses_it_before_it_binds(tmp_path):
    import subprocess

    bare = _model_dir(tmp_path / "bare")
    done = subprocess.run([sys.executable, "-m", "relax.cli.serve", "--port", "0", "model.source=hf",
                           f"model.path={bare}"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (2, ""), done
    assert done.stderr == (f"relax-serve: error: model.source=hf: cannot load the tokenizer of model.path='{bare}': "
                           f"the model directory has no tokenizer files: {NONE_OF}\n")


def test_the_same_directories_with_their_tokenizer_load(tmp_path):
    """The control: with the tokenizer's files (or the tokenizer given apart, model.tokenizer), the same checks pass
    and the tokenizer is the tiny one, token for token."""
    tiny = build_tiny_tokenizer().get_vocab()
    full = _model_dir(tmp_path / "full", tokenizer=True, architectures=["Qwen3ForCausalLM"])
    pre = preflight(load_config([*QUIET, "model.source=hf", f"model.path={full}"]), only=("model", "tokenizer"))
    assert pre.problems == {} and pre.tokenizer.get_vocab() == tiny
    pre = preflight(load_config([*QUIET, "algorithm=opd", f"teacher.path={full}"]), only=("tokenizer", "teacher"))
    assert pre.problems == {}
    check_reward_model(load_config([*QUIET, "reward_model=judge", "reward_model.template=\"{response}\"",
                                    f"reward_model.path={full}"]))
    assert load_tokenizer(load_config([f"model.tokenizer={full}"]).model).get_vocab() == tiny
