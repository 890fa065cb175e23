"""Several Ray nodes on one machine: the trainer's roles on one node, the rollout on another, the real loop.

A Ray cluster of two nodes started with `ray start` (head and worker, each with its own node IP: the head on this
machine's address, the worker on 127.0.0.2, one CPU each, ports and a temp dir of their own, token authentication
as Ray 2.60 turns on by default), joined by `relax-train cluster.address=... cluster.num_nodes=2`. The plan spreads
the roles (STRICT_SPREAD: the trainer's roles on one node, the rollout on the other), so that whatever assumes one
node shows: the embedded rollout's weights cross nodes through Ray's object store; rollout=sglang's servers bind
their node's address (a URL naming loopback or the actor's node would be wrong), and the weights go over the
weight-update group (gloo), never shared memory (rejected on several nodes before start). Where each process ran
is read from Ray's actor table (GCS), not from the plan.

`ray start` (not `ray.cluster_utils.Cluster`): the latter writes /tmp/ray/ray_current_cluster, which other
processes on this machine calling `ray.init()` would then join. Every wait is bounded.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

import relax.runner.cluster as cluster_module
import relax.runner.rollout_driver.engines as engines_module
from relax.config import load_config
from relax.config.validate import ConfigError
from relax.metrics import STALENESS_MAX, SYNC_BYTES, TRAIN_ROLLOUT_LOGP_ABS_DIFF
from relax.runner.cluster import Cluster
from relax.runner.errors import RunError
from relax.runner.plan import SPREAD_STRATEGY, build_plan, reserve
from relax.runner.rollout_driver.sglang_engines import SGLangEngines
from relax.runner.train import run

# one xdist worker runs them in a row, on the module's cluster
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("multinode")]

WORKER_IP = "127.0.0.2"  # the second node's address: loopback, but not the one that "127.0.0.1/localhost" names
START_TIMEOUT_S = 240.0  # a node starts in seconds, in a minute on a loaded machine
LOOPBACK = ("127.0.0.1", "localhost", "0.0.0.0")
SGLANG = ["rollout=sglang", "rollout.sglang.server=embedded", "rollout.num_replicas=1",
          "rollout.sglang.weight_sync=distributed", "rollout.sglang.host=0.0.0.0",
          "rollout.sglang.startup_timeout_s=180"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayNodes:
    """`ray start --block` processes (a head, then workers), each in a session of its own; SIGTERM stops what each
    started. Never `ray stop` (it would stop every Ray instance on the machine)."""

    def __init__(self):
        self.temp_dir = tempfile.mkdtemp(prefix="relax-mn-", dir="/tmp")  # short: Ray's socket paths
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.env.update(RAY_AUTH_MODE="token", RAY_worker_niceness="0")  # the token: ~/.ray/auth_token
        self.procs: list[subprocess.Popen] = []
        self.gcs_port = _free_port()
        self.address = f"127.0.0.1:{self.gcs_port}"

    def start(self, *args: str, name: str) -> None:
        ray_cli = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
        log_path = Path(self.temp_dir) / f"{name}.log"
        cmd = [ray_cli, "start", "--block", "--num-cpus=1", "--num-gpus=0", f"--temp-dir={self.temp_dir}",
               f"--object-store-memory={200 << 20}", f"--dashboard-agent-listen-port={_free_port()}",
               f"--metrics-export-port={_free_port()}", *args]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        t0 = time.monotonic()
        while "Ray runtime started" not in log_path.read_text():
            if proc.poll() is not None or time.monotonic() - t0 > START_TIMEOUT_S:
                self.stop()
                pytest.fail(f"the Ray {name} did not start:\n{log_path.read_text()}")
            time.sleep(0.5)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what it started
        self.procs = []
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def two_nodes():
    """The address of a running two-node Ray cluster on this machine; this process joins it with token auth."""
    import ray

    if ray.is_initialized():  # another test's local instance: a run joins the cluster only if none is running
        ray.shutdown()
    nodes = RayNodes()
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    try:
        nodes.start("--head", "--node-ip-address=127.0.0.1", f"--port={nodes.gcs_port}", "--include-dashboard=false",
                    f"--ray-client-server-port={_free_port()}", name="head")
        nodes.start(f"--address={nodes.address}", f"--node-ip-address={WORKER_IP}", name="worker")
        os.environ["RAY_AUTH_MODE"] = "token"  # the driver sends the token (~/.ray/auth_token), as a user sets it
        os.environ.pop("RAY_ADDRESS", None)
        from ray._raylet import Config

        Config.initialize("")  # Ray caches its config: read RAY_AUTH_MODE again, as Ray does when it turns it on
        yield nodes.address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        nodes.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _cluster_options(address: str) -> list[str]:
    return [f"cluster.address={address}", "cluster.num_nodes=2", "cluster.cpus_per_node=1"]


def _where(actor) -> dict:
    """The node of a running Ray actor, from the GCS actor table: {"ip", "node"}."""
    from ray._private import state

    info = state.actors(actor_id=actor._actor_id.hex())
    return {"ip": info["Address"]["IPAddress"], "node": info["Address"]["NodeID"]}


@pytest.fixture
def placed(monkeypatch) -> dict:
    """What the run's Cluster started, once every role answered: process name -> node ({"ip", "node"}), and for
    rollout=sglang the servers' URLs, the router's workers and each weight push (mode, urls, what it sent)."""
    seen: dict = {"nodes": {}, "pushes": []}
    wait = Cluster._wait_for_roles

    def record(self):
        wait(self)
        seen["nodes"] = {name: _where(a) for name, a in zip(self.processes, self.actors, strict=True)}

    start = SGLangEngines.start

    def record_engines(self):
        start(self)
        seen["urls"] = list(self.urls)
        seen["router"] = [w.get("url") for w in self.router.list()]
        seen["mode"] = self.target.mode
        return self

    monkeypatch.setattr(Cluster, "_wait_for_roles", record)
    monkeypatch.setattr(SGLangEngines, "start", record_engines)
    actor_push = engines_module.actor_push

    def spy(actor, watch, process):
        push = actor_push(actor, watch, process)

        def recorded(weights, version, urls, target, regroup):
            sent = push(weights, version, urls, target, regroup)
            seen["pushes"].append({"version": version, "mode": target.mode, "urls": list(urls), **sent})
            return sent

        return recorded

    monkeypatch.setattr(engines_module, "actor_push", spy)
    return seen


def assert_apart(nodes: dict) -> tuple[dict, dict]:
    """The trainer's processes on one node, the rollout's on another: (the actor's node, the rollout's)."""
    actor = nodes["actor"]
    rollout = [where for name, where in nodes.items() if name.startswith("rollout")]
    assert rollout, nodes
    trainer = {name: where["node"] for name, where in nodes.items() if not name.startswith("rollout")}
    assert set(trainer.values()) == {actor["node"]}, nodes
    assert all(where["node"] != actor["node"] for where in rollout), f"the rollout runs on the actor's node: {nodes}"
    return actor, rollout[0]


def test_the_plan_spreads_cpu_roles_over_the_nodes():
    """Pure: num_nodes=2 without GPUs is a STRICT_SPREAD group of two bundles, the trainer's roles in bundle 0, the
    rollout in bundle 1, and dry_run's render says so."""
    cfg = load_config(["cluster.address=10.0.0.1:6379", "cluster.num_nodes=2", "algorithm=ppo"])
    plan = build_plan(cfg)
    assert plan.strategy == SPREAD_STRATEGY and len(plan.bundles) == 2
    assert plan.role("rollout").bundles == (1,)
    assert {plan.role(x).bundles for x in ("actor", "critic", "advantages")} == {(0,)}
    assert plan.bundles[0]["CPU"] == pytest.approx(0.65) and plan.bundles[1]["CPU"] == 0.25
    text = plan.render()
    assert "STRICT_SPREAD" in text and "2 nodes" in text and "node of bundle 1 (CPU)" in text
    one = build_plan(load_config(["cluster=local"]))
    assert one.bundles == () and one.strategy != SPREAD_STRATEGY


