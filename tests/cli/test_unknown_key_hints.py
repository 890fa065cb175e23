"""What an unknown key's "did you mean" names (relax.config.unknown_keys): only keys the schema has, checked here
against the built config's own attributes, whatever the user misspelled (a section: `trainer.seed`, a key, verl's
names: `trainer.total_epochs`); verl's common names name the Relax key that does the same."""

from __future__ import annotations

import re

import pytest

from relax.config import ConfigError, load_config
from relax.data.datasets import PromptSampler

SECTIONS = ("algorithm", "model", "teacher", "reward_model", "cluster", "rollout", "train", "data", "tracking")
KEY = re.compile(rf"\b(?:(?:{'|'.join(SECTIONS)})\.[a-z_]+|seed)\b")


def _message(override: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config([override])
    lines = [line for line in str(err.value).splitlines() if "unknown key" in line]
    assert len(lines) == 1, str(err.value)
    return lines[0].split("unknown key ", 1)[1]


def _exists(cfg: object, key: str) -> bool:
    node = cfg
    for part in key.split("."):
        if not hasattr(node, part):
            return False
        node = getattr(node, part)
    return True


@pytest.fixture(scope="module")
def cfg():
    return load_config([])


@pytest.mark.parametrize("override, meant", [
    ("trainer.total_epochs=1", "train.num_rollout"),
    ("trainer.total_training_steps=2", "train.num_rollout"),
    ("trainer.seed=3", "seed"),
    ("trainer.save_freq=1", "train.save_interval"),
    ("trainer.test_freq=1", "train.eval_interval"),
    ("trainer.project_name=p", "tracking.experiment"),
    ("trainer.experiment_name=e", "tracking.run_name"),
    ("data.train_batch_size=8", "rollout.rollout_batch_size"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=4", "train.global_batch_size"),
    ("actor_rollout_ref.actor.clip_ratio=0.2", "algorithm.eps_clip"),
    ("actor_rollout_ref.actor.clip_ratio_high=0.28", "algorithm.eps_clip_high"),
    ("actor_rollout_ref.actor.entropy_coeff=0.01", "algorithm.entropy_coef"),
    ("actor_rollout_ref.rollout.n=4", "rollout.n_samples_per_prompt"),
    ("data.max_prompt_length=512", "rollout.max_prompt_len"),
    ("data.max_response_length=512", "rollout.max_response_len"),
    ("actor_rollout_ref.actor.optim.lr=1e-6", "train.lr"),
    ("trian.lr=1e-3", "train.lr"),
    ("trainr.lrr=1e-3", "train.lr"),
    ("train.lrr=1e-3", "train.lr"),
])
def test_every_key_a_hint_names_is_one_the_config_has(cfg, override, meant):
    key = override.split("=", 1)[0]
    message = _message(override)
    said = re.sub(r"verl's [\w.]+", "verl's name", message.split(" ", 1)[1])  # (verl's names are not Relax's)
    named = [k for k in KEY.findall(said) if k != key]
    assert meant in named, message
    missing = [k for k in named if not _exists(cfg, k)]
    assert not missing, f"{message}: names {missing}, which the config lacks"


def test_a_section_that_holds_no_such_key_is_named_alone(cfg):
    message = _message("trainer.foo=1")
    assert message == "trainer.foo: no section 'trainer' (did you mean train or tracking?)"
    # a key only loosely like one of a guessed section's is not offered (nnodes ~ mode at difflib's default cutoff)
    assert _message("trainer.nnodes=1") == "trainer.nnodes: no section 'trainer' (did you mean train or tracking?)"
    assert _exists(cfg, "train") and _exists(cfg, "tracking") and not _exists(cfg, "train.foo")


def test_a_top_level_key_under_a_section_of_verls_is_named_where_it_is():
    assert _message("trainer.seed=3") == "trainer.seed (did you mean seed?)"


def test_an_epoch_is_the_prompts_over_the_rollout_batch_size_as_the_total_epochs_hint_says():
    """The hint's arithmetic, against the sampler the run draws prompts with (rollout.rollout_batch_size per rollout):
    12 prompts in batches of 4 are one epoch in 3 rollouts, each prompt drawn once."""
    message = _message("trainer.total_epochs=1")
    assert "an epoch is the number of prompts / rollout.rollout_batch_size rollouts" in message
    sampler = PromptSampler(list(range(12)), 4, seed=0)
    drawn = [i for _ in range(3) for i in sampler.next_batch()]
    assert sorted(drawn) == list(range(12)) and sampler.epoch == 1 and sampler.position == 0
