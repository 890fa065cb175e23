"""SGLang's HTTP protocol, checked against a running server: by default Relax's embedded server (`relax-serve`,
started here on the tiny model), or any server at $SGLANG_URL, for example a real SGLang:

    python -m sglang.launch_server --model-path /models/Qwen3-0.6B --port 30000 --host 127.0.0.1
    SGLANG_URL=http://127.0.0.1:30000 pytest tests/sglang/test_conformance.py

Against $SGLANG_URL the tests that need to know the model or the embedded server's internals are skipped: health
while loading, log-probs against the trainer's, the weight updates (they load the tiny model's weights and compare
log-probs with a local copy), memory release, a retracted request's queue state, the CLI and its config file, and
the embedded server's own choices (n>1 samples with one sampling_seed differ, ignore_eos disables stop_token_ids,
unsupported fields answer 400). The rest (shapes, finish reasons, stop tokens and strings, greedy and seeded
determinism, streaming, pause/abort/continue, abort by rid, flush_cache, /get_load and /v1/loads, the router) runs
against either; where it waits for the embedded server's queue state it sleeps instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from relax.rollout.sglang import wire

# its tests share module-scoped servers: one xdist worker runs them in a row
pytestmark = [pytest.mark.xdist_group("sglang_conformance"), pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = ["model=tiny", "model.dtype=float32", "model.max_position_embeddings=4096"]
EXTERNAL = os.environ.get("SGLANG_URL")
embedded_only = pytest.mark.skipif(bool(EXTERNAL), reason="needs the embedded server (knows its model)")
PROMPT = [1, 12, 13, 5]  # token ids >= 1 (0 is the tiny model's pad token)
LONG = 3000  # max_new_tokens of a request that runs long enough to be aborted (seconds on CPU)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


@contextlib.contextmanager
def relax_serve(log_dir: Path, overrides: list[str]) -> Iterator[str]:
    """`relax-serve` (the CLI, in its own process, one thread) with `overrides`, answering: its URL; stopped after."""
    log = log_dir / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "relax.cli.serve", "--port", "0", "--threads", "1",
                                 *overrides], stdout=out, stderr=subprocess.STDOUT, env=env(), cwd=REPO)
    try:
        yield listening_url(proc, log, 120)
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def listening_url(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    """The URL a relax-serve started with `--port 0` prints once it answers. (A port picked free here and bound by the
    server seconds later, after its imports, could be taken in between by another xdist worker's server.)"""
    deadline = time.monotonic() + timeout
    while not (found := re.search(r"relax-serve: listening on (http://\S+)", log.read_text())):
        if proc.poll() is not None:
            pytest.fail(f"{proc.args[:4]} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"relax-serve not listening within {timeout} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return found.group(1)


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{proc.args[:4]} exited with {proc.returncode}:\n{log.read_text()[-3000:] if log else ''}")
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    pytest.fail(f"{url} not healthy within {timeout} s:\n{log.read_text()[-3000:] if log else ''}")


@pytest.fixture(scope="module")
def cfg():
    from relax.config import load_config

    return load_config(OVERRIDES)


@pytest.fixture(scope="module")
def launched(cfg, tmp_path_factory):
    """relax-serve started from the resolved config as JSON on a port it picks (not waited for): (process, log);
    None against $SGLANG_URL."""
    if EXTERNAL:
        yield None
        return
    tmp = tmp_path_factory.mktemp("serve")
    config = tmp / "config.json"
    config.write_text(json.dumps(dataclasses.asdict(cfg)))
    log = tmp / "serve.log"
    with open(log, "w") as out:
        # --weight-dir: the tests' temporary directories are this job's (/update_weights_from_disk loads from them)
        proc = subprocess.Popen([sys.executable, "-m", "relax.cli.serve", "--port", "0", "--threads", "1",
                                 "--config", str(config), "--weight-dir", str(tmp_path_factory.getbasetemp())],
                                stdout=out, stderr=subprocess.STDOUT, env=env(), cwd=REPO)
    try:
        yield proc, log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert "relax-serve: listening on" in log.read_text()


@pytest.fixture(scope="module")
def url(launched):
    """The server under test, healthy: $SGLANG_URL or the launched relax-serve."""
    if EXTERNAL:
        return EXTERNAL.rstrip("/")
    proc, log = launched
    return listening_url(proc, log, 120)


@pytest.fixture(scope="module")
def models(cfg):
    """Local copies of the served model: its initial weights, and other weights (another seed) to load."""
    from relax.data.tokenizer import load_tokenizer, stop_token_ids
    from relax.models.hf import build_model

    tok = load_tokenizer(cfg.model)
    build = lambda seed: build_model(cfg.model, len(tok), tok.pad_token_id, seed=seed).eval()  # noqa: E731
    return {"initial": build(cfg.seed), "other": build(cfg.seed + 1), "eos": stop_token_ids(cfg.model, tok)}


def post(url: str, path: str, body: dict | None = None, timeout: float = 120) -> requests.Response:
    return requests.post(f"{url}{path}", json=body or {}, timeout=timeout)


def generate(url: str, input_ids, timeout: float = 120, **kw) -> dict | list:
    r = post(url, "/generate", {"input_ids": input_ids, **kw}, timeout)
    assert r.status_code == 200, r.text
    return r.json()


def greedy(url: str, prompt=PROMPT, n: int = 8, **kw) -> list[int]:
    sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    return generate(url, prompt, sampling_params=sp, **kw)["output_ids"]


def state(url: str) -> dict:
    return requests.get(f"{url}/get_server_info", timeout=10).json()["internal_states"][0]


def wait_for(url: str, predicate, timeout: float = 30) -> None:
    """Until the embedded server's state satisfies `predicate` (against another server: a fixed pause)."""
    if EXTERNAL:
        time.sleep(1.0)
        return
    deadline = time.monotonic() + timeout
    while not predicate(state(url)):
        assert time.monotonic() < deadline, f"server state never matched: {state(url)}"
        time.sleep(0.01)


def in_thread(fn, *args, **kw):
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(fn, *args, **kw)
    pool.shutdown(wait=False)
    return future


@torch.no_grad()
def trainer_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    from relax.models.hf import token_logprobs

    ids = torch.tensor([prompt + response])
    return token_logprobs(model, ids, torch.ones_like(ids), len(prompt), len(response), temperature=temperature)[0]


@torch.no_grad()
def every_next_logprob(model, context: list[int], vocab: int, temperature: float) -> list[float]:
    """The trainer's log-prob of each of the first `vocab` tokens after `context`, by brute force: every token scored
    as a one-token response (`trainer_logprobs`' code), all of them as one batch."""
    from relax.models.hf import token_logprobs

    ids = torch.tensor([context + [v] for v in range(vocab)])
    return token_logprobs(model, ids, torch.ones_like(ids), len(context), 1, temperature=temperature)[:, 0].tolist()


@torch.no_grad()
def direct_logprobs(model, ids: list[int], temperature: float) -> torch.Tensor:
    """[len(ids), V]: log-softmax of the model's logits at each position (row k: the distribution of token k+1)."""
    return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float() / temperature, dim=-1)


def stream(url: str, body: dict, timeout: float = 120) -> list:
    """The events of `body` sent with stream=true: the JSON of each `data:` line, the last one "[DONE]"."""
    r = requests.post(f"{url}/generate", json={**body, "stream": True}, stream=True, timeout=timeout)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream"), r.text
    events = []
    for line in r.iter_lines():
        if line:
            assert line.startswith(b"data: "), line
            data = line[len(b"data: "):].decode()
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_same_answer(a: dict, b: dict) -> None:
    """Two answers are equal but for their ids and latencies (log-probs to 1e-5)."""
    skip = ("id", "e2e_latency", "output_token_logprobs")
    assert (a["text"], a["output_ids"]) == (b["text"], b["output_ids"])
    assert {k: v for k, v in a["meta_info"].items() if k not in skip} == \
        {k: v for k, v in b["meta_info"].items() if k not in skip}
    assert ("output_token_logprobs" in a["meta_info"]) == ("output_token_logprobs" in b["meta_info"])
    if "output_token_logprobs" in b["meta_info"]:
        assert logps(a) == pytest.approx(logps(b), abs=1e-5)


def logps(answer: dict) -> list[float]:
    return [p[0] for p in answer["meta_info"]["output_token_logprobs"]]


def served_by(url: str, model, other) -> bool:
    """Whether the server's log-probs of a seeded sample are `model`'s (and not `other`'s)."""
    out = generate(url, PROMPT, sampling_params={"max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 8},
                   return_logprob=True)
    mine = trainer_logprobs(model, PROMPT, out["output_ids"], 1.0)
    theirs = trainer_logprobs(other, PROMPT, out["output_ids"], 1.0)
    assert (mine - theirs).abs().max() > 1e-2, "the two models must differ"
    return bool(torch.allclose(torch.tensor(logps(out)), mine, atol=1e-4))


# ---------------------------------------------------------------------------------------------------- health, info


@embedded_only
def test_health_is_503_while_the_model_loads_then_200(cfg, monkeypatch, launched):
    """In process (relax-serve starts meanwhile): loading is held until /health answered 503."""
    from relax.serve.sglang.server import EmbeddedServer

    gate = threading.Event()
    build = EmbeddedServer._build
    monkeypatch.setattr(EmbeddedServer, "_build", lambda self: (gate.wait(30), build(self)))
    server = EmbeddedServer(cfg, port=0)
    server.start()
    try:
        for path in ("/health", "/health_generate"):
            assert requests.get(server.url + path, timeout=5).status_code == 503
        assert post(server.url, "/generate", {"input_ids": PROMPT}).status_code == 503
        gate.set()
        server.wait_ready(60)
        for path in ("/health", "/health_generate"):
            assert requests.get(server.url + path, timeout=30).status_code == 200
    finally:
        gate.set()
        server.shutdown()


def test_info_endpoints(url):
    assert requests.get(f"{url}/health", timeout=10).status_code == 200
    assert requests.get(f"{url}/health_generate", timeout=30).status_code == 200
    for path in ("/get_model_info", "/model_info"):
        info = requests.get(url + path, timeout=10).json()
        assert info["is_generation"] is True and {"model_path", "tokenizer_path", "weight_version"} <= set(info)
    for path in ("/get_server_info", "/server_info"):
        info = requests.get(url + path, timeout=10).json()
        assert {"model_path", "weight_version", "tp_size", "dp_size", "pp_size", "ep_size"} <= set(info)
    assert "weight_version" in requests.get(f"{url}/get_weight_version", timeout=10).json()


@embedded_only
def test_server_info_has_the_server_args_slime_compares_for_an_external_engine(url):
    """slime's _init_external asserts these of /get_server_info equal what it would launch SGLang with."""
    info = requests.get(f"{url}/get_server_info", timeout=10).json()
    assert {k: info[k] for k in ("tp_size", "dp_size", "pp_size", "ep_size", "nnodes", "node_rank", "gpu_id_step",
                                 "base_gpu_id")} == {"tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1,
                                                     "nnodes": 1, "node_rank": 0, "gpu_id_step": 1, "base_gpu_id": 0}
    assert info["enable_memory_saver"] is True and info["disaggregation_mode"] == "null"


# -------------------------------------------------------------------------------------------------------- generate


def test_answer_shapes_single_batch_and_n(url):
    one = generate(url, PROMPT, sampling_params={"max_new_tokens": 4}, return_logprob=True)
    assert isinstance(one, dict) and {"text", "output_ids", "meta_info"} <= set(one)
    meta = one["meta_info"]
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == len(one["output_ids"])
    assert {"id", "finish_reason", "cached_tokens", "weight_version", "e2e_latency"} <= set(meta)
    pairs = meta["output_token_logprobs"]
    assert [p[1] for p in pairs] == one["output_ids"] and all(p[0] <= 0 for p in pairs)

    batch = generate(url, [PROMPT, PROMPT[:2]], sampling_params={"max_new_tokens": 3})
    assert isinstance(batch, list) and [b["meta_info"]["prompt_tokens"] for b in batch] == [4, 2]
    n3 = generate(url, PROMPT, sampling_params={"max_new_tokens": 3, "n": 3})
    assert isinstance(n3, list) and len(n3) == 3
    both = generate(url, [PROMPT, PROMPT[:2]], sampling_params={"max_new_tokens": 3, "n": 2})
    assert [b["meta_info"]["prompt_tokens"] for b in both] == [4, 4, 2, 2]  # an input's samples consecutive


def test_unknown_fields_are_ignored(url):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "model": "whatever", "log_metrics": False,
            "return_text_in_logprobs": True, "stream": False, "something_new": {"a": 1}}
    r = post(url, "/generate", body)
    assert r.status_code == 200, r.text


def test_max_new_tokens_and_finish_reason_length(url):
    out = generate(url, PROMPT, sampling_params={"max_new_tokens": 5, "ignore_eos": True})
    assert len(out["output_ids"]) == 5
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


def test_stop_token_ids_end_the_output_with_the_stop_token(url):
    sp = {"max_new_tokens": 12, "sampling_seed": 21, "no_stop_trim": True}
    free = generate(url, PROMPT, sampling_params={**sp, "ignore_eos": True})["output_ids"]  # no stop at all
    stop = free[3]
    j = free.index(stop)
    out = generate(url, PROMPT, sampling_params={**sp, "stop_token_ids": [stop]})
    got, finish = out["output_ids"], out["meta_info"]["finish_reason"]
    assert 1 <= len(got) <= j + 1 and got == free[: len(got)]  # the model's own EOS may come first
    assert finish == {"type": "stop", "matched": got[-1]}
    if len(got) == j + 1:
        assert got[-1] == stop


def test_stop_strings_cut_the_output_after_the_token_that_completes_them(url):
    """A stop string ends a sample at the token that completes it (a prefix of the same sample without it, in one
    batch with a sample without stop strings); the text leaves it out unless no_stop_trim."""
    sp = {"max_new_tokens": 24, "sampling_seed": 3, "ignore_eos": True}
    free = generate(url, PROMPT, sampling_params=sp, return_logprob=True, return_text_in_logprobs=True)
    pieces = [p[2] for p in free["meta_info"]["output_token_logprobs"]]
    j = next(j for j in range(2, len(pieces) - 1) if (pieces[j] + pieces[j + 1]).strip()
             and pieces[j] + pieces[j + 1] not in "".join(pieces[:j + 1])
             and not any(p.startswith("<") for p in pieces[:j + 2]))  # a 2-token stop string, first completed at j+1
    stop = pieces[j] + pieces[j + 1]
    both = generate(url, [PROMPT, PROMPT], sampling_params=[{**sp, "stop": ["never in it", stop]}, sp],
                    return_logprob=True)
    cut = both[0]
    assert cut["output_ids"] == free["output_ids"][:j + 2]
    assert logps(cut) == pytest.approx(logps(free)[:j + 2], abs=1e-5)
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == "".join(pieces[:j]) and free["text"].startswith("".join(pieces[:j + 2]))
    assert both[1]["output_ids"] == free["output_ids"]  # its batch neighbour: unchanged
    kept = generate(url, PROMPT, sampling_params={**sp, "stop": stop, "no_stop_trim": True})
    assert kept["output_ids"] == cut["output_ids"] and kept["text"] == "".join(pieces[:j + 2])
    at_limit = generate(url, PROMPT, sampling_params={**sp, "stop": stop, "max_new_tokens": j + 2})
    assert at_limit["meta_info"]["finish_reason"] == {"type": "length", "length": j + 2}  # SGLang: the limit first
    assert at_limit["text"] == "".join(pieces[:j + 2])
    never = generate(url, PROMPT, sampling_params={**sp, "stop": "never in it"})
    assert never["output_ids"] == free["output_ids"] and never["meta_info"]["finish_reason"]["type"] == "length"


@embedded_only
def test_eos_stops_unless_ignore_eos_which_ignores_every_stop_token(url, models):
    eos = models["eos"][0]
    sp = {"max_new_tokens": 12, "sampling_seed": 21, "ignore_eos": True}
    free = generate(url, PROMPT, sampling_params=sp)["output_ids"]
    out = generate(url, PROMPT, sampling_params={**sp, "stop_token_ids": [free[0]]})
    assert out["output_ids"] == free and out["meta_info"]["finish_reason"]["type"] == "length"
    sampled = generate(url, PROMPT, sampling_params={"max_new_tokens": 40, "sampling_seed": 3, "n": 6})
    stopped = [s for s in sampled if s["meta_info"]["finish_reason"]["type"] == "stop"]
    assert stopped, "the tiny model draws its EOS within 40 tokens"
    assert all(s["output_ids"][-1] == eos == s["meta_info"]["finish_reason"]["matched"] for s in stopped)
    assert all(eos not in s["output_ids"][:-1] for s in sampled)


def test_greedy_is_deterministic_in_any_batch(url):
    alone = greedy(url)
    assert greedy(url) == alone
    batch = generate(url, [[1, 7, 8], PROMPT, [1, 20]], sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                                          "ignore_eos": True})
    assert batch[1]["output_ids"] == alone


