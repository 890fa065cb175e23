"""Short human summaries of a resolved config (dry run, start of a run)."""

from __future__ import annotations

import dataclasses

from relax import algorithms
from relax.algorithms.base import loss_agg_mode
from relax.config.derive import agentic
from relax.config.schema import RelaxConfig

# the loss aggregation's fields: the train line shows the mode the loss uses (`_loss_agg`), not the setting
_LOSS_AGG_FIELDS = ("loss_agg_mode", "loss_scale_factor")


def _changed(obj) -> str:
    """Fields of an algorithm config that differ from the shared base defaults, plus its own keys."""
    base = {f.name for f in dataclasses.fields(algorithms.AlgorithmConfig)}
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name == "name" or f.name in _LOSS_AGG_FIELDS:
            continue
        if f.name not in base or value != f.default:
            out.append(f"{f.name}={value}")
    return " ".join(out)


def _reward_model(cfg: RelaxConfig) -> str:
    """The reward model beside data.reward, and the weights the two combine by ("" without one)."""
    rm = cfg.reward_model
    if rm.kind == "none":
        return ""
    rule = f"{rm.rule_weight:g} x data.reward + " if cfg.data.reward != "none" else ""
    return f"; reward_model={rm.kind}: {rule}{rm.weight:g} x its score"


def _reward(cfg: RelaxConfig) -> str:
    """data.reward as the summary shows it: the string, or a list's weighted sum ("1 x math + 0.2 x my_rewards:fmt")."""
    d = cfg.data
    if isinstance(d.reward, str):
        return d.reward
    weights = d.reward_weights if d.reward_weights is not None else [1.0] * len(d.reward)
    return " + ".join(f"{w:g} x {spec}" for w, spec in zip(weights, d.reward, strict=True))


def _loss_agg(cfg: RelaxConfig) -> str:
    """The aggregation the loss uses, by verl's name: algorithm.loss_agg_mode, or for auto the mode
    train.calculate_per_token_loss (resolved: the algorithm's default when unset) names; with its divisor for
    seq-mean-token-sum-norm."""
    a = cfg.algorithm
    mode = loss_agg_mode(a, bool(cfg.train.calculate_per_token_loss))
    if getattr(a, "loss_agg_mode", "auto") == "auto":
        return f"loss_agg_mode={mode} (auto)"
    factor = getattr(a, "loss_scale_factor", None)
    return f"loss_agg_mode={mode}" + (f" (loss_scale_factor={factor:g})" if factor is not None else "")


def _agent(cfg: RelaxConfig) -> str:
    """What answers the model's turns in an agentic run (data.env, data.tools, data.agent, data.openai_agent), for the
    data line: runs of one data set with different agents must not print the same header."""
    d = cfg.data
    parts = [f"env={d.env}" if d.env else "", f"tools=[{','.join(d.tools)}]" if d.tools else "",
             f"agent={d.agent}" if d.agent else "", f"openai_agent={d.openai_agent}" if d.openai_agent else ""]
    return "".join(f", {p}" for p in parts if p)


def config_summary(cfg: RelaxConfig) -> str:
    a, m, ro, t, d = cfg.algorithm, cfg.model, cfg.rollout, cfg.train, cfg.data
    model = m.path or m.name
    shaping = (f", overlong_buffer_len={d.overlong_buffer_len}, overlong_penalty_factor={d.overlong_penalty_factor}"
               if d.overlong_buffer_len else "")
    filtering = (f", filter_groups (rounds of {ro.over_sampling_batch_size} prompts, at most {ro.max_filter_rounds})"
                 if ro.filter_groups else "")
    # an episode's limits (the derived config's max_episode_tokens: the default resolved) only where there are turns
    episodes = (f", max_turns={ro.max_turns}, max_episode_tokens={ro.max_episode_tokens}" if agentic(cfg) else "")
    tokens = f" (<= {t.max_tokens_per_micro_batch} tokens)" if t.max_tokens_per_micro_batch is not None else ""
    tokens += " packed" if t.pack_sequences else ""
    lines = [
        f"algorithm  {a.name}  {_changed(a)}".rstrip(),
        f"model      {model} (source={m.source}, dtype={m.dtype})",
        f"data       {d.name} (reward={_reward(cfg)}{shaping}{_reward_model(cfg)}{_agent(cfg)})",
        f"rollout    {ro.backend}: {ro.rollout_batch_size} prompts x {ro.n_samples_per_prompt} samples, "
        f"max_response_len={ro.max_response_len}{episodes}, temperature={ro.temperature}{filtering}",
        f"train      {t.backend}: {t.num_rollout} rollouts{' (evaluation only)' if t.num_rollout == 0 else ''}, "
        f"global_batch_size={t.global_batch_size}, "
        f"micro_batch_size={t.micro_batch_size}{tokens}, steps/rollout={t.num_steps_per_rollout}, lr={t.lr}, "
        f"{_loss_agg(cfg)}, mode={t.mode}",
        f"tracking   {cfg.tracking.uri if cfg.tracking.enabled else 'off'} (experiment {cfg.tracking.experiment})",
        f"seed       {cfg.seed}",
    ]
    return "\n".join(lines)
