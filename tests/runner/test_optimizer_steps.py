"""The optimizer steps of a rollout: global batches of train.global_batch_size rows, or, with
train.use_dynamic_global_batch_size, of equal shares of the rollout's response tokens."""

from __future__ import annotations

import pytest
import torch

from relax.batch import TrainBatch
from relax.config import ConfigError, load_config
from relax.runner.optimizer_steps import global_batches, token_bounds


def batch_with(lengths: list[int]) -> TrainBatch:
    """Rows whose responses have `lengths` tokens (row index in every token, to tell rows apart)."""
    T = max(lengths)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    n = len(lengths)
    return TrainBatch(prompt_ids=torch.ones(n, 2, dtype=torch.long), prompt_mask=torch.ones(n, 2, dtype=torch.long),
                      response_ids=mask * torch.arange(1, n + 1)[:, None], response_mask=mask,
                      rollout_logp=torch.zeros(n, T), finish_reason=["stop"] * n)


def by_hand(lengths: list[int], steps: int) -> list[int]:
    """The k-th global batch ends at the first row where the running token count reaches k/steps of the total."""
    total, bounds = sum(lengths), [0]
    for k in range(1, steps):
        running, row = 0, 0
        while running * steps < k * total:
            running += lengths[row]
            row += 1
        bounds.append(max(row, bounds[-1] + 1))
    return bounds + [len(lengths)]


@pytest.mark.parametrize("lengths,steps,rows", [([8, 8, 1, 1, 1, 1, 1, 1, 1, 1], 2, [2, 8]),
                                                ([1] * 6 + [12, 12], 2, [7, 1]),
                                                ([3, 5, 2, 7, 1, 1, 4, 9, 2, 6, 1, 3], 3, [4, 4, 4]),
                                                ([4] * 8, 4, [2, 2, 2, 2])])
def test_dynamic_global_batches_take_equal_shares_of_the_tokens(lengths, steps, rows):
    cfg = load_config(["train.use_dynamic_global_batch_size=true", f"train.num_steps_per_rollout={steps}",
                       f"rollout.rollout_batch_size={len(lengths) // 2}", "rollout.n_samples_per_prompt=2",
                       "train.micro_batch_size=1"])
    batch = batch_with(lengths)
    assert token_bounds(batch, steps) == by_hand(lengths, steps)
    chunks = global_batches(cfg, batch)
    assert [k for k, _ in chunks] == list(range(steps))
    assert torch.cat([c.response_ids for _, c in chunks]).equal(batch.response_ids)  # every row once, in order
    assert [len(c) for _, c in chunks] == rows


def test_dynamic_global_batches_need_several_steps_and_an_algorithm_that_allows_them():
    with pytest.raises(ConfigError, match="no effect with one optimizer step"):
        load_config(["train.use_dynamic_global_batch_size=true", "train.num_steps_per_rollout=1"])
    with pytest.raises(ConfigError) as err:
        load_config(["algorithm=rloo", "train.use_dynamic_global_batch_size=true"])
    assert "train.use_dynamic_global_batch_size" in {f for v in err.value.violations for f in v.fields}