def test_sampling_seed_gives_the_same_tokens_whatever_runs_beside(url):
    sp = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 1234, "n": 2}
    alone = generate(url, PROMPT, sampling_params=sp, return_logprob=True)
    blocker = in_thread(generate, url, [1, 9], sampling_params={"max_new_tokens": 400, "ignore_eos": True})
    others = [
        ([1, 7, 8, 9, 10, 11], {**sp, "sampling_seed": 99, "n": 3}),
        ([1, 30], {**sp, "sampling_seed": 5, "n": 1, "max_new_tokens": 40}),
        (PROMPT, {**sp, "sampling_seed": 1235}),
        ([1, 2, 3], {**sp, "temperature": 0.7, "top_p": 0.9}),
    ]
    futures = [in_thread(generate, url, ids, sampling_params=p) for ids, p in others]
    again = generate(url, PROMPT, sampling_params=sp, return_logprob=True)
    for f in futures + [blocker]:
        f.result()
    assert [a["output_ids"] for a in again] == [a["output_ids"] for a in alone]
    for a, b in zip(again, alone, strict=True):
        assert logps(a) == pytest.approx(logps(b), abs=1e-5)


@embedded_only
def test_sample_k_of_a_seed_is_its_own_stream_and_sample_0_is_the_seed_alone(url):
    sp = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 77}
    pair = generate(url, PROMPT, sampling_params={**sp, "n": 2})
    single = generate(url, PROMPT, sampling_params=sp)
    assert pair[0]["output_ids"] == single["output_ids"] != pair[1]["output_ids"]
    unseeded = generate(url, PROMPT, sampling_params={**sp, "sampling_seed": None, "n": 2})
    assert unseeded[0]["output_ids"] != unseeded[1]["output_ids"]


