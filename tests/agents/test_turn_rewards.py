"""Per-turn rewards (`data.turn_rewards=per_turn`): each turn's reward on its last token, discounted by the
algorithm's own gamma over the model's tokens (PPO's GAE, REINFORCE++'s returns), rejected where the algorithm's
advantages compare one reward per episode."""

from __future__ import annotations

import pytest
import torch

from relax.algorithms import functional as F
from relax.batch import Samples
from relax.config import load_config
from relax.config.validate import ConfigError
from relax.runner.rollout_driver.scoring import turn_token_rewards


def episode_samples() -> Samples:
    # row 0: turns at columns 0-1, 5-6, 9 (observations between); row 1: one turn 0-2
    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0, 0, 1], [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]])
    present = torch.tensor([[1] * 10, [1, 1, 1] + [0] * 7])
    return Samples(prompt_ids=torch.ones(2, 2, dtype=torch.long), prompt_mask=torch.ones(2, 2, dtype=torch.long),
                   response_ids=torch.ones(2, 10, dtype=torch.long), response_mask=mask,
                   rollout_logp=torch.zeros(2, 10), finish_reason=["env_done", "stop"], token_mask=present,
                   episodes=[{"turn_rewards": [0.5, 0.0, 1.0]}, {"turn_rewards": [0.25]}])


def test_turn_rewards_sit_on_the_last_token_of_their_turn_and_add_up_to_the_episodes_reward():
    samples = episode_samples()
    total = torch.tensor([1.5 + 0.3, 0.25 - 0.1])  # the turns' sum plus data.reward (0.3) / an overlong penalty
    tok = turn_token_rewards(samples, total)
    expected = torch.zeros(2, 10)
    expected[0, 1], expected[0, 6], expected[0, 9] = 0.5, 0.0, 1.0 + 0.3
    expected[1, 2] = 0.25 - 0.1
    torch.testing.assert_close(tok, expected)
    torch.testing.assert_close(tok.sum(1), total)


def test_ppo_discounts_turn_rewards_over_the_models_tokens():
    """GAE with rewards on turn ends equals GAE by hand over the model's tokens only (observations not steps)."""
    samples = episode_samples()
    tok = turn_token_rewards(samples, torch.tensor([1.5, 0.25]))
    values = torch.randn(2, 10, generator=torch.Generator().manual_seed(3))
    adv, _ = F.gae(tok, values, samples.response_mask, 0.9, 0.95)
    keep = samples.response_mask[0].bool()
    r, v = tok[0, keep].tolist(), values[0, keep].tolist()
    a, out = 0.0, [0.0] * len(r)
    for t in reversed(range(len(r))):
        v_next = v[t + 1] if t + 1 < len(r) else 0.0
        a = r[t] + 0.9 * v_next - v[t] + 0.9 * 0.95 * a
        out[t] = a
    torch.testing.assert_close(adv[0, keep], torch.tensor(out), atol=1e-5, rtol=1e-5)


def test_per_turn_rewards_are_validated():
    load_config(["data=guess_number", "data.turn_rewards=per_turn", "algorithm=ppo"])
    load_config(["data=guess_number", "data.turn_rewards=per_turn", "algorithm=reinforce_pp"])
    with pytest.raises(ConfigError, match="grpo's advantages compare one reward per episode"):
        load_config(["data=guess_number", "data.turn_rewards=per_turn"])
    with pytest.raises(ConfigError, match="single-turn responses have one"):
        load_config(["data.turn_rewards=per_turn", "algorithm=ppo"])


class Counting:
    """An environment that rewards every turn (0.1 per digit answered) and ends after three."""

    def reset(self, item):
        self.turns = 0

    def step(self, action):
        self.turns += 1
        reward = 0.1 if any(c.isdigit() for c in action) else 0.0
        return ("+", reward, False) if self.turns < 3 else (None, reward, True)


@pytest.mark.slow
def test_ppo_trains_per_turn_rewards(in_process, small_run, tmp_path, monkeypatch):
    from relax.runner import train
    seen = []
    original = train.turn_token_rewards

    def record(samples, rewards):
        out = original(samples, rewards)
        seen.append((samples, rewards, out))
        return out

    monkeypatch.setattr(train, "turn_token_rewards", record)
    cfg = load_config(small_run("data=guess_number", "data.env=tests.agents.test_turn_rewards:Counting",
                                "rollout.max_turns=3", "rollout.max_episode_tokens=40", "algorithm=ppo",
                                "data.turn_rewards=per_turn", steps=2))
    result = train.run(cfg, output_dir=tmp_path / "out")
    assert [s for s, _ in result.history] == [0, 1] and len(seen) == 2
    for samples, rewards, tok in seen:  # three turns, each rewarded where it ends
        assert set(samples.finish_reason) == {"env_done"}
        assert (tok != 0).sum(1).max() > 1 and torch.allclose(tok.sum(1), rewards)
