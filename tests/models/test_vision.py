"""Vision-language models (relax.models.vision, relax.rollout.vision): the tiny Qwen-VL models built from config, the
engine's and the trainer's log-probs on image prompts (token-exact in fp32), image tokens per sample, each image
encoded once per prompt, the 3-D positions against the model's own, the frozen vision tower."""

from __future__ import annotations

import pytest
import torch

from relax.algorithms.base import AlgorithmConfig
from relax.batch import TrainBatch
from relax.config.schema import ModelConfig, TrainConfig
from relax.data.datasets import PromptDataset
from relax.data.images import VisionData, build_tiny_vl_processor, build_tiny_vl_tokenizer
from relax.data.shapes import generate_shapes
from relax.metrics import IMAGE_TOKEN_FRAC, IMAGES_PER_SAMPLE, VISION_ENCODE_TIME
from relax.models.hf import build_model
from relax.models.vision import check_image_tokens, mrope_positions, stack_vision, token_types, vision_core
from relax.rollout.embedded import EmbeddedEngine
from relax.rollout.vision import vision_metrics
from relax.train.torch_policy import TorchPolicy

ARCHS = ["qwen2_5_vl", "qwen3_vl"]


def _model_cfg(arch: str, **kw) -> ModelConfig:
    return ModelConfig(name="tiny_vl", arch=arch, dtype="float32", **kw)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_vl_tokenizer()


@pytest.fixture(scope="module")
def items(tokenizer):
    """Three shape prompts with an image each and one text-only prompt (a shorter row: left padding)."""
    records = [(r, f"shapes:{i}") for i, r in enumerate(generate_shapes(3, seed=0))]
    records.append(({"prompt": "what is the shape?", "label": "red"}, "text"))
    data = PromptDataset.from_records(records, tokenizer, vision=VisionData(build_tiny_vl_processor(tokenizer)))
    return list(data)


def _engine(model, tokenizer) -> EmbeddedEngine:
    return EmbeddedEngine(model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_vl_is_built_from_config_with_its_vision_tower(arch, tokenizer):
    model = build_model(_model_cfg(arch), len(tokenizer), tokenizer.pad_token_id, seed=0)
    n = sum(p.numel() for p in model.parameters())
    tower = sum(p.numel() for p in vision_core(model).visual.parameters())
    assert model.config.model_type == arch
    assert 100_000 < n < 1_000_000 and tower > 10_000
    assert model.config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    same = build_model(_model_cfg(arch), len(tokenizer), tokenizer.pad_token_id, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), same.state_dict().values(), strict=True))


@pytest.mark.parametrize("arch", ARCHS)
def test_trainer_logprobs_equal_the_engines_on_image_prompts(arch, tokenizer, items):
    """The key parity: the trainer's forward (TorchPolicy.compute_logprobs, micro-batches of 1 row, of all rows, and
    of a token budget of two rows: each row's image tokens whole in its micro-batch) at the
    generating weights gives the engine's log-probs of every sampled token, fp32, < 1e-5; with the images replaced by
    blank ones it does not (the images reach both sides)."""
    cfg = _model_cfg(arch)
    policy = TorchPolicy(cfg, TrainConfig(), vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, seed=3,
                         device="cpu")
    engine = _engine(build_model(cfg, len(tokenizer), tokenizer.pad_token_id, seed=3), tokenizer)
    out = engine.generate([i.prompt_ids for i in items], n_samples_per_prompt=2, max_new_tokens=5, seed=1,
                          vision=[i.vision for i in items])
    assert out.vision is not None and len(out.vision) == len(out)
    assert out.vision[0] is out.vision[1]  # a group shares its prompt's images
    assert out.vision[-1] is None  # the text-only prompt
    mask = out.response_mask.bool()
    width = out.prompt_ids.shape[1] + out.response_ids.shape[1]
    for mbs, max_tokens in ((1, None), (len(out), None), (len(out), 2 * width)):  # token budget: 2 rows each
        logp = policy.compute_logprobs(out, micro_batch_size=mbs, max_tokens=max_tokens)
        assert float((logp - out.rollout_logp)[mask].abs().max()) < 1e-5
    blank = [None if v is None else {**v, "pixel_values": torch.zeros_like(v["pixel_values"])} for v in out.vision]
    other = policy.compute_logprobs(TrainBatch.from_samples(out).with_(vision=blank), micro_batch_size=len(out))
    pictured = mask.clone()
    pictured[6:] = False  # the text-only prompt's two rows: no image to blank
    assert float((other - out.rollout_logp)[pictured].abs().max()) > 1e-3
    assert float((other - out.rollout_logp)[mask & ~pictured].abs().max()) < 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_positions_are_the_models_own(arch, tokenizer, items):
    """The explicit 3-D positions (left-padded rows) give the logits of the model's own forward, which computes them
    itself from mm_token_type_ids; rows are padded to a common width."""
    model = build_model(_model_cfg(arch), len(tokenizer), tokenizer.pad_token_id, seed=0).eval()
    width = max(len(i.prompt_ids) for i in items)
    ids = torch.tensor([[0] * (width - len(i.prompt_ids)) + i.prompt_ids for i in items])
    attn = torch.tensor([[0] * (width - len(i.prompt_ids)) + [1] * len(i.prompt_ids) for i in items])
    rows = [i.vision for i in items]
    pixels, grid = stack_vision(rows, "cpu")
    positions, delta = mrope_positions(model, ids, attn, grid)
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=attn, position_ids=positions, pixel_values=pixels,
                     image_grid_thw=grid).logits
        vision_core(model).rope_deltas = None
        theirs = model(input_ids=ids, attention_mask=attn, pixel_values=pixels, image_grid_thw=grid,
                       mm_token_type_ids=token_types(model, ids)).logits
    assert torch.allclose(ours[attn.bool()], theirs[attn.bool()], atol=1e-6)
    # the image's 2x2 merged grid: 4 tokens on (t, h, w) = (s, s+{0,0,1,1}, s+{0,1,0,1}); text after it goes on
    # from the image's largest position + 1, so the next position of a row is its length + delta
    row = positions[:, 0, attn[0].bool()]
    image = (ids[0, attn[0].bool()] == model.config.image_token_id).nonzero().squeeze(-1)
    s = int(row[0, image[0]])
    assert row[:, image].tolist() == [[s] * 4, [s, s, s + 1, s + 1], [s, s + 1, s, s + 1]]
    assert int(row[0, -1]) + 1 == int(attn[0].sum()) + int(delta[0])