@embedded_only
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_logprobs_are_the_trainers_on_policy_logprobs(url, models, temperature, top_p):
    out = generate(url, PROMPT, sampling_params={"max_new_tokens": 12, "temperature": temperature, "top_p": top_p,
                                                 "ignore_eos": True, "sampling_seed": 11}, return_logprob=True)
    expected = trainer_logprobs(models["initial"], PROMPT, out["output_ids"], temperature or 1.0)
    assert logps(out) == pytest.approx(expected.tolist(), abs=1e-4)


@embedded_only
@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_top_logprobs_are_the_likeliest_tokens_of_the_trainers_distribution(url, models, temperature):
    """top_logprobs_num=3: at each output position, the 3 likeliest tokens and their log-probs, found by brute force
    over the whole vocabulary with the trainer's log-probs (greedy: temperature 1); the sampled token's log-prob is
    its own entry where it is among them."""
    out = generate(url, PROMPT, sampling_params={"max_new_tokens": 5, "temperature": temperature, "ignore_eos": True,
                                                 "sampling_seed": 5}, return_logprob=True, top_logprobs_num=3)
    tokens, top = out["output_ids"], out["meta_info"]["output_top_logprobs"]
    assert len(top) == len(tokens) == 5
    vocab = models["initial"].get_input_embeddings().weight.shape[0]
    for i, alts in enumerate(top):
        every = every_next_logprob(models["initial"], PROMPT + tokens[:i], vocab, temperature or 1.0)
        best = sorted(range(vocab), key=lambda v: -every[v])[:3]
        assert [a[1] for a in alts] == best
        assert [a[0] for a in alts] == pytest.approx([every[v] for v in best], abs=1e-4)
        if tokens[i] in best:
            assert logps(out)[i] == pytest.approx(every[tokens[i]], abs=1e-4)
    r = post(url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "top_logprobs_num": 2})
    assert r.status_code == 400 and "return_logprob" in r.json()["error"]["message"]


