"""Rollout and evaluation metrics of a generated batch (names in relax.metrics)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from relax.agents.protocol import END_REASONS
from relax.algorithms.rollout_correction import free_token_metrics, free_token_sums, mismatch_metrics
from relax.batch import FinishReason, Samples
from relax.metrics import (
    ABORTED_TOKENS,
    ENV_TIME,
    EPISODE_END,
    EPISODE_LEN,
    EVAL_MEAN_AT,
    EVAL_PASS_AT,
    EVAL_PREFIX,
    EVAL_RESPONSE_LEN,
    EVAL_REWARD_ERRORS,
    EVAL_TRUNCATED_FRAC,
    FILTER_FILLED_GROUPS,
    FILTER_GENERATED_RATIO,
    FILTER_ROUNDS,
    FILTERED_GROUP_FRAC,
    GATEWAY_BRANCHES,
    GATEWAY_SAMPLED_TOKENS,
    GATEWAY_SAMPLING_OVERRIDES,
    GATEWAY_SEGMENTS,
    GATEWAY_TRAINED_TOKENS,
    GATEWAY_UNTRAINED_TOKENS,
    GENERATED_REWARD,
    KV_REUSED_TOKENS,
    OBS_TOKEN_FRAC,
    OVERLONG_PENALIZED_FRAC,
    OVERLONG_PENALTY,
    PARTIAL_FRAC,
    RAW_REWARD,
    RESPONSE_LEN,
    REWARD_DROPPED_FRAC,
    REWARD_ERRORS,
    SAMPLING_DROPPED_MASS,
    STALENESS_HIST,
    STALENESS_MAX,
    STALENESS_MEAN,
    TOOL_CALLS_MEAN,
    TOOL_ERROR_FRAC,
    TRUNCATED_FRAC,
    TRUNCATED_MASKED_FRAC,
    TURNS_MEAN,
    eval_metric,
)
from relax.rewards.registry import Scores
from relax.rollout.vision import vision_metrics
from relax.runner.rollout_driver.scoring import FilterStats
from relax.tracking.progress import format_number


def _basic(samples: Samples, rewards: torch.Tensor, scored: torch.Tensor) -> tuple[float, float, float]:
    """(mean reward of the `scored` responses (NaN if none), mean response length, truncated share)."""
    lengths = samples.response_mask.sum(1).float()
    truncated = sum(r == FinishReason.LENGTH for r in samples.finish_reason) / max(len(samples), 1)
    reward = float(rewards[scored].mean()) if bool(scored.any()) else float("nan")
    return reward, float(lengths.mean()), truncated


def rollout_metrics(samples: Samples, rewards: torch.Tensor, kept: torch.Tensor, errors: int) -> dict[str, float]:
    """`kept` [N] bool: responses of groups that train (the others had a failed reward call in their group);
    `rollout/raw_reward` is their mean."""
    reward, length, truncated = _basic(samples, rewards, kept)
    out = {RAW_REWARD: reward, RESPONSE_LEN: length, TRUNCATED_FRAC: truncated, REWARD_ERRORS: float(errors),
           REWARD_DROPPED_FRAC: 1.0 - float(kept.float().mean())}
    if samples.dropped_mass == samples.dropped_mass:  # NaN: the engine does not report it (SGLang servers)
        out[SAMPLING_DROPPED_MASS] = samples.dropped_mass
    out.update(episode_metrics(samples))
    out.update(vision_metrics(samples))
    return out


def episode_metrics(samples: Samples) -> dict[str, float]:
    """Metrics of an agentic batch's episodes (`Samples.episodes`); {} for single-turn responses."""

    episodes = samples.episodes
    if not episodes:
        return {}
    n = len(episodes)
    calls = sum(e["tool_calls"] for e in episodes)
    present = samples.present()
    out = {TURNS_MEAN: sum(e["turns"] for e in episodes) / n,
           TOOL_CALLS_MEAN: calls / n,
           TOOL_ERROR_FRAC: sum(e["tool_errors"] for e in episodes) / calls if calls else 0.0,
           OBS_TOKEN_FRAC: float(samples.obs_mask().sum()) / max(1.0, float(present.sum())),
           EPISODE_LEN: float(present.sum(1).float().mean()),
           ENV_TIME: sum(e["env_time"] for e in episodes),
           KV_REUSED_TOKENS: sum(e["kv_reused"] for e in episodes) / n}
    for reason in END_REASONS:
        out[EPISODE_END + reason] = sum(r == reason for r in samples.finish_reason) / n
    if "segments" in episodes[0]:  # agent programs behind the OpenAI gateway
        out[GATEWAY_SEGMENTS] = sum(e["segments"] for e in episodes) / n
        out[GATEWAY_SAMPLING_OVERRIDES] = sum(e["sampling_overrides"] for e in episodes) / n
        sampled, trained = sum(e["sampled_tokens"] for e in episodes), sum(e["trained_tokens"] for e in episodes)
        out.update({GATEWAY_SAMPLED_TOKENS: sampled / n, GATEWAY_TRAINED_TOKENS: trained / n,
                    GATEWAY_UNTRAINED_TOKENS: (sampled - trained) / n,
                    GATEWAY_BRANCHES: sum(e.get("branches", 1) for e in episodes) / n})
    return out


