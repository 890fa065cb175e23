"""Colocated weight sync on two GPUs, as the plan places it (tests/gpu/bare.sh; needs two CUDA GPUs, skipped otherwise).

`cluster.actor_gpus=2` colocated with two rollout servers: replica i shares the GPU of bundle i (Ray gives each
process `CUDA_VISIBLE_DEVICES` of its bundle's GPU), and `Plan.weight_senders` names the actor rank on that GPU as the
one that sends the replica its CUDA IPC handles. Here each server is `relax-serve` in a process that sees only its
replica's GPU and each sender a process that sees only its rank's GPU, as under Ray (Ray itself is not on a bare
machine): the plan's sender's buckets load and the server then answers as the pushed weights do; the same buckets
from the rank on the other GPU (what sending everything from rank 0 did) are refused. CPU checks of the plan and the
driver's routing: tests/runner/test_weight_senders.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two CUDA GPUs (colocated weight sync from the actor rank on each server's GPU)"),
]

REPO = Path(__file__).resolve().parents[2]
CONFIG = ["rollout=sglang", "rollout.sglang.server=embedded", "model.dtype=bfloat16", "cluster.gpus_per_node=2",
          "cluster.actor_gpus=2", "train.backend=megatron", "rollout.num_replicas=2"]
PROMPT = [1, 2, 3, 4]
# a sender: the tiny model with other weights than the servers' (seed + 1), in bf16 CUDA IPC buckets to one server
SEND = """
import json, sys, torch
from relax.config import load_config
from relax.data.tokenizer import load_tokenizer
from relax.models.hf import build_model
from relax.rollout.sglang.tensor_sync import push_tensors
cfg = load_config(json.loads(sys.argv[2]))
tok = load_tokenizer(cfg.model)
model = build_model(cfg.model, len(tok), tok.pad_token_id, seed=cfg.seed + 1, dtype=torch.float32, device="cuda")
named = [(k, v.to(torch.bfloat16)) for k, v in model.state_dict().items()]
print(push_tensors([sys.argv[1]], named, 5, bucket_bytes=64 * 1024, device=torch.device("cuda"), timeout_s=120))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(gpu: int) -> dict:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": str(gpu)}


def _post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _greedy(url: str) -> list[int]:
    meta = _post(url, "/generate", {"input_ids": PROMPT, "return_logprob": True,
                                    "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}})["meta_info"]
    return [int(t[1]) for t in meta["output_token_logprobs"]]


def _send(url: str, gpu: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SEND, url, json.dumps(CONFIG)], env=_env(gpu), capture_output=True,
                          text=True, timeout=300)


def test_each_server_opens_the_handles_of_the_rank_on_its_gpu_and_not_the_others(tmp_path):
    from relax.config import load_config
    from relax.runner.plan import build_plan

    cfg = load_config(CONFIG)
    plan = build_plan(cfg)
    rollout = plan.role("rollout")
    assert plan.weight_path == "tensor" and plan.weight_senders == (0, 1) and rollout.bundles == (0, 1)
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    servers = []
    try:
        for i, gpu in enumerate(rollout.bundles):  # a bundle is one GPU; GPU index = bundle index on one node
            port, log = _free_port(), tmp_path / f"serve{i}.log"
            with open(log, "w") as out:
                proc = subprocess.Popen([sys.executable, "-m", "relax.cli.serve", "--port", str(port), "--config",
                                         str(tmp_path / "config.json")], stdout=out, stderr=subprocess.STDOUT,
                                        env=_env(gpu))
            servers.append((proc, f"http://127.0.0.1:{port}", log))
        for proc, url, log in servers:
            deadline = time.monotonic() + 180
            while True:
                assert proc.poll() is None, log.read_text()[-3000:]
                try:
                    with urllib.request.urlopen(url + "/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "relax-serve did not become healthy:\n" + log.read_text()[-3000:]
                time.sleep(0.2)
        before = _greedy(servers[1][1])
        for i, (_, url, log) in enumerate(servers):
            rank = plan.weight_senders[i]
            sent = _send(url, plan.role("actor").bundles[rank])
            assert sent.returncode == 0, (f"replica {i} from rank {rank}:\n{sent.stderr[-3000:]}\n"
                                          f"{log.read_text()[-2000:]}")
            assert _post(url, "/get_weight_version", {})["weight_version"] == "5"
        after = [_greedy(url) for _, url, _ in servers]
        assert after[0] == after[1] != before  # the same pushed weights on both GPUs, not the servers' own
        # the negative control: replica 1's buckets from rank 0's GPU, as when rank 0 sent to every server
        wrong = _send(servers[1][1], plan.role("actor").bundles[0])
        assert wrong.returncode != 0, f"a server opened CUDA IPC handles of another GPU:\n{wrong.stdout}"
    finally:
        for proc, _, _ in servers:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
