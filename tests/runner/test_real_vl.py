"""A real-architecture smoke of the vision-language path: Qwen2.5-VL-3B-Instruct and Qwen3-VL-2B-Instruct sized down
from their published configs (tests/real_vl.py: real patch size, spatial merge, window attention and full-attention
blocks, deepstack layers, mrope sections, head dimension, GQA, tied embeddings, vocabulary and special token ids,
image processor settings and chat template), saved as Hugging Face directories and trained 2 steps by the
configuration of `relax-train model=qwen2_5_vl_3b model.path=<dir> data=shapes` on the embedded rollout (roles in
this process) and of `model=qwen3_vl_2b ... rollout=sglang` (a real Ray, the real sglang-router, an embedded server
taking SGLang's image_data): one test per backend, the two families between them.

Checked in the run: the rollout's log-probs equal the trainer's recomputed ones at the generating weights (fp32,
`rollout/train_rollout_logp_abs_diff`, `rollout/train_rollout_ratio_max`), every sample holds its image and the
image tokens the real processor gives (Qwen2.5-VL: shapes' 32x32 image to min_pixels=3136, 56x56, 4x4 patches
merged 2x2 = 4 tokens; Qwen3-VL: shortest_edge=65536, 256x256, 16x16 patches = 64 tokens), the text model's weights
move and the frozen vision tower's do not.
The same at real size on a GPU: tests/gpu/test_real_vl_gpu.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from real_vl import CONF, write_vl_dir
from safetensors.torch import load_file

from relax.config import load_config
from relax.metrics import IMAGE_TOKEN_FRAC, IMAGES_PER_SAMPLE, TRAIN_ROLLOUT_LOGP_ABS_DIFF, TRAIN_ROLLOUT_RATIO_MAX
from relax.runner.train import run
from tests.runner.test_sglang_training import SGLANG

pytestmark = pytest.mark.slow

# image tokens per shapes image (32x32) under each published image processor, by hand from its settings
IMAGE_TOKENS = {"qwen2_5_vl": (56 // 14) ** 2 // 4, "qwen3_vl": (256 // 16) ** 2 // 4}
IMAGE_PAD_ID = 151655  # <|image_pad|>: its real id in both families
PARITY = 1e-5  # fp32: the trainer's and the engine's log-probs of the sampled tokens


def smoke_overrides(model_dir, arch: str, *extra: str) -> list[str]:
    return [f"model={CONF[arch]}", f"model.path={model_dir}", "data=shapes", "model.dtype=float32",
            "rollout.rollout_batch_size=2", "rollout.temperature=1.0", "train.lr=1e-3",
            # an untrained policy earns the same reward on every sample (zero advantages): the entropy bonus gives
            # the text model a gradient, so that the step shows one reaching it
            "algorithm.entropy_coef=0.01", *extra]


def check_run(result, batches: dict, model_dir, ckpt, arch: str) -> None:
    """Two steps; each at trainer/engine parity on the image prompts, one image per sample with the processor's
    number of image tokens; the text model's weights moved (a gradient reached it), the frozen tower's did not."""
    assert [s for s, _ in result.history] == [0, 1]
    for step, metrics in result.history:
        assert metrics[TRAIN_ROLLOUT_LOGP_ABS_DIFF] < PARITY, (step, metrics)
        assert abs(metrics[TRAIN_ROLLOUT_RATIO_MAX] - 1.0) < PARITY, (step, metrics)
        assert metrics[IMAGES_PER_SAMPLE] == 1.0 and 0.0 < metrics[IMAGE_TOKEN_FRAC] < 1.0
        assert metrics["train/grad_norm"] > 0.0 and math.isfinite(metrics["train/loss"])
    if batches:  # recorded where the loop hands a step's rollout to the trainer (in this process only)
        for samples in batches.values():
            for n, vision in enumerate(samples.vision):
                assert vision is not None
                assert int((samples.prompt_ids[n] == IMAGE_PAD_ID).sum()) == IMAGE_TOKENS[arch]
    start = load_file(model_dir / "model.safetensors")
    end = load_file(ckpt / "step_000002" / "policy" / "model.safetensors")
    assert start.keys() == end.keys()
    moved = {name for name, tensor in end.items() if not torch.equal(start[name], tensor)}
    vision = {name for name in start if "visual." in name}
    assert vision and not moved & vision, "the vision tower moved (model.freeze_vision_tower=true)"
    assert any(name.endswith("embed_tokens.weight") for name in moved), sorted(moved)
    assert any(".layers.0." in name and "visual." not in name for name in moved), sorted(moved)


def test_sized_down_qwen2_5_vl_trains_two_steps_on_the_embedded_rollout(in_process, small_run, trained_batches,
                                                                         tmp_path):
    arch = "qwen2_5_vl"
    model_dir = write_vl_dir(tmp_path / arch, arch)
    cfg = load_config(small_run(*smoke_overrides(model_dir, arch)))
    assert cfg.model.source == "hf" and cfg.rollout.backend == "embedded"
    check_run(run(cfg, output_dir=tmp_path / "out"), trained_batches, model_dir, tmp_path / "ckpt", arch)
    assert trained_batches


# a Ray graph, a server and the router (tens of seconds on two shared cores): tiny_vl's run over SGLang
# (tests/runner/test_sglang_vision_training.py) is CI's; this one runs with RELAX_MATRIX=1 (README, "Contributing")
@pytest.mark.matrix
def test_sized_down_qwen3_vl_trains_two_steps_over_sglang(ray_local, small_run, tmp_path):
    """rollout=sglang: the images travel as SGLang's image_data to an embedded server (relax-serve, its own
    process) behind the real sglang-router; tests/gpu/test_real_vl_gpu.py runs a real SGLang server."""
    arch = "qwen3_vl"
    model_dir = write_vl_dir(tmp_path / arch, arch)
    cfg = load_config(small_run(*smoke_overrides(model_dir, arch), *SGLANG, "rollout.num_replicas=1",
                                "tracking.enabled=false"))
    assert cfg.model.source == "hf" and cfg.rollout.backend == "sglang"
    check_run(run(cfg, output_dir=tmp_path / "out"), {}, model_dir, tmp_path / "ckpt", arch)