@embedded_only
@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_token_ids_logprob_are_those_tokens_in_the_sampling_distribution(url, models, temperature):
    """token_ids_logprob: at each output position the given tokens' log-probs under the distribution the sample was
    drawn from (greedy: temperature 1), as a direct forward pass of the model gives them; one list per input too."""
    ids = [3, 5, 20]
    out = generate(url, PROMPT, sampling_params={"max_new_tokens": 5, "temperature": temperature, "ignore_eos": True,
                                                 "sampling_seed": 5}, return_logprob=True, token_ids_logprob=ids)
    tokens, given = out["output_ids"], out["meta_info"]["output_token_ids_logprobs"]
    assert len(given) == len(tokens) == 5
    for i, entries in enumerate(given):
        every = direct_logprobs(models["initial"], PROMPT + tokens[:i], temperature or 1.0)[-1]
        assert [e[1] for e in entries] == ids
        assert [e[0] for e in entries] == pytest.approx([float(every[v]) for v in ids], abs=1e-4)
        assert logps(out)[i] == pytest.approx(float(every[tokens[i]]), abs=1e-4)
    two = generate(url, [PROMPT, [1, 20]], sampling_params={"max_new_tokens": 2, "ignore_eos": True},
                   return_logprob=True, token_ids_logprob=[[4], [6, 7]])
    assert [[[e[1] for e in p] for p in a["meta_info"]["output_token_ids_logprobs"]] for a in two] == \
        [[[4], [4]], [[6, 7], [6, 7]]]
    r = post(url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2},
                                "token_ids_logprob": [1]})
    assert r.status_code == 400 and "return_logprob" in r.json()["error"]["message"]


