"""What a bare GPU machine checks in process (tests/gpu/bare.sh): CUDA torch, transformers and peft, plus the kit's
wheels (hydra-core, omegaconf, antlr4, gguf, megatron-core); no Ray, MLflow or SGLang, no network.

1. the torch trainer on CUDA: bf16 autocast against fp32 on the same GPU (log-probs, one optimizer step);
2. the embedded rollout engine on CUDA: bf16 against fp32 (greedy tokens, the engine's log-probs against the
   trainer's of the same tokens);
3. CUDA IPC weight buckets (`tensor_sync.push_tensors` with a CUDA device, several buckets) into `relax-serve` on the
   GPU in another process: the server then answers as an engine holding the pushed weights, and differently from
   before the push.

The model is the tiny one (built from config): the SmolLM2 GGUF (98 MB) does not travel to a bare machine.
`python -m pytest -q -rs tests/gpu/test_bare_gpu.py` where a GPU is available; skipped without one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# cuda on the GPU machine; CI runs the same checks on the CPU ($RELAX_BARE_DEVICE=cpu, tests/gpu/test_bare_script.py)
# so that they cannot rot where no GPU is lent
DEVICE = os.environ.get("RELAX_BARE_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cuda" and not torch.cuda.is_available(),
        reason="needs a CUDA GPU (RELAX_BARE_DEVICE=cpu runs it on the CPU)",
    ),
]

REPO = Path(__file__).resolve().parents[2]
# bf16 autocast against fp32 on the tiny model (log-softmax in fp32 on both sides): nats per token
BF16_LOGP_MEAN, BF16_LOGP_MAX = 2e-2, 1e-1
BF16_STEP_REL = 5e-2  # loss and gradient norm of one optimizer step


def tiny_cfg(dtype: str):
    from relax.config.schema import ModelConfig

    return ModelConfig(
        name="tiny-gpu",
        source="config",
        dtype=dtype,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=128,
    )


def _backend_fixtures():
    """tests/backends/conftest.py as a module of its own (every test folder's conftest has the same module name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("backends_conftest", REPO / "tests/backends/conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_samples(n: int = 8, P: int = 12, T: int = 10, vocab: int = 64, seed: int = 0):
    """Left-padded prompts and right-padded responses of random lengths (tests/backends/conftest.py's)."""
    return _backend_fixtures().random_samples(n, P, T, seed=seed, vocab=vocab)


def policy(dtype: str):
    from relax.config.schema import TrainConfig
    from relax.train.torch_policy import TorchPolicy

    return TorchPolicy(
        tiny_cfg(dtype),
        TrainConfig(lr=1e-3, clip_grad=1.0, num_rollout=10),
        vocab_size=64,
        pad_token_id=0,
        seed=0,
        device=DEVICE,
    )


def test_the_torch_trainer_in_bf16_on_cuda_matches_fp32():
    from relax.algorithms import GRPOConfig
    from relax.batch import TrainBatch

    samples = random_samples()
    mask = samples.response_mask.bool()
    fp32, bf16 = policy("float32"), policy("bfloat16")
    assert next(bf16.model.parameters()).device.type == DEVICE
    a, b = fp32.compute_logprobs(samples, micro_batch_size=4), bf16.compute_logprobs(samples, micro_batch_size=4)
    diff = (a - b).abs()[mask]
    assert diff.mean() < BF16_LOGP_MEAN and diff.max() < BF16_LOGP_MAX, (diff.mean(), diff.max())
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(len(samples), 1, generator=g).expand_as(samples.response_mask) * samples.response_mask
    steps = {}
    for name, p in (("fp32", fp32), ("bf16", bf16)):
        batch = TrainBatch.from_samples(samples, advantages=adv.clone(), old_logp=a.clone())
        steps[name] = p.train_step(batch, GRPOConfig(), per_token=False, micro_batch_size=4)
    for k in ("train/pg_loss", "train/grad_norm"):
        assert steps["bf16"][k] == pytest.approx(steps["fp32"][k], rel=BF16_STEP_REL, abs=1e-4), k


def engine(dtype: torch.dtype, state: dict | None = None):
    from relax.models.hf import build_model
    from relax.rollout.embedded import EmbeddedEngine

    model = build_model(tiny_cfg("float32"), 64, 0, seed=0, dtype=torch.float32, device=DEVICE)
    if state is not None:
        model.load_state_dict(state)
    return EmbeddedEngine(model.eval(), eos_token_ids=[], pad_token_id=0, dtype=dtype, device=DEVICE)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [3]]


