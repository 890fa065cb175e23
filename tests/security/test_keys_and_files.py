"""Keys and temporary files of a run (issue 44, defect 3 b), checked where the operating system shows them: the
process table (`/proc/<pid>/cmdline`), the launch logs, the run's temporary directory and its mode."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import textwrap
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parents[2]
KEY = "s3cret-key-not-in-any-command-line"


def _process_table_mentions(secret: str) -> list[int]:
    """The pids whose command line holds `secret` (what `ps -ef` shows every user)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if secret.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue
    return found


def test_the_routers_key_is_in_no_command_line_nor_its_launch_log(tmp_path):
    from relax.rollout.sglang.router import Router

    router = Router(host="127.0.0.1", policy="round_robin", log_path=tmp_path / "router.log", startup_timeout_s=120,
                    request_timeout_s=60, api_key=KEY).start()
    try:
        assert _process_table_mentions(KEY) == []
        log = (tmp_path / "router.log").read_text()
        assert log.startswith("$ ") and "sglang_router.launch_router" in log and KEY not in log
        # the key did reach the router: it refuses a client without it
        assert requests.get(router.url + "/workers", timeout=30).status_code == 401
        assert requests.get(router.url + "/workers", timeout=30,
                            headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    finally:
        router.stop()


ECHO = textwrap.dedent("""
    import json, os, sys
    seen = {"argv": sys.argv[1:], "cmdline": open("/proc/self/cmdline", "rb").read().decode(),
            "env": os.environ.get("RELAX_LAUNCH_API_KEY")}
    with open(os.environ["ECHO_TO"], "w") as out:  # a file: what it prints is masked
        json.dump(seen, out)
    print("server_args=ServerArgs(api_key=%r)" % sys.argv[-1].split("=", 1)[1], file=sys.stderr)
""")


def test_the_keyed_launcher_gives_the_key_to_the_module_and_to_no_one_else(tmp_path):
    import json

    from relax.rollout.sglang.keyed import KEY_ENV, keyed_command

    (tmp_path / "echo_args.py").write_text(ECHO)
    env = {**os.environ, KEY_ENV: KEY, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "ECHO_TO": str(tmp_path / "seen.json")}
    done = subprocess.run(keyed_command("echo_args", ["--port", "1"]), env=env, capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["argv"] == ["--port", "1", f"--api-key={KEY}"]  # the module gets the key as --api-key
    assert KEY not in seen["cmdline"] and seen["env"] is None  # not in its command line, nor its children's env
    assert KEY not in done.stderr and "api_key='***'" in done.stderr  # what it logs has the key masked


def test_sglang_server_commands_carry_no_key(tmp_path, monkeypatch):
    import dataclasses

    from relax.config import load_config
    from relax.roles import sglang_server

    monkeypatch.setattr(sglang_server, "resolve_model_path", lambda model: tmp_path)  # SGLang's --model-path
    base = load_config(["rollout=sglang", "rollout.sglang.server=embedded"])
    for server in ("sglang", "embedded"):
        sg = dataclasses.replace(base.rollout.sglang, server=server)
        cfg = dataclasses.replace(base, rollout=dataclasses.replace(base.rollout, sglang=sg))
        cmd = sglang_server.server_command(cfg, host="127.0.0.1", port=1, threads=None,
                                           config_path=tmp_path / "c.json", api_key=KEY)
        assert not any(KEY in part for part in cmd)
        if server == "sglang":
            assert cmd[1:4] == ["-m", "relax.rollout.sglang.keyed", "sglang.launch_server"]


@pytest.mark.slow  # a relax-serve process: torch and the model, seconds of CPU
def test_an_engine_server_starts_relax_serve_keyed_and_loading_from_the_runs_directory_only():
    """The embedded engine as a run starts it (`EngineServer`, outside Ray): its key is in no command line and in
    no log, its directory is the user's alone, and it loads weights only from that directory."""
    from relax.config import load_config
    from relax.roles.sglang_server import EngineServer

    cfg = load_config(["rollout=sglang", "rollout.sglang.server=embedded", "model=tiny", "model.dtype=float32"])
    run_dir = Path(tempfile.mkdtemp(prefix="relax-sglang-"))  # as Cluster makes it
    engine = EngineServer(cfg, 0, threads=1, log_dir=str(run_dir))
    try:
        url = engine.start(api_key=KEY)
        assert _process_table_mentions(KEY) == []
        assert not any(KEY in p.read_text(errors="replace") for p in run_dir.iterdir() if p.is_file())
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
        auth = {"Authorization": f"Bearer {KEY}"}
        assert requests.get(url + "/get_server_info", timeout=30).status_code == 401
        assert requests.get(url + "/get_server_info", timeout=30, headers=auth).status_code == 200
        outside = requests.post(url + "/update_weights_from_disk", json={"model_path": tempfile.gettempdir()},
                                headers=auth, timeout=30)
        assert outside.status_code == 400 and os.path.realpath(run_dir) in outside.json()["message"]
    finally:
        engine.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def test_the_end_of_a_run_removes_its_engine_directory():
    from relax.runner.cluster import Cluster

    run_dir = Path(tempfile.mkdtemp(prefix="relax-sglang-"))  # as Cluster makes it: configs, logs, adapters
    (run_dir / "lora-adapters" / "relax-v3").mkdir(parents=True)
    (run_dir / "engine0-1.log").write_text("log")
    cluster = Cluster(None, None, None)
    cluster.sglang_log_dir = run_dir
    cluster.__exit__(None, None, None)
    assert not run_dir.exists()


def test_a_failed_run_keeps_its_engine_logs(capsys):
    from relax.runner.cluster import Cluster

    run_dir = Path(tempfile.mkdtemp(prefix="relax-sglang-"))
    try:
        cluster = Cluster(None, None, None)
        cluster.sglang_log_dir = run_dir
        cluster.__exit__(RuntimeError, RuntimeError("failed"), None)
        cluster.__exit__(RuntimeError, RuntimeError("failed"), None)  # as a failed start exits it: said once
        assert run_dir.exists() and capsys.readouterr().err.count(str(run_dir)) == 1
    finally:
        run_dir.rmdir()
