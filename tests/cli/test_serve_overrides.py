"""relax-serve's Hydra overrides: a key given twice is refused, as relax-train refuses it (the one helper,
relax.cli.config_check.duplicate_problems), beside the config's other problems, before anything loads; Hydra would
take the last silently. The problems are listed as relax-train lists them (relax.cli.config_check.invalid_config).
The model named here does not exist, so a command line that passes goes on to that check."""

from __future__ import annotations

import pytest

from relax.cli import serve

MISSING_MODEL = ["model.source=hf", "model.path=/nonexistent/relax-serve-model"]
REFUSED = "relax-serve: error: invalid config ({} problem{}):"


def refused(*problems: str) -> list[str]:
    """relax-serve's lines for a config with `problems`, relax-train's list (`invalid config (n problems):`)."""
    n = len(problems)
    return [REFUSED.format(n, "s" if n > 1 else ""), *(f"  - {p}" for p in problems)]


def start(capsys, *overrides: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        serve.main(["--port", "0", *MISSING_MODEL, *overrides])
    return info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("overrides,says", [
    (["seed=1", "seed=2"], "seed is given twice: seed=1 and seed=2"),
    (["model.dtype=float32", "+model.dtype=bfloat16", "++model.dtype=auto"],
     "model.dtype is given 3 times: model.dtype=float32, +model.dtype=bfloat16 and ++model.dtype=auto"),
    (["model=tiny", "model=smollm2_135m"], "model is given twice: model=tiny and model=smollm2_135m"),
])
def test_a_key_given_twice_is_refused_naming_the_key_and_each_value(capsys, overrides, says):
    code, err = start(capsys, *overrides)
    assert code == 2
    assert err.strip().splitlines() == refused(f"{says}; only the last would count: give it once"), err


def test_a_repeat_is_named_beside_the_configs_other_problems(capsys):
    code, err = start(capsys, "seed=1", "model.dtypee=float32", "seed=2")
    assert code == 2
    assert err.strip().splitlines() == refused(
        "seed is given twice: seed=1 and seed=2; only the last would count: give it once",
        "unknown key model.dtypee (did you mean model.dtype?)"), err
    # `+key` after `key`, a deletion beside a value: Relax's message alone (before: Hydra's refusal of the last as
    # written, "Could not append to config ...", "... does not support deletion", joined after it in one line)
    code, err = start(capsys, "seed=1", "+seed=2")
    assert code == 2
    assert err.strip().splitlines() == refused(
        "seed is given twice: seed=1 and +seed=2; only the last would count: give it once"), err
    code, err = start(capsys, "seed=1", "~seed", "model.hidden_size=x")
    assert code == 2
    assert err.strip().splitlines() == refused(
        "seed is both set and deleted: seed=1 sets it, ~seed deletes it; they contradict each other: give one of them",
        "model.hidden_size=x: model.hidden_size takes an int, not the string 'x'"), err


def test_config_problems_are_listed_as_relax_train_lists_them(capsys):
    """relax-serve's problems in relax-train's `invalid config (n problems)` list, one a line (before: its own
    `invalid config: a; b` on one line)."""
    from relax.cli.config_check import problems

    overrides = ["seed=abc", "model.hidden_size=x"]
    code, err = start(capsys, *overrides)
    assert code == 2
    assert err.strip() == f"relax-serve: error: {problems(overrides)}", err
    assert err.strip().splitlines() == refused(
        "seed=abc: seed takes an int, not the string 'abc'",
        "model.hidden_size=x: model.hidden_size takes an int, not the string 'x'"), err


def test_hydras_keys_and_groups_are_refused_as_doing_nothing_in_relax_serve(capsys):
    """relax-serve runs no Hydra job (no chdir, no run directory, no Hydra logging, no launcher), so each override of
    Hydra's own keys and groups is refused in the one list, beside the config's other problems, rather than accepted
    to do nothing (before: `hydra.job.chdir=true`, `hydra.run.dir=...`, `hydra/job_logging=disabled` passed the check
    and went on to start). `+` on a key that is there and `~` of a schema key: relax-train's lines."""
    no_job = "relax-serve runs no Hydra job, so this override has no effect here: leave it out"
    code, err = start(capsys, "hydra.job.chdir=true", "hydra.run.dir=/tmp/relax-serve-run",
                      "hydra/job_logging=disabled", "~hydra.job.name", "hydra/launcher=basic", "~seed")
    assert code == 2
    assert err.strip().splitlines() == refused(
        f"hydra.job.chdir=true: {no_job}",
        f"hydra.run.dir=/tmp/relax-serve-run: {no_job}",
        f"hydra/job_logging=disabled: {no_job}",
        f"~hydra.job.name: {no_job}",
        f"hydra/launcher=basic: {no_job}",
        "~seed: seed is a key of the schema (every config has it), so it cannot be deleted: to keep the "
        "value the config gives it (seed=1), leave ~seed out; to change it: seed=VALUE"), err
    code, err = start(capsys, "hydra.job.chdir=true", "seed=1", "seed=2")
    assert err.strip().splitlines() == refused(
        "seed is given twice: seed=1 and seed=2; only the last would count: give it once",
        f"hydra.job.chdir=true: {no_job}"), err
    code, err = start(capsys, "+seed=2")
    assert err.strip().splitlines() == refused(
        "+seed=2: seed is already in the config, and + adds a key it does not have: set it with "
        "seed=2 (++seed=2 sets it whether or not it is there)"), err
    # the control: the same config without Hydra's overrides goes on to the missing model
    code, err = start(capsys, "++seed=2")
    assert code == 2 and "invalid config" not in err and "/nonexistent/relax-serve-model" in err, err


def test_hydra_searchpath_adds_a_directorys_config_groups_to_relax_serves_config(tmp_path, capsys):
    """hydra.searchpath does take effect in relax-serve: the config is composed with it, so a group option of the
    directory is chosen (its value is in the config relax-serve loads), and the start goes on to the missing model.
    The control: without it, the option is unknown."""
    import argparse

    conf = tmp_path / "myconf" / "model"
    conf.mkdir(parents=True)
    (conf / "tiny_wide.yaml").write_text("# @package _global_\nmodel:\n  name: tiny\n  dtype: bfloat16\n")
    searchpath = f"hydra.searchpath=[file://{tmp_path / 'myconf'}]"
    cfg = serve._load(argparse.Namespace(config=None, overrides=["model=tiny_wide", searchpath]))
    assert cfg.model.dtype == "bfloat16"
    code, err = start(capsys, "model=tiny_wide", searchpath)
    assert code == 2 and "invalid config" not in err and "/nonexistent/relax-serve-model" in err, err
    code, err = start(capsys, "model=tiny_wide")
    assert code == 2 and "invalid config" in err and "tiny_wide" in err, err


def test_single_values_go_on_to_the_next_check(capsys):
    """The control: each key once passes, and the start stops at the missing model."""
    code, err = start(capsys, "seed=2", "++model.dtype=float32")
    assert code == 2
    assert "given twice" not in err and "/nonexistent/relax-serve-model" in err, err


def test_a_key_relax_serve_does_not_read_is_refused_in_one_line_each(capsys):
    """relax-serve serves a model: it reads model.*, seed, data.tool_parser and the server flags of a run's servers
    (rollout.lora_sync, rollout.routing_replay, rollout.record_routes, cluster.colocate), and its OpenAI routes
    sample with each request's own parameters. Every other key of the config would do nothing, so each override of
    one is refused in one line naming it, with the config's other problems, before the model loads (before: the
    review's `rollout.temperature=0.01 rollout.max_response_len=4 train.lr=1` started and sampled at the request's
    temperature and to the context's end; `rollout.temperature=0` was refused as `must be > 0`)."""
    reads = ("model.*, seed, plugins, experiment, data.tool_parser, rollout.lora_sync, rollout.routing_replay, "
             "rollout.record_routes, cluster.colocate")

    def unread(override: str, key: str) -> str:
        return (f"{override}: relax-serve does not read {key} (it reads {reads}), so this override has no effect "
                "here: leave it out")

    code, err = start(capsys, "rollout.temperature=0.01", "rollout.max_response_len=4", "train.lr=1")
    assert code == 2
    assert err.strip().splitlines() == refused(unread("rollout.temperature=0.01", "rollout.temperature"),
                                               unread("rollout.max_response_len=4", "rollout.max_response_len"),
                                               unread("train.lr=1", "train.lr")), err
    # named for doing nothing here, not checked as relax-train would check it
    code, err = start(capsys, "rollout.temperature=0")
    assert err.strip().splitlines() == refused(unread("rollout.temperature=0", "rollout.temperature")), err
    # training's groups and sections, a deletion, a model option only the trainer reads, a key given twice (one
    # line: the key is refused, not its repeat), beside a problem of a key it reads: all at once
    code, err = start(capsys, "algorithm=m2po", "data=calculator", "rollout=sglang", "cluster=1xgpu",
                      "reward_model=judge", "dry_run=true", "tracking.experiment=x", "~tracking.uri",
                      "model.gradient_checkpointing=true", "algorithm.eps_clip=0.3", "train.lr=1", "train.lr=2",
                      "seed=abc")
    assert code == 2
    assert err.strip().splitlines() == refused(
        *(unread(o, o.split("=")[0].lstrip("~")) for o in (
            "algorithm=m2po", "data=calculator", "rollout=sglang", "cluster=1xgpu", "reward_model=judge",
            "dry_run=true", "tracking.experiment=x", "~tracking.uri", "model.gradient_checkpointing=true",
            "algorithm.eps_clip=0.3", "train.lr=2")),
        "seed=abc: seed takes an int, not the string 'abc'"), err
    # a misspelled key is named as relax-train names it, with the key meant (which relax-serve may read)
    code, err = start(capsys, "rollout.lora_synk=adapter")
    assert err.strip().splitlines() == refused("unknown key rollout.lora_synk (did you mean rollout.lora_sync?)"), err


def test_the_keys_relax_serve_reads_are_taken(capsys):
    """The control: the keys relax-serve reads pass its check (the start goes on to the missing model) and reach the
    config it serves."""
    import argparse

    read = ["seed=3", "data.tool_parser=hermes", "model.dtype=float32", "rollout.record_routes=false",
            "cluster.colocate=true", "plugins=[]"]
    code, err = start(capsys, *read)
    assert code == 2 and "invalid config" not in err and "/nonexistent/relax-serve-model" in err, err
    cfg = serve._load(argparse.Namespace(config=None, overrides=["model=tiny", *read]))
    assert (cfg.seed, cfg.data.tool_parser, cfg.model.dtype, cfg.model.name) == (3, "hermes", "float32", "tiny")
    code, err = start(capsys, "+experiment=smollm2_arithmetic_cpu")  # an experiment's model
    assert code == 2 and "invalid config" not in err and "/nonexistent/relax-serve-model" in err, err
    assert all(serve._in_schema(k) for k in serve.READ_KEYS if k != "experiment")  # no key renamed away


def test_cluster_colocate_false_serves_as_a_non_colocated_runs_server(capsys, monkeypatch):
    """cluster.colocate is one of the server flags relax-serve reads (SGLang's --enable-memory-saver, which a
    colocated run's servers have), yet `cluster.colocate=false` was refused by relax-train's placement rule
    ("cluster.colocate=false has no effect without GPUs (cluster.gpus_per_node=0)"), naming a key relax-serve itself
    refuses: no command line could give it. relax-serve places no roles, so it now serves without the memory saver
    (what /get_server_info reports, and /release_memory_occupation is refused), its value still checked; a mistake
    beside it is refused alone (before: `cluster.colocate=false seed=abc` listed the placement rule too, whose value
    is accepted once seed is right)."""
    import argparse

    import torch

    from relax.serve.sglang.server_args import memory_saver, server_args

    loaded = []  # the config relax-serve's start loads, which goes on to the missing model

    def load(args: argparse.Namespace):
        loaded.append(real_load(args))
        return loaded[-1]

    real_load = serve._load
    monkeypatch.setattr(serve, "_load", load)
    code, err = start(capsys, "cluster.colocate=false")
    assert code == 2 and "invalid config" not in err and "/nonexistent/relax-serve-model" in err, err
    [apart] = loaded
    assert apart.cluster.colocate is False and not memory_saver(apart)
    assert server_args(apart, torch.device("cpu"))["enable_memory_saver"] is False
    assert memory_saver(real_load(argparse.Namespace(config=None, overrides=["model=tiny"])))  # the control: default
    # a value not of its type, and the placement keys relax-serve does not read, are refused as before
    code, err = start(capsys, "cluster.colocate=maybe", "cluster.gpus_per_node=1")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 3 and "relax-serve does not read cluster.gpus_per_node" in lines[1], err
    assert lines[2] == "  - cluster.colocate=maybe: cluster.colocate takes a bool (true or false), not the string " \
        "'maybe'", err
    # another key's mistake beside it is refused alone, the placement rule not among them
    code, err = start(capsys, "cluster.colocate=false", "seed=abc")
    assert code == 2 and err.strip().splitlines() == refused("seed=abc: seed takes an int, not the string 'abc'"), err