@embedded_only
def test_input_logprobs_from_logprob_start_len_are_the_models_at_temperature_1(url, models):
    """logprob_start_len >= 0 (verl's prompt log-probs: max_new_tokens=0): each prompt token's log-prob from that
    position on, the first None (SGLang's convention), with its top and given tokens, at temperature 1 whatever the
    sampling temperature, as a direct forward pass of the model gives them; -1 reports the last prompt token only."""
    prompt = [1, 12, 13, 5, 7, 9]
    every = direct_logprobs(models["initial"], prompt, 1.0)  # row k: the distribution of token k+1
    for start in (0, 2):
        out = generate(url, prompt, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                       logprob_start_len=start, top_logprobs_num=2, token_ids_logprob=[4, 6])
        meta = out["meta_info"]
        assert out["output_ids"] == [] and meta["output_token_logprobs"] == []
        assert [e[1] for e in meta["input_token_logprobs"]] == prompt[start:]
        assert meta["input_token_logprobs"][0][0] is None
        assert meta["input_top_logprobs"][0] is None and meta["input_token_ids_logprobs"][0] is None
        positions = range(start + 1, len(prompt))
        assert [e[0] for e in meta["input_token_logprobs"][1:]] == \
            pytest.approx([float(every[k - 1, prompt[k]]) for k in positions], abs=1e-4)
        for k, top, given in zip(positions, meta["input_top_logprobs"][1:], meta["input_token_ids_logprobs"][1:],
                                 strict=True):
            assert [e[1] for e in top] == every[k - 1].topk(2).indices.tolist()
            assert [e[0] for e in given] == pytest.approx([float(every[k - 1, 4]), float(every[k - 1, 6])], abs=1e-4)
    out = generate(url, prompt, sampling_params={"max_new_tokens": 3, "temperature": 0.7, "sampling_seed": 2,
                                                 "ignore_eos": True}, return_logprob=True, logprob_start_len=0)
    assert [e[0] for e in out["meta_info"]["input_token_logprobs"][1:]] == \
        pytest.approx([float(every[k - 1, prompt[k]]) for k in range(1, len(prompt))], abs=1e-4)
    assert logps(out) == pytest.approx(trainer_logprobs(models["initial"], prompt, out["output_ids"], 0.7).tolist(),
                                       abs=1e-4)
    default = generate(url, prompt, sampling_params={"max_new_tokens": 1}, return_logprob=True)
    assert default["meta_info"]["input_token_logprobs"] == [[None, prompt[-1], None]]
    r = post(url, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}, "return_logprob": True,
                                "logprob_start_len": len(prompt)})
    assert r.status_code == 400 and "logprob_start_len" in r.json()["error"]["message"]


@embedded_only
@pytest.mark.parametrize("field, value", [("return_hidden_states", True), ("session_params", {"id": "s"})])
def test_unsupported_request_fields_answer_400_naming_them(url, field, value):
    r = post(url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, field: value})
    assert r.status_code == 400 and field in r.json()["error"]["message"]
    r = post(url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "min_p": 0.1}})
    assert r.status_code == 400 and "min_p" in r.json()["error"]["message"]
    r = post(url, "/generate", {"input_ids": [10_000], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------------------------------------- stream


def test_stream_sends_growing_answers_then_the_plain_answer_then_done(url):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 16, "sampling_seed": 9, "ignore_eos": True}}
    events = stream(url, body)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = events[:-1]
    assert len(chunks) > 1 and all("index" not in c for c in chunks)
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b["output_ids"][:len(a["output_ids"])] == a["output_ids"] and b["text"].startswith(a["text"])
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert_same_answer(chunks[-1], generate(url, **body))
    with_logprobs = {**body, "return_logprob": True}
    assert_same_answer(stream(url, with_logprobs)[-2], generate(url, **with_logprobs))
    failed = stream(url, {**body, "sampling_params": {"max_new_tokens": 10**6}})  # beyond the context length
    assert len(failed) == 2 and "context length" in failed[0]["error"]["message"] and failed[1] == "[DONE]"


def test_stream_of_several_samples_carries_each_ones_index(url):
    body = {"input_ids": [PROMPT, [1, 20]], "return_logprob": False,
            "sampling_params": {"max_new_tokens": 6, "sampling_seed": 4, "ignore_eos": True, "n": 2}}
    events = stream(url, body)
    assert events[-1] == "[DONE]"
    plain = generate(url, **body)
    for index, answer in enumerate(plain):
        mine = [e for e in events[:-1] if e["index"] == index]
        assert mine and all(e["meta_info"]["finish_reason"] is None for e in mine[:-1])
        final = dict(mine[-1])
        del final["index"]
        assert_same_answer(final, answer)
    assert {e["index"] for e in events[:-1]} == set(range(len(plain))) and len(plain) == 4


def test_stream_aborted_ends_with_the_abort_then_done(url):
    running = in_thread(stream, url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": LONG,
                                                                               "ignore_eos": True}})
    wait_for(url, lambda s: s["#running-rows"] >= 1)  # in the engine call: it draws a token before it stops
    assert post(url, "/abort_request", {"abort_all": True}).status_code == 200
    events = running.result(timeout=60)
    assert events[-1] == "[DONE]" and events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(events[-2]["output_ids"]) < LONG


# ------------------------------------------------------------------------------------------ pause, abort, flush


