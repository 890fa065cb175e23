"""Dynamic sampling (`rollout.filter_groups`): which groups carry a signal, how the rounds of a batch are chosen, and
the rollout stream that runs them in every mode, against a brute-force walk of the prompt draw order.

The fake engine and prompts are those of test_rollout_stream; a fake scorer gives prompt number p (its draw index)
a group with mixed rewards when `SIGNAL(p)`, equal rewards otherwise, so the expected batches follow from the draw
order alone.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
from test_rollout_stream import FakeEngines, Prompts, check_responses

from relax.config import load_config
from relax.rewards.registry import Scores
from relax.runner.rollout_driver.scoring import choose_groups, group_signal
from relax.runner.rollout_driver.stream import RolloutStream
from relax.runner.train import filter_note

G, B = 4, 2  # group size, groups per batch


def SIGNAL(p: int) -> bool:
    return p % 3 == 1


def test_group_signal_by_hand():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0,  # all right: no signal
                            0.0, 0.0, 0.0, 0.0,  # all wrong: no signal
                            0.0, 1.0, 0.0, 0.0,  # mixed
                            0.5, 0.5, 0.5, 0.25,  # mixed (shaped rewards)
                            0.0, 1.0, 0.0, 1.0])  # mixed, but a failed call: left out, so no signal
    failed = [False] * 16 + [False, True, False, False]
    assert group_signal(rewards, failed, 4) == [False, False, True, True, False]


def test_choose_groups_by_hand():
    assert choose_groups([False, True, False, True, True], 2) == ([1, 3], 0)  # the first two with a signal
    assert choose_groups([True, True, True], 3) == ([0, 1, 2], 0)
    # too few with a signal: the first ones without fill the batch
    assert choose_groups([False, True, False, False], 3) == ([0, 1, 2], 2)
    assert choose_groups([False, False], 2) == ([0, 1], 2)
    with pytest.raises(ValueError, match="fewer than the 3 needed"):
        choose_groups([True, True], 3)


class FakeScorer:
    """Rewards by prompt draw index (sample id // G): mixed 0/1 in a group when SIGNAL(p), all 1 otherwise."""

    def __init__(self, on_score=None):
        self.on_score = on_score
        self.rounds = 0

    def score(self, items, samples):
        self.rounds += 1
        if self.on_score is not None:
            self.on_score(self.rounds)
        rewards = [float(j % 2) if SIGNAL(p) else 1.0 for p, j in (divmod(int(s), G) for s in samples.sample_id)]
        return Scores(rewards, [False] * len(rewards))

    def signal(self, samples, scores):
        return group_signal(torch.tensor(scores.rewards), scores.failed, G)

    def cancel(self):
        pass


def expected(steps: int, round_prompts: int, max_rounds: int) -> list[tuple[list[int], list[int], int, int]]:
    """Brute force over the draw order: per step (chosen prompts, prompts set aside, rounds, groups filled in)."""
    out, nxt = [], 0
    for _ in range(steps):
        generated, rounds = [], 0
        while rounds < max_rounds and sum(map(SIGNAL, generated)) < B:
            generated += list(range(nxt, nxt + round_prompts))
            nxt += round_prompts
            rounds += 1
        good = [p for p in generated if SIGNAL(p)][:B]
        fill = [p for p in generated if not SIGNAL(p)][:B - len(good)]
        chosen = sorted(good + fill)
        out.append((chosen, [p for p in generated if p not in chosen], rounds, len(fill)))
    return out


def config(mode: str, staleness: int | None, partial: bool, round_prompts: int, max_rounds: int, steps: int = 6):
    overrides = ["algorithm=m2po", f"train.mode={mode}", f"train.num_rollout={steps}",
                 f"rollout.rollout_batch_size={B}", f"rollout.n_samples_per_prompt={G}", "rollout.filter_groups=true",
                 f"rollout.over_sampling_batch_size={round_prompts}", f"rollout.max_filter_rounds={max_rounds}"]
    if staleness is not None:
        overrides.append(f"train.max_staleness={staleness}")
    if partial:
        overrides.append("rollout.partial_rollout=true")
    return load_config(overrides)


def ids_of(prompts: list[int]) -> list[int]:
    return [p * G + j for p in prompts for j in range(G)]


def run(cfg, stream: RolloutStream, rng: random.Random, start: int = 0):
    taken = []
    for step in range(start, cfg.train.num_rollout):
        job, samples, _ = stream.take(step)
        taken.append((job, samples))
        if rng.random() < 0.5:
            threading.Event().wait(rng.random() * 0.01)
        stream.publish(step + 1, f"w{step + 1}")
    return taken


def check(cfg, taken, start: int = 0) -> None:
    want = expected(cfg.train.num_rollout, cfg.rollout.over_sampling_batch_size, cfg.rollout.max_filter_rounds)
    for step, (job, samples) in enumerate(taken, start):
        chosen, aside, rounds, filled = want[step]
        assert job.step == step
        assert samples.sample_id.tolist() == ids_of(chosen)
        assert sorted(job.filtered_ids.tolist()) == ids_of(aside)
        assert [it.prompt_ids for it in job.items] == [[p + 1, p + 1] for p in chosen]
        stats = job.filter
        assert (stats.rounds, stats.filled_groups) == (rounds, filled)
        assert stats.generated_groups == len(chosen) + len(aside)
        assert stats.no_signal_groups == sum(not SIGNAL(p) for p in chosen + aside)
        # the job's scores are those of its rows
        assert job.scores.rewards == [float(j % 2) if SIGNAL(p) else 1.0 for p in chosen for j in range(G)]
        check_responses(cfg, step, samples)  # every response the engine's, within its step's version window


class DrawIndexPrompts(Prompts):
    """Prompts whose ids name their draw index p (as [p + 1, p + 1]), `n` per call."""

    def __init__(self):
        super().__init__()
        self.next = 0

    def __call__(self, n: int = 2):
        from relax.data.datasets import PromptItem

        items = [PromptItem([p + 1, p + 1], "label", "text", p) for p in range(self.next, self.next + n)]
        self.next += n
        return items


CASES = [  # mode, max_staleness, partial rollout, prompts per round, max rounds
    ("sync", None, False, 2, 4),  # rounds until the batch is full
    ("sync", None, False, 3, 4),  # over-sampling: groups beyond the batch set aside
    ("sync", None, False, 2, 1),  # one round: filled with groups without a signal
    ("hybrid", None, False, 2, 2),
    ("fully_async", 2, False, 2, 3),
    ("fully_async", 2, True, 3, 2),
]


@pytest.mark.parametrize("mode,staleness,partial,round_prompts,max_rounds", CASES)
def test_rounds_fill_the_batch_or_stop_at_the_round_limit(mode, staleness, partial, round_prompts, max_rounds):
    cfg = config(mode, staleness, partial, round_prompts, max_rounds)
    rng = random.Random(round_prompts * 10 + max_rounds)
    scorer = FakeScorer()
    stream = RolloutStream(cfg, FakeEngines(random.Random(1), tick_s=0.002), DrawIndexPrompts(), start_step=0,
                           scorer=scorer)
    stream.publish(0, "w0")
    with stream:
        taken = run(cfg, stream, rng)
    check(cfg, taken)
    want = expected(cfg.train.num_rollout, round_prompts, max_rounds)
    assert scorer.rounds == sum(w[2] for w in want)  # each round scored once
    if max_rounds == 1:
        assert all(w[3] > 0 for w in want[1:2])  # the case fills (prompt 2 and 3 carry no signal)


def test_a_state_saved_between_rounds_continues_the_same_batches():
    """Pause after a job's first round was scored (its second drawn, not generated), save, stop; a stream restored
    from the state finishes that job and the rest exactly as an uninterrupted stream would."""
    cfg = config("sync", None, False, 2, 4, steps=3)
    holder: dict = {}
    first_round_scored = threading.Event()

    def hold_first(rounds: int) -> None:  # the first score call returns only once the loop asked for a pause
        if rounds == 1:
            first_round_scored.set()
            while not holder["stream"]._paused:
                threading.Event().wait(0.001)

    prompts = DrawIndexPrompts()
    stream = holder["stream"] = RolloutStream(cfg, FakeEngines(random.Random(2)), prompts, start_step=0,
                                              scorer=FakeScorer(hold_first))
    stream.publish(0, "w0")
    with stream:
        assert first_round_scored.wait(30)
        with stream.paused():
            state = stream.state_dict()
            drawn = prompts.next
    cur = state["current"]
    assert cur is not None and len(cur["rounds"]) == 1 and cur["done"] == [] and cur["partial"] is None
    assert state["next_prompt"] == drawn == 4  # round 1 (prompts 0, 1) generated, round 2 (2, 3) drawn

    from relax.data.datasets import PromptItem

    resumed = DrawIndexPrompts()
    resumed.next = drawn
    again = RolloutStream(cfg, FakeEngines(random.Random(3)), resumed, start_step=0, scorer=FakeScorer())
    again.load_state_dict(state, lambda d: PromptItem(**d))
    again.publish(0, "w0")
    with again:
        taken = run(cfg, again, random.Random(0))
    check(cfg, taken)


def test_the_loop_warns_when_the_round_limit_leaves_groups_without_a_signal():
    from relax.runner.rollout_driver.scoring import FilterStats

    cfg = config("sync", None, False, 2, 3)
    stats = FilterStats(rounds=3, generated_groups=6, no_signal_groups=5, filled_groups=1, generated_reward=1.0)
    note = filter_note(cfg, 7, stats, batch_groups=2)
    assert note == ("step 8: only 1 of 2 groups carry a learning signal after rollout.max_filter_rounds=3 rounds; "
                    "the batch is filled with 1 group(s) without one")
    full = FilterStats(rounds=2, generated_groups=4, no_signal_groups=2, filled_groups=0, generated_reward=0.5)
    assert filter_note(cfg, 7, full, batch_groups=2) is None


@pytest.mark.slow
def test_a_run_with_dynamic_sampling_logs_its_rounds_and_its_ledger_verifies(in_process, small_run, tmp_path):
    """The real loop: every step's batch holds rollout_batch_size groups, the rounds and the groups set aside
    are logged and in the ledger, and relax-verify-run finds every sample once."""
    from relax.cli.verify_run import verify
    from relax.metrics import (
        FILTER_FILLED_GROUPS,
        FILTER_GENERATED_RATIO,
        FILTER_ROUNDS,
        FILTERED_GROUP_FRAC,
        GENERATED_REWARD,
        RAW_REWARD,
    )
    from relax.runner import checkpoint
    from relax.runner.ledger import Ledger, count
    from relax.runner.train import run as train

    # 0/1 rewards the untrained model earns about a quarter of the time: a third of its groups are all wrong
    cfg = load_config(small_run("rollout.filter_groups=true", "rollout.over_sampling_batch_size=5",
                                "rollout.max_filter_rounds=2", "data.reward=first_digit_reward:reward", steps=3))
    result = train(cfg, output_dir=tmp_path / "out")
    B, G = cfg.rollout.rollout_batch_size, cfg.rollout.n_samples_per_prompt
    ledger = Ledger.read(checkpoint.latest(tmp_path / "ckpt") / "ledger.jsonl")
    assert [e.step for e in ledger.entries] == [0, 1, 2]
    for (step, m), entry in zip(result.history, ledger.entries, strict=True):
        assert entry.step == step
        rounds = m[FILTER_ROUNDS]
        assert rounds in (1.0, 2.0)
        assert entry.size == B * G  # the batch keeps its size
        generated = entry.size + count(entry.set_aside)
        assert generated == rounds * 5 * G  # every generated sample is in the batch or set aside
        assert m[FILTER_GENERATED_RATIO] == generated / (B * G)
        no_signal = m[FILTERED_GROUP_FRAC] * generated / G
        assert no_signal == pytest.approx(round(no_signal))
        # rounds stop as soon as the batch can be filled with signal; filled groups only at the round limit
        assert (m[FILTER_FILLED_GROUPS] > 0) <= (rounds == 2)
        assert (rounds == 2) <= (generated / G - no_signal < 5 + B)  # round 1 alone lacked signal
        assert 0.0 <= m[GENERATED_REWARD] <= 1.0 and 0.0 <= m[RAW_REWARD] <= 1.0
    assert any(m[FILTERED_GROUP_FRAC] > 0 for _, m in result.history)  # the filter had something to drop
    report = verify(str(tmp_path / "ckpt"), uri=cfg.tracking.uri)
    assert report.ok, report.text()
    assert "set aside by dynamic sampling" in report.text()