def test_the_embedded_engine_in_bf16_on_cuda_matches_fp32():
    from relax.models.hf import build_model, token_logprobs

    outs = {
        dt: engine(dt).generate(PROMPTS, max_new_tokens=12, temperature=0.0, seed=0)
        for dt in (torch.float32, torch.bfloat16)
    }
    a, b = outs[torch.float32], outs[torch.bfloat16]
    agree = (a.response_ids == b.response_ids).float().mean()
    assert agree >= 0.9, agree  # greedy on bf16 logits: a near-tie may flip a token late in a response
    model = build_model(tiny_cfg("float32"), 64, 0, seed=0, dtype=torch.float32, device=DEVICE).eval()
    ids, mask = b.sequences()
    with torch.no_grad():
        ref = token_logprobs(
            model, ids.to(DEVICE), mask.to(DEVICE), b.prompt_ids.shape[1], b.response_ids.shape[1]
        ).cpu()
    rmask = b.response_mask.bool()
    diff = (ref - b.rollout_logp.float())[rmask].abs()
    assert diff.mean() < BF16_LOGP_MEAN and diff.max() < BF16_LOGP_MAX, (diff.mean(), diff.max())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, path: str, body: dict) -> dict:
    import urllib.request

    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _greedy(url: str) -> list[tuple[list[int], list[float]]]:
    out = []
    for p in PROMPTS:
        meta = _post(
            url,
            "/generate",
            {"input_ids": p, "return_logprob": True, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}},
        )["meta_info"]
        out.append(
            ([int(t[1]) for t in meta["output_token_logprobs"]], [float(t[0]) for t in meta["output_token_logprobs"]])
        )
    return out


def test_cuda_ipc_weight_buckets_reach_an_engine_in_another_process(tmp_path):
    """`push_tensors(..., device=cuda)`, as the actor sends colocated weights: the server on the same GPU opens the
    buckets' CUDA IPC handles and then generates as a local engine holding the pushed weights."""
    from relax.config import load_config
    from relax.models.hf import build_model
    from relax.rollout.sglang.tensor_sync import push_tensors

    cfg = load_config(["rollout=sglang", "rollout.sglang.server=embedded", "model.dtype=bfloat16"])
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    port, log = _free_port(), tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "relax.cli.serve", "--port", str(port), "--config", str(tmp_path / "config.json")],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        import urllib.request

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
        info = json.loads(urllib.request.urlopen(url + "/get_server_info", timeout=10).read())
        assert info["device"].startswith(DEVICE), info  # the server's engine is on the GPU
        before = _greedy(url)
        from relax.data.tokenizer import load_tokenizer

        tok = load_tokenizer(cfg.model)
        model = build_model(
            cfg.model, len(tok), tok.pad_token_id, seed=cfg.seed + 1, dtype=torch.float32, device=DEVICE
        )  # other weights than the server's (seed + 1)
        named = [(k, v.to(torch.bfloat16)) for k, v in model.state_dict().items()]
        n_buckets = push_tensors(
            [url], named, 7, bucket_bytes=64 * 1024, device=torch.device(DEVICE) if DEVICE == "cuda" else None
        )
        assert n_buckets > 1
        assert _post(url, "/get_weight_version", {})["weight_version"] == "7"
        after = _greedy(url)
        from relax.rollout.embedded import EmbeddedEngine

        local = EmbeddedEngine(
            model.eval(), eos_token_ids=[], pad_token_id=tok.pad_token_id, dtype=torch.bfloat16, device=DEVICE
        )
        ref = local.generate(PROMPTS, max_new_tokens=8, temperature=0.0, seed=0)
        for i, (ids, logps) in enumerate(after):
            n = int(ref.response_mask[i].sum())
            assert ids[:n] == ref.response_ids[i, :n].tolist(), i
            assert max(abs(x - float(y)) for x, y in zip(logps[:n], ref.rollout_logp[i, :n], strict=True)) < 1e-2
        assert after != before  # the push changed what the server computes
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