def overlong_metrics(penalty: torch.Tensor, kept: torch.Tensor) -> dict[str, float]:
    """`penalty` [N]: each response's overlong penalty (<= 0); its mean and the share of responses it penalises, over
    the `kept` responses (those `rollout/raw_reward` averages; NaN if none)."""
    if not bool(kept.any()):
        return {OVERLONG_PENALTY: float("nan"), OVERLONG_PENALIZED_FRAC: float("nan")}
    p = penalty[kept]
    return {OVERLONG_PENALTY: float(p.mean()), OVERLONG_PENALIZED_FRAC: float((p < 0).float().mean())}


def filter_metrics(stats: FilterStats, batch_groups: int) -> dict[str, float]:
    """Dynamic sampling's share of groups without a signal, rounds, groups filled in without one and the samples
    generated per sample trained, for a batch of `batch_groups` groups built as `stats` says."""
    return {FILTERED_GROUP_FRAC: stats.no_signal_groups / max(stats.generated_groups, 1),
            FILTER_ROUNDS: float(stats.rounds),
            FILTER_FILLED_GROUPS: float(stats.filled_groups),
            FILTER_GENERATED_RATIO: stats.generated_groups / max(batch_groups, 1),
            GENERATED_REWARD: stats.generated_reward}


def truncated_masked_metrics(kept: torch.Tensor, trained: torch.Tensor) -> dict[str, float]:
    """Share of the rollout's responses of `kept` groups that `algorithm.mask_truncated` left out of the loss (not in
    `trained`)."""
    return {TRUNCATED_MASKED_FRAC: float((kept & ~trained).float().mean())}


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from `n` responses to a prompt of which `c` are correct: the probability that
    k of them drawn without replacement hold a correct one, 1 - C(n-c, k) / C(n, k) (Chen et al. 2021), computed as
    1 - prod_{i=n-c+1..n} (1 - k / i), without the large binomials."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct response
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def eval_metrics(eval_set: str, samples: Samples, scores: Scores, *, n: int, pass_k: Sequence[int],
                 threshold: float) -> dict[str, float]:
    """The metrics of eval set `eval_set` (named eval/<eval_set>/...), from `samples` holding `n` responses to each
    prompt (prompt-major) and their `scores`. A response is correct when its reward is >= `threshold`.

    Per prompt, over its scored responses (a failed reward call is left out, and counted): mean@n is their mean
    reward, pass@k the unbiased estimate `pass_at_k(scored, correct, k)` (a prompt with fewer than k scored responses
    is left out of pass@k); each is then averaged over the prompts (NaN when no prompt counts). Response length and
    truncated share are over all responses.
    """
    rewards = torch.tensor(scores.rewards, dtype=torch.float64).view(-1, n)
    ok = ~torch.tensor(scores.failed, dtype=torch.bool).view(-1, n)
    scored = ok.sum(1)
    correct = (ok & (rewards >= threshold)).sum(1)
    has = scored > 0
    means = (rewards * ok).sum(1)[has] / scored[has]
    lengths = samples.response_mask.sum(1).float()

    def name(metric: str) -> str:
        return eval_metric(eval_set, metric)

    out = {name(f"{EVAL_MEAN_AT}{n}"): float(means.mean()) if bool(has.any()) else float("nan")}
    for k in pass_k:
        values = [pass_at_k(int(m), int(c), k) for m, c in zip(scored, correct, strict=True) if m >= k]
        out[name(f"{EVAL_PASS_AT}{k}")] = sum(values) / len(values) if values else float("nan")
    out[name(EVAL_RESPONSE_LEN)] = float(lengths.mean())
    out[name(EVAL_TRUNCATED_FRAC)] = sum(r == FinishReason.LENGTH for r in samples.finish_reason) / max(len(samples), 1)
    out[name(EVAL_REWARD_ERRORS)] = float(scores.errors)
    return out


