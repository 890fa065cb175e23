"""Image observations in multi-turn episodes (relax.agents.grid_walk, relax.agents.render, relax.rollout.vision): the
environment answers each turn with an image of the new grid, rendered with the template's image placeholder and
expanded by the processor; the embedded engine encodes each observation's image and places it at the model's own 3-D
positions; the trainer's log-probs of every turn's tokens equal the engine's (fp32), and with the observations'
images blanked on the trainer's side they do not (the negative control)."""

from __future__ import annotations

import pytest
import torch

from relax.agents.episode import EpisodeMaker
from relax.agents.loops import AgentFactory
from relax.batch import TrainBatch
from relax.config.schema import ModelConfig, TrainConfig
from relax.data.datasets import PromptDataset
from relax.data.grid_walk import generate_grid_walk
from relax.data.images import VisionData, build_tiny_vl_processor, build_tiny_vl_tokenizer, image_token_count
from relax.models.hf import build_model
from relax.rollout.embedded import EmbeddedEngine
from relax.rollout.vision import prompt_vision
from relax.train.torch_policy import TorchPolicy


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_vl_tokenizer()


@pytest.fixture(scope="module")
def processor(tokenizer):
    return build_tiny_vl_processor(tokenizer)


def _episodes(tokenizer, processor, items, n):
    maker = EpisodeMaker(AgentFactory("grid_walk", [], None, None), tokenizer, max_turns=4, max_tool_errors=1,
                         processor=processor)
    return maker.new_for(items, n)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_trainer_logprobs_equal_the_engines_over_every_turn_with_image_observations(arch, tokenizer, processor):
    records = [(r, f"grid:{i}") for i, r in enumerate(generate_grid_walk(2, seed=0))]
    items = list(PromptDataset.from_records(records, tokenizer, vision=VisionData(processor)))
    cfg = ModelConfig(name="tiny_vl", arch=arch, dtype="float32")
    policy = TorchPolicy(cfg, TrainConfig(), vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, seed=3,
                         device="cpu")
    # a turn also ends at any digit (a move): the rows' turns end apart
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    engine = EmbeddedEngine(build_model(cfg, len(tokenizer), tokenizer.pad_token_id, seed=3),
                            eos_token_ids=[tokenizer.eos_token_id, *digits], pad_token_id=tokenizer.pad_token_id)
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    # one row (its observations fed in chunks), then two prompts twice each (rows whose turns end apart: their
    # observations fed one token a step beside other rows' sampling)
    for some, n in ((items[:1], 1), (items, 2)):
        out = engine.generate([i.prompt_ids for i in some], n_samples_per_prompt=n, max_new_tokens=56, seed=0,
                              episodes=_episodes(tokenizer, processor, some, n), turn_limit=3,
                              vision=prompt_vision(some))
        turns = [e["turns"] for e in out.episodes]
        assert max(turns) >= 2, turns  # observations were fed
        ids = torch.cat([out.prompt_ids, out.response_ids], dim=1)
        mask = torch.cat([out.prompt_mask, out.present()], dim=1).bool()
        for row, v in enumerate(out.vision):  # the image tokens of prompt and observations = the processor's count
            assert int(((ids[row] == image_id) & mask[row]).sum()) == image_token_count(processor, v["image_grid_thw"])
            assert v["image_grid_thw"].shape[0] >= 1 + (out.episodes[row]["turns"] - 1) * (
                out.episodes[row]["end"] != "abort")
        generated = out.response_mask.bool()
        starts = {int((out.token_mask[r].bool() & ~generated[r]).nonzero()[0]) for r in range(len(out))
                  if out.episodes[r]["turns"] > 1}
        assert len(starts) >= min(len(out), 2), starts  # (one row; rows whose first observations start apart)
        logp = policy.compute_logprobs(out, micro_batch_size=len(out))
        assert float((logp - out.rollout_logp)[generated].abs().max()) < 1e-5
        # negative control: the observations' images blanked (the prompt's kept): the turns after them disagree
        blank = []
        for v, item in zip(out.vision, [i for i in some for _ in range(n)], strict=True):
            k = item.vision["pixel_values"].shape[0]
            pixels = v["pixel_values"].clone()
            pixels[k:] = 0
            blank.append({**v, "pixel_values": pixels})
        other = policy.compute_logprobs(TrainBatch.from_samples(out).with_(vision=blank), micro_batch_size=len(out))
        first_obs = out.token_mask.bool() & ~out.response_mask.bool()
        after = first_obs.cumsum(1) > 0
        assert float((other - out.rollout_logp)[generated & after].abs().max()) > 1e-3
        assert float((other - out.rollout_logp)[generated & ~after].abs().max()) < 1e-5


