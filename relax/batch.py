"""The tensors that move between roles. CPU tensors; every backend speaks these and nothing else.

Layout: prompts are LEFT-padded to a common width P and responses RIGHT-padded to a common width T,
so every response starts at column P of `sequences()`. Per-token tensors of the algorithms ([N, T])
are aligned with `response_ids`.

Episodes (agentic rollouts, `relax.agents`): a response is every token after the prompt, the model's turns and the
observations between them (tool results, environment feedback). `response_mask` is 1 on the tokens the policy
generated (the loss mask: every loss term, statistic and denominator reads it), `token_mask` 1 on every token of
the response, observations included (what the model attends to); a single-turn response has no observations and
`token_mask` None. A response's tokens are contiguous: `present()` is 1 on a prefix of each row.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from typing import Optional

import torch


class FinishReason(StrEnum):
    """Why a response (`Samples.finish_reason`) or an episode (its record's `end`) ended. Each member is its string
    (`FinishReason.ABORT == "abort"`, the same hash, format and JSON), so what was written as strings before reads the
    same; an agent loop may still end an episode with a string of its own (`Reply.end`). SGLang's and OpenAI's
    finish reasons are wire formats of their own, decoded and encoded where those protocols are spoken."""

    STOP = "stop"  # a stop token or string ended it (an episode: the model's final answer, no tool call, no env)
    LENGTH = "length"  # a token limit cut it (a turn's, or the episode's)
    ABORT = "abort"  # interrupted (partial rollout), to be continued
    # episodes only
    ENV_DONE = "env_done"  # the environment (or an agent loop) said done
    MAX_TURNS = "max_turns"  # rollout.max_turns turns taken (an OpenAI agent run: its calls)
    TOOL_ERRORS = "tool_errors"  # rollout.max_tool_errors tool calls failed
    # the end of an OpenAI agent run's session (its record's `end`; the row's finish reason is then STOP)
    TIMEOUT = "timeout"  # the run went past data.agent_timeout_s (an episode: a step past data.env_timeout_s)
    ERROR = "error"  # the run raised, or returned something other than a finite number or None
    DONE = "done"  # the run returned a reward (or None)


def plain_reason(reason: Optional[str]) -> Optional[str]:
    """`reason` as a plain `str` (a `FinishReason` member's value; anything else as it is). What `Samples` and episode
    records store: a checkpoint saves them with `torch.save` and reads them back with `weights_only=True`, which admits
    `str` but not the enum class, and a plain string pickles as before."""
    return reason.value if isinstance(reason, FinishReason) else reason


@dataclass
class Samples:
    """What a rollout returns: N responses, the responses of one prompt consecutive."""

    prompt_ids: torch.Tensor  # [N, P] long, left-padded
    prompt_mask: torch.Tensor  # [N, P] 1 on real prompt tokens
    response_ids: torch.Tensor  # [N, T] long, right-padded
    response_mask: torch.Tensor  # [N, T] 1 on generated tokens (the stop token included)
    rollout_logp: torch.Tensor  # [N, T] log-prob of each sampled token under the rollout engine
    finish_reason: list[str]  # FinishReason per response (ABORT: interrupted, to be continued), as plain strings
    weight_version: int = 0
    engine_time: float = 0.0  # seconds the rollout engine(s) spent generating these (0: not measured)
    vision_time: float = 0.0  # of which in a vision-language model's vision tower (relax.rollout.vision)
    # mean probability mass top-k/top-p removed per drawn token (relax.rollout.sampling); NaN: not reported
    dropped_mass: float = 0.0
    # [N] long: which sample each row is (prompt draw index * group size + index in the group); it keys the
    # sample's random stream (relax.rollout.sampling.counter_uniforms). None: not tracked.
    sample_id: Optional[torch.Tensor] = None
    # [N, T] long: the weight version that generated each response token (0 where masked). With partial
    # rollout a response can span versions; otherwise every token of a row has the same one. None: all
    # tokens are `weight_version`.
    token_version: Optional[torch.Tensor] = None
    # [N, T] fp32: the trainer's log-prob of each token under the weights that generated it, where already computed
    # (NaN: not yet). Kept with samples a checkpoint carries across a resume, whose older weights the resumed
    # trainer no longer has. None: nothing computed.
    saved_old_logp: Optional[torch.Tensor] = None
    # One entry per row, a prompt's images as its model's processor gave them ({"pixel_values", "image_grid_thw"},
    # relax.models.vision; the rows of a group share one) or None (no image). None: a text-only batch.
    vision: Optional[list] = None
    # [N, T] long: 1 on every response token, the model's and the observations' (see the module docstring). None:
    # no observations (the response is `response_mask`).
    token_mask: Optional[torch.Tensor] = None
    # One plain dict per row (`relax.agents.episode.Episode.record`): turns, tool calls and errors, rewards, time in
    # tools and environments, why the episode ended, its prompt item. None: single-turn rollout.
    episodes: Optional[list] = None
    # [N, P+T, L, k] uint8 (int16 past 254 experts): a mixture-of-experts model's top-k experts of every token of
    # `sequences()` in each of its L MoE layers, as the engine routed it (rollout.routing_replay; relax.models.moe);
    # 255 (int16: -1) where none was recorded (padding, a token never fed). None: not recorded.
    routed_experts: Optional[torch.Tensor] = None
    # [N, T] long: 1 on the generated tokens a grammar constrained (constrained decoding: their `rollout_logp` is of
    # the grammar's masked distribution, which the trainer's log-prob, of the whole vocabulary, is not; the OpenAI
    # gateway's calls under strict tools, a forced call, a response_format), 0 elsewhere. None: none constrained.
    constrained: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        # producers may hand in FinishReason members; the samples keep plain strings (see `plain_reason`)
        if any(isinstance(r, FinishReason) for r in self.finish_reason):
            self.finish_reason = [plain_reason(r) for r in self.finish_reason]

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    def versions(self) -> torch.Tensor:
        """[N, T] long: the weight version of every response token (`token_version`, else `weight_version`)."""
        if self.token_version is not None:
            return self.token_version
        return torch.full(self.response_ids.shape, self.weight_version, dtype=torch.long)

    def present(self) -> torch.Tensor:
        """[N, T]: 1 on every token of the response, observations included (what attention sees)."""
        return self.response_mask if self.token_mask is None else self.token_mask

    def obs_mask(self) -> torch.Tensor:
        """[N, T]: 1 on observation tokens (present, not generated by the policy)."""
        return self.present() * (1 - self.response_mask.clamp(max=1))

    def sequences(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [N, P+T], attention_mask [N, P+T]) of prompt followed by response (observations included)."""
        ids = torch.cat([self.prompt_ids, self.response_ids], dim=1)
        mask = torch.cat([self.prompt_mask, self.present()], dim=1)
        return ids, mask

    def select(self, index: torch.Tensor | slice) -> Samples:
        """Rows `index` of every tensor (a micro-batch, a shard)."""
        if isinstance(index, slice):
            rows = list(range(len(self)))[index]
        else:
            rows = index.tolist()
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                out[f.name] = value[index]
            elif isinstance(value, list):
                out[f.name] = [value[i] for i in rows]
            else:
                out[f.name] = value
        return type(self)(**out)


@dataclass
class TrainBatch(Samples):
    """Samples plus what the algorithm computed for them; optional tensors are [N, T]."""

    rewards: Optional[torch.Tensor] = None  # [N]
    advantages: Optional[torch.Tensor] = None
    old_logp: Optional[torch.Tensor] = None
    ref_logp: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None  # PPO critic targets
    old_values: Optional[torch.Tensor] = None  # PPO critic values at rollout time
    extras: dict = field(default_factory=dict)

    @classmethod
    def from_samples(cls, samples: Samples, **tensors: Optional[torch.Tensor]) -> TrainBatch:
        base = {f.name: getattr(samples, f.name) for f in fields(Samples)}
        return cls(**base, **tensors)

    def with_(self, **changes) -> TrainBatch:
        return replace(self, **changes)


@dataclass
class EpisodeRow:
    """One episode as lists, built token by token by a driver-side rollout (SGLang turns, OpenAI gateway
    sessions): its prompt, then every later token with its log-prob, whether the model generated it (1) or it was
    appended (0), and the weight version that generated it."""

    prompt: list[int]
    ids: list[int]
    logp: list[float]
    generated: list[int]
    version: list[int]
    finish: str
    record: dict  # Samples.episodes' entry
    constrained: Optional[list[int]] = None  # per token, 1 on a sampled token a grammar constrained (None: none)


def episode_samples(rows: list[EpisodeRow], sample_ids: torch.Tensor, pad_token_id: int) -> Samples:
    """`rows` as `Samples`: prompts left-padded, responses right-padded, `token_mask` 1 on every response token."""
    N, P = len(rows), max(len(r.prompt) for r in rows)
    T = max([len(r.ids) for r in rows] + [1])
    prompt_ids = torch.full((N, P), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(N, P, dtype=torch.long)
    ids = torch.full((N, T), pad_token_id, dtype=torch.long)
    logp = torch.zeros(N, T, dtype=torch.float32)
    generated = torch.zeros(N, T, dtype=torch.long)
    present = torch.zeros(N, T, dtype=torch.long)
    version = torch.zeros(N, T, dtype=torch.long)
    constrained = torch.zeros(N, T, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r.ids)
        prompt_ids[i, P - len(r.prompt):] = torch.tensor(r.prompt, dtype=torch.long)
        prompt_mask[i, P - len(r.prompt):] = 1
        if n:
            ids[i, :n] = torch.tensor(r.ids, dtype=torch.long)
            logp[i, :n] = torch.tensor(r.logp, dtype=torch.float32)
            generated[i, :n] = torch.tensor(r.generated, dtype=torch.long)
            version[i, :n] = torch.tensor(r.version, dtype=torch.long)
            present[i, :n] = 1
            if r.constrained is not None:
                constrained[i, :n] = torch.tensor(r.constrained, dtype=torch.long) * generated[i, :n]
    versions = version[generated.bool()]
    return Samples(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=ids, response_mask=generated,
                   rollout_logp=logp, finish_reason=[r.finish for r in rows],
                   weight_version=int(versions.min()) if len(versions) else 0,
                   dropped_mass=float("nan"),  # HTTP engines do not report what top-k/top-p removed
                   sample_id=torch.as_tensor(sample_ids, dtype=torch.long).clone(), token_version=version,
                   token_mask=present, episodes=[r.record for r in rows],
                   constrained=constrained if bool(constrained.any()) else None)


def _pad_to(x: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
    extra = width - x.shape[1]
    if extra == 0:
        return x
    pad = torch.full((x.shape[0], extra), value, dtype=x.dtype)
    return torch.cat([pad, x] if left else [x, pad], dim=1)


def concat_samples(parts: list[Samples], pad_token_id: int = 0) -> Samples:
    """Stack Samples of several engines, re-padding prompts (left) and responses (right) to common widths."""
    P = max(p.prompt_ids.shape[1] for p in parts)
    T = max(p.response_ids.shape[1] for p in parts)
    ids = [p.sample_id for p in parts]
    saved = None
    if any(p.saved_old_logp is not None for p in parts):
        saved = torch.cat([_pad_to(_unknown_if_none(p), T, float("nan"), False) for p in parts])
    constrained = None
    if any(p.constrained is not None for p in parts):
        constrained = torch.cat([_pad_to(p.constrained if p.constrained is not None
                                         else torch.zeros_like(p.response_mask), T, 0, False) for p in parts])
    present = None
    if any(p.token_mask is not None for p in parts):
        present = torch.cat([_pad_to(p.present(), T, 0, False) for p in parts])
    episodes = None
    if any(p.episodes is not None for p in parts):
        if any(p.episodes is None for p in parts):
            raise ValueError("concat_samples: episodes and single-turn responses in one batch")
        episodes = [e for p in parts for e in p.episodes]
    return Samples(
        prompt_ids=torch.cat([_pad_to(p.prompt_ids, P, pad_token_id, True) for p in parts]),
        prompt_mask=torch.cat([_pad_to(p.prompt_mask, P, 0, True) for p in parts]),
        response_ids=torch.cat([_pad_to(p.response_ids, T, pad_token_id, False) for p in parts]),
        response_mask=torch.cat([_pad_to(p.response_mask, T, 0, False) for p in parts]),
        rollout_logp=torch.cat([_pad_to(p.rollout_logp, T, 0.0, False) for p in parts]),
        finish_reason=[r for p in parts for r in p.finish_reason],
        weight_version=min(p.weight_version for p in parts),
        engine_time=max(p.engine_time for p in parts),  # engines run side by side
        vision_time=max(p.vision_time for p in parts),
        dropped_mass=sum(p.dropped_mass * float(p.response_mask.sum()) for p in parts)
        / max(1.0, float(sum(p.response_mask.sum() for p in parts))),
        sample_id=None if any(i is None for i in ids) else torch.cat(ids),
        token_version=torch.cat([_pad_to(p.versions() * p.response_mask, T, 0, False) for p in parts]),
        saved_old_logp=saved,
        vision=None if all(p.vision is None for p in parts) else
        [v for p in parts for v in (p.vision if p.vision is not None else [None] * len(p))],
        token_mask=present,
        episodes=episodes,
        routed_experts=_cat_routes(parts, P, T),
        constrained=constrained,
    )


def _cat_routes(parts: list[Samples], P: int, T: int) -> Optional[torch.Tensor]:
    """The parts' `routed_experts` re-padded to P prompt (left) and T response (right) columns."""
    if all(p.routed_experts is None for p in parts):
        return None
    if any(p.routed_experts is None for p in parts):
        raise ValueError("concat_samples: routed experts recorded for some parts only")
    out = []
    for p in parts:
        r, pp = p.routed_experts, p.prompt_ids.shape[1]
        full = torch.full((len(p), P + T, *r.shape[2:]), 255 if r.dtype == torch.uint8 else -1, dtype=r.dtype)
        full[:, P - pp:P + r.shape[1] - pp] = r
        out.append(full)
    return torch.cat(out)


def _unknown_if_none(samples: Samples) -> torch.Tensor:
    if samples.saved_old_logp is not None:
        return samples.saved_old_logp
    return torch.full(samples.response_ids.shape, float("nan"))


@dataclass
class Continuation:
    """What an engine needs to continue interrupted responses: one prompt per row (the original prompt followed by
    the response so far, observations included), the row's sample id, the response position it continues at and its
    remaining budget."""

    prompts: list[list[int]]
    sample_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N] response tokens so far
    budgets: torch.Tensor  # [N] tokens still allowed (the response's limit - positions)


def continuation(partial: Samples, max_response_len: int) -> Continuation:
    """The `Continuation` of `partial`'s rows (each with at least one token to go); `max_response_len`: the limit
    on a response's tokens (an episode's: `rollout.max_episode_tokens`)."""
    if partial.sample_id is None:
        raise ValueError("continuation: the interrupted samples carry no sample_id")
    present = partial.present()
    done = present.sum(1)
    if bool((done >= max_response_len).any()):
        raise ValueError("continuation: a row already has max_response_len tokens")
    prompts = [p[pm.bool()].tolist() + r[rm.bool()].tolist() for p, pm, r, rm in
               zip(partial.prompt_ids, partial.prompt_mask, partial.response_ids, present, strict=True)]
    return Continuation(prompts, partial.sample_id.clone(), done.clone(), max_response_len - done)


def extend_responses(prefix: Samples, continuation: Samples, pad_token_id: int = 0) -> Samples:
    """`prefix` rows (interrupted responses) followed by `continuation` (the same rows, generated from prompt +
    prefix): one response per row, its tokens, log-probs, versions and grammar marks (`constrained`) those of
    whichever part produced them, and each token's routed experts those recorded when the engine first fed it
    (`_extend_routes`)."""
    if len(prefix) != len(continuation):
        raise ValueError(f"extend_responses: {len(prefix)} prefix rows but {len(continuation)} continuations")
    a, b = prefix.present().sum(1), continuation.present().sum(1)
    T = int((a + b).max()) if len(prefix) else 0
    ids = torch.full((len(prefix), T), pad_token_id, dtype=torch.long)
    generated = torch.zeros(len(prefix), T, dtype=torch.long)
    logp = torch.zeros(len(prefix), T, dtype=torch.float32)
    version = torch.zeros(len(prefix), T, dtype=torch.long)
    pv, cv = prefix.versions(), continuation.versions()
    saved = None if prefix.saved_old_logp is None else torch.full((len(prefix), T), float("nan"))
    # the tokens a grammar constrained: each part's marks (a part without any: none of its tokens)
    held = (None if prefix.constrained is None and continuation.constrained is None
            else torch.zeros(len(prefix), T, dtype=torch.long))
    for i, (n, m) in enumerate(zip(a.tolist(), b.tolist(), strict=True)):
        if saved is not None:
            saved[i, :n] = prefix.saved_old_logp[i, :n]
        ids[i, :n], ids[i, n:n + m] = prefix.response_ids[i, :n], continuation.response_ids[i, :m]
        generated[i, :n], generated[i, n:n + m] = prefix.response_mask[i, :n], continuation.response_mask[i, :m]
        logp[i, :n], logp[i, n:n + m] = prefix.rollout_logp[i, :n], continuation.rollout_logp[i, :m]
        version[i, :n], version[i, n:n + m] = pv[i, :n], cv[i, :m]
        if held is not None and prefix.constrained is not None:
            held[i, :n] = prefix.constrained[i, :n]
        if held is not None and continuation.constrained is not None:
            held[i, n:n + m] = continuation.constrained[i, :m]
    mask = (torch.arange(T)[None, :] < (a + b)[:, None]).long()
    episodic = prefix.token_mask is not None or continuation.token_mask is not None
    tokens = float(generated.sum())
    return replace(
        prefix,
        response_ids=ids,
        response_mask=generated,
        token_mask=mask if episodic else None,
        episodes=continuation.episodes if continuation.episodes is not None else prefix.episodes,
        # a row's images: the prompt's and its observations' so far, which the continuation's carry on
        vision=continuation.vision if continuation.vision is not None else prefix.vision,
        rollout_logp=logp,
        finish_reason=list(continuation.finish_reason),
        weight_version=min(prefix.weight_version, continuation.weight_version),
        engine_time=prefix.engine_time + continuation.engine_time,
        vision_time=prefix.vision_time + continuation.vision_time,
        dropped_mass=(prefix.dropped_mass * float(prefix.response_mask.sum())
                      + continuation.dropped_mass * float(continuation.response_mask.sum())) / max(1.0, tokens),
        token_version=version,
        saved_old_logp=saved,
        constrained=held,
        routed_experts=_extend_routes(prefix, continuation, a, b, T),
    )


def _extend_routes(prefix: Samples, continuation: Samples, a: torch.Tensor, b: torch.Tensor,
                   T: int) -> Optional[torch.Tensor]:
    """The joined response's routed experts [N, P+T, L, k]: every token keeps the experts the engine routed it to
    when it first fed it. The prompt and the prefix tokens fed before the interruption: the prefix's (the weights
    that then sampled the next token); the prefix's last token (sampled, never fed before the interruption: no
    route recorded) and the continuation's tokens: the continuation's, which the engine recorded on resume. The
    continuation's routes of the prompt and prefix it re-read are not kept (they route those tokens again under
    newer weights, a second time)."""
    if prefix.routed_experts is None and continuation.routed_experts is None:
        return None
    if prefix.routed_experts is None or continuation.routed_experts is None:
        raise ValueError("extend_responses: routed experts recorded for the prefix or the continuation only")
    old, new = prefix.routed_experts, continuation.routed_experts
    P, Pc = prefix.prompt_ids.shape[1], continuation.prompt_ids.shape[1]
    fill = 255 if old.dtype == torch.uint8 else -1
    out = torch.full((len(prefix), P + T, *old.shape[2:]), fill, dtype=old.dtype)
    out[:, :P] = old[:, :P]
    for i, (n, m) in enumerate(zip(a.tolist(), b.tolist(), strict=True)):
        # the continuation's prompt is the row's prompt + its n prefix tokens (left-padded to Pc), then m new ones
        again = new[i, Pc - n:Pc + m].to(old.dtype)
        first = old[i, P:P + n]
        fed = (first != fill).flatten(1).all(1)  # recorded in every layer: fed before the interruption
        out[i, P:P + n] = torch.where(fed[:, None, None], first, again[:n])
        out[i, P + n:P + n + m] = again[n:]
    return out
