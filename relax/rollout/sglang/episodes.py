"""Agentic episodes over SGLang's protocol (`rollout=sglang` with `data.env`, `data.tools` or `data.agent`).

Each model turn is one `/generate` request whose `input_ids` are the episode's tokens so far (prompt, earlier turns as
sampled, observations as rendered: token in, token out), with the turn's limit as `max_new_tokens` and a
`sampling_seed` from (seed, sample id, response position), so a turn is the same whichever server answers it. The
episodes of a call advance in rounds: every running episode's next turn goes out at once, then each episode's agent
loop answers (`relax.agents.episode.turn_ends`: the round's environment steps run at the same time, so steps that
hang together cost one `data.env_timeout_s`) and its observation tokens are appended. Consecutive turns of an episode
extend the same prefix, which the router's cache-aware policy sends to the server that holds it in its radix cache.

An abort (partial rollout) ends the call after the round in flight: an episode interrupted inside a turn keeps that
turn's tokens (`Episode.partial`) and continues it on resume; one between turns keeps its observation.

A vision-language model's episodes (prompts with images, image observations: `relax.agents.render.VisionTokens`):
every turn's request carries SGLang's `image_data`, the images of every image placeholder its `input_ids` hold, in
their order: the prompt's, then each image observation's so far (kept as PNG data URLs, `VisionData.wire` and the
renderer's `wire`). The server places them into the placeholders and reports the prompt's token count, which must be
the ids sent (`parse_answer`). Each row's `Samples.vision` is its prompt's vision inputs followed by its
observations' (`relax.rollout.vision.merge_vision`), as the embedded engine's episodes give them, so the trainer
scores the whole episode with every image; a resumed row starts from those (its prompt then holds every placeholder
so far).

Routed experts (`rollout.routing_replay` / `record_routes` of a MoE model): each turn's answer routes every token
its request fed (the episode so far, then the turn's output but its last token); a row keeps, for each token, the
routes of the first request that fed it (the turn that sampled a token feeds it only in the next turn's request), so
that every token's route is the one the engine used when it was first fed, as the embedded engine's episodes record
them. An observation after the last turn was never fed: its tokens hold no route (`relax.models.moe.route_fill`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from relax.agents.episode import Episode, turn_ends
from relax.batch import EpisodeRow, FinishReason, Samples, episode_samples
from relax.rollout.sglang.client import Sampling, generate_payload, payload_images, sample_seed
from relax.rollout.sglang.routes import place
from relax.rollout.vision import merge_vision

Answer = tuple[list[int], list[float], FinishReason, int]  # parse_answer's (tokens, log-probs, finish reason, version)


@dataclass
class _Row:
    prompt: list[int]  # the prompt and the response before this call
    sample_id: int
    position: int  # response tokens before this call (where the sample's random stream continues)
    budget: int  # tokens this call may add
    episode: Episode
    ids: list[int] = field(default_factory=list)  # this call's tokens, the model's and the observations'
    logp: list[float] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    version: list[int] = field(default_factory=list)
    finish: str | None = None
    vision: Optional[dict] = None  # the images of `prompt`'s placeholders (None: none)
    observed: list[dict] = field(default_factory=list)  # the vision inputs of this call's image observations
    images: list[str] = field(default_factory=list)  # image_data: every placeholder's image so far, in order
    routes: Optional[torch.Tensor] = None  # [tokens fed so far, layers, k]: each token's first request's routes

    def route(self, answer_routes: Optional[torch.Tensor]) -> None:
        """Keep the routes of the tokens this turn's request fed for the first time."""
        if answer_routes is None:
            return
        if self.routes is None:
            self.routes = answer_routes
        elif answer_routes.shape[0] > self.routes.shape[0]:
            self.routes = torch.cat([self.routes, answer_routes[self.routes.shape[0]:]])

    def add(self, ids: list[int], logp: list[float], generated: int, version: int) -> None:
        self.ids += ids
        self.logp += logp
        self.generated += [generated] * len(ids)
        self.version += [version] * len(ids)

    def observe(self, obs: list[int]) -> None:
        """Append an observation's tokens; an image observation's images join the row's `image_data`."""
        vision = getattr(obs, "vision", None)
        if vision is not None:
            if not vision.get("image_data"):
                raise ValueError("an image observation has no image_data to send (its renderer was made without "
                                 "wire=True, which rollout=sglang needs)")
            self.observed.append(vision)
            self.images += list(vision["image_data"])
        self.add(list(obs), [0.0] * len(obs), 0, 0)


