"""relax-submit: the Ray Jobs payload, and a real submission to a local Ray head with token authentication."""

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax.cli.submit import (
    EXCLUDES,
    TRAIN_ENTRYPOINT,
    build_submission,
    default_working_dir,
    enable_token_auth,
    parse_env,
)

REPO = Path(__file__).resolve().parents[2]


def test_payload_runs_relax_train_with_the_checkout_and_env(tmp_path):
    env = parse_env(["WANDB_MODE=off", "MODEL_DIR=/override"], environ={"MODEL_DIR": "/models", "DATA_DIR": "/data",
                                                                       "UNRELATED": "x"})
    assert env == {"MODEL_DIR": "/override", "DATA_DIR": "/data", "WANDB_MODE": "off"}
    p = build_submission(["algorithm=rloo", "model=qwen3_0.6b", "cluster=8xgpu", "data.system_prompt=Be brief"],
                         working_dir=tmp_path, env=env, submission_id="job-1")
    assert p["entrypoint"] == (f"{TRAIN_ENTRYPOINT} algorithm=rloo model=qwen3_0.6b cluster=8xgpu "
                               "'data.system_prompt=Be brief'")
    assert p["runtime_env"] == {"working_dir": str(tmp_path), "excludes": EXCLUDES, "env_vars": env}
    assert p["submission_id"] == "job-1"
    assert default_working_dir() == REPO
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_env(["novalue"], environ={})


def test_token_auth_is_turned_on_when_a_token_is_available(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    environ = {"RAY_AUTH_TOKEN": "t"}
    assert enable_token_auth(environ) and environ["RAY_AUTH_MODE"] == "token"
    assert not enable_token_auth({})
    assert not enable_token_auth({"RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN": "t"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """`ray start --head --block` on loopback with token auth and ports of its own (other Ray instances on this
    machine keep theirs); SIGTERM makes `--block` stop every process it started. Never `ray stop` (it kills all)."""
    tmp = tmp_path_factory.mktemp("head")
    token = secrets.token_hex(16)
    gcs, dash, agent, client = (_free_port() for _ in range(4))
    ray_cli = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "HOME": str(tmp)}
    cmd = [ray_cli, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--dashboard-agent-listen-port={agent}",
           f"--ray-client-server-port={client}", "--num-cpus=2", "--num-gpus=0", "--include-dashboard=true",
           f"--temp-dir={tmp / 'ray'}"]
    log = open(tmp / "head.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True)
    url = f"http://127.0.0.1:{dash}"
    t0 = time.monotonic()
    while "Ray runtime started" not in (tmp / "head.log").read_text():
        if proc.poll() is not None or time.monotonic() - t0 > 120:
            proc.kill()
            pytest.fail("the Ray head did not start:\n" + (tmp / "head.log").read_text())
        time.sleep(0.5)
    yield url, token, tmp
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what it started
    log.close()


def _submit(args, *, token, home, timeout=180):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(home)  # no ~/.ray/auth_token of the user's
    if token:
        env["RAY_AUTH_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "relax.cli.submit", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_submit_follows_logs_and_returns_the_job_exit_code(ray_head, tmp_path):
    url, token, home = ray_head
    (tmp_path / "marker.txt").write_text("from the working dir")
    code = "import sys; print(open('marker.txt').read()); sys.exit(3)"
    proc = _submit(["--address", url, "--working-dir", str(tmp_path), "--entrypoint", f'python -c "{code}"'],
                   token=token, home=home)
    assert "submitted job" in proc.stdout, proc.stdout + proc.stderr
    assert "from the working dir" in proc.stdout
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "FAILED (exit code 3)" in proc.stderr


@pytest.mark.slow
def test_submit_relax_train_from_the_checkout(ray_head):
    url, token, home = ray_head
    proc = _submit(["--address", url, "--env", "RELAX_TEST=1", "--", "algorithm=rloo", "dry_run=true"],
                   token=token, home=home)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dry run: config valid" in proc.stdout


@pytest.mark.slow
def test_submit_without_the_token_is_refused(ray_head, tmp_path):
    url, _, home = ray_head
    proc = _submit(["--address", url, "--working-dir", str(tmp_path), "--no-follow", "--entrypoint", "true"],
                   token=None, home=tmp_path)
    assert proc.returncode == 2
    assert "relax-submit: error: cannot submit" in proc.stderr and "uthentication" in proc.stderr
