"""relax-submit: the Ray Jobs payload, and a real submission to a local Ray head with token authentication."""

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from relax.cli.submit import (
    EXCLUDES,
    TRAIN_ENTRYPOINT,
    build_submission,
    check_storage,
    default_working_dir,
    enable_token_auth,
    follow_to_the_end,
    main,
    parse_env,
    storage_problems,
)
from tests.ports import free_ports

# its tests share module-scoped Ray head: one xdist worker runs them in a row
pytestmark = pytest.mark.xdist_group("submit")

REPO = Path(__file__).resolve().parents[2]


def test_payload_runs_relax_train_with_the_checkout_and_env(tmp_path):
    env = parse_env(["WANDB_MODE=off", "MODEL_DIR=/override"], environ={"MODEL_DIR": "/models", "DATA_DIR": "/data",
                                                                       "UNRELATED": "x"})
    assert env == {"MODEL_DIR": "/override", "DATA_DIR": "/data", "WANDB_MODE": "off"}
    p = build_submission(["algorithm=rloo", "model=qwen3_0.6b", "cluster=8xgpu", "data.system_prompt=Be brief"],
                         working_dir=tmp_path, env=env, submission_id="job-1")
    assert p["entrypoint"] == (f"{TRAIN_ENTRYPOINT} algorithm=rloo model=qwen3_0.6b cluster=8xgpu "
                               "'data.system_prompt=Be brief'")
    assert p["runtime_env"] == {"working_dir": str(tmp_path), "excludes": EXCLUDES,
                                "env_vars": {"PYTHONUNBUFFERED": "1", **env}}
    assert p["submission_id"] == "job-1"
    assert default_working_dir() == REPO
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_env(["novalue"], environ={})
    # --exp-dir: relax-train runs in that directory, importing Relax from the uploaded working_dir
    p = build_submission(["seed=2"], working_dir=tmp_path, env={}, exp_dir="/shared/my exp")
    assert p["entrypoint"] == ('export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" && mkdir -p \'/shared/my exp\' && '
                               f"cd '/shared/my exp' && {TRAIN_ENTRYPOINT} seed=2")
    local = tmp_path / "exp dir"
    p = build_submission(["seed=2"], working_dir=tmp_path, env={}, exp_dir=str(local))
    out = subprocess.run(["bash", "-c", p["entrypoint"].replace(TRAIN_ENTRYPOINT, "echo \"$PWD|$PYTHONPATH\" #")],
                         cwd=tmp_path, capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    assert out.stdout.strip() == f"{local}|{tmp_path}" and local.is_dir()


# ---------------------------------------------------------------------- where a submitted run writes
ABSOLUTE = {"dry_run": False, "tracking.enabled": True, "tracking.uri": "sqlite:////shared/exp/mlflow.db",
            "train.save": True, "train.save_dir": "/shared/exp/ckpt", "hydra.run.dir": "/shared/exp/out/${now:%H}",
            "hydra.sweep.dir": "/shared/exp/multirun"}


def test_storage_rules():
    assert storage_problems(ABSOLUTE, sweep=False) == []
    for uri in ("http://mlflow:5000", "https://x/mlflow", "databricks", "file:///shared/mlruns", "/shared/mlruns",
                "postgresql://u@db/mlflow"):
        assert storage_problems({**ABSOLUTE, "tracking.uri": uri}, sweep=False) == [], uri
    for uri in ("sqlite:///mlflow.db", "sqlite:///sub/m.db", "file:mlruns", "mlruns", "./mlruns"):
        (problem,) = storage_problems({**ABSOLUTE, "tracking.uri": uri}, sweep=False)
        assert problem.startswith(f"tracking.uri={uri}: a relative MLflow store"), uri
    assert storage_problems({**ABSOLUTE, "tracking.uri": "mlruns", "tracking.enabled": False}, sweep=False) == []
    (problem,) = storage_problems({**ABSOLUTE, "train.save_dir": "ckpt"}, sweep=False)
    assert problem.startswith("train.save_dir=ckpt: relative")
    (problem,) = storage_problems({**ABSOLUTE, "train.save_dir": "~/ckpt"}, sweep=False)  # no one expands "~"
    assert problem.startswith("train.save_dir=~/ckpt: relative")
    (problem,) = storage_problems({**ABSOLUTE, "train.save_dir": None}, sweep=False)
    assert problem.startswith("train.save_dir is unset")
    assert storage_problems({**ABSOLUTE, "train.save_dir": None, "train.save": False}, sweep=False) == []
    (problem,) = storage_problems({**ABSOLUTE, "hydra.run.dir": "outputs/x"}, sweep=False)
    assert problem.startswith("hydra.run.dir=outputs/x: relative")
    assert storage_problems({**ABSOLUTE, "hydra.run.dir": "outputs/x"}, sweep=True) == []  # a sweep: sweep.dir
    (problem,) = storage_problems({**ABSOLUTE, "hydra.sweep.dir": "multirun/x"}, sweep=True)
    assert problem.startswith("hydra.sweep.dir=multirun/x: relative")
    assert storage_problems({**ABSOLUTE, "tracking.uri": "mlruns", "dry_run": True}, sweep=False) == []


def test_storage_check_composes_what_relax_train_composes():
    # the defaults of conf/ and relax.config: everything relative
    problems = check_storage(["train.num_rollout=4"], working_dir=REPO)
    assert [p.split("=")[0].split(" ")[0] for p in problems] == ["tracking.uri", "train.save_dir", "hydra.run.dir"]
    assert "hydra.run.dir=outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}: relative" in problems[2]  # as written in conf/
    good = ["tracking.uri=http://mlflow:5000", "train.save_dir=/shared/ckpt", "hydra.run.dir=/shared/out"]
    assert check_storage(["+experiment=rloo_vs_grpo_cpu", *good], working_dir=REPO) == []
    # a sweep: every job's values are composed, and Hydra's sweep dir is the one checked; a problem of some jobs only
    # names them (Hydra's job numbers: the last override varies fastest)
    problems = check_storage(["-m", "algorithm=rloo,grpo", "seed=1,2", "train.save_dir=ckpt,/abs",
                              "tracking.uri=http://mlflow:5000"], working_dir=REPO)
    assert [p.split(":")[0] for p in problems] == ["train.save_dir=ckpt", "hydra.sweep.dir=multirun/${now"]
    assert problems[0].endswith("relative; give an absolute directory (jobs 0, 2, 4, 6 of the sweep)")
    assert not problems[1].endswith("of the sweep)")  # every job's
    # the order of the swept values does not decide: the job that saves is named either way
    shared = ["tracking.uri=sqlite:////shared/m.db", "hydra.sweep.dir=/shared/sw"]
    for values, job in (("false,true", 1), ("true,false", 0)):
        (problem,) = check_storage(["-m", f"train.save={values}", *shared], working_dir=REPO)
        assert problem.startswith("train.save_dir is unset") and problem.endswith(f"(job {job} of the sweep)")
    assert check_storage(["algorithm=rloo", "dry_run=true"], working_dir=REPO) == []
    assert check_storage(["--cfg", "job"], working_dir=REPO) == []  # prints the config, runs nothing
    with pytest.raises(ValueError, match="does not compose.*nokey"):
        check_storage(["nokey=1"], working_dir=REPO)


def test_submit_refuses_relative_outputs_before_contacting_the_cluster(monkeypatch, capsys):
    monkeypatch.delenv("EXP_DIR", raising=False)
    closed = "http://127.0.0.1:9"  # nothing listens: a submission attempt would fail with "cannot submit"
    with pytest.raises(SystemExit) as exc:
        main(["--address", closed, "--", "train.num_rollout=4"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "cannot submit" not in err and "Nothing was submitted." in err
    for field in ("tracking.uri=sqlite:///mlflow.db", "train.save_dir is unset", "hydra.run.dir=outputs/"):
        assert field in err, err
    assert "--exp-dir DIR" in err
    # a relative --exp-dir or EXP_DIR is refused too
    with pytest.raises(SystemExit) as exc:
        main(["--address", closed, "--exp-dir", "exp", "--", "train.num_rollout=4"])
    assert exc.value.code == 2 and "--exp-dir=exp: must be an absolute directory" in capsys.readouterr().err
    monkeypatch.setenv("EXP_DIR", "rel/exp")
    with pytest.raises(SystemExit) as exc:
        main(["--address", closed, "--", "train.num_rollout=4"])
    assert exc.value.code == 2 and "EXP_DIR=rel/exp: must be an absolute directory" in capsys.readouterr().err
    # an absolute EXP_DIR (forwarded to the job as well) is where relax-train runs
    monkeypatch.setenv("EXP_DIR", "/shared/exp")
    main(["--dry-run", "--", "train.num_rollout=4"])
    out = capsys.readouterr().out
    assert "mkdir -p /shared/exp && cd /shared/exp && python -m relax.cli.train train.num_rollout=4" in out
    assert '"EXP_DIR": "/shared/exp"' in out
    # every output absolute: accepted without an experiment directory
    monkeypatch.delenv("EXP_DIR")
    main(["--dry-run", "--", "tracking.uri=http://mlflow:5000", "train.save_dir=/s/ckpt", "hydra.run.dir=/s/out"])
    assert '"entrypoint": "python -m relax.cli.train tracking.uri=' in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["--dry-run", "--exp-dir", "/shared/exp", "--entrypoint", "true"])
    assert exc.value.code == 2


def test_submit_reads_a_relative_config_path_where_the_job_runs_relax_train(tmp_path, monkeypatch, capsys):
    """`relax-submit -- -cp saved -cn config ...` (a run's saved config, relative -cp): the job's relax-train reads it
    from the directory it runs in, the job's copy of --working-dir (or --exp-dir), so the check before submitting
    reads it from there too, whatever the cwd here (before: Hydra's "initialize_config_dir() requires an absolute
    config_dir", exit 2). Where the job would not have it (not there, or left out of the upload) one line says so.
    The payload keeps the user's own -cp. Controls: an unknown key on it is still refused with Relax's line."""
    import json

    from omegaconf import OmegaConf

    from relax.config.compose import compose

    monkeypatch.delenv("EXP_DIR", raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))  # relax-submit puts --working-dir on it
    work, exp, elsewhere = tmp_path / "work", tmp_path / "exp", tmp_path / "elsewhere"
    for saved in (work / "saved", work / "outputs" / "run", exp / "ckpt"):
        saved.mkdir(parents=True)
        OmegaConf.save(compose(["train.num_rollout=2"]), saved / "config.yaml")
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # no `saved` here: the working_dir's is read
    absolute = ["tracking.uri=sqlite:////shared/mlflow.db", "train.save=false", "hydra.run.dir=/shared/out"]

    def refused(args: list[str]) -> str:
        with pytest.raises(SystemExit) as exc:
            main(["--dry-run", *args])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "Nothing was submitted." in err and "initialize_config_dir" not in err, err
        return err

    main(["--dry-run", "--working-dir", str(work), "--", "-cp", "saved", "-cn", "config", *absolute])
    assert json.loads(capsys.readouterr().out)["entrypoint"] == " ".join(
        [TRAIN_ENTRYPOINT, "-cp", "saved", "-cn", "config", *absolute])
    main(["--dry-run", "--working-dir", str(work), "--exp-dir", str(exp), "--", "--config-path=ckpt", "-cn",
          "config"])  # the job runs in --exp-dir: -cp relative to it
    assert json.loads(capsys.readouterr().out)["entrypoint"].endswith(" --config-path=ckpt -cn config")
    assert "  - unknown key train.lrr (did you mean train.lr?)" in refused(
        ["--working-dir", str(work), "--", "-cp", "saved", "-cn", "config", "train.lrr=1", *absolute])
    assert refused(["--working-dir", str(work), "--", "-cp", "nosuch", "-cn", "config", *absolute]) == (
        f"relax-submit: error: -cp nosuch: a relative config directory is read from the job's copy of the "
        f"working_dir (--working-dir {work.resolve()}), where it runs relax-train: {work.resolve() / 'nosuch'} is "
        "not a directory here, so the config cannot be checked before submitting (give -cp as it is there, or its "
        "absolute path)\nNothing was submitted.\n")
    assert "-cp saved: a relative config directory is read from the experiment directory " in refused(
        ["--working-dir", str(work), "--exp-dir", str(exp), "--", "-cp", "saved", "-cn", "config"])
    assert "but outputs/run is not uploaded with it (relax-submit leaves out 'outputs'" in refused(
        ["--working-dir", str(work), "--", "-cp", "outputs/run", "-cn", "config", *absolute])


def test_a_run_of_its_own_config_gets_the_checks_of_a_run_of_relaxs(tmp_path, monkeypatch, capsys):
    """`relax-submit -- -cp <checkpoint> -cn config ...` (a run's saved config): where the job writes, the secrets its
    config names and the grace `ray job stop` gives it are read from that config with the command line's overrides,
    as for a run of Relax's config (before, each of these checks skipped a command with -cp/-cn: relative outputs
    were submitted to be lost, the judge's key was not passed on, Ray's 3 s stop grace was left)."""
    import json

    from omegaconf import OmegaConf

    from relax.cli.submit import STOP_WAIT_ENV
    from relax.config.compose import compose

    for name in ("EXP_DIR", STOP_WAIT_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RELAX_T_OWN_KEY", "sk-own-secret")
    saved = tmp_path / "ckpt"
    saved.mkdir()
    OmegaConf.save(compose(["train.num_rollout=2", "cluster.heartbeat_timeout_s=5", "reward_model=judge",
                            "reward_model.engine=openai", "reward_model.url=http://127.0.0.1:8000/v1",
                            "reward_model.api_key_env=RELAX_T_OWN_KEY"]), saved / "config.yaml")
    own = ["-cp", str(saved), "-cn", "config"]
    with pytest.raises(SystemExit) as exc:  # the saved config's outputs are relax-train's defaults: relative
        main(["--dry-run", "--", *own])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Nothing was submitted." in err
    assert [line.split(":")[0] for line in err.splitlines() if line.startswith("  ")] == [
        "  tracking.uri=sqlite", "  train.save_dir is unset", "  hydra.run.dir=outputs/${now"]
    absolute = ["tracking.uri=sqlite:////shared/mlflow.db", "train.save_dir=/shared/ckpt", "hydra.run.dir=/shared/o"]
    main(["--dry-run", "--", *own, "train.checkpoint_timeout_s=20", *absolute])
    env = json.loads(capsys.readouterr().out)["runtime_env"]["env_vars"]
    # the file's heartbeat (5 s), the command line's checkpoint timeout (20 s), 120 s to close MLflow
    assert env["RELAX_T_OWN_KEY"] == "***" and env[STOP_WAIT_ENV] == str(5 + 20 + 120)
    # a sweep of it (what main reads, without its check of each job): Relax's launcher, which relax-train gives it,
    # and so its stop timeout; Hydra's sweep dir
    from relax.cli.submit import job_configs, stop_grace_s, storage_check

    configs = job_configs(["-m", *own, "seed=1,2", "hydra.launcher.stop_timeout_s=30", *absolute], REPO / "conf")
    assert [c.seed for c in configs] == [1, 2] and stop_grace_s(configs, sweep=True) == 30 + 120
    assert storage_check(configs, sweep=True) == [
        "hydra.sweep.dir=multirun/${now:%Y-%m-%d}/${now:%H-%M-%S}: relative (Hydra's output directory: the resolved "
        "config and logs); give an absolute directory"]


def test_a_config_path_in_the_home_directory_is_refused(tmp_path, monkeypatch, capsys):
    """`-cp=~/ckpt` (or a quoted `~`): the job's relax-train reads `~` on the cluster, as the user the job runs as;
    the check here would read this machine's (before: it did, and passed). Control: the same directory by its
    absolute path is checked and submitted."""
    from omegaconf import OmegaConf

    from relax.config.compose import compose

    monkeypatch.delenv("EXP_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ckpt").mkdir()
    OmegaConf.save(compose(["train.num_rollout=2"]), tmp_path / "ckpt" / "config.yaml")
    absolute = ["tracking.uri=sqlite:////shared/mlflow.db", "train.save=false", "hydra.run.dir=/shared/o"]
    with pytest.raises(SystemExit) as exc:
        main(["--dry-run", "--", "-cp=~/ckpt", "-cn", "config", *absolute])
    assert exc.value.code == 2 and capsys.readouterr().err == (
        "relax-submit: error: -cp=~/ckpt: `~` is the home directory of the user the job runs as on the cluster, which "
        "relax-submit cannot read here to check the config before submitting (it would read yours): give the "
        "directory's absolute path on storage the cluster's nodes share\nNothing was submitted.\n")
    with pytest.raises(SystemExit) as exc:  # the flag is quoted as typed: here with a space
        main(["--dry-run", "--", "--config-path", "~/ckpt", "-cn", "config", *absolute])
    assert exc.value.code == 2 and capsys.readouterr().err.startswith(
        "relax-submit: error: --config-path ~/ckpt: `~` is the home directory")
    main(["--dry-run", "--", f"-cp={tmp_path / 'ckpt'}", "-cn", "config", *absolute])
    assert f"-cp={tmp_path / 'ckpt'} -cn config" in capsys.readouterr().out


class _CutStream:
    """A Jobs client whose log stream ends after the header while the job goes on (a dropped websocket)."""

    def __init__(self, log: str, cut: int):
        self.log, self.cut, self.polls = log, cut, 0

    async def tail_job_logs(self, job_id):
        yield self.log[: self.cut]

    def get_job_status(self, job_id):
        self.polls += 1
        return "JobStatus.RUNNING" if self.polls < 3 else "JobStatus.SUCCEEDED"

    def get_job_logs(self, job_id):
        return self.log[: self.cut + 10 * self.polls] if self.polls < 3 else self.log


def test_what_the_log_stream_missed_is_printed_from_the_job_log():
    import io

    log = "algorithm  grpo\n" + "".join(f"step {i}/4 | reward 0.{i}\n" for i in range(1, 5)) + "Relax run finished\n"
    client = _CutStream(log, cut=16)
    out = io.StringIO()
    assert follow_to_the_end(client, "job", out, poll_s=0) == "SUCCEEDED"
    assert out.getvalue() == log  # every line once, in order


def test_token_auth_is_turned_on_when_a_token_is_available(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    environ = {"RAY_AUTH_TOKEN": "t"}
    assert enable_token_auth(environ) and environ["RAY_AUTH_MODE"] == "token"
    assert not enable_token_auth({})
    assert not enable_token_auth({"RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN": "t"})


# the runs' steps: small (what they prove is the submission and the join, not the batch), as test_relax_sweep's
SMALL = ["rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4", "train.global_batch_size=8",
         "train.micro_batch_size=8"]


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """`ray start --head --block` on loopback with token auth and ports of its own (other Ray instances on this
    machine keep theirs); SIGTERM makes `--block` stop every process it started. Never `ray stop` (it kills all)."""
    tmp = tmp_path_factory.mktemp("head")
    token = secrets.token_hex(16)
    # Ray's socket paths must stay under the OS limit (107 bytes): pytest's directories can be longer (xdist)
    ray_tmp = tempfile.mkdtemp(prefix="relax-head-", dir="/tmp")
    (tmp / "ray").symlink_to(ray_tmp)  # where the tests look for what the head keeps
    gcs, dash, agent, client = free_ports(4)
    ray_cli = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "HOME": str(tmp)}
    cmd = [ray_cli, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--dashboard-agent-listen-port={agent}",
           f"--ray-client-server-port={client}", "--num-cpus=2", "--num-gpus=0", "--include-dashboard=true",
           f"--temp-dir={ray_tmp}"]
    log = open(tmp / "head.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True)
    url = f"http://127.0.0.1:{dash}"
    t0 = time.monotonic()
    while "Ray runtime started" not in (tmp / "head.log").read_text():
        if proc.poll() is not None or time.monotonic() - t0 > 120:
            proc.kill()
            pytest.fail("the Ray head did not start:\n" + (tmp / "head.log").read_text())
        time.sleep(0.5)
    yield url, token, tmp, gcs
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what it started
    log.close()
    shutil.rmtree(ray_tmp, ignore_errors=True)


def _submit(args, *, token, home, timeout=180):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "EXP_DIR"}
    env["HOME"] = str(home)  # no ~/.ray/auth_token of the user's
    if token:
        env["RAY_AUTH_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "relax.cli.submit", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_submit_follows_logs_and_returns_the_job_exit_code(ray_head, tmp_path):
    url, token, home, _ = ray_head
    (tmp_path / "marker.txt").write_text("from the working dir")
    code = "import sys; print(open('marker.txt').read()); sys.exit(3)"
    proc = _submit(["--address", url, "--working-dir", str(tmp_path), "--entrypoint", f'python -c "{code}"'],
                   token=token, home=home)
    assert "submitted job" in proc.stdout, proc.stdout + proc.stderr
    assert "from the working dir" in proc.stdout
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "FAILED (exit code 3)" in proc.stderr


@pytest.mark.slow
def test_submit_without_the_token_is_refused(ray_head, tmp_path):
    url, _, home, _ = ray_head
    proc = _submit(["--address", url, "--working-dir", str(tmp_path), "--no-follow", "--entrypoint", "true"],
                   token=None, home=tmp_path)
    assert proc.returncode == 2
    assert "relax-submit: error: cannot submit" in proc.stderr and "uthentication" in proc.stderr


@pytest.mark.slow
def test_submitted_run_joins_the_cluster_records_in_the_experiment_dir_and_streams_its_progress(ray_head, tmp_path,
                                                                                                 fresh_store):
    """relax-train as a Ray job from the uploaded checkout (the default working_dir: what relax-submit leaves out of
    it must not be what relax-train needs), with no cluster.address: it joins the job's cluster (the default
    cluster=local would start its own Ray), writes MLflow and checkpoints under --exp-dir (not in the job's
    working_dir, which Ray deletes), and its log shows the progress lines and the final summary as a local run prints
    them."""
    from mlflow import MlflowClient

    url, token, home, gcs = ray_head
    exp = tmp_path / "exp"
    fresh_store(exp)  # the run's default store, sqlite:///mlflow.db where it runs (a store it created holds the same)
    proc = _submit(["--address", url, "--exp-dir", str(exp), "--", "train.num_rollout=2", *SMALL,
                    "tracking.experiment=submitted"], token=token, home=home, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "SUCCEEDED (exit code 0)" in proc.stderr
    # 1. joined the head's cluster, and said so
    joined = re.search(r"^Ray: cluster\.address is unset and this process runs inside Ray job (\S+): joining the Ray "
                       r"cluster at (\S+) \(RAY_ADDRESS\)", out, re.M)
    assert joined, out
    assert joined.group(2).endswith(f":{gcs}")  # the head's GCS port (Ray names the host by its IP); a Ray of its
    # own would have started a GCS on another port, and the default cluster=local would have failed on num_cpus
    assert re.search(rf"^submitted job {re.escape(joined.group(1))} ", out, re.M)
    # 3. the live log as a local run prints it (not a TTY: whole lines, the first and the last step), then the summary
    assert re.search(r"^step 1/2  50% \| reward \S+ \| step \S+s \| elapsed \S+ \| eta \S+$", out, re.M), out
    assert re.search(r"^step 2/2 100% \| reward \S+ .*\| eta 0:00$", out, re.M), out
    assert "\r" not in out
    summary = out[out.index("Relax run finished"):]
    assert re.search(r"^  final reward +\S+$", summary, re.M) and re.search(r"^  steps +2$", summary, re.M)
    # 2. the record and the checkpoint are in the experiment directory, read after the job (and its runtime env) ended
    db = exp / "mlflow.db"
    assert f"mlflow ui --backend-store-uri sqlite:///{db}" in summary
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (run,) = client.search_runs([client.get_experiment_by_name("submitted").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_id in summary
    assert [m.step for m in client.get_metric_history(run.info.run_id, "rollout/raw_reward")] == [0, 1]
    assert run.info.artifact_uri.startswith(str(exp))
    assert {f.path for f in client.list_artifacts(run.info.run_id)} >= {"config.yaml", "plan.txt"}
    outputs = Path(re.search(r"^  outputs +(\S+)$", summary, re.M).group(1))
    assert outputs.is_relative_to(exp) and (outputs / "config.resolved.yaml").is_file()
    checkpoints = [p for p in exp.rglob("step_000002") if p.is_dir()]
    assert len(checkpoints) == 1 and (checkpoints[0] / "policy").is_dir(), sorted(map(str, exp.rglob("*")))
    # nothing of the run was written into the job's working_dir (Ray's copy of the checkout, shared by the jobs
    # that upload the same files)
    copies = [p for p in (home / "ray").glob("session_*/runtime_resources/working_dir_files/_ray_pkg_*") if p.is_dir()]
    assert copies
    for copy in copies:
        written = [p for pattern in ("mlflow.db", "mlruns", "checkpoints", "step_[0-9]*", "config.resolved.yaml")
                   for p in copy.rglob(pattern)]
        assert not written, written


def _ray_job(args, *, token, home):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    ray_cli = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    return subprocess.run([ray_cli, "job", *args], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_ray_job_stop_lets_the_submitted_run_commit_its_checkpoint(ray_head, tmp_path, fresh_store):
    """`ray job stop` (what relax-submit says to run, and the dashboard's Stop) sends SIGTERM, then Ray SIGKILLs the
    job after RAY_JOB_STOP_WAIT_TIME_S, 3 s unless the job sets it. relax-submit sets it from the config, so the run
    finishes the step it is in, commits its checkpoint and marks its MLflow run KILLED, however long the step takes.

    The step is held (hold_rewards: the reward of the step's first sample waits for the test) from before the stop
    until Ray would have killed the job with its default: until the job's process ended (the SIGKILL), or 10 s
    passed (watched through its process id, which hold_rewards writes: polling `ray job status` would start a
    process that imports Ray at each poll)."""
    import contextlib

    import psutil
    from mlflow import MlflowClient

    url, token, home, _ = ray_head
    exp, job = tmp_path / "exp", f"relax-stop-{secrets.token_hex(4)}"
    fresh_store(exp)  # the run's default store, sqlite:///mlflow.db where it runs
    per_step = 4  # rollout_batch_size 2 x n_samples_per_prompt 2
    args = ["--address", url, "--exp-dir", str(exp), "--submission-id", job,
            "--env", f"PYTHONPATH={Path(__file__).resolve().parent}", "--env", f"RELAX_HOLD={per_step + 1}:{tmp_path}",
            "--", "train.num_rollout=50", "train.save_interval=100", "rollout.rollout_batch_size=2",
            "rollout.n_samples_per_prompt=2", "train.global_batch_size=4", "train.micro_batch_size=4",
            "data.reward=hold_rewards:hold", "data.reward_timeout_s=null", "tracking.experiment=stopped"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "EXP_DIR"}
    env.update(HOME=str(home), RAY_AUTH_TOKEN=token)
    proc = subprocess.Popen([sys.executable, "-m", "relax.cli.submit", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        while not (tmp_path / "held").exists():  # step 1 (0-based) is in progress, held in its reward
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() - t0 < 300, "the run never reached the held reward call"
            time.sleep(0.1)
        while not (pid := (tmp_path / "held").read_text()):  # created, its process id not yet written
            time.sleep(0.01)
        driver = psutil.Process(int(pid))  # the job's relax-train, which holds the step
        stopped = _ray_job(["stop", "--address", url, "--no-wait", job], token=token, home=home)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10:  # Ray's default grace is 3 s: a job still there after 10 s was given more
            with contextlib.suppress(psutil.NoSuchProcess):
                if driver.status() != psutil.STATUS_ZOMBIE:
                    time.sleep(0.1)
                    continue
            break  # killed
        (tmp_path / "release").write_text("")
        out, err = proc.communicate(timeout=300)
    finally:
        (tmp_path / "release").write_text("")
        if proc.poll() is None:
            proc.kill()
    assert "relax-train: SIGTERM received: stopping after step 2 with a checkpoint" in out, out + err
    assert "relax-train: SIGTERM received: stopped after 2 steps with a checkpoint; train.resume=auto continues from " \
        in out, out + err
    # the cluster it joined is still up: only the run's actors stopped, and the last line says so (before: "Ray and
    # its processes stopped", as if the head had gone down)
    assert re.search(r"\. The run's Ray actors stopped \(the Ray cluster at \S+ keeps running\), the MLflow run is "
                     r"marked KILLED$", out, re.M), out
    assert "Ray and its processes stopped" not in out
    assert f"job {job}: STOPPED (exit code 143)" in err
    assert proc.returncode == 143
    (ckpt,) = [p for p in exp.rglob("step_000002") if p.is_dir()]
    assert (ckpt / "state.json").is_file() and not list(exp.rglob(".tmp-step_*"))
    client = MlflowClient(tracking_uri=f"sqlite:///{exp / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("stopped").experiment_id])
    assert run.info.status == "KILLED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "rollout/raw_reward")] == [0, 1]


@pytest.mark.slow
def test_relax_train_and_a_sweep_join_a_token_cluster_with_the_token_alone(ray_head, tmp_path, fresh_store):
    """relax-train with cluster.address, and a sweep (-m) joining the cluster, with the cluster's token in the
    environment and RAY_AUTH_MODE unset (as after `ray get-auth-token --generate` on a laptop): they turn token auth on
    themselves (docs/operations.md, "Multi-node"). Ray had read RAY_AUTH_MODE when relax-train imported it, so the
    variable alone did not make ray.init send the token: the GCS refused the join (InvalidAuthToken)."""
    _, token, home, gcs = ray_head
    fresh_store(tmp_path)  # the store both write to
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), RAY_AUTH_TOKEN=token)
    common = [f"cluster.address=127.0.0.1:{gcs}", "train.num_rollout=1", *SMALL, "train.save=false",
              "tracking.progress=false",
              f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"hydra.run.dir={tmp_path}/out",
              f"hydra.sweep.dir={tmp_path}/multirun"]
    from mlflow import MlflowClient

    for args in ([], ["-m", "seed=1"]):
        proc = subprocess.run([sys.executable, "-m", "relax.cli.train", *args, *common], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "InvalidAuthToken" not in proc.stderr
        if not args:  # the single run's plan names the cluster it joined
            assert f"Ray: 127.0.0.1:{gcs}" in proc.stderr
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("relax").experiment_id], "tags.seed = '1'")
    assert sorted(r.info.status for r in runs) == ["FINISHED", "FINISHED"]  # the run and the sweep's job