@pytest.mark.parametrize("overrides, field", [
    (["rollout.sglang.weight_sync=tensor"], "rollout.sglang.weight_sync"),  # shared memory: one node only
    (["rollout.sglang.host=127.0.0.1"], "rollout.sglang.host"),  # servers other nodes cannot reach
    (["model.lora_rank=4", "rollout.lora_sync=adapter"], "rollout.lora_sync"),  # adapter directories: local paths
], ids=["tensor", "loopback", "adapter"])
def test_single_node_assumptions_are_rejected_before_start(overrides, field, ray_not_started):
    """What only works on one node is refused at load_config, naming the field, before Ray starts."""
    base = [o for o in SGLANG if not o.startswith(field)]
    with pytest.raises(ConfigError) as e:
        load_config([*base, *_cluster_options("10.0.0.1:6379"), *overrides])
    assert field in str(e.value)
    assert ray_not_started == []


def test_nodes_are_told_apart_and_a_one_node_placement_would_be_caught(two_nodes):
    """The negative control, with placeholder roles on the real cluster: the plan's group puts the actor and the
    rollout on different nodes; the same plan packed onto one node (what a single-node assumption would do) fails
    `assert_apart`; a plan that needs more nodes than the cluster has fails at once."""
    import ray

    from relax.runner.plan import SPREAD_STRATEGY as spread

    cfg = load_config(_cluster_options(two_nodes))
    plan = build_plan(cfg)
    ray.init(address=two_nodes, include_dashboard=False, logging_level="WARNING")
    try:
        ips = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        assert len(ips) == 2 and WORKER_IP in ips, ips

        @ray.remote
        class Placeholder:
            def ping(self) -> str:
                return "ok"

        def start(p) -> dict:
            pg = reserve(p, timeout_s=60)
            try:
                actors = {role: Placeholder.options(**cluster_module.ray_options(p, role, 0, pg)).remote()
                          for role in ("actor", "rollout")}
                ray.get([a.ping.remote() for a in actors.values()], timeout=60)
                return {role: _where(a) for role, a in actors.items()}
            finally:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(pg)

        actor, rollout = assert_apart(start(plan))
        assert {actor["ip"], rollout["ip"]} == ips
        packed = start(dataclasses.replace(plan, strategy="STRICT_PACK"))
        with pytest.raises(AssertionError, match="on the actor's node"):
            assert_apart(packed)
        three = build_plan(load_config([f"cluster.address={two_nodes}", "cluster.num_nodes=3",
                                        "rollout.num_replicas=2"]))
        assert three.strategy == spread and len(three.bundles) == 3
        t0 = time.monotonic()
        with pytest.raises(RunError, match="over 3 nodes .* has 2 node"):
            reserve(three, timeout_s=60)
        assert time.monotonic() - t0 < 10
    finally:
        ray.shutdown()


