"""The Megatron backend on CUDA with NCCL: the CPU suite's parity and training checks, on GPUs.

One launch of tests/megatron/ranks.py (scenario `gpu`) with one rank per visible GPU, at most 2 (TP = ranks):
fp32 logits and log-probs against transformers / the torch backend on the same GPU, a 3-step fp32 train equal
to TorchPolicy's (with Transformer Engine's layer spec where transformer_engine is installed: train.layer_spec=auto;
then also packed sequences through TE's THD attention; with sequence parallelism too on two GPUs), and a 3-step
train with bf16 parameters (Megatron's mixed precision: bf16 weights, fp32 master weights and gradients) against
the torch backend's bf16 autocast. Run it with
`python -m pytest -q tests/gpu/test_megatron_gpu.py` where a GPU is available.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]

sys.path.insert(0, str(Path(__file__).parents[1] / "megatron"))

# fp32 on GPU: reductions run in other orders than on the CPU (and than the torch backend's kernels)
FP32_REL = 1e-3
# bf16 parameters vs fp32 parameters under bf16 autocast: the same bf16 matmul inputs, but Megatron also keeps
# norm weights and activations between layers in bf16
BF16_REL = 5e-2


@pytest.fixture(scope="module")
def gpu(tmp_path_factory) -> dict:
    from test_megatron_cpu import launch

    return launch("gpu", min(2, torch.cuda.device_count()), tmp_path_factory.mktemp("gpu"))["gpu"]


def assert_fp32_steps(rows: list[dict]) -> None:
    """Each step's fp32 metrics of the Megatron run equal the torch backend's, within FP32_REL."""
    for i, row in enumerate(rows):
        for k in ("train/pg_loss", "train/grad_norm", "train/entropy"):
            assert row["megatron"][k] == pytest.approx(row["torch"][k], rel=FP32_REL, abs=1e-6), (i, k)


def test_gpu_fp32_parity(gpu):
    assert gpu["logits_max_diff"] < 1e-4
    assert gpu["logprob_max_diff"] < 1e-4
    assert_fp32_steps(gpu["train"])


def test_gpu_layer_spec_is_transformer_engines_where_installed(gpu):
    te = importlib.util.find_spec("transformer_engine") is not None
    assert gpu["layer_spec"] == ("transformer_engine" if te else "local")


def test_gpu_sequence_parallel_parity(gpu):
    if "sp_logprob_max_diff" not in gpu:
        pytest.skip("sequence parallelism needs two GPUs (TP=2)")
    assert gpu["sp_logprob_max_diff"] < 1e-4
    assert_fp32_steps(gpu["train_sp"])


def test_gpu_packed_sequences_through_transformer_engine_attention(gpu):
    """train.pack_sequences on Megatron: each micro-batch one row, sequences kept apart by TE's THD attention
    (cu_seqlens); the same log-probs and steps as the torch backend's padded ones."""
    if "packed_logprob_max_diff" not in gpu:
        pytest.skip("packing on Megatron runs in Transformer Engine's attention: transformer_engine is not installed")
    assert gpu["packed_logprob_max_diff"] < 1e-4
    assert_fp32_steps(gpu["train_packed"])


def test_gpu_bf16_training_tracks_torch_autocast(gpu):
    for i, row in enumerate(gpu["train_bf16"]):
        for k in ("train/pg_loss", "train/entropy"):
            assert row["megatron"][k] == pytest.approx(row["torch"][k], rel=BF16_REL, abs=5e-3), (i, k)
        assert row["megatron"]["train/grad_norm"] == pytest.approx(row["torch"]["train/grad_norm"], rel=0.2), i


@pytest.mark.slow
def test_gpu_megatron_trains_through_ray(tmp_path):
    """`relax-train cluster=1xgpu train.backend=megatron` end to end: Ray, NCCL, bf16, colocated rollout."""
    pytest.importorskip("ray", reason="the Ray loop runs on a prepared machine (tests/gpu/run.sh), not a bare one")
    from relax.config import load_config
    from relax.runner.train import run

    cfg = load_config(["cluster=1xgpu", "train.backend=megatron", "train.num_rollout=3", "tracking.progress=false",
                       f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"train.save_dir={tmp_path}/ckpt"])
    result = run(cfg, output_dir=tmp_path / "out")
    assert [s for s, _ in result.history] == [0, 1, 2]
    te = importlib.util.find_spec("transformer_engine") is not None
    states = list((tmp_path / "ckpt").rglob("trainer_state.json"))
    assert states and all(json.loads(p.read_text())["layer_spec"] == ("transformer_engine" if te else "local")
                          for p in states)
    for _, m in result.history:
        assert all(k in m for k in ("train/pg_loss", "train/grad_norm", "rollout/raw_reward"))
        assert m["train/grad_norm"] == m["train/grad_norm"]  # not NaN