@pytest.mark.slow
def test_relax_train_on_grid_walk_scores_every_turn_with_its_images(in_process, small_run, tmp_path):
    """`relax-train model=tiny_vl data=grid_walk` (sync, in this process) for 2 steps: episodes of several turns
    whose observations are images; the trainer's old log-probs equal the engine's (fp32)."""
    from relax.config import load_config
    from relax.metrics import IMAGES_PER_SAMPLE, TRAIN_ROLLOUT_LOGP_ABS_DIFF, TURNS_MEAN
    from relax.runner.train import run

    cfg = load_config(small_run("model=tiny_vl", "data=grid_walk", "model.dtype=float32", "algorithm.use_tis=true",
                                "tracking.enabled=false", "rollout.rollout_batch_size=2",
                                "rollout.n_samples_per_prompt=2", "train.micro_batch_size=4"))
    result = run(cfg, output_dir=tmp_path / "out")
    assert [s for s, _ in result.history] == [0, 1]
    for _, m in result.history:
        assert m[TURNS_MEAN] > 1 and m[IMAGES_PER_SAMPLE] > 1  # observations were images
        assert m[TRAIN_ROLLOUT_LOGP_ABS_DIFF] < 1e-5


def test_an_episode_with_image_observations_interrupted_and_continued_is_scored_with_every_image(tokenizer,
                                                                                                 processor):
    """Partial rollout: episodes aborted mid-way (an image observation already appended) and continued from their
    prefix keep every image (the prompt's, the observations' before and after the abort); the trainer's log-probs equal
    the engine's over both parts."""
    from relax.batch import continuation, extend_responses

    records = [(r, f"grid:{i}") for i, r in enumerate(generate_grid_walk(2, seed=1))]
    items = list(PromptDataset.from_records(records, tokenizer, vision=VisionData(processor)))
    cfg = ModelConfig(name="tiny_vl", arch="qwen2_5_vl", dtype="float32")
    policy = TorchPolicy(cfg, TrainConfig(), vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, seed=3,
                         device="cpu")
    engine = EmbeddedEngine(build_model(cfg, len(tokenizer), tokenizer.pad_token_id, seed=3),
                            eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    maker = EpisodeMaker(AgentFactory("grid_walk", [], None, None), tokenizer, max_turns=4, max_tool_errors=1,
                         processor=processor)
    steps = iter(range(10_000))
    partial = engine.generate([i.prompt_ids for i in items], n_samples_per_prompt=2, max_new_tokens=60, seed=0,
                              episodes=maker.new_for(items, 2), turn_limit=3, vision=prompt_vision(items),
                              should_abort=lambda: next(steps) >= 3)  # in the second turn: past an observation
    assert set(partial.finish_reason) == {"abort"}
    assert all(v["image_grid_thw"].shape[0] >= 2 for v in partial.vision)  # an observation's image already in
    job = continuation(partial, 60)
    more = engine.generate(job.prompts, seed=0, sample_ids=job.sample_ids, positions=job.positions,
                           budgets=job.budgets, max_new_tokens=int(job.budgets.max()), turn_limit=3,
                           episodes=[maker.restore(e) for e in partial.episodes], vision=partial.vision)
    out = extend_responses(partial, more, pad_token_id=tokenizer.pad_token_id)
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ids = torch.cat([out.prompt_ids, out.response_ids], dim=1)
    present = torch.cat([out.prompt_mask, out.present()], dim=1).bool()
    for row, v in enumerate(out.vision):
        assert int(((ids[row] == image_id) & present[row]).sum()) == image_token_count(processor, v["image_grid_thw"])
    assert max(v["image_grid_thw"].shape[0] for v in out.vision) > min(v["image_grid_thw"].shape[0]
                                                                       for v in partial.vision)
    generated = out.response_mask.bool()
    logp = policy.compute_logprobs(out, micro_batch_size=len(out))
    assert float((logp - out.rollout_logp)[generated].abs().max()) < 1e-5


def test_an_observation_image_the_processor_refuses_is_a_data_error_naming_the_observation(tokenizer, processor):
    """An environment's image that the model's processor refuses (an aspect ratio over its limit of 200) stopped the
    run with the processor's bare ValueError, which named neither the environment nor the image; it is a DataError
    (a user's input, reported without a traceback) naming the observation and the image's size. Control: the same
    observation with a square image renders, its image tokens expanded."""
    from PIL import Image

    from relax.agents.render import ObservationRenderer
    from relax.data.files import DataError

    renderer = ObservationRenderer(tokenizer, processor)

    def observation(width: int, height: int) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (width, height))},
                                             {"type": "text", "text": "again"}]}]

    with pytest.raises(DataError, match=r"the environment's observation: its images \(2000x3 pixels\) cannot be "
                                        r"read by the model's processor: .*aspect ratio"):
        renderer.tokens(observation(2000, 3), None)
    ok = renderer.tokens(observation(56, 56), None)
    assert ok.vision["image_tokens"] == image_token_count(processor, ok.vision["image_grid_thw"]) > 0