def test_embedded_rollout_on_the_other_node(two_nodes, small_run, tmp_path, placed):
    """rollout=embedded: the actor on one node, the replica on the other, its weights from the actor's node through
    the object store each step; the rollout log-probs are the trainer's (fp32) and every step's tokens come from
    that step's weights."""
    cfg = load_config(small_run(*_cluster_options(two_nodes), "model.dtype=float32"))
    assert build_plan(cfg).strategy == SPREAD_STRATEGY
    result = run(cfg, output_dir=tmp_path / "out")
    assert [s for s, _ in result.history] == [0, 1]
    actor, rollout = assert_apart(placed["nodes"])
    assert WORKER_IP in (actor["ip"], rollout["ip"])
    for _, m in result.history:
        assert m[STALENESS_MAX] == 0.0
        assert m[TRAIN_ROLLOUT_LOGP_ABS_DIFF] < 1e-4


def test_sglang_servers_on_the_other_node_take_weights_over_the_group(two_nodes, small_run, tmp_path, placed,
                                                                        trained_batches):
    """rollout=sglang with an embedded server behind the router: the server's process on the other node, its URL
    (in the router) naming that node's address, never loopback or the actor's; every step's weights over the
    weight-update group (distributed); the server's tokens carry that step's version and its log-probs are the
    trainer's (fp32)."""
    cfg = load_config(small_run(*SGLANG, *_cluster_options(two_nodes), "model.dtype=float32"))
    assert cfg.rollout.sglang.weight_sync == "distributed"
    result = run(cfg, output_dir=tmp_path / "out")
    assert [s for s, _ in result.history] == [0, 1]
    actor, rollout = assert_apart(placed["nodes"])
    assert WORKER_IP in (actor["ip"], rollout["ip"])
    hosts = [urlparse(u).hostname for u in placed["urls"]]
    assert hosts == [rollout["ip"]], (placed["urls"], placed["nodes"])  # the server's node, not "127.0.0.1"
    assert not set(hosts) & {*LOOPBACK, actor["ip"]}
    assert sorted(placed["router"]) == sorted(placed["urls"])
    assert placed["mode"] == "distributed"
    pushes = placed["pushes"]
    # a version per step, pushed before its rollout (version 0: the initial weights), all over the group
    assert [p["version"] for p in pushes] == [0, 1] and {p["mode"] for p in pushes} == {"distributed"}, pushes
    assert all(p["urls"] == placed["urls"] and p["bytes"] > 0 for p in pushes), pushes
    assert result.series(SYNC_BYTES) == [float(p["bytes"]) for p in pushes]
    for _, m in result.history:
        assert m[STALENESS_MAX] == 0.0
        assert m[TRAIN_ROLLOUT_LOGP_ABS_DIFF] < 1e-4
    for step, samples in trained_batches.items():  # each step's tokens come from the weights of that step
        assert set(samples.token_version[samples.response_mask.bool()].tolist()) == {step}