def test_image_tokens_per_sample_are_checked(tokenizer, items):
    model = build_model(_model_cfg("qwen2_5_vl"), len(tokenizer), tokenizer.pad_token_id, seed=0)
    ids = torch.tensor([items[0].prompt_ids, items[1].prompt_ids])
    check_image_tokens(model, ids, [items[0].vision, items[1].vision])  # the processor's 4 tokens each
    with pytest.raises(ValueError, match="row 1: 4 image tokens but its images need 0"):
        check_image_tokens(model, ids, [items[0].vision, None])
    cut = ids.clone()
    cut[0, cut[0] == model.config.image_token_id] = tokenizer.pad_token_id
    with pytest.raises(ValueError, match="row 0: 0 image tokens but its images need 4"):
        check_image_tokens(model, cut, [items[0].vision, items[1].vision])


def test_each_image_is_encoded_once_per_prompt(tokenizer, items):
    """The vision tower sees each prompt's patches once, whatever the group size."""
    model = build_model(_model_cfg("qwen2_5_vl"), len(tokenizer), tokenizer.pad_token_id, seed=0)
    seen: list[int] = []
    vision_core(model).visual.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    engine = _engine(model, tokenizer)
    out = engine.generate([i.prompt_ids for i in items], n_samples_per_prompt=4, max_new_tokens=3, seed=0,
                          vision=[i.vision for i in items])
    patches = sum(i.vision["pixel_values"].shape[0] for i in items if i.vision is not None)
    assert seen == [patches] and len(out) == 4 * len(items)
    metrics = vision_metrics(out)
    image_tokens = int((out.prompt_ids == model.config.image_token_id).sum())
    assert metrics[IMAGES_PER_SAMPLE] == 3 / 4  # three of the four prompts have one image
    assert metrics[IMAGE_TOKEN_FRAC] == image_tokens / float(out.prompt_mask.sum() + out.response_mask.sum())
    assert metrics[VISION_ENCODE_TIME] == out.vision_time > 0


def test_lora_freezes_the_vision_tower_by_default(tokenizer, items):
    """With LoRA, model.freeze_vision_tower defaults to true: a training step changes adapters of the text model only;
    freeze_vision_tower=false trains the tower's adapters too."""
    def step(cfg: ModelConfig) -> tuple[TorchPolicy, dict]:
        policy = TorchPolicy(cfg, TrainConfig(lr=1e-2), vocab_size=len(tokenizer),
                             pad_token_id=tokenizer.pad_token_id, seed=0, device="cpu")
        engine = _engine(build_model(_model_cfg("qwen2_5_vl"), len(tokenizer), tokenizer.pad_token_id, seed=0),
                         tokenizer)
        out = engine.generate([i.prompt_ids for i in items[:3]], n_samples_per_prompt=2, max_new_tokens=3, seed=0,
                              vision=[i.vision for i in items[:3]])
        before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
        adv = torch.tensor([1.0, -1.0] * 3)[:, None] * out.response_mask
        batch = TrainBatch.from_samples(out, advantages=adv, old_logp=out.rollout_logp)
        policy.train_step(batch, AlgorithmConfig(), per_token=True, micro_batch_size=6)
        return policy, {n: not torch.equal(p, before[n]) for n, p in policy.model.named_parameters()}

    policy, changed = step(_model_cfg("qwen2_5_vl", lora_rank=4))
    assert any(c for n, c in changed.items() if "lora" in n and "visual" not in n)
    assert not any(c for n, c in changed.items() if "visual" in n)
    assert all(not p.requires_grad for n, p in policy.model.named_parameters() if "visual" in n)
    _, changed = step(_model_cfg("qwen2_5_vl", lora_rank=4, freeze_vision_tower=False))
    assert any(c for n, c in changed.items() if "visual" in n and "lora" in n)


