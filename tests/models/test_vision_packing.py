"""Packed micro-batches with images (train.pack_sequences=true, relax.train.vision_packing) against the padded ones:
the same log-probs (and the engine's), the same losses, metrics and gradients of a train step; packing without the
text positions that mark where each sequence starts lets them attend across (the negative control)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from relax import algorithms
from relax.batch import TrainBatch
from relax.config.schema import ModelConfig, TrainConfig
from relax.data.datasets import PromptDataset
from relax.data.images import VisionData, build_tiny_vl_processor, build_tiny_vl_tokenizer
from relax.data.shapes import generate_shapes
from relax.models.hf import build_model
from relax.models.vision import stack_vision
from relax.rollout.embedded import EmbeddedEngine
from relax.train.packing import pack
from relax.train.torch_policy import TorchPolicy


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_packed_rows_with_images_equal_the_padded_ones(arch):
    tokenizer = build_tiny_vl_tokenizer()
    records = [(r, f"shapes:{i}") for i, r in enumerate(generate_shapes(3, seed=0))]
    records.append(({"prompt": "what is the shape?", "label": "red"}, "text"))
    items = list(PromptDataset.from_records(records, tokenizer, vision=VisionData(build_tiny_vl_processor(tokenizer))))
    cfg = ModelConfig(name="tiny_vl", arch=arch, dtype="float32")
    engine = EmbeddedEngine(build_model(cfg, len(tokenizer), tokenizer.pad_token_id, seed=3),
                            eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    out = engine.generate([i.prompt_ids for i in items], n_samples_per_prompt=2, max_new_tokens=5, seed=1,
                          vision=[i.vision for i in items])
    mask = out.response_mask
    g = torch.Generator().manual_seed(0)
    batch = TrainBatch.from_samples(out, advantages=torch.randn(len(out), 1, generator=g).expand_as(mask) * mask,
                                    old_logp=out.rollout_logp - 0.05 * mask, ref_logp=out.rollout_logp + 0.02 * mask)

    def policy(packed: bool) -> TorchPolicy:
        return TorchPolicy(cfg, dataclasses.replace(TrainConfig(), pack_sequences=packed), vocab_size=len(tokenizer),
                           pad_token_id=tokenizer.pad_token_id, seed=3, device="cpu")

    results = {}
    for packed in (False, True):
        p = policy(packed)
        for max_tokens in (None, 40) if packed else (None,):  # packed: also a token budget (2-3 rows each)
            logp = p.compute_logprobs(out, micro_batch_size=4, max_tokens=max_tokens)
            assert float((logp - out.rollout_logp)[mask.bool()].abs().max()) < 1e-5  # = the engine's
        metrics = p.accumulate_gradients(batch, algorithms.get("grpo").config_cls(), per_token=True,
                                         micro_batch_size=4)
        results[packed] = (metrics, {n: w.grad.clone() for n, w in p.model.named_parameters()
                                     if w.grad is not None})
    metrics, grads = results[False]
    assert any("visual" in n for n in grads)  # the vision tower trains (not frozen without LoRA)
    for key in (True,):
        m, gr = results[key]
        assert m.keys() == metrics.keys() and gr.keys() == grads.keys()
        for k in metrics:
            assert m[k] == pytest.approx(metrics[k], rel=1e-4, abs=1e-6), (key, k)
        for n in grads:
            torch.testing.assert_close(gr[n], grads[n], atol=1e-5, rtol=1e-3, msg=f"{key} {n}")
    # negative control: the packed row with only the 3-D positions (no text positions marking the sequences'
    # starts): the model attends across sequences, and the log-probs move
    model = policy(True).model
    p = pack(out)
    from relax.train.vision_packing import packed_vision_logprobs

    with torch.no_grad():
        right, _, _ = packed_vision_logprobs(model, out, torch.device("cpu"))
        pixels, grid = stack_vision(out.vision, "cpu")
        four = _positions(model, out)
        leaky = model(input_ids=p.input_ids, position_ids=four[1:], pixel_values=pixels, image_grid_thw=grid).logits
    leaked = torch.log_softmax(leaky[0, p.before].float(), -1).gather(-1, p.targets[:, None])[:, 0]
    assert float((right[p.valid] - out.rollout_logp[:, :p.response_len][p.valid]).abs().max()) < 1e-5
    assert float((leaked - out.rollout_logp[:, :p.response_len][p.valid]).abs().max()) > 1e-3


def _positions(model, samples) -> torch.Tensor:
    """The [4, 1, L] position ids packed_vision_logprobs gives the model (read back through a hook)."""
    from relax.train.vision_packing import packed_vision_logprobs

    seen = {}
    handle = model.register_forward_pre_hook(lambda m, args, kwargs: seen.update(kwargs), with_kwargs=True)
    try:
        packed_vision_logprobs(model, samples, torch.device("cpu"))
    finally:
        handle.remove()
    return seen["position_ids"]
