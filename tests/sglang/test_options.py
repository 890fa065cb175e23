"""What each `rollout.sglang.*` option does, observed on the engine manager (`SGLangEngines`) driving a real
relax-serve process over HTTP, through the real router (the schema walk rejects these options outside rollout=sglang;
this file shows their effect inside it)."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests
import torch

from relax.config import load_config
from relax.data.tokenizer import load_tokenizer, stop_token_ids
from relax.metrics import WEIGHT_BUCKETS
from relax.models.hf import build_model
from relax.roles.sglang_server import server_command
from relax.rollout.sglang.client import EngineRequestError, GenerateClient
from relax.rollout.sglang.process import StartupError, start_process, start_server, wait_healthy
from relax.rollout.sglang.router import Router
from relax.runner.errors import RoleFailure, RunError
from relax.runner.rollout_driver.sglang_engines import SGLangEngines, actor_push
from relax.runner.watchdog import Watchdog

# its tests share module-scoped server: one xdist worker runs them in a row
pytestmark = [pytest.mark.xdist_group("sglang_options"), pytest.mark.slow]

# big enough for several 1 MiB buckets (about 8 MB in fp32)
MODEL = ["model=tiny", "model.dtype=float32", "model.hidden_size=256", "model.intermediate_size=1024",
         "model.head_dim=64"]


def config(url: str, *extra: str):
    return load_config([*MODEL, "rollout=sglang", f"rollout.sglang.urls=[{url}]", "rollout.sglang.bucket_mb=1",
                        "rollout.max_response_len=6", *extra])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One relax-serve for the module (the servers a run names in rollout.sglang.urls are started by the user),
    started with the command a run builds for its embedded servers (`server_command`)."""
    tmp = tmp_path_factory.mktemp("serve")
    embedded = load_config([*MODEL, "rollout=sglang", "rollout.sglang.server=embedded"])

    def command(port: int) -> list[str]:
        (tmp / "cfg.json").write_text(json.dumps(dataclasses.asdict(config(f"http://127.0.0.1:{port}"))))
        cmd = server_command(embedded, host="127.0.0.1", port=port, threads=1, config_path=tmp / "cfg.json")
        assert cmd[1:3] == ["-m", "relax.cli.serve"] and cmd[cmd.index("--threads") + 1] == "1"
        return cmd

    # start_server, as a run starts its servers: another port when the one picked free was taken before it was bound
    proc, port = start_server(command, host="127.0.0.1", url_host="127.0.0.1", log_path=tmp / "serve.log",
                              timeout_s=120, what="relax-serve")
    url = f"http://127.0.0.1:{port}"
    yield url, proc
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def weights(server):
    cfg = config(server[0])
    tok = load_tokenizer(cfg.model)
    states = [{k: v.detach().clone() for k, v in build_model(cfg.model, len(tok), tok.pad_token_id,
                                                             seed=cfg.seed + s).state_dict().items()}
              for s in (7, 8)]
    return states, stop_token_ids(cfg.model, tok), tok.pad_token_id


def engines_for(cfg, eos, pad, tmp_path: Path) -> SGLangEngines:
    return SGLangEngines(cfg, eos_token_ids=eos, pad_token_id=pad, log_dir=tmp_path, start_server=None).start()


PROMPTS = [[1, 12, 13, 5], [1, 7, 9]]
IDS = torch.arange(2 * 8)  # 2 prompts x n_samples_per_prompt (8)


def direct_generate(url: str) -> int:
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}}
    return requests.post(url + "/generate", json=body, timeout=60).status_code


@pytest.mark.parametrize("sync", ["tensor", "distributed"])
def test_weight_sync_modes_buckets_versions_and_memory_release(sync, server, weights, tmp_path):
    url, _ = server
    (start, state), eos, pad = weights
    engines = engines_for(config(url, f"rollout.sglang.weight_sync={sync}"), eos, pad, tmp_path)
    try:
        engines.load_weights(start, 4)  # a known start, whatever an earlier test left on the server
        first = engines.generate(PROMPTS, IDS, seed=3)
        assert first.response_ids.shape[0] == 16
        assert set(first.token_version[first.response_mask.bool()].tolist()) == {4}
        # colocated, sync mode: released after the rollout; the server refuses to generate until resumed
        assert direct_generate(url) == 400
        engines.load_weights(state, 5)
        assert engines.metrics()[WEIGHT_BUCKETS] > 1  # rollout.sglang.bucket_mb=1 splits 8 MB of weights
        second = engines.generate(PROMPTS, IDS, seed=3)
        assert second.weight_version == 5 and set(second.token_version[second.response_mask.bool()].tolist()) == {5}
        assert not torch.equal(first.rollout_logp, second.rollout_logp)
        again = engines.generate(PROMPTS, IDS, seed=3)  # released in between: resumed and given version 5 again
        assert torch.equal(again.response_ids, second.response_ids)
        # the server batches whatever arrives together: the same numbers up to float rounding of other batch shapes
        torch.testing.assert_close(again.rollout_logp, second.rollout_logp, atol=1e-5, rtol=0)
    finally:
        engines.close()


