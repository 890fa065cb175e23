"""Rewards of a rollout batch, as the loop trains them: the task's reward calls, the groups they leave out, DAPO's
overlong penalty, and which groups carry a learning signal (dynamic sampling, `rollout.filter_groups`).

The rollout stream scores each batch as soon as it is generated (`Scorer.score`, in its scoring thread), so rewards of
the asynchronous modes are computed while the trainer trains and the engines generate the next batch; dynamic
sampling scores each round in the pump to decide whether to generate another; evaluation scores its own responses
with the same function.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from relax.agents.episode import conversation
from relax.batch import FinishReason, Samples
from relax.config.schema import RelaxConfig
from relax.metrics import RULE_REWARD_MEAN, SANDBOX_TIMEOUT_FRAC
from relax.rewards.calls import MESSAGES, RewardContext, reward_inputs
from relax.rewards.combined import RewardList, score_list
from relax.rewards.registry import Scores, score_responses, warn_failed_score
from relax.rewards.remote import RemoteReward, RewardServiceError
from relax.rewards.shaping import overlong_penalty
from relax.rewards.worker_pool import wake_calls
from relax.runner.errors import RunError


def score(cfg: RelaxConfig, tokenizer: Any, reward_fn: Any, samples: Samples, items: Sequence[Any], n: int,
          reward_model: Any = None, cancel: Optional[threading.Event] = None) -> Scores:
    """Decode the responses and score them against their prompt's label (`n` responses per item); with
    `data.reward_error=raise` the first failing call stops the run, with its traceback.

    Episodes (`samples.episodes`): the reward is the sum of the rewards their environment or agent loop gave, plus
    the reward function's on the model's last message (`reward_fn` None, `data.reward=none`: the former only).

    `reward_model` (a `relax.runner.reward_model.RewardModelScorer`, reward_model=classifier|judge): its scores are
    added by weight (`with_reward_model`).

    A list `data.reward` (`reward_fn` a `relax.rewards.combined.RewardList`): the weighted sum of its entries
    (`data.reward_weights`), each entry's rewards kept for its metric (`score_list`).

    `cancel` (`Scorer.cancel`): set from another thread, it stops the reward calls in worker processes
    (CallsCancelled)."""
    if reward_model is not None:
        scores = score(cfg, tokenizer, reward_fn, samples, items, n, cancel=cancel) if reward_fn is not None or \
            samples.episodes is not None else Scores(rewards=[0.0] * len(samples), failed=[False] * len(samples))
        return with_reward_model(cfg, tokenizer, samples, items, n, scores, reward_model)

    episodes = samples.episodes
    if episodes is not None:
        texts = [e["actions"][-1] if e["actions"] else "" for e in episodes]
        given = [sum(e["turn_rewards"]) for e in episodes]
        if reward_fn is None:
            scores = _agent_failures(cfg, episodes, Scores(rewards=given, failed=[False] * len(given)))
            if scores.first_error is not None and cfg.data.reward_error == "raise":
                raise RunError(f"{episode_source(cfg)} failed (data.reward_error=raise):\n{scores.first_error}")
            return scores
    else:
        texts = [tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
                 for ids, mask in zip(samples.response_ids, samples.response_mask, strict=True)]
    labels = [item.label for item in items for _ in range(n)]
    prompts = [item.prompt_text for item in items for _ in range(n)]
    try:
        contexts = reward_contexts(items, n, episodes, image_urls=reads_messages(reward_fn))
    except (ValueError, OSError) as e:  # a prompt's images read again for the reward: the record or file is gone
        raise RunError(f"the reward reads the conversation (messages), whose images cannot be given to it: {e}") \
            from None
    if isinstance(reward_fn, RemoteReward):  # batched requests with the run's data.reward_service options
        reward_fn.options = cfg.data.reward_service
    try:
        if isinstance(reward_fn, RewardList):
            scores = score_list(reward_fn, cfg.data.reward_weights, texts, labels, prompts,
                                timeout_s=cfg.data.reward_timeout_s, service_options=cfg.data.reward_service,
                                contexts=contexts, workers=cfg.data.reward_workers,
                                memory_mb=cfg.data.reward_memory_mb, cancel=cancel)
        else:
            scores = score_responses(reward_fn, texts, labels, prompts, timeout_s=cfg.data.reward_timeout_s,
                                     contexts=contexts, workers=cfg.data.reward_workers,
                                     memory_mb=cfg.data.reward_memory_mb, cancel=cancel)
    except RewardServiceError as exc:  # past data.reward_service.max_errors: the run stops with its message
        raise RunError(str(exc)) from None
    if episodes is not None:
        scores.rewards = [r + g if not bad else r for r, g, bad in zip(scores.rewards, given, scores.failed,
                                                                       strict=True)]
    if episodes is not None:
        reward_error = scores.first_error
        _agent_failures(cfg, episodes, scores)
        if reward_error is None and scores.first_error is not None and cfg.data.reward_error == "raise":
            raise RunError(f"{episode_source(cfg)} failed (data.reward_error=raise):\n{scores.first_error}")
    if scores.first_error is not None and cfg.data.reward_error == "raise":
        raise RunError(f"data.reward={cfg.data.reward} failed (data.reward_error=raise):\n{scores.first_error}")
    return scores


def reads_messages(fn: Any) -> bool:
    """Whether a reward reads `messages` (a service always sends them; a function asks by a parameter's name or
    `**kwargs`): only then are its images encoded as data URLs (`reward_contexts`), work a reward of the response and
    label alone (the built-in tasks') does not pay for each step."""
    if isinstance(fn, RewardList):
        return any(reads_messages(f) for f in fn.fns)
    if isinstance(fn, RemoteReward):
        return True
    try:
        inputs = reward_inputs(fn)
    except ValueError:  # (refused at start; whatever it is, it gets the images)
        return True
    return inputs.rest or any(what == MESSAGES for _, what in inputs.named)


def reward_contexts(items: Sequence[Any], n: int, episodes: Optional[list[dict]] = None,
                    image_urls: bool = True) -> list[RewardContext]:
    """What each response's reward may ask for (`relax.rewards.calls.RewardContext`), `n` responses per item: its
    prompt text, its messages (the prompt's; an episode's: its conversation, `relax.agents.episode.conversation`)
    and its record's fields. Images (a vision-language policy's prompts, an environment's image observations) are
    OpenAI `image_url` parts with PNG data URLs in the messages (`relax.data.images.image_url_messages`): a reward
    service or function sees the images the task shows, never a bare image part; the prompt's are encoded once per
    item. `image_urls` False (a reward that reads no messages: `reads_messages`) leaves the image parts as they
    are."""
    from relax.data.images import image_data_url, image_url_messages, reference_images

    out = []
    urls: dict[int, list[str]] = {}  # the prompt's images as data URLs, by item
    for i, item in enumerate(item for item in items for _ in range(n)):
        messages = getattr(item, "messages", None)
        if messages is None:
            messages = [{"role": "user", "content": item.prompt_text}]
        if episodes is not None:
            messages = conversation(episodes[i], messages)
        if image_urls and _has_image_part(messages):
            if id(item) not in urls:
                urls[id(item)] = [image_data_url(im) for im in reference_images(getattr(item, "images", None))]
            messages = image_url_messages(messages, urls[id(item)])
        out.append(RewardContext(prompt=item.prompt_text, messages=copy.deepcopy(list(messages)),
                                 fields=dict(getattr(item, "fields", None) or {})))
    return out


def _has_image_part(messages: Sequence[Any]) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") == "image" for p in m["content"]) for m in messages)


def with_reward_model(cfg: RelaxConfig, tokenizer: Any, samples: Samples, items: Sequence[Any], n: int,
                      scores: Scores, reward_model: Any) -> Scores:
    """`scores` (the rule reward's: data.reward, an episode's turn rewards; zeros with neither) combined with the
    reward model's: rule_weight * rule + weight * model score. A response the model gave no score (a failed call, an
    answer without a readable score) fails like a failed reward call: its group is left out, never scored 0, and the
    batch's first such failure is warned of as data.reward's are (`warn_failed_score`); with
    `data.reward_error=raise` the run stops. A call that timed out counts in rollout/reward_timeouts as a reward
    call's time-out does (unless the response's rule reward had already failed: one failure per response)."""
    episodes = samples.episodes
    if episodes is not None:
        texts = [e["actions"][-1] if e["actions"] else "" for e in episodes]
    else:
        texts = [tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
                 for ids, mask in zip(samples.response_ids, samples.response_mask, strict=True)]
    rm = cfg.reward_model
    model = reward_model.score([item for item in items for _ in range(n)], texts)
    rule = cfg.data.reward != "none" or episodes is not None
    rule_weight = rm.rule_weight if rule else 0.0
    if rule:  # the rule reward before the model's score is added (rollout/rule_reward_mean)
        scores.extras[RULE_REWARD_MEAN] = [float("nan") if bad else r for r, bad in zip(scores.rewards, scores.failed,
                                                                                         strict=True)]
    for i, value in enumerate(model.values):
        if value is None:
            if not scores.failed[i] and i < len(model.timed_out) and model.timed_out[i]:
                scores.timeouts += 1  # a judge call past reward_model.timeout_s: a reward time-out (and error)
            scores.failed[i], scores.rewards[i] = True, 0.0
        elif not scores.failed[i]:
            scores.rewards[i] = rule_weight * scores.rewards[i] + rm.weight * value
    scores.model_scores = [float("nan") if v is None else float(v) for v in model.values]
    scores.parse_failures = sum(model.parse_failed)
    scores.model_time = model.seconds
    if model.first_error is not None:
        if cfg.data.reward_error == "raise":
            raise RunError(f"reward_model={rm.kind} failed (data.reward_error=raise): {model.first_error}")
        warn_failed_score(f"reward_model={rm.kind}", model.first_error)
        if scores.first_error is None:
            scores.first_error = f"reward_model={rm.kind}: {model.first_error}"
    return scores


def episode_source(cfg: RelaxConfig) -> str:
    """The option whose code ran a batch's episodes, with its value ("data.openai_agent=my_agents:run"): what a
    failed episode's warning and stop message name."""
    d = cfg.data
    for option, value in (("data.openai_agent", d.openai_agent), ("data.agent", d.agent), ("data.env", d.env)):
        if value:
            return f"{option}={value}"
    return f"data.tools={','.join(d.tools)}"


def _agent_failures(cfg: RelaxConfig, episodes: list[dict], scores: Scores) -> Scores:
    """Episodes that failed (`data.openai_agent`: the run raised, timed out or made no call; `data.env` /
    `data.agent`: a step or turn past `data.env_timeout_s`) as failed reward calls: their groups are left out, counted
    in rollout/reward_errors (time-outs in rollout/reward_timeouts), and the batch's first failure is warned of as
    data.reward's are (`warn_failed_score`), naming the option. `scores.first_error` (unless a reward call failed
    first) is that failure, prefixed with the option (`optimizer_steps.FailedRewardSteps` names it when it stops
    the run)."""
    first, failed = None, 0
    for i, e in enumerate(episodes):
        if e.get("error") and not scores.failed[i]:
            scores.failed[i], scores.rewards[i] = True, 0.0
            scores.timeouts += e.get("end") == FinishReason.TIMEOUT
            failed += 1
            if first is None:
                first = e["error"]
    if first is not None:
        what = episode_source(cfg)
        named = first.startswith(f"{what}: ")  # (an episode's time-out names its option itself)
        warn_failed_score(what, first[len(what) + 2:] if named else first, on=f"{failed} of {len(episodes)} episodes")
        if scores.first_error is None:
            scores.first_error = first if named else f"{what}: {first}"
    return scores


def kept_groups(failed: list[bool], group_size: int) -> torch.Tensor:
    """[N] bool: the responses of groups in which every reward call succeeded. A group with a failed call is left
    out whole (its statistics would compare real rewards with a placeholder)."""
    bad = torch.tensor(failed, dtype=torch.bool).view(-1, group_size).any(-1)
    return (~bad).repeat_interleave(group_size)


def overlong_penalties(cfg: RelaxConfig, samples: Samples) -> torch.Tensor | None:
    """[N] DAPO's overlong penalty of each response (`relax.rewards.shaping.overlong_penalty` with
    `data.overlong_buffer_len` and `data.overlong_penalty_factor`) by its tokens, the stop token included; None when
    `data.overlong_buffer_len=0`. An episode counts the model's tokens (not its observations) against its budget,
    `rollout.max_episode_tokens`."""
    d = cfg.data
    if d.overlong_buffer_len == 0:
        return None
    lengths = samples.response_mask.sum(1).tolist()
    limit = cfg.rollout.max_response_len if samples.episodes is None else cfg.rollout.max_episode_tokens
    return torch.tensor([overlong_penalty(int(n), limit, d.overlong_buffer_len, d.overlong_penalty_factor)
                         for n in lengths], dtype=torch.float32)


def trained_rewards(cfg: RelaxConfig, samples: Samples, scores: Scores) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([N] the rewards the algorithm trains on: the task's plus the overlong penalty when on, the penalty or None)."""
    rewards = torch.tensor(scores.rewards, dtype=torch.float32)
    penalty = overlong_penalties(cfg, samples)
    return (rewards if penalty is None else rewards + penalty), penalty


def turn_token_rewards(samples: Samples, rewards: torch.Tensor) -> torch.Tensor:
    """[N, T] the episodes' rewards on tokens (`data.turn_rewards=per_turn`): each turn's reward from its environment
    on the last token of that turn, and what the episode's reward `rewards` [N] holds beyond them (`data.reward` on
    the last message, the overlong penalty) on its last model token. A row's tokens add up to its reward."""
    out = torch.zeros(samples.response_ids.shape, dtype=torch.float32)
    gen = samples.response_mask.bool()
    ends = gen & ~torch.cat([gen[:, 1:], torch.zeros_like(gen[:, :1])], dim=1)  # last token of each model turn
    for r, episode in enumerate(samples.episodes):
        cols = ends[r].nonzero().squeeze(-1).tolist()
        turn = episode["turn_rewards"]
        if not cols:
            continue
        if len(cols) != len(turn):
            raise ValueError(f"episode {r}: {len(cols)} model turns in its tokens but {len(turn)} turn rewards")
        for c, value in zip(cols, turn, strict=True):
            out[r, c] += value
        out[r, cols[-1]] += float(rewards[r]) - sum(turn)
    return out


def group_signal(rewards: torch.Tensor, failed: Sequence[bool], group_size: int) -> list[bool]:
    """Per group: whether it carries a learning signal for a group baseline, i.e. every reward call succeeded and
    its rewards are not all equal. A group baseline gives an all-right or all-wrong group advantage 0 on every token;
    a batch-wide normalization after it (REINFORCE++-baseline always, algorithm.normalize_advantages=true) turns that
    0 into the batch's constant shift -mu/sigma, the same on all of the group's tokens, so it still ranks none of its
    responses above another (and dropping the group moves mu and sigma for the rest of the batch)."""
    r = rewards.view(-1, group_size)
    varied = r.amax(-1) > r.amin(-1)
    ok = ~torch.tensor(list(failed), dtype=torch.bool).view(-1, group_size).any(-1)
    return (varied & ok).tolist()


def choose_groups(signal: Sequence[bool], target: int) -> tuple[list[int], int]:
    """Dynamic sampling's choice among the groups generated for one batch, in draw order: the first `target` groups
    with a signal; if there are fewer, the batch is filled with the first groups without one. Returns (the chosen
    groups' indices, ascending; how many of them were filled in without a signal)."""
    if len(signal) < target:
        raise ValueError(f"choose_groups: {len(signal)} groups generated, fewer than the {target} needed")
    with_signal = [g for g, s in enumerate(signal) if s][:target]
    fill = [g for g, s in enumerate(signal) if not s][:target - len(with_signal)]
    return sorted(with_signal + fill), len(fill)


@dataclass
class FilterStats:
    """How dynamic sampling built one batch (`rollout.filter_groups`)."""

    rounds: int  # generation rounds
    generated_groups: int  # groups generated over the rounds
    no_signal_groups: int  # of those, groups without a learning signal
    filled_groups: int  # groups without a signal in the batch (too few with one after max_filter_rounds)
    generated_reward: float  # mean task reward of every response generated over the rounds (NaN: none scored)


def merge_scores(parts: Sequence[Scores]) -> Scores:
    """The scores of several batches, one after the other."""
    out = Scores()
    for p in parts:
        out.rewards.extend(p.rewards)
        out.failed.extend(p.failed)
        out.timeouts += p.timeouts
        for name, count in p.counts.items():
            out.counts[name] = out.counts.get(name, 0) + count
        if out.first_error is None:
            out.first_error = p.first_error
        for key in set(out.extras) | set(p.extras):  # (a key missing from some parts is NaN in their rows)
            before = out.extras.get(key, [float("nan")] * (len(out.rewards) - len(p.rewards)))
            out.extras[key] = before + list(p.extras.get(key, [float("nan")] * len(p.rewards)))
        if p.model_scores is not None:  # (a reward model scores every round or none)
            out.model_scores = (out.model_scores or []) + list(p.model_scores)
            out.parse_failures += p.parse_failures
            out.model_time += p.model_time
    return out


def count_metrics(scores: Scores) -> dict[str, float]:
    """Metrics of what the reward calls counted (`Scores.counts`): rollout/sandbox_timeout_frac when they ran code;
    and the means of what a reward is made of (`extra_metrics`)."""
    runs = scores.counts.get("sandbox_runs", 0)
    out = {SANDBOX_TIMEOUT_FRAC: scores.counts.get("sandbox_timeouts", 0) / runs} if runs else {}
    out.update(extra_metrics(scores))
    return out


def extra_metrics(scores: Scores) -> dict[str, float]:
    """Each of `Scores.extras` (a list data.reward's components, a dict return's other keys, the rule reward beside
    a reward model) as its mean over the responses whose reward calls all succeeded and that have a value (NaN when
    none has)."""
    out = {}
    for key, values in scores.extras.items():
        ok = [v for v, bad in zip(values, scores.failed, strict=True) if not bad and v == v]
        out[key] = sum(ok) / len(ok) if ok else float("nan")
    return out


def mean_reward(scores: Scores) -> float:
    """The mean of the rewards whose call succeeded (NaN if none did)."""
    ok = [r for r, bad in zip(scores.rewards, scores.failed, strict=True) if not bad]
    return sum(ok) / len(ok) if ok else float("nan")


def select_scores(scores: Scores, rows: Sequence[int]) -> Scores:
    """The scores of responses `rows` (the first error, the time-outs and the counts stay those of the whole batch)."""
    model = None if scores.model_scores is None else [scores.model_scores[i] for i in rows]
    return Scores([scores.rewards[i] for i in rows], [scores.failed[i] for i in rows], scores.first_error,
                  scores.timeouts, model_scores=model, parse_failures=scores.parse_failures,
                  model_time=scores.model_time, counts=dict(scores.counts),
                  extras={k: [v[i] for i in rows] for k, v in scores.extras.items()})


def scores_state(scores: Scores) -> dict:
    """`Scores` as plain values (for a checkpoint's rollout state, read with `torch.load(weights_only=True)`)."""
    return {"rewards": list(scores.rewards), "failed": list(scores.failed), "first_error": scores.first_error,
            "timeouts": scores.timeouts, "counts": dict(scores.counts),
            "model_scores": None if scores.model_scores is None else list(scores.model_scores),
            "parse_failures": scores.parse_failures, "model_time": scores.model_time,
            "extras": {k: list(v) for k, v in scores.extras.items()}}


class Scorer:
    """What the rollout stream calls on each generated batch: its reward calls (`score`), and which of its groups
    carry a learning signal (`signal`, for `rollout.filter_groups`)."""

    def __init__(self, cfg: RelaxConfig, tokenizer: Any, reward_fn: Any, reward_model: Any = None):
        """`reward_model`: the reward model's scorer (`relax.runner.reward_model.make_scorer`; None: none)."""
        self.cfg, self.tokenizer, self.reward_fn = cfg, tokenizer, reward_fn
        self.reward_model = reward_model
        self.group_size = cfg.rollout.n_samples_per_prompt
        self.cancelled = threading.Event()  # `cancel`: the stream closes, no batch is scored after

    def score(self, items: Sequence[Any], samples: Samples) -> Scores:
        return score(self.cfg, self.tokenizer, self.reward_fn, samples, items, self.group_size, self.reward_model,
                     cancel=self.cancelled)

    def cancel(self) -> None:
        """From another thread: stop the reward calls of the `score` in progress, or of one about to start (those in
        worker processes, under data.reward_timeout_s: it raises CallsCancelled); for good, the stream is closing."""
        self.cancelled.set()
        wake_calls()

    def signal(self, samples: Samples, scores: Scores) -> list[bool]:
        rewards, _ = trained_rewards(self.cfg, samples, scores)
        return group_signal(rewards, scores.failed, self.group_size)
