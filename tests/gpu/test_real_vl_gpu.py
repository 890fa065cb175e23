"""The real-architecture vision-language smoke at real size on a GPU (tests/runner/test_real_vl.py sized down on the
CPU): Qwen2.5-VL-3B-Instruct and Qwen3-VL-2B-Instruct with their published configs (tests/real_vl.py), random
weights built from config on the GPU and saved as a Hugging Face directory (bf16, about 7.5 GB each), or the real
checkpoint's directory where $RELAX_QWEN2_5_VL_DIR / $RELAX_QWEN3_VL_DIR names one; trained 2 steps through
`relax-train model=qwen2_5_vl_3b model.path=<dir> data=shapes cluster=1xgpu` on the embedded rollout, and
`model=qwen3_vl_2b ... rollout=sglang` against a real SGLang server launched as a run launches it (where `sglang`
is installed). Checked: two steps, one image per sample, the trainer's bf16 log-probs against the engine's within
the bf16 bound of tests/gpu/test_bare_gpu.py (mean over tokens), a finite loss and a gradient.

Run by tests/gpu/run.sh (a prepared machine: Ray, MLflow; SGLang for the second test); skipped without CUDA.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import pytest
import torch
from real_vl import CONF, write_vl_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="relax-train needs Ray (tests/gpu/run.sh)"),
]

BF16_LOGP_MEAN = 2e-2  # nats per token: the trainer's bf16 log-probs against the engine's (as test_bare_gpu.py)
ENV = {"qwen2_5_vl": "RELAX_QWEN2_5_VL_DIR", "qwen3_vl": "RELAX_QWEN3_VL_DIR"}


def model_dir(arch: str, tmp_path_factory) -> Path:
    """The real checkpoint named by the environment, else the published config at real size, random weights."""
    given = os.environ.get(ENV[arch])
    if given:
        return Path(given)
    return write_vl_dir(tmp_path_factory.mktemp(arch) / arch, arch, real_size=True, device="cuda",
                        dtype=torch.bfloat16)


def train_two_steps(arch: str, tmp_path, tmp_path_factory, small_run, *extra: str):
    from relax.config import load_config
    from relax.metrics import IMAGES_PER_SAMPLE, TRAIN_ROLLOUT_LOGP_ABS_DIFF
    from relax.runner.train import run

    path = model_dir(arch, tmp_path_factory)
    cfg = load_config(small_run(f"model={CONF[arch]}", f"model.path={path}", "data=shapes", "cluster=1xgpu",
                                "model.dtype=bfloat16", "rollout.max_prompt_len=512", "rollout.rollout_batch_size=2",
                                "train.lr=1e-5", "algorithm.entropy_coef=0.01", "tracking.enabled=false", *extra))
    result = run(cfg, output_dir=tmp_path / "out")
    assert [s for s, _ in result.history] == [0, 1]
    for step, m in result.history:
        assert m[TRAIN_ROLLOUT_LOGP_ABS_DIFF] < BF16_LOGP_MEAN, (step, m)
        assert m[IMAGES_PER_SAMPLE] == 1.0
        assert math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0.0, (step, m)
    return result


def test_real_size_qwen2_5_vl_trains_two_steps_on_the_embedded_rollout(ray_local, small_run, tmp_path,
                                                                      tmp_path_factory):
    train_two_steps("qwen2_5_vl", tmp_path, tmp_path_factory, small_run)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs SGLang (pip install 'sglang[all]')")
def test_real_size_qwen3_vl_trains_two_steps_over_a_real_sglang_server(ray_local, small_run, tmp_path,
                                                                      tmp_path_factory):
    train_two_steps("qwen3_vl", tmp_path, tmp_path_factory, small_run, "rollout=sglang", "rollout.num_replicas=1",
                    "rollout.sglang.extra_args=[--enable-deterministic-inference]")
