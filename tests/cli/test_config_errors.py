"""Bad input to relax-train, relax-submit and relax-compare: one clear `<tool>: error: ...` (exit 2) naming what is
wrong, every problem at once, no traceback, before anything starts; the same for a sweep (`-m`) and for `--cfg`.
Each case has its control: the valid command goes on."""

from __future__ import annotations

import pytest
from relax_train_inprocess import relax_train

from relax.config import ConfigError, load_config


def _refused(code: int, out: str, err: str) -> str:
    assert code == 2, out + err
    assert err.startswith("relax-train: error: "), err
    assert "Traceback" not in out + err and "FrozenInstanceError" not in err
    assert "To append to your config use +" not in err and "_schema" not in err
    return err


@pytest.mark.parametrize("args,message", [
    (["train.lrr=1e-3"], "unknown key train.lrr (did you mean train.lr?)"),
    (["+train.lrr=1e-3"], "unknown key train.lrr (did you mean train.lr?)"),
    (["+train.foo=1"], "unknown key train.foo"),
    (["trian.lr=1e-3"], "unknown key trian.lr (did you mean train.lr?)"),
    (["algorithm.kl2_budget=0.02"], "algorithm.kl2_budget is an option of algorithm=m2po, not of algorithm=grpo"),
    (["+algorithm.kl2_budget=0.02"], "algorithm.kl2_budget is an option of algorithm=m2po, not of algorithm=grpo"),
])
def test_unknown_key_is_named_with_what_was_meant(args, message, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    err = _refused(*relax_train([*args, "dry_run=true"], capfd))
    assert message in err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_unknown_keys_are_reported_with_every_other_problem(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    err = _refused(*relax_train(["train.lrr=1", "+train.foo=1", "train.lr=-1", "tracking.uri=foo://bar"], capfd))
    assert "(4 problems)" in err
    for needle in ("unknown key train.lrr", "unknown key train.foo", "train.lr=-1.0 must be > 0",
                   "tracking.uri='foo://bar'"):
        assert needle in err


def test_a_group_choice_that_names_no_option_is_reported_with_the_other_problems(tmp_path, monkeypatch, capfd):
    """`model=nonexistent` no longer hides the rest of the command line's problems (Hydra stops at the first missing
    option with its own message: before, `In 'config': Could not find 'model/nonexistent'` alone): every such choice,
    with its group's options, and every unknown key, at once. The rules are not run on the groups' defaults put in
    their place; an algorithm's keys are not judged against another algorithm."""
    monkeypatch.chdir(tmp_path)
    err = _refused(*relax_train(["model=nonexistent", "algorithm.foo=1", "data.bar=2", "dry_run=true"], capfd))
    first, choice, foo, bar = err.splitlines()
    assert first == "relax-train: error: invalid config (3 problems):"
    assert choice.startswith("  - model=nonexistent: config group model has no option 'nonexistent'; its options: "
                             "qwen2_5_vl_3b, qwen35_9b, qwen3_0.6b,"), err
    assert ", tiny, tiny_moe" in choice and "_schema" not in choice  # (the list is conf/model's files)
    assert (foo, bar) == ("  - unknown key algorithm.foo: algorithm has no key 'foo'",
                          "  - unknown key data.bar: data has no key 'bar'"), err
    assert list(tmp_path.iterdir()) == []  # nothing written
    err = _refused(*relax_train(["algorithm=grpoo", "data=nope", "algorithm.kl2_budget=1", "train.lrr=1",
                                 "train.lr=-1", "dry_run=true"], capfd))
    assert "(3 problems)" in err, err
    for needle in ("algorithm=grpoo: config group algorithm has no option 'grpoo' (did you mean algorithm=grpo?)",
                   "data=nope: config group data has no option 'nope'; its options: arithmetic, calculator",
                   "unknown key train.lrr (did you mean train.lr?)"):
        assert needle in err, err
    assert "kl2_budget" not in err and "train.lr=-1" not in err
    # an algorithm no option is close to: perhaps a plugin's, registered only when plugins= imports its module
    err = _refused(*relax_train(["algorithm=vanilla_pg", "dry_run=true"], capfd))
    assert ("algorithm=vanilla_pg: config group algorithm has no option 'vanilla_pg' (an algorithm a plugin "
            "registers: give plugins=[its module] on the command line); its options: ") in err, err
    # the control: with the choice valid, the same keys are judged as before (the rules too)
    err = _refused(*relax_train(["model=tiny", "algorithm.foo=1", "data.bar=2", "train.lr=-1", "dry_run=true"],
                                capfd))
    assert "(3 problems)" in err and "train.lr=-1.0 must be > 0" in err, err


def test_the_algorithms_own_key_is_accepted_with_it():
    """The control: the m2po key with algorithm=m2po, a + that adds nothing new is no unknown key."""
    assert load_config(["algorithm=m2po", "algorithm.kl2_budget=0.02"]).algorithm.kl2_budget == 0.02
    with pytest.raises(ConfigError) as exc:
        load_config(["algorithm=m2po", "algorithm.kl2_budget=0.02", "+train.foo=1"])
    assert [v.fields for v in exc.value.violations] == [("train.foo",)]


@pytest.mark.parametrize("args,needles", [
    (["-m", "train.lrr=1", "seed=1,2"], ["invalid config in 2 of 2 sweep jobs", "job 0 (train.lrr=1 seed=1)",
                                         "job 1 (train.lrr=1 seed=2)",
                                         "unknown key train.lrr (did you mean train.lr?)"]),
    (["-m", "algorithm=rloo,grpo", "train.lr=abc"], ["invalid config in 2 of 2 sweep jobs", "train.lr=abc"]),
    (["-m", "algorithm=rloo,grpoo", "seed=1"], ["invalid config in 1 of 2 sweep jobs",
                                               "job 1 (algorithm=grpoo seed=1)",
                                               "algorithm=grpoo: config group algorithm has no option 'grpoo' (did you "
                                               "mean algorithm=grpo?); its options: cispo, grpo", "rloo"]),
    (["-m", "seed=1,2", "tracking.uri=foo://bar"], ["invalid config in 2 of 2 sweep jobs", "tracking.uri='foo://bar'"]),
    (["--cfg", "job", "train.lrr=1"], ["unknown key train.lrr (did you mean train.lr?)"]),
])
def test_a_sweep_and_cfg_get_the_same_clean_errors(args, needles, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    err = _refused(*relax_train(args, capfd))
    for needle in needles:
        assert needle in err
    assert list(tmp_path.iterdir()) == []  # no multirun/ directory: nothing started


@pytest.mark.parametrize("args, override, extra", [
    ([], "data.tools=mymod:TOOLS", ["rollout.max_turns=2"]),
    (["-m", "seed=1,2"], "data.tools=mymod:TOOLS", ["rollout.max_turns=2"]),
    ([], "train.eval_pass_k=1", ["train.eval_interval=5"]),
])
def test_a_list_option_without_brackets_is_named_with_the_form_it_takes(args, override, extra, tmp_path, monkeypatch,
                                                                         capfd):
    """data.tools=mymod:TOOLS (a list option given one bare value) gets one line naming the option and the accepted
    form, not OmegaConf's "str is not a ListConfig, list or tuple"; the form it shows composes (the control: only
    the module, which does not exist, is left to refuse, at start)."""
    from relax.cli.config_check import problems

    monkeypatch.chdir(tmp_path)
    key, value = override.split("=", 1)
    err = _refused(*relax_train([*args, override, *extra, "dry_run=true"], capfd))
    assert f"{override}: {key} is a list, written in brackets: {key}=[{value}]" in err, err
    assert "ListConfig" not in err and "Error merging" not in err
    assert f"in a shell, quote it: '{key}=[{value}]'" in err
    assert problems([f"{key}=[{value}]", *extra]) is None
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_job_with_a_password_in_a_url_is_named_without_it(tmp_path, monkeypatch, capfd):
    """The job's header lists its overrides: a URL's user:password@ is masked there as in the rule's message."""
    monkeypatch.chdir(tmp_path)
    err = _refused(*relax_train(["-m", "data.reward=http://user:pwsecret@127.0.0.1:8131/ok,digits",
                                 "train.num_rollout=1"], capfd))
    assert "invalid config in 1 of 2 sweep jobs" in err and "job 0 (data.reward=http\\://***@127.0.0.1" in err
    assert "holds a user or password" in err and "pwsecret" not in err


def test_a_valid_sweep_and_cfg_go_on(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    code, out, err = relax_train(["-m", "hydra/launcher=basic", "seed=1,2", "dry_run=true"], capfd)
    assert code in (0, None), err
    assert out.count("dry run: config valid") == 2
    code, out, err = relax_train(["--cfg", "job", "algorithm=m2po", "algorithm.kl2_budget=0.02"], capfd)
    assert code in (0, None), err
    assert "kl2_budget: 0.02" in out


@pytest.mark.parametrize("uri", ["sqlite:///mlflow.db", "file:///tmp/mlruns", "mlruns", "/tmp/mlruns",
                                 "http://127.0.0.1:5000", "https://mlflow.example", "postgresql+psycopg2://u@h/db",
                                 "databricks"])
def test_tracking_uri_that_mlflow_can_use_is_accepted(uri):
    assert load_config([f"tracking.uri={uri}"]).tracking.uri == uri


@pytest.mark.parametrize("uri", ["foo://bar", "s3://bucket/mlruns", "htp://host:5000"])
def test_tracking_uri_that_mlflow_cannot_use_is_refused_before_anything(uri, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    err = _refused(*relax_train([f"tracking.uri={uri}", "dry_run=true"], capfd))
    assert f"tracking.uri={uri!r}: MLflow has no store for the scheme" in err
    assert list(tmp_path.iterdir()) == []
    # not read without tracking: not checked either
    assert load_config([f"tracking.uri={uri}", "tracking.enabled=false"]).tracking.uri == uri


def test_readme_example_of_a_field_one_backend_rejects_is_true():
    with pytest.raises(ConfigError) as exc:
        load_config(["train.backend=megatron", "train.max_tokens_per_micro_batch=4096"])
    assert exc.value.violations[0].fields[0] == "train.max_tokens_per_micro_batch"
    with pytest.raises(ConfigError) as exc:
        load_config(["train.expert_parallel_size=2"])
    assert exc.value.violations[0].fields[0] == "train.expert_parallel_size"


def test_help_group_table_is_aligned(capfd):
    code, out, _ = relax_train(["--help"], capfd)
    lines = out.splitlines()
    start = lines.index("Config groups (default in brackets):") + 1
    rows = lines[start:lines.index("", start)]
    assert any(r.split()[0] == "reward_model" for r in rows)
    assert len({len(r) - len(r[2:].split(" ", 1)[1].lstrip()) for r in rows}) == 1, rows  # one options column
    assert code in (0, None) and "[none]" in next(r for r in rows if r.split()[0] == "reward_model")


def test_submit_validates_the_config_before_submitting(monkeypatch, capsys):
    from relax.cli.submit import main

    monkeypatch.delenv("EXP_DIR", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["--dry-run", "--exp-dir", "/shared/exp", "--", "train.lrr=1", "train.lr=-1"])
    captured = capsys.readouterr()
    assert exc.value.code == 2 and captured.out == ""
    assert captured.err.startswith("relax-submit: error: invalid config (2 problems)")
    assert "unknown key train.lrr (did you mean train.lr?)" in captured.err
    assert "train.lr=-1.0 must be > 0" in captured.err
    assert "Nothing was submitted." in captured.err and "Traceback" not in captured.err
    with pytest.raises(SystemExit) as exc:
        main(["--dry-run", "--exp-dir", "/shared/exp", "--", "-m", "seed=1,2", "algorithm.kl2_budget=0.02"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "invalid config in 2 of 2 sweep jobs" in err
    # the control: a valid config is submitted (printed, with --dry-run)
    main(["--dry-run", "--exp-dir", "/shared/exp", "--", "train.lr=1e-3"])
    assert "python -m relax.cli.train train.lr=1e-3" in capsys.readouterr().out


def test_submit_runs_relax_trains_config_only_start_checks_before_submitting(monkeypatch, capsys, tmp_path):
    """A data.tool_parser that nothing of the run reads passes the config rules, and relax-train refuses it before
    Ray (preflight's tool_parser check): on the cluster, once the job started. relax-submit refuses it before it
    submits, with the start's message (exit 2, nothing submitted), in every job of a sweep; the checks it runs are
    preflight's own list of those that read the config alone (CONFIG_CHECKS). Control: the same parser with
    data.tools, which reads it, is submitted. Before: the first two were submitted."""
    from relax.cli.submit import main
    from relax.config import load_config
    from relax.runner.preflight import CONFIG_CHECKS, preflight

    monkeypatch.delenv("EXP_DIR", raising=False)
    monkeypatch.chdir(tmp_path)  # (the start's checks probe the default checkpoint directory, writing nothing)
    assert CONFIG_CHECKS == ("tool_parser",)
    bad = ["data.tool_parser=hermes"]
    start = str(preflight(load_config(bad)).error())  # what the job's start says (the whole preflight, as it runs)
    assert start.startswith("data.tool_parser=hermes has no effect: single-turn data"), start
    with pytest.raises(SystemExit) as exc:
        main(["--dry-run", "--exp-dir", "/shared/exp", "--", *bad])
    captured = capsys.readouterr()
    assert exc.value.code == 2 and captured.out == ""
    assert captured.err == f"relax-submit: error: a start would stop before Ray: {start}\nNothing was submitted.\n"
    with pytest.raises(SystemExit) as exc:
        main(["--dry-run", "--exp-dir", "/shared/exp", "--", "-m", "seed=1,2", *bad])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "invalid config in 2 of 2 sweep jobs" in err and err.count(start) == 2, err
    read = [*bad, "data.tools=[python]", "rollout.max_turns=4"]
    main(["--dry-run", "--exp-dir", "/shared/exp", "--", *read])
    assert "data.tool_parser=hermes" in capsys.readouterr().out


def test_submit_leaves_a_keys_variable_to_the_cluster(monkeypatch, capsys):
    """Whether a key's environment variable is set is true of the job's machine: relax-submit does not refuse a
    job whose variable only the cluster sets, which relax-train here (the control) refuses."""
    from relax.cli.config_check import problems
    from relax.cli.submit import main

    monkeypatch.delenv("EXP_DIR", raising=False)
    monkeypatch.delenv("RELAX_TEST_UNSET_KEY", raising=False)
    judge = ["reward_model=judge", "reward_model.engine=openai", "reward_model.url=http://10.0.0.1:8000/v1",
             "reward_model.model=judge", "reward_model.api_key_env=RELAX_TEST_UNSET_KEY"]
    assert "RELAX_TEST_UNSET_KEY is not set" in problems(judge)
    main(["--dry-run", "--exp-dir", "/shared/exp", "--", *judge])
    assert "reward_model.api_key_env=RELAX_TEST_UNSET_KEY" in capsys.readouterr().out


def test_submit_runs_the_start_checks_when_only_a_keys_variable_is_unset_here(monkeypatch, capsys, tmp_path):
    """The usual relax-submit case: the judge's key variable is set on the cluster only, which the rules leave to
    the cluster; the config's other start checks still apply. A data.tool_parser that nothing reads is refused at
    submit with the start's message (exit 2), as it is with the variable set (the control: the same refusal) and
    with data.tools, which reads it, the job is submitted. Before: the unset variable made job_problem return None
    early, so the job was submitted and refused by the cluster's preflight."""
    from relax.cli.submit import main

    monkeypatch.delenv("EXP_DIR", raising=False)
    monkeypatch.delenv("RELAX_TEST_UNSET_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    judge = ["reward_model=judge", "reward_model.engine=openai", "reward_model.url=http://10.0.0.1:8000/v1",
             "reward_model.model=judge", "reward_model.api_key_env=RELAX_TEST_UNSET_KEY"]
    bad = [*judge, "data.tool_parser=hermes"]
    refusal = "relax-submit: error: a start would stop before Ray: data.tool_parser=hermes has no effect"
    with pytest.raises(SystemExit) as exc:
        main(["--dry-run", "--exp-dir", "/shared/exp", "--", *bad])
    captured = capsys.readouterr()
    assert exc.value.code == 2 and captured.out == "" and captured.err.startswith(refusal), captured.err
    monkeypatch.setenv("RELAX_TEST_UNSET_KEY", "k")  # control: the variable set here, the same refusal
    with pytest.raises(SystemExit) as exc:
        main(["--dry-run", "--exp-dir", "/shared/exp", "--", *bad])
    assert exc.value.code == 2 and capsys.readouterr().err.startswith(refusal)
    monkeypatch.delenv("RELAX_TEST_UNSET_KEY")
    main(["--dry-run", "--exp-dir", "/shared/exp", "--", *bad, "data.tools=[python]", "rollout.max_turns=4"])
    assert "data.tool_parser=hermes" in capsys.readouterr().out


@pytest.mark.parametrize("n", ["0", "-5"])
def test_compare_refuses_a_bootstrap_below_1(n, capsys):
    from relax.cli.compare import main

    with pytest.raises(SystemExit) as exc:
        main(["--bootstrap", n])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--bootstrap must be >= 1 (the number of bootstrap resamples), got {n}" in err


def test_compare_accepts_a_bootstrap_of_1(tmp_path, monkeypatch, capsys):
    from relax.cli.compare import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):  # no store here: refused for that, not for --bootstrap
        main(["--bootstrap", "1", "--uri", f"sqlite:///{tmp_path}/none.db"])
    assert "--bootstrap" not in capsys.readouterr().err


@pytest.mark.slow  # trains 3 steps
def test_run_summary_names_the_steps_its_first_reward_is_over(in_process, tmp_path, monkeypatch, capfd):
    """Fewer than 10 steps: "first 3 steps reward", the mean over all of them (not "first 10")."""
    monkeypatch.chdir(tmp_path)
    code, out, err = relax_train(["train.num_rollout=3", "tracking.enabled=false",
                                  f"train.save_dir={tmp_path / 'ckpt'}"], capfd)
    assert code in (0, None), err
    out += err
    assert "first 3 steps reward" in out and "first 10 steps" not in out, out


def test_values_not_of_their_keys_type_are_reported_together_with_the_other_problems(tmp_path, monkeypatch, capfd):
    """`train.lr=abc ... train.num_rollout=xyz` names every value not of its key's type, with the key, the value and
    the type the schema declares, in the one 'invalid config (n problems)' list beside the rules' problems (Hydra
    stopped at the first, in OmegaConf's words: 'Error merging override train.lr=abc ... could not be converted to
    Float'). Nothing is written."""
    monkeypatch.chdir(tmp_path)
    err = _refused(*relax_train(["train.lr=abc", "model=tiny", "train.num_rollout=xyz", "tracking.uri=foo://bar",
                                 "dry_run=true"], capfd))
    lines = err.splitlines()
    assert lines[:3] == ["relax-train: error: invalid config (3 problems):",
                         "  - train.lr=abc: train.lr takes a float (a number: 0.5, 1e-5), not the string 'abc'",
                         "  - train.num_rollout=xyz: train.num_rollout takes an int, not the string 'xyz'"], err
    assert lines[3].startswith("  - tracking.uri='foo://bar'") and len(lines) == 4, err
    assert "Error merging" not in err and "could not be converted" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("override,message", [
    ("train.num_rollout=1.5", "train.num_rollout=1.5: train.num_rollout takes an int, not the float 1.5"),
    ("train.num_rollout=null", "train.num_rollout=null: train.num_rollout takes an int, not null"),
    ("model.gradient_checkpointing=maybe", "model.gradient_checkpointing=maybe: model.gradient_checkpointing takes a "
                                           "bool (true or false), not the string 'maybe'"),
    ("cluster.cpus_per_node=abc", "cluster.cpus_per_node=abc: cluster.cpus_per_node takes an int or null, not the "
                                  "string 'abc'"),
    ("train.eval_pass_k=[1,a]", "train.eval_pass_k=[1,a]: train.eval_pass_k takes a list of ints, in brackets "
                                "([a,b]) or null, not [1,a]: its item [1] is the string 'a'"),
    ("data.eval_sets=3", "data.eval_sets=3: data.eval_sets takes a mapping, in braces ({key: value}), not the int 3"),
    # an algorithm's own field, typed by its config class (the override after the choice whose keys merge first)
    ("algorithm.kl2_budget=x", "algorithm.kl2_budget=x: algorithm.kl2_budget takes a float (a number: 0.5, 1e-5), "
                               "not the string 'x'"),
])
def test_a_value_not_of_its_keys_type_names_the_key_the_value_and_the_type(override, message):
    from relax.cli.config_check import problems

    assert problems(["algorithm=m2po", override, "train.lrr=1"]) == (
        "invalid config (2 problems):\n"
        f"  - {message}\n"
        "  - unknown key train.lrr (did you mean train.lr?)")
    assert problems(["algorithm=m2po", "train.num_rollout=2", "algorithm.kl2_budget=0.02"]) is None  # the control


def test_the_rules_do_not_judge_the_default_put_in_place_of_a_refused_value():
    """A refused value leaves its key at the default only so the rest composes: a rule about that key would judge a
    value nobody gave (train.global_batch_size=7 against the default train.micro_batch_size=8), so it is not
    reported; the control: with train.micro_batch_size=8 given, the rule is."""
    from relax.cli.config_check import problems

    refused = problems(["train.micro_batch_size=abc", "train.global_batch_size=7"])
    assert "train.micro_batch_size=abc: train.micro_batch_size takes an int" in refused, refused
    assert "divisible by train.micro_batch_size" not in refused, refused
    given = problems(["train.micro_batch_size=8", "train.global_batch_size=7"])
    assert "must be divisible by train.micro_batch_size=8" in given, given


def test_a_sweeps_launcher_option_and_jobs_values_of_the_wrong_type_are_all_named():
    from relax.cli.config_check import problems

    found = problems(["-m", "hydra.launcher.max_concurrent_jobs=abc", "train.lr=abc,0.5", "train.num_rollout=x"])
    assert found == (
        "invalid config (1 problem):\n"
        "  - hydra.launcher.max_concurrent_jobs=abc: hydra.launcher.max_concurrent_jobs takes an int or null, not the "
        "string 'abc'\n"
        "invalid config in 2 of 2 sweep jobs (nothing started):\n"
        "job 0 (train.lr=abc train.num_rollout=x):\n"
        "  - train.lr=abc: train.lr takes a float (a number: 0.5, 1e-5), not the string 'abc'\n"
        "  - train.num_rollout=x: train.num_rollout takes an int, not the string 'x'\n"
        "job 1 (train.lr=0.5 train.num_rollout=x):\n"
        "  - train.num_rollout=x: train.num_rollout takes an int, not the string 'x'"), found
    assert problems(["-m", "hydra.launcher.max_concurrent_jobs=2", "train.lr=1e-4,1e-5"]) is None  # the control


def test_a_key_given_twice_is_refused_naming_the_key_and_both_values(tmp_path, monkeypatch, capfd):
    """`train.lr=1e-5 train.lr=2e-5` no longer runs with the last value silently: refused before anything starts,
    naming the key and each value, beside the command line's other problems (checked with the last of each, as Hydra
    would compose it). `+key`/`++key` are the same key; a group choice given twice too."""
    from relax.cli.config_check import problems

    monkeypatch.chdir(tmp_path)
    err = _refused(*relax_train(["train.lr=1e-5", "train.lr=2e-5", "dry_run=true"], capfd))
    assert err.splitlines() == [
        "relax-train: error: invalid config (1 problem):",
        "  - train.lr is given twice: train.lr=1e-5 and train.lr=2e-5; only the last would count: give it once (to "
        "run each value: relax-train -m train.lr=1e-5,2e-5)"], err
    assert list(tmp_path.iterdir()) == []
    found = problems(["train.lr=1e-5", "+train.lr=2e-5", "++train.lr=3e-5", "model=tiny", "model=smollm2_135m",
                      "train.lrr=1"])
    assert found.startswith("invalid config (3 problems):\n"
                            "  - train.lr is given 3 times: train.lr=1e-5, +train.lr=2e-5 and ++train.lr=3e-5; "
                            "only the last would count"), found
    assert "  - model is given twice: model=tiny and model=smollm2_135m; only the last would count" in found
    assert "unknown key train.lrr" in found  # the rest of the command line is still checked
    # a sweep's repeat (a launcher option too) is refused; its values in one override are no repeat (the control)
    found = problems(["-m", "train.lr=1e-5", "train.lr=2e-5", "hydra.launcher.max_concurrent_jobs=1",
                      "++hydra.launcher.max_concurrent_jobs=2", "seed=1,2"])
    assert found == (
        "invalid config (2 problems):\n"
        "  - train.lr is given twice: train.lr=1e-5 and train.lr=2e-5; only the last would count: give it once; to "
        "run each value, sweep them in one override: train.lr=1e-5,2e-5\n"
        "  - hydra.launcher.max_concurrent_jobs is given twice: hydra.launcher.max_concurrent_jobs=1 and "
        "++hydra.launcher.max_concurrent_jobs=2; only the last would count: give it once"), found
    assert problems(["-m", "train.lr=1e-5,2e-5", "hydra.launcher.max_concurrent_jobs=1", "seed=1,2"]) is None
    assert problems(["train.lr=2e-5", "seed=1"]) is None
    # the same value twice: give it once, no sweep of the value with itself (before: relax-train -m model=tiny,tiny)
    assert problems(["model=tiny", "model=tiny"]) == (
        "invalid config (1 problem):\n"
        "  - model is given twice: model=tiny and model=tiny; only the last would count: give it once")


def test_a_key_set_and_deleted_or_appended_after_its_value_is_one_message_without_hydras(tmp_path, monkeypatch, capfd):
    """`train.lr=1e-5 ~train.lr` (a deletion beside a value: a contradiction, named with both) and `train.lr=1e-5
    +train.lr=2e-5`: Relax's one message, exit 2, without Hydra's text after it (before: "TrainConfig (DictConfig)
    does not support deletion" / "Could not append to config ..." followed the list, since the rest of the command
    line was composed with the last override as written, which does not compose alone). The rest is checked with the
    last value, written as the first was."""
    from relax.cli.config_check import duplicate_problems, problems

    monkeypatch.chdir(tmp_path)
    err = _refused(*relax_train(["train.lr=1e-5", "~train.lr", "dry_run=true"], capfd))
    assert err.splitlines() == [
        "relax-train: error: invalid config (1 problem):",
        "  - train.lr is both set and deleted: train.lr=1e-5 sets it, ~train.lr deletes it; they contradict each "
        "other: give one of them"], err
    assert list(tmp_path.iterdir()) == []
    assert problems(["train.lr=1e-5", "+train.lr=2e-5"]) == (
        "invalid config (1 problem):\n"
        "  - train.lr is given twice: train.lr=1e-5 and +train.lr=2e-5; only the last would count: give it once (to "
        "run each value: relax-train -m train.lr=1e-5,2e-5)")
    assert problems(["train.lr=1e-5", "train.lr=2e-5", "~train.lr", "train.lrr=1"]) == (
        "invalid config (2 problems):\n"
        "  - train.lr is both set and deleted: train.lr=1e-5 and train.lr=2e-5 set it, ~train.lr deletes it; they "
        "contradict each other: give one of them\n"
        "  - unknown key train.lrr (did you mean train.lr?)")
    assert duplicate_problems(["train.lr=1e-5", "seed=1", "+train.lr=abc", "~train.lr"], command="run")[1] == [
        "seed=1", "train.lr=abc"]
    assert problems(["train.lr=1e-5", "+train.lr=abc"]).endswith(  # the last value, checked
        "  - train.lr=abc: train.lr takes a float (a number: 0.5, 1e-5), not the string 'abc'")
    for first, last in (("+train.lr=1e-5", "train.lr=2e-5"), ("+train.lr=1e-5", "++train.lr=2e-5"),
                        ("++train.lr=1e-5", "+train.lr=2e-5")):  # either order: only Relax's line
        assert problems([first, last]) == (
            "invalid config (1 problem):\n"
            f"  - train.lr is given twice: {first} and {last}; only the last would count: give it once (to "
            "run each value: relax-train -m train.lr=1e-5,2e-5)"), (first, last)
    assert problems(["train.lr=2e-5"]) is None  # the control


def test_a_hydra_key_of_the_wrong_type_or_unknown_is_listed_with_the_others(tmp_path, monkeypatch, capfd):
    """A value of one of Hydra's own keys outside the launcher's not of its type (`hydra.job.chdir=abc`) is in the
    one `invalid config` list with every other, naming the key, the value and the type, exit 2 (before: Hydra's own
    "Error merging override" text, exit 1, after nothing else); an unknown one is named as the config's are."""
    from relax.cli.config_check import problems

    monkeypatch.chdir(tmp_path)
    err = _refused(*relax_train(["hydra.job.chdir=abc", "train.lr=abc", "dry_run=true"], capfd))
    assert err.splitlines() == [
        "relax-train: error: invalid config (2 problems):",
        "  - hydra.job.chdir=abc: hydra.job.chdir takes a bool (true or false) or null, not the string 'abc'",
        "  - train.lr=abc: train.lr takes a float (a number: 0.5, 1e-5), not the string 'abc'"], err
    assert problems(["-m", "hydra.job.chdir=abc", "seed=1,2"]) == (
        "invalid config (1 problem):\n"
        "  - hydra.job.chdir=abc: hydra.job.chdir takes a bool (true or false) or null, not the string 'abc'")
    assert problems(["hydra.job.chdirr=true", "hydra.job.env_set.FOO=1"]) == (
        "invalid config (2 problems):\n"
        "  - unknown key hydra.job.chdirr (did you mean hydra.job.chdir?)\n"
        "  - unknown key hydra.job.env_set.FOO: hydra.job.env_set has no key 'FOO' to set; add it with "
        "+hydra.job.env_set.FOO=...")
    # the controls: values of their type, a key added to a mapping of free keys
    assert problems(["hydra.job.chdir=true", "+hydra.job.env_set.FOO=1", "hydra.run.dir=out"]) is None


def test_a_plus_on_a_key_there_or_a_deletion_of_a_schema_key_is_one_message_naming_what_to_type(
        tmp_path, monkeypatch, capfd):
    """`+train.lr=2e-5` (`+` adds a key: train.lr is there) and `~train.lr` (a schema key: every config has it),
    each given once: Relax's one line naming the key and what to type instead, with the config's other problems,
    exit 2 (before: Hydra's "Could not append to config ..." and "TrainConfig (DictConfig) does not support
    deletion" alone). A root field (`~dry_run`) was deleted silently, its schema default put in its place; a null one
    (`~model.path`) and an unknown one (`~train.lrr`) got Hydra's "does not exist"."""
    from relax.cli.config_check import problems

    monkeypatch.chdir(tmp_path)
    err = _refused(*relax_train(["~train.lr", "dry_run=true"], capfd))
    assert err.splitlines() == [
        "relax-train: error: invalid config (1 problem):",
        "  - ~train.lr: train.lr is a key of the schema (every config has it), so it cannot be deleted: to keep the "
        "value the config gives it (train.lr=0.001), leave ~train.lr out; to change it: train.lr=VALUE"], err
    err = _refused(*relax_train(["+train.lr=2e-5", "dry_run=true"], capfd))
    assert err.splitlines() == [
        "relax-train: error: invalid config (1 problem):",
        "  - +train.lr=2e-5: train.lr is already in the config, and + adds a key it does not have: set it with "
        "train.lr=2e-5 (++train.lr=2e-5 sets it whether or not it is there)"], err
    assert "Could not" not in err and list(tmp_path.iterdir()) == []
    assert problems(["~dry_run", "~model.path", "~train", "~train.lrr", "+seed=3", "train.num_rollout=x"]) == (
        "invalid config (6 problems):\n"
        "  - train.num_rollout=x: train.num_rollout takes an int, not the string 'x'\n"
        "  - ~dry_run: dry_run is a key of the schema (every config has it), so it cannot be deleted: to keep the "
        "value the config gives it (dry_run=false), leave ~dry_run out; to change it: dry_run=VALUE\n"
        "  - ~model.path: model.path is a key of the schema (every config has it), so it cannot be deleted: to keep "
        "the value the config gives it (model.path=null), leave ~model.path out; to change it: model.path=VALUE\n"
        "  - ~train: train is a section of the schema (every config has it), so it cannot be deleted: to keep the "
        "values the config gives it, leave ~train out; to change one: train.KEY=VALUE\n"
        "  - ~train.lrr: nothing to delete: unknown key train.lrr (did you mean train.lr?)\n"
        "  - +seed=3: seed is already in the config, and + adds a key it does not have: set it with seed=3 "
        "(++seed=3 sets it whether or not it is there)")
    # a key and a section of Hydra's own config, named as Hydra's (before: "a key of the schema")
    assert problems(["~hydra.job.chdir", "~hydra.run"]) == (
        "invalid config (2 problems):\n"
        "  - ~hydra.job.chdir: hydra.job.chdir is a key of Hydra's config (every config has it), so it cannot be "
        "deleted: to keep the value the config gives it (hydra.job.chdir=false), leave ~hydra.job.chdir out; to "
        "change it: hydra.job.chdir=VALUE\n"
        "  - ~hydra.run: hydra.run is a section of Hydra's config (every config has it), so it cannot be deleted: "
        "to keep the values the config gives it, leave ~hydra.run out; to change one: hydra.run.KEY=VALUE")
    # the controls: ++ sets a key that is there (as Hydra documents), + adds one to a mapping of free keys, ~ deletes
    # a group's default (the schema's node stays)
    assert problems(["++train.lr=2e-5", "+hydra.job.env_set.FOO=1", "~teacher", "train.num_rollout=2"]) is None


def test_a_choice_of_one_of_hydras_groups_is_listed_with_its_options(tmp_path, monkeypatch, capfd):
    """`hydra/job_logging=bogus` is in the one `invalid config` list with the group's options, as a wrong
    `algorithm=` is, exit 2 (before: Hydra's "Could not find 'hydra/job_logging/bogus'" and its search path, exit
    1, after nothing else); valid choices, Relax's own launcher plugin's among them, go on."""
    from relax.cli.config_check import problems

    monkeypatch.chdir(tmp_path)
    err = _refused(*relax_train(["hydra/job_logging=bogus", "algorithm=grpoo", "dry_run=true"], capfd))
    assert err.splitlines() == [
        "relax-train: error: invalid config (2 problems):",
        "  - hydra/job_logging=bogus: config group hydra/job_logging has no option 'bogus'; its options: default, "
        "disabled, none, stdout",
        "  - algorithm=grpoo: config group algorithm has no option 'grpoo' (did you mean algorithm=grpo?); its "
        "options: cispo, grpo, gspo, m2po, opd, ppo, reinforce_pp, reinforce_pp_baseline, rloo, sapo"], err
    assert "Config search path" not in err
    assert problems(["-m", "hydra/output=nope", "seed=1,2"]) == (
        "invalid config (1 problem):\n"
        "  - hydra/output=nope: config group hydra/output has no option 'nope'; its options: default")
    assert problems(["-m", "hydra/launcher=nonexistent", "seed=1,2"]) == (
        "invalid config (1 problem):\n"
        "  - hydra/launcher=nonexistent: config group hydra/launcher has no option 'nonexistent'; its options: "
        "basic, relax_ray")
    # the controls
    assert problems(["hydra/job_logging=disabled", "hydra/hydra_logging=disabled", "train.num_rollout=2"]) is None
    assert problems(["-m", "hydra/launcher=relax_ray", "hydra/job_logging=stdout", "seed=1,2"]) is None


def test_a_run_with_hydras_keys_is_checked_in_one_composition(monkeypatch):
    """A run's Hydra keys and groups are checked in its config's composition (`relax.cli.config_check.load`): one
    Hydra compose, as for a command line without them (before: a second, with Hydra's config, for their check)."""
    import hydra

    from relax.cli.config_check import problems

    calls = []
    real = hydra.compose
    monkeypatch.setattr(hydra, "compose", lambda *a, **k: calls.append(k.get("overrides")) or real(*a, **k))
    assert problems(["hydra.job.chdir=true", "hydra/job_logging=disabled", "train.lr=1e-5"]) is None
    assert calls == [["hydra.job.chdir=true", "hydra/job_logging=disabled", "train.lr=1e-5"]]
    calls.clear()
    assert problems(["train.lr=1e-5"]) is None  # the control: one, without Hydra's keys
    assert calls == [["train.lr=1e-5"]]


def test_a_run_of_its_own_config_is_read_as_the_schemas_once_per_composition(tmp_path, monkeypatch):
    """`relax-train -cp <dir> -cn config ...`'s check reads the saved config as the schema's (`saved_config`, a merge
    onto the schema) once for each composition, for naming its problems and for its validation alike (before: two
    more times, by `_composed` and by to_relax_config, after compose_known's); the problems are the same (an unknown
    key, a `~key`, a value not of its key's type: the lines below; each costs a composition).
    Control: a run of Relax's config reads none."""
    import importlib

    import hydra
    from omegaconf import OmegaConf

    from relax.cli.config_check import problems
    from relax.config.compose import compose

    saved = tmp_path / "saved"
    saved.mkdir()
    OmegaConf.save(compose(["train.num_rollout=2"]), saved / "config.yaml")
    module = importlib.import_module("relax.config.compose")  # relax.config's `compose` is the function
    views, compositions = [], []
    real_view, real_compose = module.saved_config, hydra.compose
    monkeypatch.setattr(module, "saved_config", lambda *a, **k: views.append(1) or real_view(*a, **k))

    def composed(*a, **k):  # a composition that Hydra refuses (the unknown key's first) is not read
        dc = real_compose(*a, **k)
        compositions.append(1)
        return dc

    monkeypatch.setattr(hydra, "compose", composed)
    own = ["-cp", str(saved), "-cn", "config"]
    assert problems([*own, "seed=2"]) is None and len(views) == len(compositions) == 1
    views.clear()
    compositions.clear()
    message = problems([*own, "train.lrr=1", "~train.lr", "seed=abc"])
    for line in ("unknown key train.lrr (did you mean train.lr?)", "~train.lr: train.lr is a key of the schema",
                 "seed=abc: seed takes an int, not the string 'abc'"):
        assert line in message, message
    assert len(views) == len(compositions), (views, compositions)
    views.clear()
    assert problems(["seed=2"]) is None and views == []


def test_a_run_of_its_own_config_gets_every_type_problem_and_repeated_key_too(tmp_path, monkeypatch, capfd):
    """`relax-train -cp <dir> -cn config ...` (a run's saved config, which the command line's precheck leaves to
    Hydra): every value not of its key's type, the saved config's or the command line's, and a key given twice, in
    the one list with the rules' problems (before: only the first type problem, in OmegaConf's words as 'the saved
    config does not fit this version's schema'; a repeated key silently the last)."""
    from omegaconf import OmegaConf

    from relax.config.compose import compose

    saved = tmp_path / "saved"
    saved.mkdir()
    OmegaConf.save(compose(["train.num_rollout=2"]), saved / "config.yaml")
    text = (saved / "config.yaml").read_text()
    (saved / "config.yaml").write_text(text.replace("  micro_batch_size: 8\n", "  micro_batch_size: eight\n"))
    monkeypatch.chdir(tmp_path)
    err = _refused(*relax_train(["-cp", str(saved), "-cn", "config", "train.lr=abc", "train.num_rollout=xyz",
                                 "seed=1", "seed=2", "tracking.uri=foo://bar", "dry_run=true"], capfd))
    lines = err.splitlines()
    assert lines[0] == "relax-train: error: invalid config (5 problems):", err
    for line in ("  - seed is given twice: seed=1 and seed=2; only the last would count: give it once (to run each "
                 "value: relax-train -m seed=1,2)",
                 "  - train.lr=abc: train.lr takes a float (a number: 0.5, 1e-5), not the string 'abc'",
                 "  - train.num_rollout=xyz: train.num_rollout takes an int, not the string 'xyz'",
                 "  - train.micro_batch_size=eight: train.micro_batch_size takes an int, not the string 'eight'"):
        assert line in lines, err
    assert lines[-1].startswith("  - tracking.uri='foo://bar'"), err
    assert "does not fit" not in err


def test_a_key_given_to_a_mapping_of_free_keys_without_plus_names_the_plus_form():
    """review-exp 4: `data.eval_sets={two:...}` got OmegaConf's raw "Could not override 'data.eval_sets'. Key 'two' is
    not in struct" (not in the problems list), `data.eval_sets.two=...` a bare 'unknown key'. Both are now a line of
    the list naming the user's own override with + in front, beside the other problems; Hydra's own
    mapping (hydra.job.env_set) likewise. Controls: both + forms and an empty mapping pass."""
    from relax.cli.config_check import problems

    mine = ("data.eval_sets is a mapping of keys of your own (empty unless a config gives it some), and Hydra adds a "
            "key to it only with +")
    assert problems(["data.eval_sets={two:/x/two.jsonl}", "train.eval_interval=1", "train.lrr=1"]) == (
        "invalid config (2 problems):\n"
        f"  - data.eval_sets={{two:/x/two.jsonl}}: {mine}: '+data.eval_sets={{two:/x/two.jsonl}}'\n"
        "  - unknown key train.lrr (did you mean train.lr?)")
    # the user's own override with + in front, the exact text to type (was '+data.eval_sets={two:...}' (or ...))
    assert problems(["data.eval_sets.two=/x/two.jsonl", "train.eval_interval=1", "train.lrr=1"]) == (
        "invalid config (2 problems):\n"
        f"  - unknown key data.eval_sets.two: {mine}: '+data.eval_sets.two=/x/two.jsonl'\n"
        "  - unknown key train.lrr (did you mean train.lr?)")
    assert "'+hydra.job.env_set={FOO:1}'" in problems(["hydra.job.env_set={FOO:1}"])
    for fine in (["+data.eval_sets={two:/x/two.jsonl}"], ["+data.eval_sets.two=/x/two.jsonl"]):
        assert "has no effect: train.eval_interval=0 runs no evaluation" in problems(fine)  # composed: the rules ran
    assert problems(["data.eval_sets={}"]) is None and problems(["+hydra.job.env_set.FOO=1"]) is None


def test_a_key_set_inside_a_value_is_one_line_of_the_list():
    """`model.path.x=1` got OmegaConf's "Cannot convert 'dict' to string" and `rollout.sglang.extra_args.foo=1` a
    traceback (AssertionError: Unexpected type for root: NoneType): a key set inside a key the schema declares a value
    is a line of the list naming the key, its type and the form to write, beside the other problems. Controls: keys
    inside a mapping of free keys and inside sections pass as before."""
    from relax.cli.config_check import problems

    assert problems(["model.path.x=1", "rollout.sglang.extra_args.foo=1", "train.lrr=1"]) == (
        "invalid config (3 problems):\n"
        "  - model.path.x=1: model.path takes a string or null, a value without keys of its own: set it with "
        "model.path=VALUE\n"
        "  - rollout.sglang.extra_args.foo=1: rollout.sglang.extra_args takes a list of strings, in brackets ([a,b]) "
        "or null, a value without keys of its own: set it with rollout.sglang.extra_args=VALUE\n"
        "  - unknown key train.lrr (did you mean train.lr?)")
    assert problems(["+data.eval_sets.two=/x/two.jsonl", "train.eval_interval=1"]) is None
    assert "without keys of its own" not in (problems(["rollout.sglang.extra_args=[--foo]", "model.path=/x"]) or "")


def test_a_deletion_on_a_run_of_its_own_config_is_the_line_a_run_of_relaxs_gets(tmp_path, monkeypatch, capfd):
    """`relax-train -cp <dir> -cn config ~train.lr` (a run's saved config) ran with the schema's default lr (1e-06;
    Hydra deletes a key of a plain YAML without a word), and `~train.lr=5` or `~train.nosuch` printed Hydra's
    'Could not delete from config. ...': now each is the one line `relax-train ~...` gives, with the config's other
    problems, exit 2. Control: deleting a key of a free mapping (an eval set added on the same line) goes on."""
    from omegaconf import OmegaConf

    from relax.cli.config_check import problems
    from relax.config.compose import compose

    saved = tmp_path / "saved"
    saved.mkdir()
    OmegaConf.save(compose(["train.num_rollout=2"]), saved / "config.yaml")
    monkeypatch.chdir(tmp_path)
    code, out, err = relax_train(["-cp", str(saved), "-cn", "config", "~train.lr", "dry_run=true"], capfd)
    assert code == 2 and "Traceback" not in out + err and "dry run" not in out, out + err
    assert err.splitlines() == problems(["~train.lr", "train.num_rollout=2"]).replace(
        "invalid config", "relax-train: error: invalid config", 1).splitlines(), err
    own = ["-cp", str(saved), "-cn", "config"]
    for given in (["~train.lr=5", "train.micro_batch_size=-1"], ["~train.nosuch", "train.micro_batch_size=-1"],
                  ["~train"]):  # Hydra's text before, for the first two; the same lines as a run of Relax's config
        expected = problems([*given, "train.num_rollout=2"])
        assert f"  - {given[0]}: " in expected and problems([*own, *given]) == expected, given
    assert problems([*own, "+data.eval_sets={two:/x/two.jsonl}", "~data.eval_sets.two"]) is None
    assert problems([*own, "train.lr=1e-5"]) is None


def test_a_deletion_on_a_sweep_of_its_own_config_and_on_relax_submit_is_the_same_line(tmp_path, monkeypatch, capfd):
    """`relax-train -m -cp <dir> -cn config ~train.lr seed=1,2` ran each job with the schema's default lr (the check
    above left -m to Hydra), and relax-submit, which checked no -cp run, submitted either form. Now both commands
    refuse both forms with the line the run without -m gets (a sweep: in each job, as a sweep of Relax's config
    lists it), exit 2, nothing started or submitted. Control: the same commands without the deletion pass
    relax-submit's check."""
    from omegaconf import OmegaConf

    from relax.cli.config_check import problems
    from relax.cli.submit import check_config
    from relax.config.compose import compose

    saved = tmp_path / "saved"
    saved.mkdir()
    OmegaConf.save(compose(["train.num_rollout=2"]), saved / "config.yaml")
    monkeypatch.chdir(tmp_path)
    line = problems(["~train.lr", "train.num_rollout=2"])
    assert "  - ~train.lr: train.lr is a key of the schema" in line
    code, out, err = relax_train(["-m", "-cp", str(saved), "-cn", "config", "~train.lr", "seed=1,2", "dry_run=true"],
                                 capfd)
    assert code == 2 and "Traceback" not in out + err and "dry run" not in out, out + err
    jobs = problems(["-m", "~train.lr", "seed=1,2", "dry_run=true"])  # each job's line, as a sweep of Relax's config
    assert err.splitlines() == ("relax-train: error: " + jobs).splitlines() and jobs.count("is a key of the schema") \
        == 2, err
    for sweep in (["-m"], []):
        own = [*sweep, "-cp", str(saved), "-cn", "config"]
        with pytest.raises(SystemExit) as exited:
            check_config([*own, "~train.lr", "seed=1,2" if sweep else "seed=1"], working_dir=tmp_path, env={})
        assert exited.value.code == 2
        err = capfd.readouterr().err
        expected = problems(["-m", "~train.lr", "seed=1,2"]) if sweep else line
        assert err.splitlines() == f"relax-submit: error: {expected}\nNothing was submitted.".splitlines(), err
        check_config([*own, "seed=1,2" if sweep else "seed=1"], working_dir=tmp_path, env={})  # control: goes on


def test_an_unknown_key_or_a_mistyped_value_on_a_run_of_its_own_config_is_the_line_a_run_of_relaxs_gets(tmp_path):
    """`relax-train -cp <dir> -cn config train.lrr=1` (a run's saved config) got Hydra's "Could not override
    'train.lrr'. ... Key 'lrr' is not in struct" (exit 1), and `+train.foo=1` 'the saved config does not fit this
    version's schema': `problems` left such a run to Hydra. Now it gets the list a run of Relax's config gets for the
    same overrides. Control: the saved config with valid overrides passes."""
    from omegaconf import OmegaConf

    from relax.cli.config_check import problems
    from relax.config.compose import compose

    saved = tmp_path / "saved"
    saved.mkdir()
    OmegaConf.save(compose(["train.num_rollout=2"]), saved / "config.yaml")
    given = ["train.lrr=1", "+train.foo=1", "train.lr=abc"]
    assert problems(["-cp", str(saved), "-cn", "config", *given]) == problems([*given, "train.num_rollout=2"]) == (
        "invalid config (3 problems):\n"
        "  - train.lr=abc: train.lr takes a float (a number: 0.5, 1e-5), not the string 'abc'\n"
        "  - unknown key train.lrr (did you mean train.lr?)\n"
        "  - unknown key train.foo: train has no key 'foo'")
    assert problems([f"--config-path={saved}", "--config-name", "config", "train.lr=1e-5"]) is None  # the control
    # a choice of one of Relax's config groups, which a run of its own config cannot reach (before: "config group
    # algorithm has no option 'm2po'; its options: " with none, Hydra's advice to `+model=tiny`, which leads there,
    # or "unknown key experiment"): one line saying what to set instead, with the command line's other problems
    own = ["-cp", str(saved), "-cn", "config"]
    for choice, instead in (("+algorithm=m2po", "(algorithm.name=m2po, and a key of m2po's that the file lacks "
                                                "with +: +algorithm.<key>=...)"),
                            ("model=tiny", "(model.<key>=..., and a key the file lacks with +: +model.<key>=...)"),
                            ("+experiment=gspo", "(the keys conf/experiment/gspo.yaml sets)")):
        assert problems([*own, choice, "train.lrr=1"]) == (
            "invalid config (2 problems):\n"
            f"  - {choice}: a run of its own config (-cp/-cn) chooses no option of Relax's config groups (Relax's "
            "conf/ is not on its search path, and a run's saved config has no defaults list): set the saved "
            f"config's keys instead {instead}\n"
            "  - unknown key train.lrr (did you mean train.lr?)"), choice
    # what it says works: the algorithm's name, and its own key, which the saved grpo config lacks, with + (without
    # it, before: a bare "unknown key algorithm.kl2_budget")
    assert problems([*own, "algorithm.name=m2po", "+algorithm.kl2_budget=1"]) is None
    assert problems([*own, "algorithm.name=m2po", "algorithm.kl2_budget=1"]) == (
        "invalid config (1 problem):\n"
        "  - unknown key algorithm.kl2_budget: the config file (-cp/-cn) has no such key, though the schema has it: "
        "add it with +algorithm.kl2_budget=...")