def test_release_memory_false_keeps_the_servers_resident(server, weights, tmp_path):
    url, _ = server
    (state, _), eos, pad = weights
    engines = engines_for(config(url, "rollout.sglang.release_memory=false"), eos, pad, tmp_path)
    try:
        engines.load_weights(state, 1)
        engines.generate(PROMPTS, IDS, seed=3)
        assert direct_generate(url) == 200
    finally:
        engines.close()


def test_the_sglang_command_follows_host_tp_and_extra_args(tmp_path):
    """SGLang's own server cannot start here (tests/gpu starts it): its command line, as a run builds it."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    cfg = load_config(["rollout=sglang", "cluster=8xgpu", "model=qwen3_0.6b", "model.source=hf",
                       f"model.path={tmp_path / 'm'}",
                       "cluster.colocate=false", "cluster.actor_gpus=4", "cluster.rollout_gpus=4",
                       "rollout.num_replicas=2", "cluster.rollout_gpus_per_engine=2", "rollout.sglang.host=0.0.0.0",
                       "rollout.sglang.extra_args=[--mem-fraction-static,0.5]"])
    cmd = server_command(cfg, host="0.0.0.0", port=1234, threads=None, config_path=tmp_path / "c.json")
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and cmd[-2:] == ["--mem-fraction-static", "0.5"]
    assert cmd[cmd.index("--tp-size") + 1] == "2" and cmd[cmd.index("--model-path") + 1] == str(tmp_path / "m")
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert "--enable-memory-saver" not in cmd  # not colocated: nothing to release
    # no remote code: the trainer does not run any either; the run's key when it has one
    assert "--trust-remote-code" not in cmd and "--api-key" not in cmd
    keyed = server_command(cfg, host="0.0.0.0", port=1234, threads=None, config_path=tmp_path / "c.json",
                           api_key="-k3y")
    # the key reaches SGLang through the environment (relax.rollout.sglang.keyed), never its command line
    assert keyed[1:4] == ["-m", "relax.rollout.sglang.keyed", "sglang.launch_server"] and keyed[4:] == cmd[3:]
    assert not any("k3y" in part for part in keyed)


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_the_router_starts_with_its_command_line_and_routes_to_the_server(policy, server, weights, tmp_path):
    """The real sglang-router, started with the command line `Router` builds (the policy among its arguments), takes
    the relax-serve server as its worker and answers /generate through it."""
    url, _ = server
    router = Router(host="127.0.0.1", policy=policy, log_path=tmp_path / "router.log", startup_timeout_s=60,
                    request_timeout_s=60)
    command = router.command(1234)
    assert command[command.index("--policy") + 1] == policy and command[command.index("--port") + 1] == "1234"
    router.start()
    try:
        router.add(url)
        assert [w["url"] for w in router.list()] == [url]
        engines = engines_for(config(url, "rollout.sglang.release_memory=false"), weights[1], weights[2], tmp_path)
        try:
            engines.load_weights(weights[0][0], 1)
        finally:
            engines.close()
        body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}}
        answer = requests.post(router.url + "/generate", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["output_ids"]) == 3
    finally:
        router.stop()


def test_a_port_taken_before_the_router_binds_it_is_replaced_by_another(tmp_path, monkeypatch):
    """Between choosing a free port and the server binding it, another process may take it: the router exits with
    "Address already in use" and starts again on another port."""
    from relax.rollout.sglang import process
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]
        real = process.free_port

        def chosen(host: str = "127.0.0.1") -> int:
            return ports.pop(0) if ports else real(host)

        monkeypatch.setattr(process, "free_port", chosen)
        router = Router(host="127.0.0.1", policy="round_robin", log_path=tmp_path / "router.log",
                        startup_timeout_s=60, request_timeout_s=10).start()
        try:
            assert router.port != taken.getsockname()[1] and not ports
            assert requests.get(router.url + "/health", timeout=10).status_code == 200
            assert "Address already in use" in (tmp_path / "router.log").read_text()
        finally:
            router.stop()


def _dying_actor():
    """An actor class that dies inside its `push_weights` call (shipped by value: its process imports nothing of
    ours)."""

    class Actor:
        def weights(self, version: int):
            return {}

        def push_weights(self, weights, version, urls, target, regroup):
            import os

            os._exit(1)

    return Actor


def test_an_actor_that_dies_while_its_weights_are_sent_restarts_the_graph(server, weights, ray_local, tmp_path):
    """The actor's process sends the weights (the run's `push`); an actor that dies doing so is a RoleFailure of the
    actor (the run restarts the service graph, as with the embedded engines), never a traceback that ends the run."""
    url, _ = server
    _, eos, pad = weights
    actor = ray_local.remote(_dying_actor()).options(num_cpus=0).remote()
    engines = SGLangEngines(config(url), eos_token_ids=eos, pad_token_id=pad, log_dir=tmp_path, start_server=None,
                            push=actor_push(actor, Watchdog(None, None), "actor", timeout_s=60)).start()
    try:
        with pytest.raises(RoleFailure, match="died") as failure:
            engines.load_weights(actor.weights.remote(2), 2)
        assert failure.value.role == "actor"
    finally:
        engines.close()


def test_request_timeout_bounds_the_retries(closed_port):
    client = GenerateClient(f"http://127.0.0.1:{closed_port()}", request_timeout_s=1.0)  # nobody listens
    t0 = time.monotonic()
    with pytest.raises(EngineRequestError, match="request_timeout_s"):
        client.generate([{"input_ids": [1, 2]}])
    assert 1.0 <= time.monotonic() - t0 < 10 and client.retries > 1


def test_startup_timeout_fails_with_the_servers_log(tmp_path, closed_port):
    proc = start_process([sys.executable, "-c", "print('loading forever', flush=True); import time; time.sleep(60)"],
                         tmp_path / "slow.log")
    try:
        with pytest.raises(StartupError, match="(?s)not healthy within 1 s.*loading forever"):
            wait_healthy(f"http://127.0.0.1:{closed_port()}/health", proc, 1.0, what="engine",
                         log_path=tmp_path / "slow.log")
    finally:
        proc.kill()


def test_a_given_server_that_dies_stops_the_run_with_its_url(weights, tmp_path):
    """Health checks every health_check_interval_s; after health_failures misses the server is declared dead, and
    one from rollout.sglang.urls cannot be restarted."""
    (state, _), eos, pad = weights
    health = ("rollout.sglang.health_check_interval_s=0.2", "rollout.sglang.health_failures=2")
    # --port 0: the server binds a port the kernel picks and prints its URL (a port picked free here could be taken by
    # another xdist worker's process before the server binds it); the config it serves names no URL it uses
    (tmp_path / "cfg.json").write_text(json.dumps(dataclasses.asdict(config("http://127.0.0.1:1", *health))))
    log = tmp_path / "serve.log"
    proc = start_process([sys.executable, "-m", "relax.cli.serve", "--port", "0", "--threads", "1",
                          "--config", str(tmp_path / "cfg.json")], log)
    engines = None
    try:
        deadline = time.monotonic() + 120
        while not (found := re.search(r"relax-serve: listening on (http://\S+)", log.read_text(errors="replace"))):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.1)
        url = found.group(1)
        cfg = config(url, *health)
        wait_healthy(url + "/health", proc, 120, what="relax-serve", log_path=log)
        engines = engines_for(cfg, eos, pad, tmp_path)
        engines.load_weights(state, 1)
        engines.generate(PROMPTS, IDS, seed=1)
        proc.kill()
        proc.wait()
        with pytest.raises(RunError, match=f"{url}.*cannot restart"):
            engines.generate(PROMPTS, IDS, seed=1)
    finally:
        if proc.poll() is None:
            proc.kill()
        if engines is not None:
            engines.close()


def test_a_server_that_exits_at_start_names_its_exit_code(tmp_path, closed_port):
    proc = start_process([sys.executable, "-c", "raise SystemExit('bad model directory')"], tmp_path / "bad.log")
    with pytest.raises(StartupError, match="(?s)exited with code 1.*bad model directory"):
        wait_healthy(f"http://127.0.0.1:{closed_port()}/health", proc, 30, what="engine", log_path=tmp_path / "bad.log")
    assert proc.wait() == 1 and isinstance(proc, subprocess.Popen)


def test_a_paused_server_keeps_its_place_though_its_health_check_fails(server, weights, tmp_path, monkeypatch):
    """SGLang's /health generates a token, so it fails while generation is paused (partial rollout) or weights load,
    and relax-serve's does the same. The watchdog then checks that the server answers at all, instead of replacing a
    healthy server (this one is given by URL: a replacement would stop the run)."""
    import threading

    url, _ = server
    (state, _), eos, pad = weights
    cfg = config(url, "rollout.sglang.health_check_interval_s=0.2", "rollout.sglang.health_failures=2",
                 "rollout.max_response_len=200", "rollout.sglang.release_memory=false")
    engines = engines_for(cfg, eos, pad, tmp_path)
    try:
        engines.load_weights(state, 1)
        done = []
        job = threading.Thread(target=lambda: done.append(engines.generate(PROMPTS, IDS, seed=5, gen_id=7)))
        job.start()
        deadline = time.monotonic() + 60
        while engines._gen != 7 and time.monotonic() < deadline:  # the job's requests are out
            time.sleep(0.01)
        engines.abort(7)  # partial rollout's pause: the servers hold generation until the next weight update
        job.join(60)
        assert done and requests.get(url + "/health", timeout=10).status_code == 503  # paused: no token comes
        # three times health_failures (2) checks of the paused server by the watchdog, counted where it makes them:
        # had each been a miss, the server would have been replaced (and, given by URL, the run stopped) twice by now
        checks, alive = threading.Semaphore(0), engines._alive

        def counted(i: int, u: str) -> bool:
            answer = alive(i, u)
            checks.release()
            return answer

        monkeypatch.setattr(engines, "_alive", counted)
        for _ in range(3 * 2):
            assert checks.acquire(timeout=60), "the watchdog stopped checking the server"
        assert engines._failed is None and engines.restarts == 0
        engines.load_weights(state, 2)  # continues generation
        assert requests.get(url + "/health", timeout=10).status_code == 200
        assert engines.generate(PROMPTS, IDS, seed=5).weight_version == 2
    finally:
        engines.close()



def test_an_abort_also_stops_requests_that_reach_the_servers_after_they_paused(server, weights, tmp_path,
                                                                            monkeypatch):
    """Requests still on their way when generation is aborted reach a paused server, which holds them until the
    next weight update: the abort aborts again until every request sent has its answer, so the aborted generation
    returns (partial rollout then loads the new weights). Here every request takes a second to leave the client."""
    import asyncio
    import threading

    import aiohttp

    url, _ = server
    (state, _), eos, pad = weights
    cfg = config(url, "rollout.max_response_len=200", "rollout.sglang.release_memory=false")
    engines = engines_for(cfg, eos, pad, tmp_path)
    post = aiohttp.ClientSession.post

    class Late:
        def __init__(self, request):
            self.request = request

        async def __aenter__(self):
            await asyncio.sleep(1.0)
            return await self.request.__aenter__()

        async def __aexit__(self, *exc):
            return await self.request.__aexit__(*exc)

    try:
        engines.load_weights(state, 1)
        monkeypatch.setattr(aiohttp.ClientSession, "post", lambda *a, **kw: Late(post(*a, **kw)))
        done = []
        job = threading.Thread(target=lambda: done.append(engines.generate(PROMPTS, IDS, seed=5, gen_id=7)))
        job.start()
        deadline = time.monotonic() + 60
        while engines.client._posting < len(IDS):  # every request on its way, none at the server yet
            assert time.monotonic() < deadline
            time.sleep(0.01)
        engines.abort(7)
        job.join(30)
        assert done, "the aborted generation did not return: its late requests wait at the paused server"
        assert done[0].finish_reason == ["abort"] * len(IDS)
    finally:
        monkeypatch.undo()
        engines.close()

def test_a_launched_server_requires_the_runs_key(tmp_path):
    """The servers a run launches get its key (relax-serve through its environment, SGLang as --api-key): every
    request but health and information must carry it, so that nothing else that reaches them can generate, pause or
    change their weights (the run's own requests carry it: every rollout=sglang run test goes through it)."""
    from relax.roles.sglang_server import EngineServer

    cfg = load_config([*MODEL, "rollout=sglang", "rollout.sglang.server=embedded"])
    server = EngineServer(cfg, 0, threads=1, log_dir=str(tmp_path))
    try:
        url = server.start(api_key="k3y")
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
        assert requests.get(url + "/health", timeout=60).status_code == 200
        assert requests.post(url + "/generate", json=body, timeout=60).status_code == 401
        assert requests.post(url + "/pause_generation", json={}, timeout=60).status_code == 401
        ok = requests.post(url + "/generate", json=body, timeout=60, headers={"Authorization": "Bearer k3y"})
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 1
        assert "k3y" not in " ".join(psutil.Process(server.pid()).cmdline())  # not in the process list
    finally:
        server.stop()
