"""SGLang protocol details the embedded server (`relax-serve`) missed, checked over real HTTP, and through the real
`sglang-router` where a framework sends them so (slime's external-engine check, verl's batched requests):

- `GET /v1/models/{model}`: the served model's card; another name is OpenAI's 404.
- `/get_server_info` carries the ServerArgs keys slime compares with its own: `enable_memory_saver` as the run's
  SGLang command line has it (`--enable-memory-saver` only when colocated; without it `/release_memory_occupation`
  is refused, as SGLang's memory-saver adapter refuses it), `random_seed` (the run's seed, SGLang's `--random-seed`),
  `skip_tokenizer_init` false.
- A streamed `/generate` with `return_logprob` carries the log-probs of the tokens so far in every event, as
  SGLang's tokenizer manager writes them (cumulative, like output_ids), not only in its last event.
- A batch that gives one rid to two inputs, or different `n` to its inputs, is a 400, as SGLang's request
  validation answers it.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest
import requests

pytestmark = pytest.mark.slow  # starts an HTTP server (and the router)

PROMPT = [1, 12, 13, 5]
OVERRIDES = ["model=tiny", "model.dtype=float32", "model.max_position_embeddings=4096"]


def _server(overrides: list[str], colocate: bool = True):
    import dataclasses

    from relax.config import load_config
    from relax.serve.sglang.server import EmbeddedServer

    cfg = load_config(overrides)
    if not colocate:  # a GPU run's server with its own GPU (validation refuses colocate=false on a CPU cluster)
        cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, colocate=False))
    server = EmbeddedServer(cfg, host="127.0.0.1", port=0, threads=1)
    server.start()
    server.wait_ready(120)
    return cfg, server


@pytest.fixture(scope="module")
def served():
    cfg, server = _server(OVERRIDES)
    yield cfg, server
    server.shutdown()


def post(url: str, path: str, body: dict, **kw) -> requests.Response:
    return requests.post(f"{url}{path}", json=body, timeout=120, **kw)


def events_of(response: requests.Response, on_event=None) -> list:
    """The `data:` events of a streamed answer (JSON, the last one "[DONE]"); `on_event(event)` as each arrives."""
    out = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith(b"data: "), line
        data = line[len(b"data: "):].decode()
        event = data if data == "[DONE]" else json.loads(data)
        out.append(event)
        if on_event is not None:
            on_event(event)
    return out


# ------------------------------------------------------------------------------------------------ /v1/models/{id}


def test_v1_models_by_id_is_the_served_models_card_and_404_for_another(served):
    _, server = served
    listed = requests.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]
    # `root` the served name, as SGLang's (root=served_model_name), not the server's model directory
    assert listed["root"] == listed["id"] == server.served_model_name, listed
    one = requests.get(f"{server.url}/v1/models/{listed['id']}", timeout=30)
    assert one.status_code == 200 and one.json() == listed
    other = requests.get(f"{server.url}/v1/models/no-such-model", timeout=30)
    assert other.status_code == 404
    error = other.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model" and "no-such-model" in error["message"]


# ------------------------------------------------------------------------------------------------- server args


def _sglang_command(cfg, monkeypatch, tmp_path) -> list[str]:
    """The real SGLang command line a Relax run starts for `cfg` (what slime's engine would have been given; the
    model's path stands in: nothing is read)."""
    import dataclasses

    from relax.roles import sglang_server
    from relax.roles.sglang_server import server_command

    monkeypatch.setattr(sglang_server, "resolve_model_path", lambda model: tmp_path)

    sg = dataclasses.replace(cfg.rollout.sglang, server="sglang")
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, sglang=sg))
    return server_command(cfg, host="127.0.0.1", port=1, threads=None, config_path="/nonexistent/config.json")


def test_server_info_has_the_server_args_slime_compares_as_the_runs_sglang_would(served, monkeypatch, tmp_path):
    cfg, server = served
    info = requests.get(f"{server.url}/get_server_info", timeout=30).json()
    cmd = _sglang_command(cfg, monkeypatch, tmp_path)
    assert cfg.cluster.colocate and "--enable-memory-saver" in cmd
    assert info["enable_memory_saver"] is True
    assert info["random_seed"] == cfg.seed and cmd[cmd.index("--random-seed") + 1] == str(cfg.seed)
    assert info["skip_tokenizer_init"] is False
    assert {k: info[k] for k in ("tp_size", "dp_size", "pp_size", "ep_size", "nnodes")} == dict.fromkeys(
        ("tp_size", "dp_size", "pp_size", "ep_size", "nnodes"), 1)