@pytest.mark.parametrize("rollout", ["embedded", "sglang"])
def test_blank_images_makes_the_observations_grey_too(rollout, processor):
    """`data.blank_images=true` (the blind arm) blanks every image the policy sees: the grid an environment answers
    with (data=grid_walk) as well as the prompt's. Before, only the prompt's image was grey and the blind policy saw
    the real grid from its second turn on. Checked against the processor's own pixels of a grey image of the grid's
    size, and on rollout=sglang against the PNG data URL it sends (decoded). Control: blank_images=false gives the
    real grid's pixels, which differ from the grey ones."""
    import base64
    import io

    from PIL import Image

    from relax.config.compose import load_config
    from relax.data.grid_walk import render_grid
    from relax.data.images import BLANK_GREY

    def observation(blank: bool) -> tuple[list[dict], object]:
        cfg = load_config(["model=tiny_vl", "data=grid_walk", f"data.blank_images={str(blank).lower()}",
                           *(["rollout=sglang", "rollout.sglang.server=embedded"] if rollout == "sglang" else [])])
        maker = EpisodeMaker.for_config(cfg)
        try:
            loop = maker.loops()
            loop.reset({"label": "0,8"})  # agent top-left, goal bottom-right
            reply = loop.turn("4")  # one cell right: not at the goal, the new grid comes back
            return reply.messages, maker.renderer.tokens(reply.messages, None)
        finally:
            maker.close()

    messages, blind = observation(True)
    real = render_grid(1, 8)
    assert messages[0]["content"][0]["image"].tobytes() == real.tobytes()  # the environment answered the real grid
    grey = Image.new("RGB", real.size, BLANK_GREY)
    expected = processor.image_processor(images=[grey], return_tensors="pt")["pixel_values"].float()
    sighted = processor.image_processor(images=[real], return_tensors="pt")["pixel_values"].float()
    assert torch.equal(blind.vision["pixel_values"], expected)
    _, seen = observation(False)  # control: the sighted arm sees the grid
    assert torch.equal(seen.vision["pixel_values"], sighted)
    assert not torch.equal(sighted, expected)
    if rollout == "sglang":
        def decoded(url: str) -> bytes:
            return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB").tobytes()

        assert [decoded(u) for u in blind.vision["image_data"]] == [grey.tobytes()]
        assert [decoded(u) for u in seen.vision["image_data"]] == [real.tobytes()]
    else:
        assert "image_data" not in blind.vision
