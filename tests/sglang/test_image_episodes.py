"""Multi-turn episodes whose observations are images over rollout=sglang (`relax.rollout.sglang.episodes`): the engine
manager (`SGLangEngines`, rollout=sglang's own code) drives `data=grid_walk` episodes on the embedded SGLang server
(in this process, real HTTP; the router in front adds nothing here: tests/sglang/test_image_data.py sends image_data
through it). Every turn's request carries SGLang's `image_data`: the prompt's image, then each image observation's so
far, in placeholder order (checked against the environment's own grids replayed from the episode's actions; a request
with an observation's image dropped is refused by the server). The trainer's log-probs at the generating weights equal
the server's over every turn (fp32); with the observations' images blanked on the trainer's side they do not. An
episode interrupted between turns (partial rollout) and resumed sends every image so far and ends as the uninterrupted
one."""

from __future__ import annotations

import pytest
import requests
import torch

from relax.agents.grid_walk import GridWalk
from relax.batch import TrainBatch
from relax.config import load_config
from relax.data.datasets import PromptDataset
from relax.data.grid_walk import generate_grid_walk
from relax.data.images import (
    VISION_START,
    VisionData,
    build_tiny_vl_processor,
    build_tiny_vl_tokenizer,
    image_data_url,
    image_token_count,
)
from relax.data.tokenizer import stop_token_ids
from relax.rollout.sglang.client import GenerateClient, sample_seed
from relax.runner.rollout_driver.sglang_engines import SGLangEngines
from relax.serve.sglang.server import EmbeddedServer
from relax.train.torch_policy import TorchPolicy

# its tests share the module's server: one xdist worker runs them in a row
pytestmark = pytest.mark.xdist_group("sglang_image_episodes")

# the server's model and the trainer's: tiny_vl in fp32, seed 3 (both build it from the config)
MODEL = ["model=tiny_vl", "model.dtype=float32", "seed=3"]
IDS = torch.arange(4)  # 2 prompts x 2 samples


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_vl_tokenizer()


@pytest.fixture(scope="module")
def processor(tokenizer):
    return build_tiny_vl_processor(tokenizer)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def server(request):
    """The embedded server of tiny_vl with model.arch=`param`: (its URL, the run's overrides)."""
    overrides = [*MODEL, f"model.arch={request.param}"]
    srv = EmbeddedServer(load_config(overrides), port=0, threads=1)
    srv.start()
    try:
        srv.wait_ready(120)
        yield srv.url, overrides
    finally:
        srv.shutdown()


@pytest.fixture(scope="module")
def items(tokenizer, processor):
    """Two grid_walk prompts with their start grid as an image (kept as PNG data URLs for image_data)."""
    records = [(r, f"grid:{i}") for i, r in enumerate(generate_grid_walk(2, seed=0))]
    return list(PromptDataset.from_records(records, tokenizer, vision=VisionData(processor, wire=True)))


@pytest.fixture()
def engines(server, tokenizer, tmp_path):
    """`SGLangEngines` on the server (rollout.sglang.urls), its client's requests recorded in `engines.sent`
    (`engines.after_round(n)`: a hook after the n-th round's answers)."""
    url, overrides = server
    cfg = load_config([*overrides, "data=grid_walk", "rollout=sglang", f"rollout.sglang.urls=[{url}]",
                       "rollout.sglang.release_memory=false", "rollout.n_samples_per_prompt=2"])
    eng = SGLangEngines(cfg, eos_token_ids=stop_token_ids(cfg.model, tokenizer), pad_token_id=tokenizer.pad_token_id,
                        log_dir=tmp_path, start_server=None)
    eng.urls = [url]  # the server itself, without a router (`start` would put one in front)
    eng.client = GenerateClient(url, request_timeout_s=60)
    eng.sent, eng.after_round = [], lambda n: None
    generate = eng.client.generate

    def recorded(payloads: list[dict]) -> list[dict]:
        answers = generate(payloads)
        eng.sent.append(payloads)
        eng.after_round(len(eng.sent))
        return answers

    eng.client.generate = recorded
    try:
        yield eng
    finally:
        eng.episodes.close()


def _rows(out) -> list[list[int]]:
    """Each row's prompt and response tokens."""
    present = out.present().bool()
    return [p[m.bool()].tolist() + r[k].tolist()
            for p, m, r, k in zip(out.prompt_ids, out.prompt_mask, out.response_ids, present, strict=True)]


def _expected_images(input_ids: list[int], seed: int, rows: list[list[int]], out, row_items: list,
                     start: int) -> list[str]:
    """What a request's image_data must hold: its row's prompt image, then the grid the environment showed after each
    of the row's earlier moves (replayed from the episode's actions), one per observation its `input_ids` hold."""
    # the row: its tokens start with the request's and the request's seed is its sample's at that position (the two
    # prompts' token ids are the same: their grids differ only in the images)
    row = next(i for i, r in enumerate(rows) if r[:len(input_ids)] == input_ids and seed == sample_seed(
        0, int(out.sample_id[i]), len(input_ids) - len(row_items[i].prompt_ids)))
    item = row_items[row]
    observations = input_ids[len(item.prompt_ids):].count(start)
    env = GridWalk()
    env.reset({"label": item.label})
    shown = [image_data_url(env.step(action).observation[0]["image"])
             for action in out.episodes[row]["actions"][:observations]]
    return list(item.vision["image_data"]) + shown