def test_a_server_of_a_run_that_is_not_colocated_has_no_memory_saver_and_refuses_release(monkeypatch, tmp_path):
    cfg, server = _server([*OVERRIDES, "seed=5"], colocate=False)
    try:
        info = requests.get(f"{server.url}/get_server_info", timeout=30).json()
        assert "--enable-memory-saver" not in _sglang_command(cfg, monkeypatch, tmp_path)
        assert info["enable_memory_saver"] is False and info["random_seed"] == 5
        r = post(server.url, "/release_memory_occupation", {})
        assert r.status_code == 400 and "enable-memory-saver" in r.json()["message"]
        assert post(server.url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
                    ).status_code == 200  # nothing was released
    finally:
        server.shutdown()


# ------------------------------------------------------------------------------------------ streamed log-probs


def test_a_streamed_generate_with_return_logprob_sends_the_logprobs_so_far_in_every_event(served, monkeypatch):
    """The engine is held after its 4th token until the client has read an event (a barrier, not a sleep), so the
    stream has events before its last; each carries the log-probs of its tokens, the prefix of the final ones, and
    the final answer is the unstreamed one."""
    from relax.serve.sglang import scheduler

    _, server = served
    seen_progress = threading.Event()
    original = scheduler._Watch.turn_logps

    def held(self, logps):
        if len(self.row.tokens) + len(self.row.live) == 4 and self.row.request.stream:
            assert seen_progress.wait(60), "no event reached the client while the engine was held"
        original(self, logps)

    monkeypatch.setattr(scheduler._Watch, "turn_logps", held)
    sp = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 17}
    body = {"input_ids": PROMPT, "sampling_params": sp, "return_logprob": True}
    plain = post(server.url, "/generate", body).json()

    def on_event(event):
        if isinstance(event, dict) and event["meta_info"]["finish_reason"] is None:
            seen_progress.set()

    events = events_of(post(server.url, "/generate", {**body, "stream": True}, stream=True), on_event)
    assert events[-1] == "[DONE]"
    final, progress = events[-2], events[:-2]
    assert progress, "no event before the last"
    assert final["output_ids"] == plain["output_ids"]
    assert [p[0] for p in final["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [p[0] for p in plain["meta_info"]["output_token_logprobs"]], abs=1e-6)
    for event in progress:
        meta = event["meta_info"]
        n = len(event["output_ids"])
        assert meta["finish_reason"] is None and 0 < n <= len(final["output_ids"])
        assert [p[1] for p in meta["output_token_logprobs"]] == event["output_ids"]
        assert meta["output_token_logprobs"] == final["meta_info"]["output_token_logprobs"][:n]
        assert meta["input_token_logprobs"] == final["meta_info"]["input_token_logprobs"]


# ------------------------------------------------------------------------------------------ batch validation


def test_duplicate_rids_and_different_n_in_one_batch_answer_400(served):
    _, server = served
    two = [PROMPT, [1, 7, 8]]
    sp = {"max_new_tokens": 2, "temperature": 0}
    r = post(server.url, "/generate", {"input_ids": two, "sampling_params": sp, "rid": ["same", "same"]})
    assert r.status_code == 400 and "duplicate" in r.text and "same" in r.text
    r = post(server.url, "/generate", {"input_ids": two, "sampling_params": [{**sp, "n": 1}, {**sp, "n": 2}]})
    assert r.status_code == 400 and "n differs" in r.text
    # the controls: distinct rids, one n for every input
    ok = post(server.url, "/generate", {"input_ids": two, "sampling_params": [{**sp, "n": 2}, {**sp, "n": 2}],
                                        "rid": ["r1", "r2"]})
    assert ok.status_code == 200 and len(ok.json()) == 4


# -------------------------------------------------------------------------------------------- through the router


def test_through_the_real_router_streamed_events_carry_their_logprobs(served, tmp_path):
    """A slime-style streamed request with return_logprob through sglang-router: every event the router passes on
    carries the log-probs of its tokens."""
    from relax.rollout.sglang.process import free_port, start_server, stop_process

    _, server = served
    log = tmp_path / "router.log"
    # start_server: another port when the one picked free was taken before the router bound it
    proc, port = start_server(lambda port: [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                            "--port", str(port), "--policy", "round_robin", "--log-level", "warn",
                                            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                              host="127.0.0.1", url_host="127.0.0.1", log_path=log, timeout_s=60,
                              what="sglang-router")
    router = f"http://127.0.0.1:{port}"
    try:
        assert post(router, "/workers", {"url": server.url}).status_code in (200, 202)
        sp = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 3}
        body = {"input_ids": PROMPT, "sampling_params": sp, "return_logprob": True}
        deadline = time.monotonic() + 30
        while (r := post(router, "/generate", body)).status_code != 200:  # until the worker is registered
            assert time.monotonic() < deadline, f"{r.status_code} {r.text}\n{log.read_text()[-2000:]}"
            time.sleep(0.1)
        events = events_of(post(router, "/generate", {**body, "stream": True}, stream=True))
        assert events[-1] == "[DONE]" and events[-2]["output_ids"] == r.json()["output_ids"]
        for event in events[:-1]:
            assert len(event["meta_info"]["output_token_logprobs"]) == len(event["output_ids"])
    finally:
        stop_process(proc)


# ------------------------------------------------------------------------------------------- pause and continue


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_pause_at_a_token_keeps_the_running_request_and_continue_finishes_it(served, monkeypatch, mode):
    """The pause lands while the engine draws the request's 5th token (a hook there waits until the pause has
    interrupted the engine: no sleep); the request is kept, as SGLang keeps it: retract moves it back to the waiting
    queue (flush_cache may run), in_place keeps it in the running batch (counted running; flush_cache fails while it
    is there); after a weight-version update and /continue_generation it finishes with the tokens it would have drawn
    unpaused, under the new version."""
    from relax.serve.sglang import scheduler

    _, server = served
    reached, original = threading.Event(), scheduler._Watch.turn_end

    def hook(self, tokens, stop_token, context):
        if self.row.options.stop == ("<never>",) and len(self.row.tokens) + len(self.row.live) == 4:
            reached.set()
            deadline = time.monotonic() + 60
            with server.scheduler.cv:  # on once the pause asked the engine to stop (after this token)
                while not server.scheduler._interrupt:  # the pause sets it under cv without a notify
                    assert time.monotonic() < deadline, "the pause never interrupted the engine"
                    server.scheduler.cv.wait(0.01)
        return original(self, tokens, stop_token, context)

    monkeypatch.setattr(scheduler._Watch, "turn_end", hook)
    sp = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 29, "stop": ["<never>"]}
    body = {"input_ids": PROMPT, "sampling_params": sp, "return_logprob": True}
    reference = post(server.url, "/generate", {**body, "sampling_params": {**sp, "stop": None}}).json()
    answer: dict = {}
    thread = threading.Thread(target=lambda: answer.update(r=post(server.url, "/generate", body)))
    thread.start()
    try:
        assert reached.wait(60)
        assert post(server.url, "/pause_generation", {"mode": mode}).status_code == 200
        state = requests.get(f"{server.url}/get_server_info", timeout=30).json()["internal_states"][0]
        load = requests.get(f"{server.url}/v1/loads", timeout=30).json()
        assert state["#running-rows"] == 0 and "r" not in answer  # no engine call runs
        flush = requests.post(f"{server.url}/flush_cache", timeout=30)
        rank = load["loads"][0]
        if mode == "retract":
            assert (state["#queue-req"], state["#running-req"]) == (1, 0) and flush.status_code == 200
            assert (rank["num_waiting_reqs"], rank["num_running_reqs"]) == (1, 0)
        else:
            assert (state["#queue-req"], state["#running-req"]) == (0, 1) and flush.status_code == 400
            assert (rank["num_waiting_reqs"], rank["num_running_reqs"]) == (0, 1)
        assert post(server.url, "/update_weight_version", {"new_version": f"after-{mode}"}).status_code == 200
        assert "r" not in answer, "the paused request was answered"
    finally:
        assert post(server.url, "/continue_generation", {}).status_code == 200
        thread.join(60)
    out = answer["r"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["output_ids"] == reference["output_ids"]
    assert [p[0] for p in out["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [p[0] for p in reference["meta_info"]["output_token_logprobs"]], abs=1e-5)
    assert out["meta_info"]["weight_version"] == f"after-{mode}"
