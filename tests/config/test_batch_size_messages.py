"""The refusal of a global batch that micro-batches do not split: when train.global_batch_size was left unset it is
derived from the rollout (rollout.rollout_batch_size x rollout.n_samples_per_prompt / train.num_steps_per_rollout),
and the message says so and names the fixes, rather than only a value the user never set (the reviewer's case)."""

from __future__ import annotations

import pytest

from relax.config import ConfigError, load_config


def refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(list(overrides))
    lines = [line for line in str(info.value).splitlines() if "train.micro_batch_size" in line]
    assert len(lines) == 1, str(info.value)
    return lines[0]


def test_a_derived_global_batch_names_what_it_was_derived_from_and_the_fixes():
    line = refusal("rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2", "train.micro_batch_size=8")
    assert ("train.global_batch_size=4 (unset, it is the samples of a rollout: rollout.rollout_batch_size=2 x "
            "rollout.n_samples_per_prompt=2) must be divisible by train.micro_batch_size=8") in line
    assert "train.micro_batch_size=4 fits" in line
    assert "raise rollout.rollout_batch_size or rollout.n_samples_per_prompt" in line
    # the fix it names is accepted (the control: the suggestion is a config that loads)
    assert load_config(["rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
                        "train.micro_batch_size=4"]).train.global_batch_size == 4


def test_several_steps_per_rollout_are_named_too():
    line = refusal("rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=2", "train.num_steps_per_rollout=2",
                   "train.micro_batch_size=3")
    assert "rollout.n_samples_per_prompt=2 / train.num_steps_per_rollout=2)" in line
    assert "train.micro_batch_size=2 fits" in line and "each step holds a multiple of 3 samples" in line


def test_a_set_global_batch_unlike_the_rollout_is_named_as_set():
    # (6 samples per step, one step per rollout of 12: refused on that count too, on a line of its own)
    line = refusal("rollout.rollout_batch_size=3", "rollout.n_samples_per_prompt=4", "train.global_batch_size=6",
                   "train.num_steps_per_rollout=1", "train.micro_batch_size=4")
    assert line.strip().startswith("- train.global_batch_size=6 must be divisible by train.micro_batch_size=4")
    assert "unset" not in line and "train.micro_batch_size=3 fits" in line
