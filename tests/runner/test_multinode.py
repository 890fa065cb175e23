"""Several Ray nodes on one machine: the trainer's roles on one node, the rollout on another, the real loop.

A Ray cluster started with `ray start` (token authentication, as Ray 2.60 turns on by default), joined by
`relax-train cluster.address=... cluster.num_nodes=2`: a head without CPUs (Ray's services and the driver: no role
can land there; started on 127.0.0.1, which Ray resolves to this machine's address) and two nodes of one CPU, on
127.0.0.2 and 127.0.0.3. So that whatever assumes one node shows:
- each node has a temporary directory of its own (`TMPDIR`, Ray's `--temp-dir`) and a shared-memory file system of
  its own (each worker node runs in a mount namespace with a private tmpfs on /dev/shm): a file or a shared-memory
  segment one node makes is not there on the other (`test_nodes_are_told_apart...` checks it), so weights can only
  cross through the paths configured for it;
- no role runs on 127.0.0.1, so an address naming loopback (or "localhost") where a node's address belongs shows as
  such instead of reaching the right process by luck (every 127.x address of this machine is reachable from every
  node: what is asserted is which address each path names);
- placement is fixed: the 127.0.0.3 node has a resource only it has, with which a detached placement group holds
  0.7 of its CPU, so the plan's trainer bundle (0.5 or more) fits on 127.0.0.2 alone and the rollout's (0.25) lands
  on 127.0.0.3, every time.
The plan spreads the roles (STRICT_SPREAD): the embedded rollout's weights cross nodes through Ray's object store;
rollout=sglang's servers bind their node's address and the weights go over the weight-update group (gloo), never
shared memory (rejected on several CPU nodes before start). Where each process ran is read from Ray's actor table
(GCS), not from the plan.

`ray start` (not `ray.cluster_utils.Cluster`): the latter writes /tmp/ray/ray_current_cluster, which other
processes on this machine calling `ray.init()` would then join. Every wait is bounded. Without mount namespaces
(`unshare --mount`, CAP_SYS_ADMIN) the module is skipped, saying so.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
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
from tests.ports import free_ports

# one xdist worker runs them in a row, on the module's cluster
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("multinode")]

HEAD_IP = "127.0.0.1"  # Ray's services and the driver (Ray registers the head at this machine's address); no CPUs
TRAINER_IP, ROLLOUT_IP = "127.0.0.2", "127.0.0.3"  # the nodes the roles run on (placement fixed, see above)
ROLLOUT_NODE = "relax_mn_rollout_node"  # a resource only the rollout's node has
PINNED_CPU = 0.7  # of the rollout node's one CPU, held by a detached placement group: the trainer's bundle cannot fit
START_TIMEOUT_S = 240.0  # a node starts in seconds, in a minute on a loaded machine
LOOPBACK = ("127.0.0.1", "localhost", "0.0.0.0")
SGLANG = ["rollout=sglang", "rollout.sglang.server=embedded", "rollout.num_replicas=1",
          "rollout.sglang.weight_sync=distributed", "rollout.sglang.host=0.0.0.0",
          "rollout.sglang.startup_timeout_s=180"]
# a worker node's processes: a mount namespace of their own with a private tmpfs on /dev/shm
PRIVATE_SHM = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
               'mount -t tmpfs -o mode=1777,size=1g relax-mn-shm /dev/shm && exec "$@"', "sh"]


def _mount_namespaces() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "true"], capture_output=True).returncode == 0


class RayNodes:
    """`ray start --block` processes (a head, then workers), each in a session of its own, each with a directory of
    its own under `base` (Ray's temp dir and TMPDIR); SIGTERM stops what each started. Never `ray stop` (it would
    stop every Ray instance on the machine)."""

    def __init__(self):
        self.base = tempfile.mkdtemp(prefix="rmn-", dir="/tmp")  # short: Ray's socket paths
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.env.update(RAY_AUTH_MODE="token", RAY_worker_niceness="0")  # the token: ~/.ray/auth_token
        self.procs: list[subprocess.Popen] = []
        self.logs: dict[str, Path] = {}
        self._ports = iter(free_ports(12))  # every port these nodes are given, distinct
        self.gcs_port = self.port()
        self.address = f"{HEAD_IP}:{self.gcs_port}"

    def port(self) -> int:
        return next(self._ports)

    def launch(self, *args: str, name: str, cpus: int, private_shm: bool = False) -> None:
        """Start node `name` (not waiting: `wait`)."""
        ray_cli = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
        home = Path(self.base) / name
        (home / "tmp").mkdir(parents=True)
        log_path = self.logs[name] = Path(self.base) / f"{name}.log"
        cmd = [ray_cli, "start", "--block", f"--num-cpus={cpus}", "--num-gpus=0", f"--temp-dir={home / 'r'}",
               f"--object-store-memory={200 << 20}", f"--dashboard-agent-listen-port={self.port()}",
               f"--metrics-export-port={self.port()}", *args]
        with open(log_path, "w") as log:
            proc = subprocess.Popen((PRIVATE_SHM if private_shm else []) + cmd, stdout=log, stderr=subprocess.STDOUT,
                                    env={**self.env, "TMPDIR": str(home / "tmp")}, start_new_session=True)
        self.procs.append(proc)

    def wait(self, name: str) -> None:
        proc, log_path = self.procs[list(self.logs).index(name)], self.logs[name]
        t0 = time.monotonic()
        while "Ray runtime started" not in log_path.read_text():
            if proc.poll() is not None or time.monotonic() - t0 > START_TIMEOUT_S:
                text = log_path.read_text()
                self.stop()
                pytest.fail(f"the Ray {name} did not start:\n{text}")
            time.sleep(0.5)

    def stop(self) -> None:
        """The worker nodes at once, then the head (a worker whose head is gone first waits for it)."""
        for batch in (self.procs[1:], self.procs[:1]):
            for proc in batch:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in batch:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what it started
        self.procs = []
        shutil.rmtree(self.base, ignore_errors=True)


PIN_NAME = "relax-mn-pin"


def _pin_the_rollout_node(address: str, pin: bool = True) -> None:
    """A detached placement group holding PINNED_CPU of the rollout node (its resource), for the module's life;
    `pin=False` removes it (a node holding a detached group's bundle takes half a minute to stop)."""
    import ray
    from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group

    # a named group is found in the Ray namespace it was made in
    ray.init(address=address, include_dashboard=False, logging_level="WARNING", namespace="relax-multinode-test")
    try:
        if pin:
            pg = placement_group([{"CPU": PINNED_CPU, ROLLOUT_NODE: 1}], strategy="STRICT_PACK", lifetime="detached",
                                 name=PIN_NAME)
            assert pg.wait(60), "the rollout node's CPU could not be pinned"
        else:
            remove_placement_group(get_placement_group(PIN_NAME))
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def two_nodes():
    """The address of a running Ray cluster of two CPU nodes (and a head without CPUs) on this machine; this process
    joins it with token auth."""
    import ray

    if not _mount_namespaces():
        pytest.skip("needs mount namespaces (unshare --mount: CAP_SYS_ADMIN) to give each node its own /dev/shm")
    if ray.is_initialized():  # another test's local instance: a run joins the cluster only if none is running
        ray.shutdown()
    nodes = RayNodes()
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    pinned = False
    try:
        nodes.launch("--head", f"--node-ip-address={HEAD_IP}", f"--port={nodes.gcs_port}",
                     "--include-dashboard=false", f"--ray-client-server-port={nodes.port()}", name="head", cpus=0)
        nodes.wait("head")
        nodes.launch(f"--address={nodes.address}", f"--node-ip-address={TRAINER_IP}", name="trainer", cpus=1,
                     private_shm=True)
        nodes.launch(f"--address={nodes.address}", f"--node-ip-address={ROLLOUT_IP}",
                     f'--resources={{"{ROLLOUT_NODE}": 1}}', name="rollout", cpus=1, private_shm=True)
        nodes.wait("trainer")  # started at once, like the head's single worker before
        nodes.wait("rollout")
        os.environ["RAY_AUTH_MODE"] = "token"  # the driver sends the token (~/.ray/auth_token), as a user sets it
        os.environ.pop("RAY_ADDRESS", None)
        from ray._raylet import Config

        Config.initialize("")  # Ray caches its config: read RAY_AUTH_MODE again, as Ray does when it turns it on
        _pin_the_rollout_node(nodes.address)
        pinned = True
        yield nodes.address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if pinned:
            _pin_the_rollout_node(nodes.address, pin=False)
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

    def spy(actor, watch, process, **kwargs):
        push = actor_push(actor, watch, process, **kwargs)

        def recorded(weights, version, urls, target, regroup, senders=None):
            sent = push(weights, version, urls, target, regroup, senders)
            seen["pushes"].append({"version": version, "mode": target.mode, "urls": list(urls), **sent})
            return sent

        return recorded

    monkeypatch.setattr(engines_module, "actor_push", spy)
    return seen


def assert_apart(nodes: dict) -> tuple[dict, dict]:
    """The trainer's processes on one node, the rollout's on another, each where the fixture's placement puts it:
    (the actor's node, the rollout's)."""
    actor = nodes["actor"]
    rollout = [where for name, where in nodes.items() if name.startswith("rollout")]
    assert rollout, nodes
    trainer = {name: where["node"] for name, where in nodes.items() if not name.startswith("rollout")}
    assert set(trainer.values()) == {actor["node"]}, nodes
    assert all(where["node"] != actor["node"] for where in rollout), f"the rollout runs on the actor's node: {nodes}"
    assert actor["ip"] == TRAINER_IP and {where["ip"] for where in rollout} == {ROLLOUT_IP}, nodes
    return actor, rollout[0]


def _assert_nodes_share_no_files(ray) -> None:
    """A process on each node writes a file into its temporary directory and a shared-memory segment's file into
    /dev/shm; neither is there for the other node's processes (nor this driver's), and the temporary directories
    differ: whatever crosses nodes goes through a configured path (Ray's object store, a URL, the weight-update
    group), never a file or shared memory one node made."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def leave_and_look(tag: str) -> dict:
        import os
        import tempfile

        name = f"relax-mn-probe-{tag}"
        for directory in ("/dev/shm", tempfile.gettempdir()):
            open(os.path.join(directory, name), "w").close()
        return {"tmp": tempfile.gettempdir(),
                "shm": sorted(f for f in os.listdir("/dev/shm") if f.startswith("relax-mn-probe-")),
                "tmp_files": sorted(f for f in os.listdir(tempfile.gettempdir()) if f.startswith("relax-mn-probe-"))}

    ids = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
    seen = {}
    for tag, ip in (("trainer", TRAINER_IP), ("rollout", ROLLOUT_IP)):  # one after the other
        where = NodeAffinitySchedulingStrategy(node_id=ids[ip], soft=False)
        seen[tag] = ray.get(leave_and_look.options(scheduling_strategy=where).remote(tag), timeout=120)
    assert seen["trainer"]["tmp"] != seen["rollout"]["tmp"], seen
    for tag in seen:
        assert seen[tag]["shm"] == seen[tag]["tmp_files"] == [f"relax-mn-probe-{tag}"], seen
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("relax-mn-probe-")]


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
    rollout on different nodes, the same ones each time; the same plan packed onto one node (what a single-node
    assumption would do) fails `assert_apart`; the nodes share no temporary or shared-memory files; a plan that needs
    more nodes than the cluster has CPU nodes (the head has none) fails at once."""
    import ray

    from relax.runner.plan import SPREAD_STRATEGY as spread

    cfg = load_config(_cluster_options(two_nodes))
    plan = build_plan(cfg)
    ray.init(address=two_nodes, include_dashboard=False, logging_level="WARNING")
    try:
        cpus = {n["NodeManagerAddress"]: n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]}
        head = set(cpus) - {TRAINER_IP, ROLLOUT_IP}  # this machine's address (Ray resolves 127.0.0.1 to it)
        assert len(cpus) == 3 and len(head) == 1 and cpus[head.pop()] == 0, cpus
        assert cpus[TRAINER_IP] == cpus[ROLLOUT_IP] == 1, cpus

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

        assert_apart(start(plan))  # on the nodes the fixture's placement fixes
        packed = start(dataclasses.replace(plan, strategy="STRICT_PACK"))
        with pytest.raises(AssertionError, match="on the actor's node"):
            assert_apart(packed)
        _assert_nodes_share_no_files(ray)
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
    assert_apart(placed["nodes"])
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
