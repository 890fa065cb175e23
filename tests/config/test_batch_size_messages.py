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


def loads(*overrides: str) -> bool:
    load_config(list(overrides))
    return True


def test_a_global_batch_the_user_set_is_named_as_set_with_the_fix_of_changing_it():
    """The reviewer's case: train.global_batch_size=3 set, train.num_steps_per_rollout derived from it (6 samples / 3
    = 2 steps): 3 x 2 is the rollout's samples, yet the value is the user's, not "unset". Each fix named loads."""
    rollout = ("rollout.rollout_batch_size=3", "rollout.n_samples_per_prompt=2")
    line = refusal(*rollout, "train.global_batch_size=3", "train.micro_batch_size=2")
    assert line.strip() == ("- train.global_batch_size=3 must be divisible by train.micro_batch_size=2: lower "
                            "train.micro_batch_size (train.micro_batch_size=1 fits), or set train.global_batch_size "
                            "to a multiple of 2 that divides the rollout's 6 samples (2 or 6; "
                            "train.num_steps_per_rollout follows)")
    assert loads(*rollout, "train.global_batch_size=3", "train.micro_batch_size=1")
    assert loads(*rollout, "train.global_batch_size=2", "train.micro_batch_size=2")
    assert load_config([*rollout, "train.global_batch_size=6", "train.micro_batch_size=2"]).train \
        .num_steps_per_rollout == 1


def test_both_set_name_the_pairs_that_fit():
    rollout = ("rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=2")
    line = refusal(*rollout, "train.global_batch_size=2", "train.num_steps_per_rollout=4", "train.micro_batch_size=4")
    assert "unset" not in line and line.endswith(
        "or set train.global_batch_size to a multiple of 4 and train.num_steps_per_rollout to match (global batch x "
        "steps = the rollout's 8 samples: 4x2 or 8x1)"), line
    assert loads(*rollout, "train.global_batch_size=4", "train.num_steps_per_rollout=2", "train.micro_batch_size=4")


def test_a_derived_global_batch_with_set_steps_names_the_step_counts_that_fit():
    rollout = ("rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=2")
    line = refusal(*rollout, "train.num_steps_per_rollout=4", "train.micro_batch_size=4")
    assert line.strip().startswith("- train.global_batch_size=2 (unset, it is the samples of a rollout: "
                                   "rollout.rollout_batch_size=4 x rollout.n_samples_per_prompt=2 / "
                                   "train.num_steps_per_rollout=4) must be divisible by train.micro_batch_size=4")
    assert line.endswith("or set train.num_steps_per_rollout to 2 or 1 (a global batch of 4 or 8)"), line
    assert loads(*rollout, "train.num_steps_per_rollout=2", "train.micro_batch_size=4")


def test_without_the_given_config_the_message_claims_neither():
    """`validate` of a config its caller resolved itself (relax-serve): whether the value was set is not known, so a
    value equal to the rollout's samples / steps may be either, and the message says so."""
    import dataclasses

    from relax.config import RelaxConfig, resolve
    from relax.config.validate import validate

    base = RelaxConfig()
    given = dataclasses.replace(base, rollout=dataclasses.replace(base.rollout, rollout_batch_size=3,
                                                                  n_samples_per_prompt=2),
                                train=dataclasses.replace(base.train, global_batch_size=3, micro_batch_size=2))
    lines = [v.message for v in validate(resolve(given)) if "train.micro_batch_size" in v.message]
    assert lines == ["train.global_batch_size=3 (set, or derived when unset: rollout.rollout_batch_size=3 x "
                     "rollout.n_samples_per_prompt=2 / train.num_steps_per_rollout=2) must be divisible by "
                     "train.micro_batch_size=2: lower train.micro_batch_size (train.micro_batch_size=1 fits), or make "
                     "a global batch a multiple of 2 samples (train.global_batch_size, train.num_steps_per_rollout or "
                     "the rollout's size)"]
    with_given = [v.message for v in validate(resolve(given), given) if "train.micro_batch_size" in v.message]
    assert with_given[0].startswith("train.global_batch_size=3 must be divisible")
