"""Routed experts of multi-turn episodes over rollout=sglang (`relax.rollout.sglang.episodes`): the engine manager
(`SGLangEngines`) drives `data=guess_number` episodes of tiny_moe on the embedded server (in this process, real HTTP;
tests/sglang/test_routed_experts.py sends routes through the real router), a `/generate` request per turn.

Each row's routes, joined over its turns, equal Hugging Face's router on the served model at every token the engine
fed (every token but each row's last), and each token keeps the routes of the first request that fed it: later
turns' answers are altered at the prompt's positions (a hook on the client), and the rows' routes still equal Hugging
Face's (taking a later answer's routes there would not). A trainer whose routers disagree replays them on every fed
token (agreement 1).
"""

from __future__ import annotations

import pytest
import torch

from relax.config import load_config
from relax.data.datasets import PromptDataset
from relax.data.tasks import generate_guess_number
from relax.data.tokenizer import load_tokenizer, stop_token_ids
from relax.models.moe import recorded_mask
from relax.rollout.sglang.client import GenerateClient
from relax.rollout.sglang.routes import decode, encode
from relax.runner.rollout_driver.sglang_engines import SGLangEngines
from relax.serve.sglang.server import EmbeddedServer
from tests.sglang.test_routed_experts import _hf_routes, _same

MODEL = ["model=tiny_moe", "model.dtype=float32", "seed=3", "rollout.routing_replay=true"]


@pytest.fixture(scope="module")
def server():
    srv = EmbeddedServer(load_config(MODEL), port=0, threads=1)
    srv.start()
    try:
        srv.wait_ready(120)
        yield srv
    finally:
        srv.shutdown()


def test_episode_routes_are_each_tokens_first_and_the_trainer_replays_them(server, tmp_path):
    from relax.config.schema import TrainConfig
    from relax.models.hf import build_model
    from relax.models.moe import moe_routers
    from relax.train.torch_policy import TorchPolicy

    cfg = load_config([*MODEL, "data=guess_number", "rollout=sglang", f"rollout.sglang.urls=[{server.url}]",
                       "rollout.sglang.release_memory=false", "rollout.n_samples_per_prompt=4"])
    tokenizer = load_tokenizer(cfg.model)
    items = list(PromptDataset.from_records([(r, f"g:{i}") for i, r in enumerate(generate_guess_number(3, seed=0))],
                                            tokenizer))
    prompt_len = min(len(i.prompt_ids) for i in items)
    layers, k, experts = cfg.model.num_layers, cfg.model.num_experts_per_tok, cfg.model.num_experts
    eng = SGLangEngines(cfg, eos_token_ids=stop_token_ids(cfg.model, tokenizer), pad_token_id=tokenizer.pad_token_id,
                        log_dir=tmp_path, start_server=None)
    eng.urls = [server.url]
    eng.client = GenerateClient(server.url, request_timeout_s=60)
    generate, rounds = eng.client.generate, []

    def altered(payloads: list[dict]) -> list[dict]:
        """After the first round, every answer's routes at the prompt's positions (fed by the first round) moved to
        other experts: the join must keep the first round's."""
        answers = generate(payloads)
        rounds.append(len(payloads))
        if len(rounds) > 1:
            for a in answers:
                r = decode(a["meta_info"]["routed_experts"], layers, k).clone()
                r[:prompt_len] = (r[:prompt_len] + 1) % experts
                a["meta_info"]["routed_experts"] = encode(r)
        return answers

    eng.client.generate = altered
    try:
        G = cfg.rollout.n_samples_per_prompt
        s = eng.generate([i.prompt_ids for i in items], torch.arange(len(items) * G), seed=0, items=items)
    finally:
        eng.episodes.close()
    assert len(rounds) >= 3 and max(e["turns"] for e in s.episodes) >= 3  # multi-turn episodes
    P = s.prompt_ids.shape[1]
    present = torch.cat([s.prompt_mask, s.present()], 1).bool()
    fed = present.clone()
    fed[torch.arange(len(s)), P + s.present().sum(1) - 1] = False  # each row's last token: never fed
    assert torch.equal(recorded_mask(s.routed_experts, experts).all(-1), fed)
    model = build_model(cfg.model, len(tokenizer), tokenizer.pad_token_id, seed=cfg.seed, dtype=torch.float32).eval()
    assert bool(_same(_hf_routes(model, s), s.routed_experts)[fed].all())

    policy = TorchPolicy(cfg.model, TrainConfig(), vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         seed=cfg.seed, device="cpu", num_threads=1, routing_replay=True)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the trainer's routers disagree with the engine's
        for r in moe_routers(policy.model):
            r.weight.add_(0.3 * r.weight.std() * torch.randn(r.weight.shape, generator=g))
    logp = policy.compute_logprobs(s, micro_batch_size=len(s))
    assert policy.routing.metrics()["rollout/router_agreement"] == 1.0
    assert torch.isfinite(logp).all()
