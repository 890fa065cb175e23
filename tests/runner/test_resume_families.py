"""Exact resume of a mixture-of-experts run with routing replay (model=tiny_moe) and of a vision-language run
(model=tiny_vl data=shapes): resumed from the step-2 checkpoint of a 3-step run, step 2 records the same metrics and
ends at the same weights as in the uninterrupted run.

Roles in this process (tests/inprocess_ray.py), the hybrid mode: a checkpoint then holds the batch generated ahead,
whose routed experts (MoE) or images (VL) the resumed run must train exactly as the uninterrupted one did; the test
checks that the checkpoint holds them (else it would not cover them). The stop is the checkpoint's step boundary
(the uninterrupted run's own step-2 checkpoint is the one resumed); what a kill -9 between two checkpoints does to a
run is tests/runner/test_resume.py's. The comparison's own negative control (a resume that loses AdamW's state is
seen) is tests/runner/test_training.py's.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from relax.batch import Samples
from relax.config import load_config
from relax.runner import checkpoint
from relax.runner.train import run

pytestmark = pytest.mark.slow

KEYS = ["rollout/raw_reward", "rollout/response_len", "train/loss", "train/grad_norm", "train/pg_clipfrac"]
FAMILIES = {
    "moe_replay": (["model=tiny_moe", "rollout.routing_replay=true"], ["rollout/router_agreement"]),
    "vision": (["model=tiny_vl", "data=shapes"], ["rollout/images_per_sample", "rollout/image_token_frac"]),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_resume_equals_the_uninterrupted_run(family, in_process, small_run, tmp_path):
    extra, keys = FAMILIES[family]
    common = [*extra, "model.dtype=float32", "train.mode=hybrid", "cluster.cpus_per_node=1"]
    full = run(load_config(small_run(*common, "train.save_interval=2", steps=3)), output_dir=tmp_path / "a")
    step2 = tmp_path / "ckpt" / "step_000002"
    buffered = [Samples(**d["samples"]) for d in checkpoint.read_rollout_state(step2)["buffer"]]
    assert buffered, "the checkpoint holds no batch generated ahead"
    if family == "moe_replay":
        assert all(s.routed_experts is not None for s in buffered)
    else:
        assert all(s.vision is not None and any(v is not None for v in s.vision) for s in buffered)

    resumed = run(load_config(small_run(*common, f"train.resume={step2}", f"train.save_dir={tmp_path}/ckpt2",
                                        steps=3)), output_dir=tmp_path / "b")
    assert [s for s, _ in resumed.history] == [2]
    for (step_a, a), (step_b, b) in zip(full.history[2:], resumed.history, strict=True):
        assert step_a == step_b
        for key in KEYS + keys:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), (step_a, key)
    if family == "moe_replay":
        assert [m["rollout/router_agreement"] for _, m in resumed.history] == [1.0]
    ref = load_file(tmp_path / "ckpt" / "step_000003" / "policy" / "model.safetensors")
    got = load_file(tmp_path / "ckpt2" / "step_000003" / "policy" / "model.safetensors")
    assert ref.keys() == got.keys()
    for name, tensor in ref.items():
        assert torch.allclose(got[name], tensor, rtol=0, atol=1e-6), name
    start = load_file(step2 / "policy" / "model.safetensors")
    assert any(not torch.equal(start[n], t) for n, t in ref.items())  # step 2 moved the weights
