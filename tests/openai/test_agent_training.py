"""Agent programs written against the official `openai` client, trained through the gateway (`data.openai_agent`,
rollout=sglang with embedded servers behind the real sglang-router, on a real Ray): the trained tokens are the
sampled ones (the trainer's log-probs equal the engine's, fp32), the three-turn conversations arrive as one
trajectory with the follow-ups out of the loss, an edited history as a second segment, and agents that raise or
hang cost their groups (counted as failed reward calls, the hung ones as time-outs) and nothing else."""

from __future__ import annotations

import pytest
from gateway_agents import TOUR_SEGMENTS  # noqa: E402  (tests/openai on sys.path)

from relax.config import load_config
from relax.metrics import (
    GATEWAY_BRANCHES,
    GATEWAY_SEGMENTS,
    GATEWAY_UNTRAINED_TOKENS,
    REWARD_ERRORS,
    REWARD_TIMEOUTS,
    STALENESS_MAX,
    TRAIN_ROLLOUT_LOGP_ABS_DIFF,
    TURNS_MEAN,
)
from relax.runner.train import run

pytestmark = pytest.mark.slow

GATEWAY = ["rollout=sglang", "rollout.sglang.server=embedded", "rollout.num_replicas=1", "model.dtype=float32",
           "rollout.max_turns=3", "rollout.max_response_len=6", "rollout.max_episode_tokens=80",
           "rollout.n_samples_per_prompt=2", "train.micro_batch_size=4", "data.reward=none", "data.agent_workers=4",
           "rollout.sglang.startup_timeout_s=120"]


