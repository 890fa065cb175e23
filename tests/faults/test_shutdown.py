"""The rollout engines' shutdown and the driver's wait on the actor that sends weights to SGLang servers (issue 44,
"Shutdown" and "Waits without an end"), with a real actor on the local Ray: one that hangs in its `push_weights`,
one that is dead when the run ends.

The servers are the embedded engine's SGLang-compatible server (in this process: the tiny model) behind the real
sglang-router; the actor is a real Ray actor with the actor role's weights thread (`WEIGHTS_GROUP`). Hangs are made
by an Event in the actor that the test sets, never by sleeping.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from relax.config import load_config
from relax.roles.workers import WEIGHTS_GROUP
from relax.runner.errors import RoleFailure, RunError
from relax.runner.rollout_driver.engines import started_engines
from relax.runner.rollout_driver.sglang_engines import actor_push
from relax.runner.watchdog import Watchdog

# a local Ray and the router: in the xdist group of tests/sglang/test_options.py, whose worker starts a local Ray for
# its own dead-actor test, so that one Ray serves both files
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("sglang_options")]

TINY = ["model=tiny", "model.dtype=float32"]


def _actor_class() -> type:
    """The actor's side of a weight push, shipped by value (its process imports nothing of the tests):
    `push_weights` hangs until `release` after `hang(True)`, else answers as a sender that sent one bucket (what it
    sends is not what these tests look at)."""
    import threading

    class Actor:
        def __init__(self) -> None:
            self.hanging, self.released = False, threading.Event()

        def ping(self) -> str:
            return "ok"

        def hang(self, on: bool) -> None:
            self.hanging = on
            self.released.clear()

        def release(self) -> None:
            self.released.set()

        def push_weights(self, weights: Any, version: int, urls: list[str], target: Any, regroup: bool) -> dict:
            if self.hanging:
                self.released.wait()  # a broadcast that never completes: the process keeps running
            return {"buckets": 1, "bytes": 0}

    return Actor


@pytest.fixture(scope="module")
def actors(ray_module) -> Iterator[SimpleNamespace]:
    """`actors.get()`: the module's live actor (one process for the tests, started at the first call, again after
    `actors.kill()`); `actors.kill()`: it dies (ray.kill)."""
    live: list[Any] = []

    def get() -> Any:
        if not live:
            actor = ray_module.remote(concurrency_groups={WEIGHTS_GROUP: 1})(_actor_class()).options(
                num_cpus=0).remote()
            assert ray_module.get(actor.ping.remote(), timeout=120) == "ok"
            live.append(actor)
        return live[0]

    def kill() -> None:
        ray_module.kill(live.pop())

    yield SimpleNamespace(get=get, kill=kill)
    for actor in live:
        ray_module.kill(actor)


def test_the_driver_waits_for_a_weight_push_at_most_request_timeout_s(actors, ray_module) -> None:
    """An actor alive and hung in its `push_weights` (it would keep beating: the heartbeats alone do not end the wait):
    the driver's wait ends after rollout.sglang.request_timeout_s with a RoleFailure of the actor that says what it
    waited for (the version, the servers) and for how long (the setting). Today's `actor_push` had no deadline: the
    wait lasted as long as the hang."""
    ray = ray_module
    actor = actors.get()
    ray.get(actor.hang.remote(True), timeout=60)
    push = actor_push(actor, Watchdog(None, None), "actor", timeout_s=2.0)
    t0 = time.monotonic()
    try:
        with pytest.raises(RoleFailure) as failure:
            push(ray.put({}), 3, ["http://127.0.0.1:1"], None, False)
        took = time.monotonic() - t0
        assert failure.value.role == "actor"
        message = str(failure.value)
        assert "did not finish within 2 s (rollout.sglang.request_timeout_s=2)" in message, message
        assert "sending the weights of version 3 to http://127.0.0.1:1" in message, message
        assert 2.0 <= took < 30, took  # the bound, then one poll of the watchdog
    finally:
        actor.release.remote()
        ray.get(actor.hang.remote(False), timeout=60)


@pytest.fixture(scope="module")
def user_server() -> Iterator[Any]:
    """A server the user started (`rollout.sglang.urls`): the embedded engine's SGLang-compatible server."""
    from relax.serve.sglang.server import EmbeddedServer

    server = EmbeddedServer(load_config(TINY), port=0, threads=1)
    server.start()
    server.wait_ready(120)
    yield server
    server.shutdown()


class _UserMistake(RunError):
    """The error that ends the run in the test (a RunError: the run stops, it is not restarted)."""


def test_a_dead_actor_at_shutdown_leaves_nothing_running_and_masks_nothing(user_server, actors, ray_module,
                                                                         tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    """Servers given by URL, colocated in sync mode: their memory is released after each rollout, and at the end the
    engines give it back with the last weights, which the actor sends. The actor is dead by then, so that push fails:
    the router is stopped all the same, the cluster's own exit (actors killed, placement group released) follows, the
    error that ended the run is the one that comes out (not a RoleFailure that would restart the graph), and a
    message names the servers left without their weights and why. Today `close()` raised at the push: the router
    kept running and the run's own error was replaced by the actor's."""
    cfg = load_config([*TINY, "rollout=sglang", f"rollout.sglang.urls=[{user_server.url}]",
                       "rollout.max_response_len=3", "rollout.sglang.request_timeout_s=60"])
    assert cfg.cluster.colocate and cfg.train.mode == "sync" and cfg.rollout.sglang.release_memory
    actor = actors.get()
    cluster = SimpleNamespace(  # what `started_engines` reads of a Cluster whose rollout is rollout.sglang.urls
        cfg=cfg, info=SimpleNamespace(eos_token_ids=tuple(user_server.eos_token_ids),
                                      pad_token_id=user_server.pad_token_id),
        plan=SimpleNamespace(rollout_in_actor=False, weight_senders=[0]), sglang_log_dir=tmp_path,
        rollout_replicas=[], actor=actor, watch=Watchdog(None, None), actor_process="actor",
        actor_ranks=[(actor, "actor")])
    exits: list[str] = []
    router: list[Any] = []  # the router's process
    with pytest.raises(_UserMistake), contextlib.ExitStack() as stack:
        stack.callback(exits.append, "cluster")  # Cluster.__exit__: after the engines are closed
        engines = stack.enter_context(started_engines(cluster))
        router.append(engines.router.proc)
        engines.load_weights(ray_module.put({}), 1)
        engines.generate([[1, 12, 13, 5]], torch.arange(cfg.rollout.n_samples_per_prompt), seed=1)
        assert engines._released  # colocated, sync mode: released after the rollout
        actors.kill()  # the actor dies; the run ends with an error of its own
        raise _UserMistake("a reward function failed")
    assert exits == ["cluster"]
    assert router[0].poll() is not None, "the router is still running"
    err = capsys.readouterr().err
    assert f"giving the servers at {user_server.url} (rollout.sglang.urls) their memory and the weights of version 1 " \
           "back" in err and "actor" in err and "every other step was done" in err, err
