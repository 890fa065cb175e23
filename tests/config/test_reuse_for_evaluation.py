"""Evaluating what a run left behind (docs/training.md, "Evaluation"): a run's saved config.yaml taken whole with
`relax-train -cp <dir> -cn config` (the config it composes equals the run's, checked field by field), any other YAML
as the primary config refused in one line naming what works, a LoRA adapter directory given as model.path standing
for its merged model, and an evaluation of a run's saved config that needs none of its saving options retyped."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from relax.cli.command_line import absolute_config_path
from relax.config import ConfigError, load_config, to_relax_config
from relax.config.schema import ModelConfig
from relax.data.tokenizer import ModelPathError, check_model_files


def saved(tmp_path: Path, *overrides: str) -> tuple[object, Path]:
    """The resolved config of `overrides`, written as a checkpoint writes its config.yaml."""
    cfg = load_config(list(overrides))
    directory = tmp_path / "step_000002"
    directory.mkdir()
    (directory / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    return cfg, directory


def composed(directory: Path, name: str, *overrides: str):
    with initialize_config_dir(config_dir=str(directory), version_base=None):
        return to_relax_config(compose(config_name=name, overrides=list(overrides)))


def test_a_saved_config_composes_to_the_runs_config_with_overrides_on_top(tmp_path):
    # an algorithm whose config class is not the default's, and fields away from their defaults
    cfg, directory = saved(tmp_path, "algorithm=ppo", "model.lora_rank=4", "model.lora_alpha=8", "seed=7",
                           "train.eval_interval=2", "+data.eval_sets={x:{path:/d/x.jsonl,prompt_key:problem}}")
    assert composed(directory, "config") == cfg
    again = composed(directory, "config", "train.num_rollout=0", "train.eval_save_samples=true")
    assert again == dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, num_rollout=0,
                                                                       eval_save_samples=True))
    # the saved values are validated as an override's would be
    with pytest.raises(ConfigError, match="train.eval_pass_k=\\[8\\]: each k must be in 1"):
        composed(directory, "config", "train.eval_pass_k=[8]")


def test_another_yaml_as_the_primary_config_is_one_line_naming_what_works(tmp_path):
    (tmp_path / "mine.yaml").write_text("train:\n  lr: 0.1\n")
    with pytest.raises(ConfigError) as exc:
        composed(tmp_path, "mine")
    assert str(exc.value).startswith("  - the config file (-cn/--config-name) is not a Relax config: it has no "
                                     "algorithm, model, rollout, data sections.")
    assert "relax-train -cp <its directory> -cn config" in str(exc.value) and "+experiment=<name>" in str(exc.value)
    # a saved config with a key this version lacks names it
    cfg, directory = saved(tmp_path, "seed=3")
    text = (directory / "config.yaml").read_text().replace("seed: 3", "seed: 3\nfoo: 1")
    (directory / "config.yaml").write_text(text)
    with pytest.raises(ConfigError, match="the saved config does not fit this version's schema: .*foo"):
        composed(directory, "config")


def test_relax_train_reads_a_relative_config_path_from_the_working_directory(tmp_path):
    assert absolute_config_path(["-cp", "ck/step_1", "-cn", "config", "x=1"]) == \
        ["-cp", str(Path("ck/step_1").resolve()), "-cn", "config", "x=1"]
    assert absolute_config_path(["--config-path=ck", "x=1"]) == [f"--config-path={Path('ck').resolve()}", "x=1"]
    (tmp_path / "mine.yaml").write_text("foo: 1\n")
    out = subprocess.run([sys.executable, "-m", "relax.cli.train", "-cp", ".", "-cn", "mine"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and "TypeError" not in out.stderr
    assert "relax-train: error: invalid config (1 problem):\n  - the config file (-cn/--config-name) is not a " \
           "Relax config" in out.stderr


def test_an_adapter_directory_as_model_path_stands_for_its_merged_model(tmp_path, monkeypatch):
    """A PEFT adapter directory is its base with the adapters merged (relax.models.peft_merge, which relax-train,
    relax-serve and relax-export run first; tests/models/test_peft_adapter.py): before that merge the file check
    says so, rather than reading the adapter directory as a model."""
    monkeypatch.setenv("RELAX_MODEL_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4}))
    with pytest.raises(ModelPathError) as exc:
        check_model_files(ModelConfig(source="hf", path=str(tmp_path)))
    assert f"{str(tmp_path)!r} is a PEFT adapter directory (adapter_config.json, no config.json) not yet merged " \
           "into its base model" in str(exc.value)
    (tmp_path / "adapter_config.json").unlink()  # the control: a directory without either file
    with pytest.raises(ModelPathError, match="has no config.json"):
        check_model_files(ModelConfig(source="hf", path=str(tmp_path)))


def loaded(directory: Path, *overrides: str):
    """What relax-train makes of `-cp <directory> -cn config <overrides>`: the overrides passed along (`_run`)."""
    with initialize_config_dir(config_dir=str(directory), version_base=None):
        return to_relax_config(compose(config_name="config", overrides=list(overrides)), overrides=list(overrides))


def test_evaluating_a_run_with_its_saved_config_needs_none_of_its_saving_options_retyped(tmp_path, capsys):
    """review-user #4: the documented `-cp <checkpoint> -cn config train.resume=<checkpoint> train.num_rollout=0` was
    refused for any run that saved every few steps or exported (its own config's saving options 'have no effect')."""
    cfg, directory = saved(tmp_path, "train.save_interval=2", "train.save_hf=true", "train.keep_checkpoints=3")
    out = loaded(directory, "train.num_rollout=0")
    # the evaluation writes nothing: the run's saving options are put back to the defaults, and a note says so
    default = type(cfg.train)()
    assert (out.train.num_rollout, out.train.save_interval, out.train.save_hf, out.train.keep_checkpoints) == \
        (0, default.save_interval, False, default.keep_checkpoints)
    note = capsys.readouterr().err
    assert "evaluation only (train.num_rollout=0) writes no checkpoint and exports nothing" in note
    assert "train.save_interval=2, train.keep_checkpoints=3, train.save_hf=True (the training run's)" in note
    # every other field is the run's
    assert out == dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, num_rollout=0, save_interval=default.save_interval, save_hf=False,
        keep_checkpoints=default.keep_checkpoints))
    # one set on this command line is the user's for this run: refused, as without a saved config
    with pytest.raises(ConfigError) as exc:
        loaded(directory, "train.num_rollout=0", "train.save_hf=true")
    assert [v.fields for v in exc.value.violations] == [("train.save_hf",)]
    # continuing the run (steps left) keeps what it writes
    more = loaded(directory, "train.num_rollout=8")
    assert (more.train.save_interval, more.train.save_hf, more.train.keep_checkpoints) == (2, True, 3)
    # the control: without the command line's overrides every value counts as set, and the rule refuses all three
    with pytest.raises(ConfigError, match="train.save_hf=True has no effect: train.num_rollout=0"):
        composed(directory, "config", "train.num_rollout=0")


def test_relax_train_evaluates_a_saved_config_with_its_saving_options(tmp_path):
    _, directory = saved(tmp_path, "train.save_interval=2", "train.save_hf=true")
    run = subprocess.run([sys.executable, "-m", "relax.cli.train", "-cp", str(directory), "-cn", "config",
                          "train.num_rollout=0", "dry_run=true", f"train.save_dir={tmp_path / 'ck'}"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)  # Hydra's outputs/ here
    assert run.returncode == 0, run.stderr
    assert "train.save_interval=2, train.save_hf=True (the training run's) do not apply" in run.stderr
    assert "dry run: config valid" in run.stdout