def run_episodes(send: Callable[[list[dict]], list[Answer]], prompts: list[list[int]], sample_ids: torch.Tensor,
                 positions: torch.Tensor, budgets: list[int], episodes: list[Episode], *, seed: int,
                 sampling: Sampling, turn_limit: int, aborted: Callable[[], bool], pad_token_id: int,
                 vision: Optional[list[Optional[dict]]] = None,
                 routes: Optional[tuple[int, int, int]] = None) -> Samples:
    """The episodes of rows `prompts` (one per row, the response so far included when resuming), each with `budgets`
    tokens to go; `send(payloads)` posts one round's `/generate` requests and returns their answers in order.
    `vision`: per row, the images of its prompt's placeholders (with their `image_data`), None for a row without.
    `routes`: (MoE layers, top-k, experts) when the requests ask for routed experts; `send` then returns (answers,
    each answer's decoded routes or None) and the samples carry `routed_experts` (see the module docstring)."""
    vision = [None] * len(prompts) if vision is None else list(vision)
    if len(vision) != len(prompts):
        raise ValueError(f"run_episodes: {len(vision)} vision inputs for {len(prompts)} rows")
    rows = [_Row(list(p), int(s), int(q), int(b), e, vision=v, images=payload_images(v) or [])
            for p, s, q, b, e, v in zip(prompts, sample_ids, positions, budgets, episodes, vision, strict=True)]
    live = list(rows)
    while live and not aborted():
        payloads = []
        for r in live:
            turn_left = turn_limit - len(r.episode.partial)
            payloads.append(generate_payload(r.prompt + r.ids, sampling,
                                             max_new_tokens=min(turn_left, r.budget - len(r.ids)),
                                             seed=sample_seed(seed, r.sample_id, r.position + len(r.ids)),
                                             image_data=list(r.images), routed_experts=routes is not None))
        answers, answer_routes = send(payloads) if routes is not None else (send(payloads), [None] * len(live))
        ended, turns = [], []  # the rows whose turn ended, and (episode, tokens, stop token, context) of each
        for r, (ids, logp, finish, version), fed in zip(live, answers, answer_routes, strict=True):
            r.route(fed)
            r.add(ids, logp, 1, version)
            if finish == FinishReason.ABORT:
                r.episode.partial += ids
                r.finish = FinishReason.ABORT
            elif finish == FinishReason.LENGTH and len(r.ids) >= r.budget:  # the episode's limit, not the turn's
                r.episode.end = r.finish = FinishReason.LENGTH
            else:
                ended.append(r)
                turns.append((r.episode, ids, ids[-1] if finish == FinishReason.STOP and ids else None,
                              len(r.prompt) + len(r.ids)))
        # the round's answers started together: steps that hang together cost one data.env_timeout_s
        for r, obs in zip(ended, turn_ends(turns), strict=True):
            if obs is None:
                r.finish = r.episode.end
            elif len(r.ids) + len(obs) >= r.budget:  # no room for a model token after the observation
                r.episode.end = r.finish = FinishReason.LENGTH
            else:
                r.observe(obs)
        live = [r for r in live if r.finish is None]
    for r in live:  # interrupted between turns: the observation is in, the next turn starts on resume
        r.finish = FinishReason.ABORT
    return _samples(rows, sample_ids, pad_token_id, routes)


def _samples(rows: list[_Row], sample_ids: torch.Tensor, pad_token_id: int,
             routes: Optional[tuple[int, int, int]] = None) -> Samples:
    out = episode_samples([EpisodeRow(r.prompt, r.ids, r.logp, r.generated, r.version, r.finish, r.episode.record())
                           for r in rows], sample_ids, pad_token_id)
    if routes is not None:
        layers, top_k, experts = routes
        P, T = out.prompt_ids.shape[1], out.response_ids.shape[1]
        out = replace(out, routed_experts=place([(len(r.prompt), len(r.ids), r.routes) for r in rows], P, T,
                                                layers, top_k, experts))
    if all(r.vision is None and not r.observed for r in rows):
        return out
    # each row's images in token order; the servers' vision-tower time is not reported over SGLang's protocol
    return replace(out, vision=[merge_vision(r.vision, r.observed) for r in rows], vision_time=float("nan"))
