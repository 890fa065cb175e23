"""Partial rollout with routing replay (rollout.partial_rollout + rollout.routing_replay, docs/training.md "Mixture of
experts"): a response interrupted and continued under newer weights keeps, for every token, the experts the engine
routed it to when it first fed it (`relax.batch.extend_responses`), and the trainer replays exactly those.

The interruption is a hook (the engine's `should_abort`, true from its 4th check on); the continuation is the rollout
worker's own `resume` after a weight update whose routers differ (router weights perturbed), so that re-reading the
prefix routes it differently. The expected routes are independent of the engine: a plain Hugging Face forward of the
whole joined sequence under each version's weights (its routers' top-k), the first version's for the tokens fed
before the interruption, the second's from the prefix's last token on.
"""

from __future__ import annotations

import torch
from test_moe import _experts_seen, _hf_routes, _same_sets

from relax.batch import TrainBatch
from relax.config import load_config
from relax.config.schema import TrainConfig
from relax.data.tokenizer import load_tokenizer, stop_token_ids
from relax.models.hf import build_model
from relax.models.moe import moe_routers, recorded_mask
from relax.roles.workers import ModelInfo, RolloutWorker
from relax.train.routing import routes_in_layout
from relax.train.torch_policy import TorchPolicy
from relax.train.trainer import length_sorted_micro_batches

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def test_an_interrupted_and_resumed_response_keeps_every_tokens_routes_and_the_trainer_replays_them():
    cfg = load_config(["model=tiny_moe", "model.dtype=float32", "rollout.routing_replay=true",
                       "rollout.max_response_len=12", "rollout.n_samples_per_prompt=2", "tracking.enabled=false"])
    tokenizer = load_tokenizer(cfg.model)
    info = ModelInfo(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                     eos_token_ids=stop_token_ids(cfg.model, tokenizer))
    worker = RolloutWorker(cfg, info, threads=1)
    old = build_model(cfg.model, info.vocab_size, info.pad_token_id, seed=cfg.seed)  # the worker's weights
    new = build_model(cfg.model, info.vocab_size, info.pad_token_id, seed=cfg.seed)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for router in moe_routers(new):
            router.weight.add_(0.5 * router.weight.std() * torch.randn(router.weight.shape, generator=g))

    checks = []

    def interrupt() -> bool:  # after the 4th token of every row
        checks.append(1)
        return len(checks) >= 4

    first = worker.engine.generate(PROMPTS, n_samples_per_prompt=2, max_new_tokens=12, seed=3, temperature=1.0,
                                   should_abort=interrupt)
    aborted = [i for i, r in enumerate(first.finish_reason) if r == "abort"]
    assert len(aborted) >= 4
    partial = first.select(torch.tensor(aborted))
    worker.load_weights(new.state_dict(), version=1)
    joined = worker.resume(partial, seed=3)

    n = partial.response_mask.sum(1)
    total = joined.response_mask.sum(1)
    assert bool((total > n).all())  # every row went on after the interruption
    P = joined.prompt_ids.shape[1]
    # fed: every real token but each row's last (sampled, never fed)
    fed = torch.cat([joined.prompt_mask, joined.response_mask], 1).bool()
    fed[torch.arange(len(joined)), P + total - 1] = False
    column = torch.arange(fed.shape[1])[None, :]
    before = column < (P + n - 1)[:, None]  # fed before the interruption: the prompt, the prefix but its last token
    expected = torch.where(before[..., None, None], _hf_routes(old, joined), _hf_routes(new, joined))
    routes = joined.routed_experts
    assert routes.shape[:2] == fed.shape
    assert torch.equal(recorded_mask(routes, cfg.model.num_experts).all(-1), fed)  # recorded exactly where fed
    assert bool(_same_sets(routes, expected)[fed].all())  # every token, every layer
    # the negative control: re-reading the prefix under the new weights routes it otherwise (keeping the resumed
    # pass's routes of the prefix would fail the check above)
    reread = _same_sets(_hf_routes(new, joined), _hf_routes(old, joined))
    assert int((~reread)[fed & before].sum()) >= 5

    # the trainer replays every token's recorded experts: agreement 1, at the experts module of each layer
    policy = TorchPolicy(cfg.model, TrainConfig(), vocab_size=info.vocab_size, pad_token_id=info.pad_token_id,
                         seed=0, device="cpu", num_threads=1, routing_replay=True)
    seen = _experts_seen(policy.model)
    policy.compute_logprobs(TrainBatch.from_samples(joined), micro_batch_size=len(joined))
    assert policy.routing.metrics()["rollout/router_agreement"] == 1.0
    (rows,) = length_sorted_micro_batches(joined, len(joined), packed=False)  # the order the trainer ran them in
    want = routes_in_layout(joined.select(rows), False)  # [M, L, k] in the trainer's layout, -1: not recorded
    for layer, calls in enumerate(seen):
        assert len(calls) == 1
        known = (want[:, layer] >= 0).all(-1)
        assert calls[0].shape[0] == want.shape[0] and int(known.sum()) == int(fed.sum())
        assert bool(_same_sets(calls[0][known], want[known, layer]).all())