def test_gradient_checkpointing_gives_the_same_gradients(tokenizer, items):
    """model.gradient_checkpointing=true recomputes the text model's and the vision tower's blocks in the backward:
    the same gradients (fp32) as without."""
    engine = _engine(build_model(_model_cfg("qwen2_5_vl"), len(tokenizer), tokenizer.pad_token_id, seed=0), tokenizer)
    out = engine.generate([i.prompt_ids for i in items[:2]], n_samples_per_prompt=2, max_new_tokens=3, seed=0,
                          vision=[i.vision for i in items[:2]])
    batch = TrainBatch.from_samples(out, advantages=torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None] * out.response_mask,
                                    old_logp=out.rollout_logp)
    grads = []
    for checkpointing in (False, True):
        policy = TorchPolicy(_model_cfg("qwen2_5_vl", gradient_checkpointing=checkpointing), TrainConfig(),
                             vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, seed=0, device="cpu")
        core = vision_core(policy.model)
        assert core.visual.gradient_checkpointing is checkpointing
        assert core.language_model.gradient_checkpointing is checkpointing
        policy.accumulate_gradients(batch, AlgorithmConfig(), per_token=True, micro_batch_size=4)
        grads.append({n: p.grad for n, p in policy.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("visual" in n for n in grads[0])
    assert all(torch.allclose(grads[0][n], grads[1][n], atol=1e-6) for n in grads[0])


def test_a_vision_language_directory_loads_through_model_path(tmp_path, tokenizer):
    """model.source=hf with a Qwen2.5-VL directory (the tiny model saved with its tokenizer, image processor and chat
    template, as a real checkpoint ships them): the model, tokenizer and processor load offline, and its samples'
    log-probs are the trainer's."""
    from relax.data.images import load_processor
    from relax.data.tokenizer import load_tokenizer

    built = build_model(_model_cfg("qwen2_5_vl"), len(tokenizer), tokenizer.pad_token_id, seed=5)
    built.save_pretrained(str(tmp_path))
    tokenizer.save_pretrained(str(tmp_path))
    build_tiny_vl_processor(tokenizer).image_processor.save_pretrained(str(tmp_path))
    cfg = ModelConfig(name="vl", source="hf", path=str(tmp_path), dtype="float32")
    loaded_tokenizer = load_tokenizer(cfg)
    processor = load_processor(cfg, loaded_tokenizer)
    item = PromptDataset.from_records([(generate_shapes(1, seed=0)[0], "r")], loaded_tokenizer,
                                      vision=VisionData(processor))[0]
    model = build_model(cfg, len(loaded_tokenizer), loaded_tokenizer.pad_token_id, seed=0)
    assert type(model) is type(built)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), built.state_dict().values(),
                                                 strict=True))
    out = _engine(model, loaded_tokenizer).generate([item.prompt_ids], n_samples_per_prompt=2, max_new_tokens=3,
                                                    seed=0, vision=[item.vision])
    policy = TorchPolicy(cfg, TrainConfig(), vocab_size=len(loaded_tokenizer),
                         pad_token_id=loaded_tokenizer.pad_token_id, seed=0, device="cpu")
    logp = policy.compute_logprobs(out, micro_batch_size=2)
    assert float((logp - out.rollout_logp)[out.response_mask.bool()].abs().max()) < 1e-5


def test_samples_with_images_survive_a_checkpoints_rollout_state(tmp_path, tokenizer, items):
    """What a resume reads back of buffered samples and prompt items with images (the rollout stream's state, written
    and read as a checkpoint does: torch.load(weights_only=True)) equals what was written."""
    import dataclasses

    from relax.batch import Samples
    from relax.data.datasets import PromptItem
    from relax.runner.checkpoint import read_rollout_state, write_rollout_state
    from relax.runner.rollout_driver.stream import _items_state, samples_state

    model = build_model(_model_cfg("qwen2_5_vl"), len(tokenizer), tokenizer.pad_token_id, seed=0)
    out = _engine(model, tokenizer).generate([i.prompt_ids for i in items], n_samples_per_prompt=2, max_new_tokens=2,
                                             seed=0, vision=[i.vision for i in items])
    write_rollout_state(tmp_path, {"samples": samples_state(out), "items": _items_state(items)})
    state = read_rollout_state(tmp_path)
    back = Samples(**state["samples"])
    assert len(back.vision) == len(out) and back.vision[-1] is None
    for a, b in zip(back.vision, out.vision, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a["pixel_values"], b["pixel_values"]) and a["image_tokens"] == b["image_tokens"]
            assert torch.equal(a["image_grid_thw"], b["image_grid_thw"])
    restored = [PromptItem(**d) for d in state["items"]]
    assert [dataclasses.astuple(i)[:5] for i in restored] == [dataclasses.astuple(i)[:5] for i in items]
    assert torch.equal(restored[0].vision["pixel_values"], items[0].vision["pixel_values"])
