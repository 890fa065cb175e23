"""The rows of agent runs that forked: every branch of a run through the training gateway trained, each sampled token
once, with its run's reward and advantage.

An agent program's run (`data.openai_agent`) is one sample of its group: scoring, groups, dynamic sampling, the
buffer, checkpoints and the ledger see one row per run (its main row). A run that forked (a side call, parallel calls,
a choice not continued, a segment left by an edit) carries its other rows in its episode record (`branch_rows`, one
per other branch: its whole token context, `generated` 1 on the sampled tokens it owns; `relax.serve.openai.sessions`).
The training batch gets them here (`expand`): each run's rows consecutive, its main row first, each with its run's
sample id, reward, finish reason and group. Batch sizes in rows therefore vary; what the configuration counts stays
runs: a global batch (`train.global_batch_size`) is that many runs with all their rows (`global_batch_rows`), and
micro-batches, data-parallel shards and the loss denominators take any number of rows. A row counts as one response
where a loss reduces per response.

Advantages (`branch_advantages`). The algorithm's advantage function sees groups of `rollout.n_samples_per_prompt`
consecutive rows, one per run. A run with B rows is laid out in B layers: layer b holds, for each run, its b-th row,
or a stand-in with no valid token (its run's main row, masked) where it has fewer; each layer is a whole batch of
groups in order. One call over the layers then gives every row exactly what its run's row would get: a group
statistic (GRPO, RLOO, the REINFORCE++ baseline) reads the group's rewards, the same in every layer (a row's reward is
its run's); a per-token one (PPO's GAE, REINFORCE++'s KL returns, distillation) reads the row's own tokens; whitening
(`algorithm.normalize_advantages`) runs over every valid token of every row. The advantage hook's metrics are those of
the main rows alone (the batch without the other rows: the stand-ins would count as empty responses).

Rewards. With `data.turn_rewards=episode` each row of a run trains with the run's reward. With `per_turn`, a call's
reward (`POST /v1/relax/reward`) sits on the last token of its answer in the row that owns it, and the rest of the
run's reward (what no call was given: `data.reward`, the agent's return value) on the last model token of every row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Optional

import torch

from relax.algorithms.base import AdvantageInputs, AdvantageOutput
from relax.batch import EpisodeRow, Samples, episode_samples

BRANCH_ROWS = "branch_rows"  # the episode record's key of a run's other rows (relax.serve.openai.agents)


@dataclass
class Expanded:
    """A batch with every run's rows: `samples` (each run's rows consecutive, its main row first), `run` [N'] the row of
    the run in the batch it was expanded from, `layer` [N'] 0 for a main row, b for a run's b-th other row."""

    samples: Samples
    run: torch.Tensor
    layer: torch.Tensor

    @property
    def layers(self) -> int:
        return int(self.layer.max()) + 1 if len(self.layer) else 1


def has_branches(samples: Samples) -> bool:
    """Whether a row of `samples` carries other rows of its run."""
    return samples.episodes is not None and any(e.get(BRANCH_ROWS) for e in samples.episodes)


def _lists(samples: Samples, i: int) -> dict:
    """Row `i` of `samples` as the lists a record's other rows are kept as (its prompt's real tokens, its present
    response tokens)."""
    prompt = samples.prompt_ids[i][samples.prompt_mask[i] != 0].tolist()
    n = int((samples.present()[i] != 0).sum())
    out = {"prompt": prompt, "ids": samples.response_ids[i, :n].tolist(), "logp": samples.rollout_logp[i, :n].tolist(),
           "generated": samples.response_mask[i, :n].tolist(), "version": samples.versions()[i, :n].tolist()}
    if samples.saved_old_logp is not None:
        out["saved_old_logp"] = samples.saved_old_logp[i, :n].tolist()
    if samples.constrained is not None:
        out["constrained"] = samples.constrained[i, :n].tolist()
    return out


def _rows_as_samples(rows: list[dict], base: Samples, run: list[int], records: list, pad_token_id: int) -> Samples:
    """`rows` (lists, as `_lists` gives them) as `Samples`, each with the sample id and finish reason of its run (a row
    of `base`) and `base`'s other fields."""
    if base.vision is not None or base.routed_experts is not None:
        raise ValueError("branch rows: images and routed experts are not carried by the gateway's rows")
    built = episode_samples(
        [EpisodeRow(r["prompt"], r["ids"], r["logp"], r["generated"],
                    [v * g for v, g in zip(r["version"], r["generated"], strict=True)], base.finish_reason[j], rec,
                    r.get("constrained"))
         for r, j, rec in zip(rows, run, records, strict=True)],
        torch.tensor(run, dtype=torch.long), pad_token_id)
    saved = None
    if any("saved_old_logp" in r for r in rows):
        saved = torch.full(built.response_ids.shape, float("nan"))
        for i, r in enumerate(rows):
            if "saved_old_logp" in r and r["ids"]:
                saved[i, :len(r["ids"])] = torch.tensor(r["saved_old_logp"], dtype=torch.float32)
    sid = None if base.sample_id is None else base.sample_id[torch.tensor(run, dtype=torch.long)].clone()
    return replace(base, prompt_ids=built.prompt_ids, prompt_mask=built.prompt_mask, response_ids=built.response_ids,
                   response_mask=built.response_mask, rollout_logp=built.rollout_logp,
                   finish_reason=built.finish_reason, sample_id=sid, token_version=built.token_version,
                   saved_old_logp=saved, token_mask=built.token_mask, episodes=records, vision=None,
                   routed_experts=None, constrained=built.constrained)


def _row_record(record: dict, turn_rewards: list, layer: int) -> dict:
    """A row's episode record in the expanded batch: its run's, without the other rows' lists, with the turn rewards
    of the answers it owns (`turn_rewards`) and the sum of those of all the run's rows (`run_turn_rewards`)."""
    own = [record.get("row_turn_rewards", record["turn_rewards"])] + [o["turn_rewards"]
                                                                      for o in record.get(BRANCH_ROWS) or []]
    out = {k: v for k, v in record.items() if k != BRANCH_ROWS}
    out.update(turn_rewards=list(turn_rewards), run_turn_rewards=float(sum(sum(t) for t in own)), branch=layer)
    return out


def expand(samples: Samples, pad_token_id: int = 0) -> Expanded:
    """`samples` with every run's other rows after its main row (see the module docstring); without any, the same
    samples (run = row, one layer)."""
    N = len(samples)
    if not has_branches(samples):
        return Expanded(samples, torch.arange(N), torch.zeros(N, dtype=torch.long))
    rows, run, layer, records = [], [], [], []
    for i, record in enumerate(samples.episodes):
        rows.append(_lists(samples, i))
        run.append(i)
        layer.append(0)
        records.append(_row_record(record, record.get("row_turn_rewards", record["turn_rewards"]), 0))
        for b, other in enumerate(record.get(BRANCH_ROWS) or [], start=1):
            rows.append(other)
            run.append(i)
            layer.append(b)
            records.append(_row_record(record, other["turn_rewards"], b))
    out = _rows_as_samples(rows, samples, run, records, pad_token_id)
    return Expanded(out, torch.tensor(run, dtype=torch.long), torch.tensor(layer, dtype=torch.long))


def per_turn_rewards(x: Expanded, rewards: torch.Tensor) -> torch.Tensor:
    """[N'] what `relax.runner.rollout_driver.scoring.turn_token_rewards` takes for the expanded rows with
    `data.turn_rewards=per_turn`: a row's own turn rewards plus the part of its run's reward `rewards` [N] that no call
    was given (so that its turns hold its own calls' rewards and its last token that part)."""
    own = torch.tensor([sum(e["turn_rewards"]) for e in x.samples.episodes], dtype=torch.float32)
    given = torch.tensor([e.get("run_turn_rewards", sum(e["turn_rewards"])) for e in x.samples.episodes],
                         dtype=torch.float32)
    return rewards[x.run].to(torch.float32) - given + own


def branch_advantages(compute: Callable[[AdvantageInputs], AdvantageOutput], inputs: AdvantageInputs,
                      layer: torch.Tensor) -> AdvantageOutput:
    """The advantages of `inputs`' rows (each run's rows consecutive, its main row first (`layer` 0), whole groups of
    runs in order) by the algorithm's `compute`, laid out in layers (see the module docstring)."""
    layer = layer.to(torch.long)
    if len(layer) == 0 or int(layer.max()) == 0:
        return compute(inputs)
    main = (layer == 0).nonzero().squeeze(-1)
    K, B, M = len(main), int(layer.max()) + 1, len(layer)
    run = torch.cumsum((layer == 0).to(torch.long), 0) - 1  # [M]: the run (0..K-1) of each row
    index = main.repeat(B)  # [B*K]: layer-major; a stand-in is its run's main row
    real = torch.zeros(B * K, dtype=torch.bool)
    slots = layer * K + run
    index[slots] = torch.arange(M)
    real[slots] = True

    def take(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if x is None else x[index.to(x.device)]

    mask = take(inputs.mask) * real.to(inputs.mask.device, inputs.mask.dtype)[:, None]
    rewards = take(inputs.rewards)
    if rewards.dim() == 2:  # token rewards: a stand-in has none
        rewards = rewards * real.to(rewards.device, rewards.dtype)[:, None]
    layered = AdvantageInputs(rewards=rewards, mask=mask, group_size=inputs.group_size,
                              old_logp=take(inputs.old_logp), ref_logp=take(inputs.ref_logp),
                              values=take(inputs.values), teacher_logp=take(inputs.teacher_logp),
                              stopped=take(inputs.stopped), lengths=take(inputs.lengths))
    out = compute(layered)
    back = slots.to(out.advantages.device)
    metrics = compute(_select(inputs, main)).metrics  # the main rows' (without the stand-ins)
    return AdvantageOutput(advantages=out.advantages[back],
                           returns=None if out.returns is None else out.returns[back], metrics=metrics)


def _select(inputs: AdvantageInputs, rows: torch.Tensor) -> AdvantageInputs:
    values = {f.name: getattr(inputs, f.name) for f in fields(inputs)}
    return AdvantageInputs(**{k: (v[rows.to(v.device)] if isinstance(v, torch.Tensor) else v)
                              for k, v in values.items()})


def run_starts(sample_id: Optional[torch.Tensor]) -> Optional[list[int]]:
    """The first row of each run in a training batch whose runs have several rows (consecutive rows with one sample
    id); None when every row is its own run."""
    if sample_id is None or len(sample_id) < 2:
        return None
    new = torch.cat([torch.ones(1, dtype=torch.bool), sample_id[1:] != sample_id[:-1]])
    if bool(new.all()):
        return None
    return new.nonzero().squeeze(-1).tolist()


def global_batch_rows(bounds: list[int], starts: Optional[list[int]], rows: int) -> list[int]:
    """Row boundaries of global batches whose `bounds` count runs (see `run_starts`); `bounds` as they are when every
    row is its own run."""
    if starts is None:
        return bounds
    at = starts + [rows]
    return [at[min(b, len(starts))] for b in bounds]


def fill_saved_old_logprobs(samples: Samples, logprobs: Callable[[Samples, int], torch.Tensor], version: int,
                            pad_token_id: int = 0) -> None:
    """`RolloutStream.save_old_logprobs` for a run's other rows: their tokens older than `version`, under their own
    weights, kept in their lists (`saved_old_logp`), which a resumed trainer reads back through `expand`."""
    if not has_branches(samples):
        return
    x = expand(samples, pad_token_id)
    others = (x.layer > 0).nonzero().squeeze(-1)
    part = x.samples.select(others)
    stale = part.response_mask.bool() & (part.versions() < version)
    if not bool(stale.any()):
        return
    known = part.saved_old_logp if part.saved_old_logp is not None else torch.full(stale.shape, float("nan"))
    logp = torch.where(stale, logprobs(part, version).float()[:, :stale.shape[1]], known)
    k = 0
    for e in samples.episodes:
        for other in e.get(BRANCH_ROWS) or []:
            other["saved_old_logp"] = logp[k, :len(other["ids"])].tolist()
            k += 1
