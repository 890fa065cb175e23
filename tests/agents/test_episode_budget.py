"""The agentic data groups' episode budget follows their turns: conf/data/guess_number.yaml, grid_walk.yaml and
calculator.yaml set `rollout.max_episode_tokens` with `${relax.episode_tokens:...}` (relax.config.store), so that
`rollout.max_turns=10` gets episodes of 10 turns instead of ones cut `length` after the group's own number of turns.
The budget is checked against the observations the run's own renderer writes (relax.agents.render), the defaults
against the values the groups had (grid_walk's raised to hold its 4 turns), and a value given on the command line
wins. Before, the groups fixed the budget (guess_number: 60, 5 turns whatever max_turns), and a guess_number run with
max_turns=10 ended most episodes `length`."""

from __future__ import annotations

import pytest

from relax.agents.render import ObservationRenderer
from relax.batch import FinishReason
from relax.config import load_config
from relax.data.tokenizer import load_tokenizer
from relax.metrics import EPISODE_END, TURNS_MEAN


def _longest_observation(cfg, observation, processor=None) -> int:
    """Tokens of the environment's observation `observation` as the run appends it after a turn: the longer of
    after a turn that ended with its stop token and after one cut at max_response_len (no stop token)."""
    tok = load_tokenizer(cfg.model)
    renderer = ObservationRenderer(tok, processor)
    message = [{"role": "user", "content": observation}]
    return max(len(renderer.tokens(message, stop)) for stop in (tok.eos_token_id, None))


def _holds(cfg, observation_tokens: int) -> bool:
    ro = cfg.rollout
    return ro.max_episode_tokens >= ro.max_turns * ro.max_response_len + (ro.max_turns - 1) * observation_tokens


def test_guess_number_with_more_turns_gets_a_budget_that_holds_them():
    cfg = load_config(["data=guess_number", "rollout.max_turns=10"])
    assert cfg.rollout.max_turns == 10 and cfg.rollout.max_response_len == 2
    # 10 turns of 2 tokens and the 9 observations between them, 11 tokens each (after a cut turn)
    assert cfg.rollout.max_episode_tokens == 10 * 2 + 9 * 11 == 119
    from relax.agents.guess_number import HIGHER, INVALID, LOWER

    longest = max(_longest_observation(cfg, obs) for obs in (HIGHER, LOWER, INVALID))
    assert _holds(cfg, longest), (cfg.rollout.max_episode_tokens, longest)
    twenty = load_config(["data=guess_number", "rollout.max_turns=20", "rollout.max_response_len=3"])
    assert twenty.rollout.max_episode_tokens == 20 * 3 + 19 * 11
    assert _holds(twenty, longest)


def test_the_groups_defaults_are_the_values_they_had_and_hold_their_turns():
    # guess_number: 60 (its 5 turns need 54), also with max_turns=1 (the sweep arm of docs/training.md)
    assert load_config(["data=guess_number"]).rollout.max_episode_tokens == 60
    assert load_config(["data=guess_number", "rollout.max_turns=1"]).rollout.max_episode_tokens == 60
    assert load_config(["data=calculator"]).rollout.max_episode_tokens == 200  # 3 x 48 + 2 x 28
    more = load_config(["data=calculator", "rollout.max_turns=5"])
    assert more.rollout.max_episode_tokens == 5 * 48 + 4 * 28


def test_grid_walk_holds_its_four_turns_of_image_observations():
    """grid_walk's 72 held 3 of its 4 turns (an image observation is 23-24 tokens with tiny_vl, not 18): now 80."""
    from relax.agents.grid_walk import GridWalk
    from relax.data.grid_walk import generate_grid_walk
    from relax.data.images import vision_data

    cfg = load_config(["data=grid_walk", "model=tiny_vl"])
    assert cfg.rollout.max_episode_tokens == 4 * 2 + 3 * 24 == 80
    env = GridWalk()
    env.reset(generate_grid_walk(1, seed=0)[0])
    step = next(s for s in (env.step(a) for a in "1234") if s.observation is not None)
    longest = _longest_observation(cfg, step.observation, vision_data(cfg, load_tokenizer(cfg.model)).processor)
    assert _holds(cfg, longest), (cfg.rollout.max_episode_tokens, longest)
    eight = load_config(["data=grid_walk", "model=tiny_vl", "rollout.max_turns=8"])
    assert _holds(eight, longest)


def test_a_budget_given_wins():
    cfg = load_config(["data=guess_number", "rollout.max_turns=10", "rollout.max_episode_tokens=70"])
    assert cfg.rollout.max_episode_tokens == 70
    derived = load_config(["data=guess_number", "rollout.max_turns=10", "rollout.max_episode_tokens=null"])
    assert derived.rollout.max_episode_tokens == 2 * 10 * 2  # the documented default of a budget left unset


@pytest.mark.slow
def test_a_guess_number_run_with_ten_turns_ends_no_episode_at_the_budget(in_process, small_run, tmp_path):
    """A real run, `data=guess_number rollout.max_turns=10`: its episodes end by the game or at 10 turns, none
    `length` (before: 77-94% did, no episode got past 5 turns)."""
    from relax.runner.train import run

    result = run(load_config(small_run("data=guess_number", "rollout.max_turns=10", steps=1)),
                 output_dir=tmp_path / "out")
    [(_, m)] = result.history
    ends = {r: m.get(EPISODE_END + r, 0.0) for r in (FinishReason.LENGTH, FinishReason.ENV_DONE,
                                                       FinishReason.MAX_TURNS)}
    assert ends[FinishReason.LENGTH] == 0, ends
    assert ends[FinishReason.ENV_DONE] + ends[FinishReason.MAX_TURNS] == pytest.approx(1.0), ends
    assert ends[FinishReason.MAX_TURNS] > 0 and m[TURNS_MEAN] > 5, (ends, m[TURNS_MEAN])