def final_eval_summary(history: Sequence[tuple[int, dict[str, float]]]) -> dict[str, str]:
    """The last evaluation in `history` ([(step, metrics)]) for the run's closing summary, a line per eval set:
    {"eval <set> (step s)": "mean@4 0.3125  pass@1 0.3125  pass@4 0.75"}; {} when the run logged none."""
    evaluated = [(step, m) for step, m in history if any(k.startswith(EVAL_PREFIX) for k in m)]
    if not evaluated:
        return {}
    step, metrics = evaluated[-1]
    out: dict[str, str] = {}
    # as logged: the sets in evaluation order, mean@n, then pass@k by k
    for key in (k for k in metrics if k.startswith(EVAL_PREFIX)):
        eval_set, _, metric = key[len(EVAL_PREFIX):].rpartition("/")
        for prefix, shown in ((EVAL_MEAN_AT, "mean@"), (EVAL_PASS_AT, "pass@")):
            if metric.startswith(prefix):
                label = f"eval {eval_set} (step {step})"
                value = f"{shown}{metric[len(prefix):]} {format_number(metrics[key])}"
                out[label] = f"{out[label]}  {value}" if label in out else value
    return out


def response_versions(samples: Samples) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] oldest, [N] newest) weight version over each response's tokens (both `weight_version` if empty)."""
    v, m = samples.versions(), samples.response_mask.bool()
    big = torch.iinfo(torch.long).max
    oldest = v.masked_fill(~m, big).min(1).values
    newest = v.masked_fill(~m, -1).max(1).values
    empty = ~m.any(1)
    oldest[empty] = samples.weight_version
    newest[empty] = samples.weight_version
    return oldest, newest


def latest_version_mask(samples: Samples) -> torch.Tensor:
    """[N, T] 1 on the tokens generated by their response's newest weight version (the others: an interrupted
    response's prefix, from older weights); what `rollout.mask_offpolicy_in_partial_rollout` keeps in the loss."""
    _, newest = response_versions(samples)
    return (samples.versions() == newest[:, None]).to(samples.response_mask.dtype) * samples.response_mask


def staleness_metrics(samples: Samples, step: int, max_staleness: int) -> dict[str, float]:
    """Staleness of the batch trained at `step` (trainer version `step`), its histogram over 0..max_staleness, and
    what partial rollout did to it."""
    oldest, newest = response_versions(samples)
    staleness = (step - oldest).float()
    older = samples.response_mask.bool() & (samples.versions() < newest[:, None])
    out = {STALENESS_MEAN: float(staleness.mean()), STALENESS_MAX: float(staleness.max()),
           PARTIAL_FRAC: float((oldest != newest).float().mean()), ABORTED_TOKENS: float(older.sum())}
    for s in range(max_staleness + 1):
        out[f"{STALENESS_HIST}{s}"] = float((staleness == s).float().mean())
    return out


def rollout_mismatch(algo_cfg, old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                     constrained: Optional[torch.Tensor] = None) -> dict[str, float]:
    """The train/rollout mismatch from the actor's log-probs of each token at the weights that generated it
    (`old_logp`) and the engine's: mean |difference| and max ratio over the valid tokens no grammar constrained
    (`constrained` [N, T]: 1 on those a grammar did, None: none), mean |difference| over those it did and their share
    of the valid tokens, and the rollout correction's diagnostics over all valid tokens
    (`relax.algorithms.rollout_correction.mismatch_metrics`): the mean |difference| and max ratio only where some
    valid token is free, the constrained ones' only where some is constrained. (TorchPolicy's `rollout_mismatch`
    measures the same from the first optimizer step when no old log-probs exist, through the same
    `free_token_sums`/`free_token_metrics`, and the rollout correction's diagnostics from the same log-ratios.)"""
    if not bool((mask != 0).any()):
        return {}
    return (free_token_metrics(free_token_sums(old_logp, rollout_logp, mask, constrained))
            | mismatch_metrics(algo_cfg, old_logp, rollout_logp, mask))