def test_pause_abort_returns_partial_output_and_holds_new_requests_until_continue(url):
    long = in_thread(generate, url, PROMPT, sampling_params={"max_new_tokens": LONG, "ignore_eos": True},
                     return_logprob=True)
    # in the engine call (a request taken for a batch but not yet in its call ends with no token when aborted)
    wait_for(url, lambda s: s["#running-rows"] >= 1)
    assert post(url, "/pause_generation", {"mode": "abort"}).status_code == 200
    out = long.result(timeout=60)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < LONG and len(logps(out)) == len(out["output_ids"])
    held = in_thread(generate, url, PROMPT, sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    time.sleep(0.5)
    assert not held.done(), "a request sent while paused waits for /continue_generation"
    assert post(url, "/continue_generation", {}).status_code == 200
    assert held.result(timeout=60)["meta_info"]["finish_reason"]["type"] == "length"


def test_abort_request_by_rid_leaves_cobatched_requests_unchanged(url):
    sp = {"max_new_tokens": 300, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 4242}
    reference = generate(url, PROMPT, sampling_params=sp, return_logprob=True)
    assert post(url, "/pause_generation", {"mode": "retract"}).status_code == 200  # both start in one batch
    victim = in_thread(generate, url, [1, 17, 18], sampling_params={**sp, "max_new_tokens": LONG, "sampling_seed": 1},
                       rid="victim-rid", return_logprob=True)
    other = in_thread(generate, url, PROMPT, sampling_params=sp, rid="other-rid", return_logprob=True)
    wait_for(url, lambda s: s["#queue-req"] == 2)
    assert post(url, "/continue_generation", {}).status_code == 200
    wait_for(url, lambda s: s["#running-rows"] == 2)
    assert post(url, "/abort_request", {"rid": "victim-rid"}).status_code == 200
    aborted, kept = victim.result(timeout=60), other.result(timeout=60)
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(aborted["output_ids"]) < 300, "aborted while the other request was running"
    assert kept["meta_info"]["finish_reason"]["type"] == "length"
    assert kept["output_ids"] == reference["output_ids"]
    assert logps(kept) == pytest.approx(logps(reference), abs=1e-5)


def test_abort_request_with_no_rid_and_abort_all_false_aborts_nothing(url):
    """verl's default arguments ({"rid": "", "abort_all": false}): SGLang answers 200 and a running request goes on."""
    sp = {"max_new_tokens": 40, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}
    running = in_thread(generate, url, PROMPT, sampling_params=sp)
    for body in ({"rid": "", "abort_all": False}, {}):
        assert post(url, "/abort_request", body).status_code == 200
    assert running.result(timeout=60)["meta_info"]["finish_reason"]["type"] == "length"


@embedded_only
def test_pause_retract_continues_from_the_prefix_after_continue(url):
    sp = {"max_new_tokens": 300, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 31}
    reference = generate(url, PROMPT, sampling_params=sp)
    running = in_thread(generate, url, PROMPT, sampling_params=sp)
    wait_for(url, lambda s: s["#running-rows"] == 1)
    assert post(url, "/pause_generation", {"mode": "retract"}).status_code == 200
    assert state(url)["#queue-req"] == 1 and not running.done()
    assert post(url, "/continue_generation", {}).status_code == 200
    assert running.result(timeout=60)["output_ids"] == reference["output_ids"]
    r = post(url, "/pause_generation", {"mode": "sideways"})
    assert r.status_code == 400 and "sideways" in r.text


def test_flush_cache_fails_while_busy_then_succeeds(url):
    assert post(url, "/flush_cache").status_code == 200
    long = in_thread(generate, url, PROMPT, sampling_params={"max_new_tokens": LONG, "ignore_eos": True})
    wait_for(url, lambda s: s["#running-req"] >= 1)
    assert post(url, "/flush_cache").status_code == 400
    assert post(url, "/abort_request", {"abort_all": True}).status_code == 200
    assert long.result(timeout=60)["meta_info"]["finish_reason"]["type"] == "abort"
    deadline = time.monotonic() + 30
    while post(url, "/flush_cache").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def load_until(url: str, predicate, timeout: float = 30) -> dict:
    """/get_load's entry once it satisfies `predicate`."""
    deadline = time.monotonic() + timeout
    while not predicate(load := requests.get(f"{url}/get_load", timeout=10).json()[0]):
        assert time.monotonic() < deadline, load
        time.sleep(0.02)
    return load


def test_get_load_and_v1_loads_count_running_samples_then_none_after_abort_all(url):
    """slime's check that a server is idle after an abort: /get_load's num_reqs back to 0."""
    load = requests.get(f"{url}/get_load", timeout=10).json()
    assert isinstance(load, list) and len(load) == 1
    assert {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"} <= set(load[0])
    long = in_thread(generate, url, PROMPT, sampling_params={"max_new_tokens": LONG, "ignore_eos": True, "n": 2})
    assert load_until(url, lambda load: load["num_reqs"] == 2)["num_tokens"] >= 2 * len(PROMPT)
    loads = requests.get(f"{url}/v1/loads", timeout=10).json()
    assert {"timestamp", "version", "loads"} <= set(loads)
    rank = loads["loads"][0]
    assert {"dp_rank", "num_running_reqs", "num_waiting_reqs", "num_used_tokens", "num_total_tokens",
            "max_total_num_tokens", "token_usage", "gen_throughput", "cache_hit_rate", "utilization",
            "max_running_requests"} <= set(rank)
    assert rank["num_running_reqs"] + rank["num_waiting_reqs"] == 2 and "queues" in rank
    assert "queues" not in requests.get(f"{url}/v1/loads?include=core", timeout=10).json()["loads"][0]
    assert requests.get(f"{url}/v1/loads?include=bogus", timeout=10).status_code == 400
    assert post(url, "/abort_request", {"abort_all": True}).status_code == 200
    assert all(a["meta_info"]["finish_reason"]["type"] == "abort" for a in long.result(timeout=60))
    load_until(url, lambda load: load["num_reqs"] == 0)


# ------------------------------------------------------------------------------------------------------- weights


def state_dict(model) -> list[tuple[str, torch.Tensor]]:
    return [(k, v.detach().clone()) for k, v in model.state_dict().items()]


def push_tensors(url: str, named, *, bucket_bytes: int, flattened: bool, version: str) -> None:
    groups = list(wire.buckets(named, bucket_bytes))
    for i, bucket in enumerate(groups):
        obj = wire.flatten_bucket(bucket) if flattened else bucket
        body = {"serialized_named_tensors": [wire.serialize(obj)],
                "load_format": "flattened_bucket" if flattened else None, "flush_cache": i == len(groups) - 1,
                "weight_version": version if i == len(groups) - 1 else None}
        r = post(url, "/update_weights_from_tensor", body)
        assert r.status_code == 200 and r.json()["success"], r.text
        del obj  # kept alive until the server answered


def version(url: str) -> str:
    return requests.get(f"{url}/get_weight_version", timeout=10).json()["weight_version"]


@pytest.fixture
def restore(url, models):
    """Load the initial weights back after a test that changed them."""
    yield
    post(url, "/continue_generation")
    post(url, "/resume_memory_occupation", {"tags": None})
    push_tensors(url, state_dict(models["initial"]), bucket_bytes=1 << 30, flattened=True, version="initial")
    assert served_by(url, models["initial"], models["other"])


@embedded_only
def test_update_weights_from_tensor_in_buckets_changes_outputs_and_version(url, models, restore):
    initial, other = models["initial"], models["other"]
    assert served_by(url, initial, other)
    push_tensors(url, state_dict(other), bucket_bytes=20_000, flattened=True, version="7")  # several buckets
    assert version(url) == "7" and served_by(url, other, initial)
    out = generate(url, PROMPT, sampling_params={"max_new_tokens": 2}, return_logprob=True)
    assert out["meta_info"]["weight_version"] == "7"
    push_tensors(url, state_dict(initial), bucket_bytes=30_000, flattened=False, version="8")  # plain (name, tensor)
    assert version(url) == "8" and served_by(url, initial, other)


@embedded_only
def test_a_partial_update_loads_and_a_bad_name_or_shape_fails_naming_it(url, models, restore):
    baseline = greedy(url)
    one = [("model.norm.weight", torch.randn(64, generator=torch.Generator().manual_seed(0)))]
    push_tensors(url, one, bucket_bytes=1 << 20, flattened=True, version="partial")
    assert version(url) == "partial" and greedy(url) != baseline
    for bad, needle in ([("model.nope.weight", torch.zeros(3))], "model.nope.weight"), \
                       ([("model.norm.weight", torch.zeros(3))], "model.norm.weight: shape"):
        body = {"serialized_named_tensors": [wire.serialize(wire.flatten_bucket(one + bad))],
                "load_format": "flattened_bucket", "weight_version": "bad"}
        r = post(url, "/update_weights_from_tensor", body)
        assert r.status_code == 400 and r.json()["success"] is False and needle in r.json()["message"]
    assert version(url) == "partial"  # all or nothing
    r = post(url, "/update_weights_from_tensor", {"serialized_named_tensors": ["%%%"]})
    assert r.status_code == 400 and "base64" in r.json()["message"]


@embedded_only
def test_update_weights_from_distributed_through_a_gloo_group(url, models, restore):
    other = models["other"]
    # rank 0's store binds port 0 first (as BroadcastSync does): a port picked free and bound later could be taken
    store, port = wire.host_update_store("127.0.0.1", 60)
    join = in_thread(post, url, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": "conformance", "backend": "gloo"})
    group = wire.init_update_group("127.0.0.1", port, 0, 2, "conformance", "gloo", 60, store=store)
    try:
        assert join.result(timeout=60).status_code == 200
        named = state_dict(other)
        body = {"names": [k for k, _ in named], "dtypes": [str(v.dtype).removeprefix("torch.") for _, v in named],
                "shapes": [list(v.shape) for _, v in named], "group_name": "conformance", "weight_version": "dist"}
        answer = in_thread(post, url, "/update_weights_from_distributed", body)
        for _, tensor in named:
            torch.distributed.broadcast(tensor, src=0, group=group)
        r = answer.result(timeout=60)
        assert r.status_code == 200 and r.json()["success"], r.text
    finally:
        r = post(url, "/destroy_weights_update_group", {"group_name": "conformance"})
        wire.destroy_update_group(group)
    assert r.status_code == 200
    assert version(url) == "dist" and served_by(url, other, models["initial"])
    r = post(url, "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [],
                                                       "group_name": "conformance"})
    assert r.status_code == 400 and "conformance" in r.json()["message"]


@embedded_only
def test_update_weights_from_disk(url, models, restore, tmp_path):
    models["other"].save_pretrained(tmp_path / "other")
    r = post(url, "/update_weights_from_disk", {"model_path": str(tmp_path / "other"), "weight_version": "disk"})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert version(url) == "disk" and served_by(url, models["other"], models["initial"])
    r = post(url, "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
    assert r.status_code == 400 and "safetensors" in r.json()["message"]


@embedded_only
def test_release_rejects_work_until_resume_and_a_weight_load(url, models, restore):
    baseline = greedy(url)
    assert post(url, "/release_memory_occupation", {"tags": None}).status_code == 200
    r = post(url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and "resume_memory_occupation" in r.text
    named = state_dict(models["initial"])
    body = {"serialized_named_tensors": [wire.serialize(wire.flatten_bucket(named))],
            "load_format": "flattened_bucket"}
    r = post(url, "/update_weights_from_tensor", body)
    assert r.status_code == 400 and "resume_memory_occupation" in r.json()["message"]
    assert post(url, "/resume_memory_occupation", {"tags": ["weights"]}).status_code == 200
    push_tensors(url, named, bucket_bytes=1 << 30, flattened=True, version="reloaded")
    r = post(url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400, "the KV cache is still released"
    assert post(url, "/resume_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    assert greedy(url) == baseline and version(url) == "reloaded" and served_by(url, models["initial"], models["other"])



@embedded_only
def test_a_health_check_queued_when_memory_is_released_fails_and_the_release_goes_ahead(cfg):
    """In process: /health's one-token generation waits in the queue (the model is held) when a release arrives;
    the release must not answer "requests are waiting" for it (the watchdog checks health at any time)."""
    from relax.serve.sglang.server import EmbeddedServer

    server = EmbeddedServer(cfg, port=0)
    server.start()
    try:
        server.wait_ready(60)
        scheduler = server.scheduler
        with ThreadPoolExecutor(2) as pool:
            with scheduler.exclusive("test holds the model"):  # nothing runs: what arrives waits
                health = pool.submit(requests.get, server.url + "/health", timeout=60)
                wait_until(lambda: scheduler.state()["#queue-req"] == 1, "the health check is queued")
                release = pool.submit(post, server.url, "/release_memory_occupation", {"tags": ["kv_cache"]})
                wait_until(lambda: scheduler._ops_waiting == 1, "the release waits for the model")
            assert release.result().status_code == 200, release.result().text
            assert health.result().status_code == 503
        assert scheduler.state()["#queue-req"] == 0
        assert post(server.url, "/resume_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
        assert requests.get(server.url + "/health", timeout=30).status_code == 200
    finally:
        server.shutdown()


def wait_until(predicate, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.01)


# -------------------------------------------------------------------------------------------------------- router


def test_generate_through_the_real_sglang_router(url, tmp_path):
    from relax.rollout.sglang.process import start_server, stop_process

    log = tmp_path / "router.log"
    # start_server: another port when the one picked free was taken before the router bound it
    proc, port = start_server(lambda port: [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                            "--port", str(port), "--policy", "cache_aware", "--log-level", "warn",
                                            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                              host="127.0.0.1", url_host="127.0.0.1", log_path=log, timeout_s=60,
                              what="sglang-router")
    router = f"http://127.0.0.1:{port}"
    try:
        assert post(router, "/workers", {"url": url}).status_code in (200, 202)
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
        deadline = time.monotonic() + 30
        while (r := post(router, "/generate", body)).status_code != 200:  # until the worker is registered
            assert time.monotonic() < deadline, f"{r.status_code} {r.text}\n{log.read_text()[-2000:]}"
            time.sleep(0.1)
        assert r.json()["output_ids"] == greedy(url)
        seeded = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "sampling_seed": 5, "n": 1},
                  "return_logprob": True}
        via_router = post(router, "/generate", seeded).json()
        direct = post(url, "/generate", seeded).json()
        assert via_router["output_ids"] == direct["output_ids"]
        assert logps(via_router) == pytest.approx(logps(direct), abs=1e-5)
        events = stream(router, seeded)
        assert events[-1] == "[DONE]"
        assert_same_answer(events[-2], direct)
    finally:
        stop_process(proc)


# ----------------------------------------------------------------------------------------------------------- CLI


@embedded_only
def test_cli_bad_input_is_one_message_and_exit_2(tmp_path, capsys, monkeypatch):
    from relax.cli.serve import main

    monkeypatch.delenv("RELAX_SERVE_API_KEY", raising=False)  # (beyond loopback without a key: refused)

    light = [["--port", "0", "--config", str(tmp_path / "missing.json")], ["--port", "0", "--threads", "0"]]
    procs = [subprocess.Popen([sys.executable, "-m", "relax.cli.serve", *c], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO) for c in light]
    in_process = [["--port", "0", "bogus_key=1"], ["--port", "0", "--config", "x.json", "model=tiny"],
                  ["--port", "0", "model.source=hf", f"model.path={tmp_path / 'no_model'}"],
                  ["--port", "0", "--bogus-flag"], ["--port", "0", "--host", "0.0.0.0", "model=tiny"]]
    errors = []
    for argv in in_process:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        errors.append((exit_info.value.code, capsys.readouterr().err))
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        errors.append((proc.returncode, err))
    needles = ["bogus_key", "either", "no_model", "--bogus-flag", "--host 0.0.0.0", "missing.json", "--threads"]
    for (code, err), needle in zip(errors, needles, strict=True):
        lines = err.strip().splitlines()
        assert code == 2 and lines[0].startswith("relax-serve: error:") and "Traceback" not in err, err
        if needle == "bogus_key":  # the config's problems are listed as relax-train lists them, a line each
            assert lines == ["relax-serve: error: invalid config (1 problem):",
                             "  - unknown key bogus_key: no such section or key"], err
        else:
            assert len(lines) == 1 and needle in lines[0], err


@embedded_only
def test_config_json_round_trip_and_unknown_keys(cfg, tmp_path):
    from relax.cli.serve import config_from_json

    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(dataclasses.asdict(cfg)))
    assert config_from_json(path) == cfg
    data = dataclasses.asdict(cfg)
    data["model"]["colour"] = "red"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="model: unknown key.*colour"):
        config_from_json(path)