def test_agent_programs_train_through_the_gateway(ray_local, small_run, tmp_path, trained_batches, monkeypatch):
    # five prompts, all of them in each rollout: every kind of agent in every step (the time limit leaves the agents
    # that answer room on a loaded machine: each of their runs is a few calls of at most 6 new tokens of the tiny
    # model, a small fraction of it; one that still runs past it counts as a time-out, nothing else). The agent that
    # hangs does so in step 0 only (a hang costs its step the whole time limit) and raises in step 1, which runs on
    # the agent workers that replaced the ones killed at the limit: the driver tells the agents which job runs
    from gateway_agents import BARRIER_ENV

    from relax.serve.openai.agents import AgentRollout

    barrier = tmp_path / "barrier"
    barrier.mkdir()
    monkeypatch.setenv(BARRIER_ENV, str(barrier))  # the agent workers start after this, with it
    agent_run = AgentRollout.run

    def run_job(self, items, sample_ids, **kw):  # job j's sample ids start at j * its size
        (barrier / "job").write_text(str(int(sample_ids[0]) // len(sample_ids)))
        return agent_run(self, items, sample_ids, **kw)

    monkeypatch.setattr(AgentRollout, "run", run_job)
    cfg = load_config(small_run(*GATEWAY, "data.openai_agent=gateway_agents:mixed", "data.agent_timeout_s=8",
                                "algorithm.use_tis=true", "rollout.max_turns=8", "data.num_prompts=5",
                                "rollout.rollout_batch_size=5", "train.micro_batch_size=5", steps=2))
    result = run(cfg, output_dir=tmp_path / "out")
    assert [s for s, _ in result.history] == [0, 1]
    answered = set()
    for step, m in result.history:
        samples = trained_batches[step]
        kinds = [e["item"]["index"] % 5 for e in samples.episodes]
        assert sorted(set(kinds)) == [0, 1, 2, 3, 4]
        errors = [(k, e["error"]) for k, e in zip(kinds, samples.episodes, strict=True) if e["error"]]
        timed_out = [k for k, error in errors if error.startswith("agent call timed out")]
        for kind, error in errors:  # an agent that answers may run past the limit too, on a slow machine
            broke = kind == 0 or (kind == 1 and step > 0)  # the one that hung in step 0 raises after it
            assert (broke and "the agent broke" in error) or error.startswith("agent call timed out"), errors
        if step == 0:  # every sample of the agent that hangs is a time-out
            assert timed_out.count(1) == kinds.count(1) > 0, errors
        assert kinds.count(0) + kinds.count(1) == sum(k in (0, 1) for k, _ in errors), errors
        assert m[REWARD_ERRORS] == len(errors) and m[REWARD_TIMEOUTS] == len(timed_out), errors
        assert m[TRAIN_ROLLOUT_LOGP_ABS_DIFF] < 1e-4  # the trained tokens are the sampled ones, on-policy
        gen, present = samples.response_mask.bool(), samples.present().bool()
        for r, (kind, e) in enumerate(zip(kinds, samples.episodes, strict=True)):
            if e["error"]:
                assert kind > 1 or not present[r].any()  # they made no call: nothing to train
                continue
            answered.add(kind)
            assert e["segments"] == {2: 2, 3: 1, 4: TOUR_SEGMENTS}[kind]
            # every branch a row (the tour's: its segments and the second of its n=2 choices), every sampled token
            # in one row's loss mask; TRAIN_ROLLOUT_LOGP_ABS_DIFF above reads the tokens of all of them
            assert e["branches"] == {2: 2, 3: 1, 4: TOUR_SEGMENTS + 1}[kind]
            assert e["trained_tokens"] == e["sampled_tokens"] > 0
            runs = int(((gen[r, 1:] & ~gen[r, :-1]).sum()) + gen[r, 0])  # model turns in the trajectory
            assert runs == e["turns"] == (3 if kind == 3 else 1)
            assert (present[r] & ~gen[r]).any() == (kind == 3)  # follow-ups: in the context, out of the loss
        assert m[GATEWAY_UNTRAINED_TOKENS] == 0
        assert m[GATEWAY_BRANCHES] == pytest.approx(sum(e["branches"] for e in samples.episodes) / len(kinds))
        assert m[GATEWAY_SEGMENTS] == pytest.approx(sum(e["segments"] for e in samples.episodes) / len(kinds))
        assert m[TURNS_MEAN] == pytest.approx(sum(e["turns"] for e in samples.episodes) / len(kinds))
    assert answered == {2, 3, 4}  # every agent that answers was trained in at least one step


def test_fully_async_with_partial_rollout_loads_weights_between_calls(ray_local, small_run, tmp_path,
                                                                     trained_batches, monkeypatch):
    """fully_async with rollout.partial_rollout=true: weights published while agent runs are under way are loaded
    between their calls (each answer has one version, later answers newer ones), and the staleness bound holds per
    token. The update lands between two calls by construction, not by timing: in job 1 the agents' first calls are
    answered before the publish of version 1 starts (it waits for them), and their second calls are sent after it
    returned (they wait for it): `gateway_agents.three_turns_across_an_update`."""
    from gateway_agents import BARRIER_ENV, wait_for

    from relax.runner.rollout_driver.stream import RolloutStream
    from relax.serve.openai.agents import AgentRollout

    steps, barrier = 2, tmp_path / "barrier"
    barrier.mkdir()
    monkeypatch.setenv(BARRIER_ENV, str(barrier))  # the agent workers start after this, with it
    agent_run, publish = AgentRollout.run, RolloutStream.publish

    def run_job(self, items, sample_ids, **kw):  # job j's sample ids start at j * its size
        (barrier / "job").write_text(str(int(sample_ids[0]) // len(sample_ids)))
        return agent_run(self, items, sample_ids, **kw)

    def publish_after_first_calls(self, version, weights):
        if 1 <= version < steps:  # job `version` runs (on version - 1): one of its agents was answered first
            assert wait_for(barrier / f"first-{version}"), f"no agent of job {version} made its first call"
        publish(self, version, weights)
        (barrier / f"published-{version}").touch()

    monkeypatch.setattr(AgentRollout, "run", run_job)
    monkeypatch.setattr(RolloutStream, "publish", publish_after_first_calls)
    # two prompts of two samples a job: four agents, one per agent worker (job 1's all wait at the barrier at once)
    cfg = load_config(small_run(*GATEWAY, "data.openai_agent=gateway_agents:three_turns_across_an_update",
                                "train.mode=fully_async", "train.max_staleness=1", "rollout.partial_rollout=true",
                                "algorithm=m2po", "rollout.rollout_batch_size=2", steps=steps))
    result = run(cfg, output_dir=tmp_path / "out")
    spanning = 0
    for step, m in result.history:
        assert m[STALENESS_MAX] <= 1
        samples = trained_batches[step]
        gen, versions = samples.response_mask.bool(), samples.versions()
        assert int(versions[gen].min()) >= step - 1 and int(versions[gen].max()) <= step
        for r, e in enumerate(samples.episodes):
            assert e["turns"] == 3 and e["segments"] == 1
            answers: list[list[int]] = []  # the versions of each answer (a run of generated tokens)
            for t in range(gen.shape[1]):
                if gen[r, t] and (t == 0 or not gen[r, t - 1]):
                    answers.append([])
                if gen[r, t]:
                    answers[-1].append(int(versions[r, t]))
            assert len(answers) == 3 and all(len(set(a)) == 1 for a in answers)  # one version per answer
            firsts = [a[0] for a in answers]
            assert firsts == sorted(firsts)  # versions only grow along a trajectory
            spanning += firsts[-1] > firsts[0]
    assert spanning > 0, "no weight update landed between the calls of a run"
