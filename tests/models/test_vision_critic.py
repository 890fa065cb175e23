"""The PPO critic of a vision-language model: its values see the rows' images (relax.train.torch_critic).

Checked against an independent computation: the value before response token t of a row is the value head over the
last hidden state of the model's own multimodal forward of that row's unpadded prefix alone (the prompt with its
image and the first t response tokens), one row at a time; padded micro-batches of any size and packed ones equal it,
and blank images change it (the images reach the critic).
"""

from __future__ import annotations

import pytest
import torch

from relax.batch import TrainBatch
from relax.config.schema import ModelConfig, TrainConfig
from relax.data.datasets import PromptDataset
from relax.data.images import VisionData, build_tiny_vl_processor, build_tiny_vl_tokenizer
from relax.data.shapes import generate_shapes
from relax.models.hf import build_model
from relax.models.vision import mrope_positions, stack_vision, vision_core
from relax.rollout.embedded import EmbeddedEngine
from relax.train.torch_critic import TorchCritic

ARCHS = ["qwen2_5_vl", "qwen3_vl"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_vl_tokenizer()


@pytest.fixture(scope="module")
def samples(tokenizer):
    """Three shape prompts with an image each and one text-only prompt, 2 samples each, from the embedded engine."""
    records = [(r, f"shapes:{i}") for i, r in enumerate(generate_shapes(3, seed=0))]
    records.append(({"prompt": "what is the shape?", "label": "red"}, "text"))
    items = list(PromptDataset.from_records(records, tokenizer,
                                            vision=VisionData(build_tiny_vl_processor(tokenizer))))
    model = build_model(ModelConfig(name="tiny_vl", arch="qwen2_5_vl", dtype="float32"), len(tokenizer),
                        tokenizer.pad_token_id, seed=0)
    engine = EmbeddedEngine(model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    return engine.generate([i.prompt_ids for i in items], n_samples_per_prompt=2, max_new_tokens=4, seed=1,
                           vision=[i.vision for i in items])


def _critic(arch: str, tokenizer, packed: bool = False) -> TorchCritic:
    critic = TorchCritic(ModelConfig(name="tiny_vl", arch=arch, dtype="float32"),
                         TrainConfig(pack_sequences=packed), vocab_size=len(tokenizer),
                         pad_token_id=tokenizer.pad_token_id, seed=3, device="cpu")
    with torch.no_grad():  # a value head that reads the state (it starts at zero: V = 0 everywhere)
        torch.manual_seed(0)
        critic.critic.value_head.weight.normal_()
        critic.critic.value_head.bias.fill_(0.1)
    return critic


def _by_hand(critic: TorchCritic, samples, row: int, t: int) -> float:
    """V(state before response token t) of `row`: its prompt and first t response tokens, without padding, alone."""
    model = critic.critic.lm
    prompt = samples.prompt_ids[row][samples.prompt_mask[row].bool()]
    ids = torch.cat([prompt, samples.response_ids[row, :t]])[None]
    vision = samples.vision[row]
    pixels, grid = stack_vision([vision], "cpu")
    positions, _ = mrope_positions(model, ids, torch.ones_like(ids), grid)
    with torch.no_grad():
        h = vision_core(model)(input_ids=ids, position_ids=positions, pixel_values=pixels, image_grid_thw=grid,
                               use_cache=False).last_hidden_state[0, -1]
        return float(critic.critic.value_head(h.float()))


# The value head is N(0, 1) over the hidden state, so the values reach 22 here, where float32's step is 1.9e-6: the
# batched, packed and by-hand forwards (different matmul shapes) round differently by two or three steps (3.8e-6 on
# MKL's default path, 5.7e-6 on MKL_CBWR=COMPATIBLE's). 1e-4 leaves room for another CPU's kernels; a value that
# misses its image moves by 4 or more (the control below), one wrong token in its prefix by 0.6 or more (measured).
VALUE_TOL = 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_critic_values_see_the_images(arch, tokenizer, samples):
    critic = _critic(arch, tokenizer)
    mask = samples.response_mask.bool()
    for mbs in (1, len(samples)):
        values = critic.compute_values(samples, micro_batch_size=mbs)
        for row in range(len(samples)):
            for t in range(int(mask[row].sum())):
                assert abs(float(values[row, t]) - _by_hand(critic, samples, row, t)) < VALUE_TOL, (mbs, row, t)
    packed = _critic(arch, tokenizer, packed=True).compute_values(samples, micro_batch_size=len(samples))
    assert float((packed - values)[mask].abs().max()) < VALUE_TOL
    blank = [None if v is None else {**v, "pixel_values": torch.zeros_like(v["pixel_values"])} for v in samples.vision]
    other = critic.compute_values(TrainBatch.from_samples(samples).with_(vision=blank), micro_batch_size=len(samples))
    pictured = mask.clone()
    pictured[6:] = False  # the text-only prompt's two rows: no image to blank
    assert float((other - values)[pictured].abs().max()) > 1e-3
    assert float((other - values)[mask & ~pictured].abs().max()) < VALUE_TOL


def test_critic_trains_on_image_prompts(tokenizer, samples):
    """A value step moves the values towards the returns (the loss drops), packed and padded alike."""
    from relax.algorithms import get

    algo = get("ppo").config_cls()
    batch = TrainBatch.from_samples(samples).with_(returns=torch.ones_like(samples.rollout_logp))
    losses = {}
    for packed in (False, True):
        critic = _critic("qwen2_5_vl", tokenizer, packed=packed)
        first = critic.train_step(batch, algo, per_token=True, micro_batch_size=3)
        second = critic.train_step(batch, algo, per_token=True, micro_batch_size=3)
        assert second["critic/value_loss"] < first["critic/value_loss"]
        losses[packed] = first["critic/value_loss"]
    # the first value loss is about 24 (float32's step there: 1.9e-6); packed and padded differ by up to three steps
    # (5.7e-6 measured, 2.4e-7 relative), one token left out of the loss moves it by 7% (measured)
    assert losses[True] == pytest.approx(losses[False], rel=1e-5, abs=0)
