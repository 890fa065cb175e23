"""relax-submit passes the run's secrets to the job from the submitting environment, never through argv or its
printout: the variables named by the config's `*api_key_env` options are forwarded (their values `***` in
`--dry-run`), `--env NAME` forwards NAME's value, a key variable unset here is named before submitting. The job's
payload is captured from a stand-in Ray Jobs client (nothing is contacted); a plain `--env K=V` and MODEL_DIR are
printed as before (the controls)."""

from __future__ import annotations

import json

import pytest

from relax.cli import submit
from relax.cli.submit import api_key_options, main
from tests.cli.jobs_stub import Jobs

ABSOLUTE = ["tracking.uri=http://mlflow.example:5000", "train.save_dir=/shared/ckpt", "hydra.run.dir=/shared/out"]
JUDGE = ["reward_model=judge", "reward_model.engine=openai", "reward_model.url=http://127.0.0.1:8000/v1",
         "reward_model.api_key_env=RELAX_T_JUDGE_KEY"]
SERVICE = ["data.reward=http://127.0.0.1:8131/score", "data.reward_service.api_key_env=RELAX_T_SVC_KEY"]


@pytest.fixture
def env(monkeypatch):
    for name in ("EXP_DIR", "MODEL_DIR", "RELAX_T_JUDGE_KEY", "RELAX_T_SVC_KEY", "RELAX_T_TOKEN",
                 "RELAX_SGLANG_API_KEY", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
                 "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    import ray.job_submission

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", Jobs)
    monkeypatch.setattr(submit, "enable_token_auth", lambda: None)
    Jobs.submitted = []
    return monkeypatch


def dry_run(capsys, *argv: str) -> tuple[dict, str]:
    main(["--dry-run", *argv])
    out = capsys.readouterr()
    return json.loads(out.out), out.err


def test_the_schema_names_every_key_variable_option():
    assert {"reward_model.api_key_env", "data.reward_service.api_key_env"} <= set(api_key_options())


def test_the_key_variables_of_the_config_are_forwarded_and_never_printed(env, capsys):
    env.setenv("RELAX_T_JUDGE_KEY", "sk-judge-secret")
    env.setenv("RELAX_T_SVC_KEY", "sk-svc-secret")
    env.setenv("MODEL_DIR", "/shared/models")
    payload, err = dry_run(capsys, "--env", "PLAIN=visible", "--", *JUDGE, *SERVICE, *ABSOLUTE)
    shown = payload["runtime_env"]["env_vars"]
    assert shown["RELAX_T_JUDGE_KEY"] == "***" and shown["RELAX_T_SVC_KEY"] == "***"
    assert "sk-judge-secret" not in json.dumps(payload) + err and "sk-svc-secret" not in json.dumps(payload) + err
    assert shown["PLAIN"] == "visible" and shown["MODEL_DIR"] == "/shared/models"  # controls: printed as before
    # the job gets the values
    main(["--address", "http://head.example:8265", "--no-follow", "--", *JUDGE, *SERVICE, *ABSOLUTE])
    sent = Jobs.submitted[-1]["runtime_env"]["env_vars"]
    assert sent["RELAX_T_JUDGE_KEY"] == "sk-judge-secret" and sent["RELAX_T_SVC_KEY"] == "sk-svc-secret"
    assert "sk-" not in Jobs.submitted[-1]["entrypoint"]
    assert "sk-" not in capsys.readouterr().out


def test_a_key_variable_given_on_the_command_line_is_masked_too(env, capsys):
    """The old workaround (`--env KEY=value`) still works; its value is not printed back."""
    payload, _ = dry_run(capsys, "--env", "RELAX_T_SVC_KEY=sk-typed", "--", *SERVICE, *ABSOLUTE)
    assert payload["runtime_env"]["env_vars"]["RELAX_T_SVC_KEY"] == "***"


def test_env_name_forwards_its_value_from_here(env, capsys):
    env.setenv("RELAX_T_TOKEN", "tok-secret")
    payload, _ = dry_run(capsys, "--env", "RELAX_T_TOKEN", "--", *ABSOLUTE)
    assert payload["runtime_env"]["env_vars"]["RELAX_T_TOKEN"] == "***"
    main(["--address", "http://head.example:8265", "--no-follow", "--env", "RELAX_T_TOKEN", "--", *ABSOLUTE])
    assert Jobs.submitted[-1]["runtime_env"]["env_vars"]["RELAX_T_TOKEN"] == "tok-secret"
    # unset here: refused before anything is submitted, naming it
    env.delenv("RELAX_T_TOKEN")
    with pytest.raises(SystemExit) as exc:
        main(["--address", "http://head.example:8265", "--no-follow", "--env", "RELAX_T_TOKEN", "--", *ABSOLUTE])
    assert exc.value.code == 2 and "RELAX_T_TOKEN is not set here" in capsys.readouterr().err
    assert len(Jobs.submitted) == 1


def test_a_key_variable_unset_here_is_named_before_submitting(env, capsys):
    main(["--address", "http://head.example:8265", "--no-follow", "--", *SERVICE, *ABSOLUTE])
    out = capsys.readouterr()
    assert "data.reward_service.api_key_env=RELAX_T_SVC_KEY: RELAX_T_SVC_KEY is not set here" in out.err
    assert "RELAX_T_SVC_KEY" not in Jobs.submitted[-1]["runtime_env"]["env_vars"]
    # control: set, no note
    env.setenv("RELAX_T_SVC_KEY", "sk-x")
    main(["--address", "http://head.example:8265", "--no-follow", "--", *SERVICE, *ABSOLUTE])
    assert "not set here" not in capsys.readouterr().err


def test_the_servers_key_and_mlflow_credentials_are_forwarded_when_the_run_reads_them(env, capsys):
    env.setenv("RELAX_SGLANG_API_KEY", "sg-secret")
    env.setenv("MLFLOW_TRACKING_PASSWORD", "ml-secret")
    payload, _ = dry_run(capsys, "--", "rollout=sglang", "rollout.sglang.urls=[http://127.0.0.1:30000]", *ABSOLUTE)
    shown = payload["runtime_env"]["env_vars"]
    assert shown["RELAX_SGLANG_API_KEY"] == "***" and shown["MLFLOW_TRACKING_PASSWORD"] == "***"
    # control: a run that reads neither (servers it launches, a local store) does not get them
    payload, _ = dry_run(capsys, "--", "tracking.uri=sqlite:////shared/mlflow.db", *ABSOLUTE[1:])
    assert "RELAX_SGLANG_API_KEY" not in payload["runtime_env"]["env_vars"]
    assert "MLFLOW_TRACKING_PASSWORD" not in payload["runtime_env"]["env_vars"]


def test_a_value_whose_name_looks_like_a_secret_is_masked_however_it_was_given(env, capsys):
    """`--env NAME=value` of a name holding KEY, TOKEN, SECRET, PASSWORD, PASSWD or CREDENTIAL (any case) is `***` in
    --dry-run, also where no option of the config names it (before, only the config's *api_key_env names and
    `--env NAME` were masked: HF_TOKEN=hf_abc was printed as given). The job still gets the values; PLAIN and a
    value that merely contains such a word are printed (the controls)."""
    given = {"HF_TOKEN": "hf_abc", "WANDB_API_KEY": "wk-secret", "AWS_SECRET_ACCESS_KEY": "aws-secret",
             "PGPASSWORD": "pg-secret", "my_db_passwd": "db-secret", "GOOGLE_APPLICATION_CREDENTIALS": "/keys/sa.json"}
    argv = [a for name, value in given.items() for a in ("--env", f"{name}={value}")]
    argv += ["--env", "PLAIN=token-key-secret"]
    payload, err = dry_run(capsys, *argv, "--", *ABSOLUTE)
    shown = payload["runtime_env"]["env_vars"]
    assert {name: shown[name] for name in given} == dict.fromkeys(given, "***")
    assert shown["PLAIN"] == "token-key-secret"
    for value in given.values():
        assert value not in json.dumps(payload) + err
    # --entrypoint (no config read): masked the same
    payload, _ = dry_run(capsys, "--entrypoint", "python prep.py", "--env", "HF_TOKEN=hf_abc")
    assert payload["runtime_env"]["env_vars"]["HF_TOKEN"] == "***"
    main(["--address", "http://head.example:8265", "--no-follow", *argv, "--", *ABSOLUTE])
    sent = Jobs.submitted[-1]["runtime_env"]["env_vars"]
    assert {name: sent[name] for name in given} == given