def _check_requests(sent: list[list[dict]], out, row_items: list, tokenizer) -> int:
    """Every recorded request's image_data against `_expected_images` (`row_items`: each row's prompt item); how many
    held an observation's image."""
    start = tokenizer.convert_tokens_to_ids(VISION_START)
    rows = _rows(out)
    with_observations = 0
    for payload in (p for round_ in sent for p in round_):
        expected = _expected_images(payload["input_ids"], payload["sampling_params"]["sampling_seed"], rows, out,
                                    row_items, start)
        assert payload["image_data"] == expected
        with_observations += len(expected) > 1
    return with_observations


def test_trainer_logprobs_equal_the_servers_over_every_turn_with_image_observations(engines, items, tokenizer,
                                                                                     processor, server):
    out = engines.generate([i.prompt_ids for i in items], IDS, seed=0, items=items)
    assert max(e["turns"] for e in out.episodes) >= 3  # observations were fed, several per episode
    # each turn's request: the prompt's image and every observation's so far, in order
    row_items = [i for i in items for _ in range(2)]
    assert _check_requests(engines.sent, out, row_items, tokenizer) >= 2
    # negative control: the server refuses a request with an observation's image dropped
    last = next(p for round_ in reversed(engines.sent) for p in round_ if len(p["image_data"]) > 1)
    r = requests.post(f"{server[0]}/generate", json={**last, "image_data": last["image_data"][:-1]}, timeout=60)
    assert r.status_code == 400 and "image placeholders" in r.json()["error"]["message"], r.text
    # the rows' vision inputs: the prompt's image and each observation's, as many image tokens as the rows hold
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for row, (tokens, v) in enumerate(zip(_rows(out), out.vision, strict=True)):
        assert v["image_grid_thw"].shape[0] == tokens.count(tokenizer.convert_tokens_to_ids(VISION_START))
        assert tokens.count(image_id) == image_token_count(processor, v["image_grid_thw"]) == v["image_tokens"]
        assert v["image_grid_thw"].shape[0] >= out.episodes[row]["turns"]  # one per turn but the last
    cfg = engines.cfg
    policy = TorchPolicy(cfg.model, cfg.train, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         seed=cfg.seed, device="cpu")
    generated = out.response_mask.bool()
    logp = policy.compute_logprobs(out, micro_batch_size=len(out))
    assert float((logp - out.rollout_logp)[generated].abs().max()) < 1e-5
    # negative control: the observations' images blanked (the prompt's kept): the turns after them disagree
    blank = []
    for v, item in zip(out.vision, row_items, strict=True):
        pixels = v["pixel_values"].clone()
        pixels[item.vision["pixel_values"].shape[0]:] = 0
        blank.append({**v, "pixel_values": pixels})
    other = policy.compute_logprobs(TrainBatch.from_samples(out).with_(vision=blank), micro_batch_size=len(out))
    after = (out.token_mask.bool() & ~generated).cumsum(1) > 0
    assert float((other - out.rollout_logp)[generated & after].abs().max()) > 1e-3
    assert float((other - out.rollout_logp)[generated & ~after].abs().max()) < 1e-5


@pytest.mark.parametrize("server", ["qwen2_5_vl"], indirect=True)  # (resuming does not depend on the architecture)
def test_an_interrupted_image_episode_resumes_with_every_image(engines, items, tokenizer):
    """Partial rollout: `abort` after the second round (each running episode has an observation's image in), then
    `resume`: its requests send every image so far, and the episodes end as without the interruption."""
    prompts = [i.prompt_ids for i in items]
    full = engines.generate(prompts, IDS, seed=0, items=items)
    engines.sent.clear()
    engines.after_round = lambda n: engines.abort(1) if n == 2 else None
    cut = engines.generate(prompts, IDS, seed=0, items=items, gen_id=1)
    aborted = torch.tensor([k for k, f in enumerate(cut.finish_reason) if f == "abort"])
    assert len(aborted) >= 1
    partial = cut.select(aborted)
    assert all(v["image_grid_thw"].shape[0] >= 2 for v in partial.vision)  # an observation's image already in
    engines.sent.clear()
    engines.after_round = lambda n: None
    out = engines.resume(partial, seed=0, gen_id=2)
    expected = full.select(aborted)
    assert torch.equal(out.response_ids, expected.response_ids) and out.finish_reason == expected.finish_reason
    assert [len(v["image_data"]) for v in out.vision] == [len(v["image_data"]) for v in expected.vision]
    assert all(torch.equal(a["pixel_values"], b["pixel_values"]) for a, b in zip(out.vision, expected.vision,
                                                                                  strict=True))
    assert _check_requests(engines.sent, out, [items[int(k) // 2] for k in aborted], tokenizer) >= 1
