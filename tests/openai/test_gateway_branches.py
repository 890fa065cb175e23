"""No trained token lost in the gateway: a call is matched against every branch of its session, with what does not
change the tokens ignored (an assistant message's `name`, tool_choice "none", a think-stripped answer), and a run
that forks (a side call, parallel calls, a choice not continued) trains one row per branch, each sampled token in
exactly one row's loss mask (`relax.serve.openai.sessions`, `relax.runner.branch_rows`).

Each test drives the gateway with the official `openai` client (the parallel one with AsyncOpenAI and
asyncio.gather) against a scripted engine, and counts tokens from the engine's side: a call's output is trained when
a row the trainer gets (the rollout's sample, expanded as the training loop expands it) holds the call's input as its
context, then its output, in its loss mask; every output must be trained so, in one row only, and the rows must
train nothing else. Negative controls: the last session's rule (only the branch holding the most sampled tokens
trains) loses the side calls and the parallel call; the older one (a call extends only the latest call's choices,
messages compared as sent, the sample is the latest call's segment) loses more."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
from collections.abc import Callable

import openai
import pytest
import torch

from relax.data.tokenizer import build_tiny_tokenizer
from relax.metrics import (
    GATEWAY_BRANCHES,
    GATEWAY_SAMPLED_TOKENS,
    GATEWAY_SEGMENTS,
    GATEWAY_TRAINED_TOKENS,
    GATEWAY_UNTRAINED_TOKENS,
)
from relax.runner.branch_rows import expand
from relax.runner.step_metrics import episode_metrics
from relax.serve.openai.agents import _samples
from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.gateway import Gateway
from relax.serve.openai.protocol import same_message
from relax.serve.openai.service import OpenAIService
from relax.serve.openai.sessions import FORMS, Limits, Session, _Call

USER = [{"role": "user", "content": "What is 3 + 4?"}]
FOLLOW_UP = {"role": "user", "content": "what is the final answer?"}
SIDE = [{"role": "user", "content": "repeat the answer"}]  # a side call: another conversation through the client
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
# a template that uses <think> (answers opening with a block get it split off into reasoning_content)
QWEN3_LIKE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
              "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
              "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
              "{% endif %}{% endif %}")
THOUGHT = "<think>\nwhat is 3 + 4\n</think>\n\n7"


class Engine:
    """A scripted engine: `answer(prompt text) -> text` (then the stop token), after `delay(prompt text)` seconds;
    every call's (input ids, output ids) kept in the order answered."""

    def __init__(self, fmt: ChatFormat, answer: Callable[[str], str], delay: Callable[[str], float]):
        self.fmt, self.answer, self.delay = fmt, answer, delay
        self.calls: list[tuple[list[int], list[int]]] = []
        self.lock = threading.Lock()

    def __call__(self, payloads: list[dict]) -> list[dict]:
        out = []
        for p in payloads:
            text = self.fmt.tokenizer.decode(p["input_ids"])
            time.sleep(self.delay(text))
            ids = self.fmt.encode(self.answer(text)) + [min(self.fmt.eos_token_ids)]
            with self.lock:
                self.calls.append((list(p["input_ids"]), ids))
            out.append({"meta_info": {"output_token_logprobs": [[-0.25, t, None] for t in ids],
                                      "finish_reason": {"type": "stop", "matched": ids[-1]}, "weight_version": "1"}})
        return out


def by_turn(text: str) -> str:
    """The main conversation's answers grow with its turns (the trained branch is the longest); a side call's is
    short."""
    if "repeat" in text:
        return "7"
    turn = text.count("assistant") - 1  # earlier answers (the generation prompt is the last)
    return ["the answer is 7", "the final answer is 3 + 4 = 7", "the final answer is boxed 7"][min(turn, 2)]


class LongestBranchOnly(Session):
    """The last session's rule, for the negative control: only the main row (the branch holding the most sampled
    tokens) trains."""

    def rows(self):
        t = self.trajectory()
        return [] if t is None else [t]


class LastSegmentOnly(LongestBranchOnly):
    """The older rule, for the negative control: a call extends only the latest call's choices, its messages compared
    as sent (a name, a think block, tool_choice count), and the sample is the latest call's branch (choice 0)."""

    def chat_prompt(self, messages, tools, fmt, template_kwargs=None, offered=None):
        key = repr(tools) + json.dumps(template_kwargs or {}, sort_keys=True)
        with self._lock:
            for node in [n for n in self.nodes if n.call == self.latest]:
                old = [{k: v for k, v in m.items() if k != FORMS} for m in node.messages]
                if node.tools_key == key and len(messages) > len(old) and all(
                        same_message(a, b) for a, b in zip(messages, old, strict=False)):
                    delta = fmt.continuation(messages[len(old):], node.stop_token, template_kwargs)
                    return node.context + delta, _Call(node, delta, node.messages + messages[len(old):], key)
            return fmt.prompt(messages, tools, template_kwargs), _Call(None, [], list(messages), key)

    def _row(self):
        latest = [n for n in self.nodes if n.call == self.latest]
        return min(latest, key=lambda n: n.choice) if latest else None


@pytest.fixture
def make():
    """make(answer, delay, template, old) -> (gateway, engine, session, client, async client)."""
    made = []

    def build(answer=by_turn, delay=lambda text: 0.0, template=None, old=None):
        tok = build_tiny_tokenizer()
        tok.add_tokens(["<think>", "</think>"])  # as Qwen3's: added tokens, not special ones
        if template is not None:
            tok.chat_template = template
        fmt = ChatFormat(tok, (tok.eos_token_id,))
        engine = Engine(fmt, answer, delay)
        gw = Gateway(OpenAIService(fmt, engine, model="policy", context_length=None, max_tokens=64)).start()
        made.append(gw)
        limits = Limits(max_calls=8, max_tokens=400, max_new_tokens=64, temperature=1.0, top_p=1.0, top_k=-1, seed=0)
        session = old("relax-old", 0, limits) if old else gw.open(0, limits)
        if old:
            gw._sessions[session.key] = session
        return (gw, engine, session, openai.OpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0),
                openai.AsyncOpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0))

    yield build
    for gw in made:
        gw.close()


def sample_of(session: Session):
    """The rollout's sample of this session's run (`relax.serve.openai.agents`)."""
    return _samples([(session, {}, session.trajectory(), None)], torch.tensor([0]), 0)


def rows(session: Session) -> list[tuple[list[int], list[int]]]:
    """(token context, loss mask) of every row the trainer gets for this run: the sample expanded as the training
    loop expands it (`relax.runner.branch_rows.expand`)."""
    s = expand(sample_of(session)).samples
    out = []
    for i in range(len(s)):
        prompt = s.prompt_ids[i][s.prompt_mask[i] != 0].tolist()
        n = int(s.present()[i].sum())
        out.append((prompt + s.response_ids[i, :n].tolist(), [0] * len(prompt) + s.response_mask[i, :n].tolist()))
    return out


def count(session: Session, engine: Engine) -> tuple[int, int, int]:
    """(sampled, trained, off) counted from the engine's side: a call's output is trained when a row holds the
    call's input as its context, then the output, in its loss mask (the trained log-prob of each of its tokens is
    then taken at the context the engine sampled it in); in one row at most, and the rows train nothing else."""
    trained_rows = rows(session)
    on = off = 0
    for ids, out in engine.calls:
        end = len(ids) + len(out)
        hits = sum(ctx[:len(ids)] == ids and ctx[len(ids):end] == out and all(mask[len(ids):end])
                   for ctx, mask in trained_rows)
        assert hits <= 1  # trained once
        on, off = (on + len(out), off) if hits else (on, off + len(out))
    assert on == sum(sum(mask) for _, mask in trained_rows)  # nothing trained that the engine did not sample there
    return on + off, on, off


def metrics(session: Session) -> dict[str, float]:
    """The step metrics of the sample the rollout makes of this session (`relax.serve.openai.agents`)."""
    return episode_metrics(sample_of(session))


def check(session: Session, engine: Engine) -> None:
    """Every sampled token trained once, and the metrics say so."""
    sampled, trained, off = count(session, engine)
    assert (trained, off) == (sampled, 0)
    m = metrics(session)
    assert (m[GATEWAY_SAMPLED_TOKENS], m[GATEWAY_TRAINED_TOKENS], m[GATEWAY_UNTRAINED_TOKENS]) == (sampled, sampled, 0)
    assert m[GATEWAY_BRANCHES] == session.branches == len(rows(session))
    assert session.token_counts() == (sampled, sampled)


def message(r) -> dict:
    return r.choices[0].message.model_dump(exclude_none=True)


# ------------------------------------------------------------------------------------------------- the cases
def side_call_between_turns(client, aclient) -> None:
    first = client.chat.completions.create(model="m", messages=USER)
    client.chat.completions.create(model="m", messages=SIDE)  # a title, a judge: another conversation
    client.chat.completions.create(model="m", messages=USER + [message(first), FOLLOW_UP])


def parallel_calls(client, aclient) -> None:
    """Two calls at once continuing the same answer (two follow-ups), then the conversation goes on from the
    first; the engine answers the second later (it is recorded last)."""
    first = client.chat.completions.create(model="m", messages=USER)
    base = USER + [message(first)]
    followups = [FOLLOW_UP, {"role": "user", "content": "repeat the answer"}]

    async def both():
        return await asyncio.gather(*[aclient.chat.completions.create(model="m", messages=base + [f])
                                      for f in followups])

    a, _ = asyncio.run(both())
    client.chat.completions.create(model="m", messages=base + [FOLLOW_UP, message(a), FOLLOW_UP])


def named_assistant(client, aclient) -> None:
    first = client.chat.completions.create(model="m", messages=USER)
    named = {**message(first), "name": "solver"}  # as LangChain and LangGraph send it
    second = client.chat.completions.create(model="m", messages=USER + [named, FOLLOW_UP])
    client.chat.completions.create(model="m", messages=USER + [named, FOLLOW_UP, {**message(second), "name": "solver"},
                                                               FOLLOW_UP])


def tool_choice_none_last(client, aclient) -> None:
    first = client.chat.completions.create(model="m", messages=USER, tools=[TOOL])
    second = client.chat.completions.create(model="m", messages=USER + [message(first), FOLLOW_UP], tools=[TOOL],
                                            tool_choice="auto")
    client.chat.completions.create(model="m", tools=[TOOL], tool_choice="none",  # "answer now"
                                   messages=USER + [message(first), FOLLOW_UP, message(second), FOLLOW_UP])


def think_stripped(client, aclient) -> None:
    """The answers come back without their <think> block (as Qwen3's template renders history), the block kept in
    content (separate_reasoning=false) or split off by the gateway and the agent dropping reasoning_content."""
    whole = {"separate_reasoning": False}
    first = client.chat.completions.create(model="m", messages=USER, extra_body=whole).choices[0].message
    assert first.content == THOUGHT
    stripped = {"role": "assistant", "content": "7"}
    second = client.chat.completions.create(model="m", messages=USER + [stripped, FOLLOW_UP])
    assert second.choices[0].message.content == "7"  # reasoning_content split off; the agent drops it
    client.chat.completions.create(model="m", messages=USER + [stripped, FOLLOW_UP, {"role": "assistant",
                                                                                    "content": "7"}, FOLLOW_UP])


def think_inline(client, aclient) -> None:
    """The split-off block put back in front of the content (an agent that keeps the raw text)."""
    first = client.chat.completions.create(model="m", messages=USER).choices[0].message
    assert (first.reasoning_content, first.content) == ("what is 3 + 4", "7")
    client.chat.completions.create(model="m", messages=USER + [{"role": "assistant", "content": THOUGHT}, FOLLOW_UP])


THINKING = {"answer": lambda text: THOUGHT, "template": QWEN3_LIKE}
CASES = {  # name: (the agent, the engine's script, segments, branches)
    "side_call_between_turns": (side_call_between_turns, {}, 2, 2),
    "parallel_calls": (parallel_calls, {"delay": lambda text: 0.5 if "repeat" in text else 0.0}, 1, 2),
    "named_assistant": (named_assistant, {}, 1, 1),
    "tool_choice_none_last": (tool_choice_none_last, {}, 1, 1),
    "think_stripped": (think_stripped, THINKING, 1, 1),
    "think_inline": (think_inline, THINKING, 1, 1),
}


def side_answers(engine: Engine) -> int:
    """The tokens of the side calls' answers in these cases ('repeat the answer', answered '7'): off the branch
    holding the most sampled tokens."""
    decode = engine.fmt.tokenizer.decode
    return sum(len(out) for ids, out in engine.calls if decode(ids).rstrip().endswith("repeat the answer<|im_end|>\n"
                                                                                      "<|im_start|>assistant"))


@pytest.mark.parametrize("name", list(CASES))
def test_every_sampled_token_is_trained_once(make, name):
    agent, script, segments, branches = CASES[name]
    gw, engine, session, client, aclient = make(**script)
    agent(client, aclient)
    assert (session.segments, session.branches) == (segments, branches)
    check(session, engine)
    assert len(session.trajectory().answers) == (2 if name in ("side_call_between_turns", "think_inline") else 3)
    assert metrics(session)[GATEWAY_SEGMENTS] == segments


@pytest.mark.parametrize("name", ["side_call_between_turns", "parallel_calls"])
def test_negative_control_the_longest_branch_rule_loses_the_side_calls(make, name):
    """The last session's rule on the agents that fork: exactly the side answers are lost."""
    agent, script, _, _ = CASES[name]
    gw, engine, session, client, aclient = make(**script, old=LongestBranchOnly)
    agent(client, aclient)
    sampled, trained, off = count(session, engine)
    assert off == side_answers(engine) == 2 and trained == sampled - off


@pytest.mark.parametrize("name", list(CASES))
def test_negative_control_the_last_segment_rule_loses_tokens(make, name):
    """The same agents under the older rule: turns that the new rule trains are not trained."""
    agent, script, _, _ = CASES[name]
    gw, engine, session, client, aclient = make(**script, old=LastSegmentOnly)
    agent(client, aclient)
    sampled, trained, _ = count(session, engine)
    assert trained < sampled - side_answers(engine)


def test_rewards_follow_their_calls_and_none_is_lost(make):
    """Per-call rewards stay with their calls on the trained branch; those of calls off it (and of the run before
    its first call) go to its first call: the run's total is kept."""
    import requests

    gw, engine, session, client, aclient = make()
    headers = {"Authorization": f"Bearer {session.key}"}

    def reward(value):
        assert requests.post(gw.base_url + "/relax/reward", json={"reward": value}, headers=headers,
                             timeout=10).status_code == 200

    reward(0.25)  # before any call
    first = client.chat.completions.create(model="m", messages=USER)
    reward(1)
    client.chat.completions.create(model="m", messages=SIDE)
    reward(10)
    client.chat.completions.create(model="m", messages=USER + [message(first), FOLLOW_UP])
    reward(100)
    assert session.trajectory().rewards == [11.25, 100.0]  # the run's total (what its reward sums)
    main, side = session.rows()  # each call's reward on the row that trains its answer
    assert (main.rewards, side.rewards) == ([1.25, 100.0], [10.0])


def test_n_choices_are_branches_and_each_is_trained(make):
    """n=2: the choice the agent continues is trained with its continuation, the other in a row of its own."""
    answers = iter(["the answer is 7", "7", "the final answer is 7"])
    gw, engine, session, client, aclient = make(answer=lambda text: next(answers))
    r = client.chat.completions.create(model="m", messages=USER, n=2)
    short = r.choices[1].message.model_dump(exclude_none=True)
    assert short["content"] == "7"
    client.chat.completions.create(model="m", messages=USER + [short, FOLLOW_UP])
    t = session.trajectory()
    assert t.answers == ["7", "the final answer is 7"] and (session.segments, session.branches) == (1, 2)
    check(session, engine)


# ------------------------------------------------------------------------------ the rows in the training batch
GROUPS = [("side_call_between_turns", "named_assistant"), ("parallel_calls", "tool_choice_none_last")]
RUN_REWARDS = [1.0, 0.0, 0.5, 2.0]  # per run, in group order


@pytest.fixture(scope="module")
def group_runs():
    """Two groups of two runs (each an agent of CASES, in its own session of one gateway): (the rollout's samples,
    the sessions, the engine). Shared by the tests below: a test that changes the samples changes a copy."""
    tok = build_tiny_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    fmt = ChatFormat(tok, (tok.eos_token_id,))
    engine = Engine(fmt, by_turn, lambda text: 0.5 if "repeat" in text else 0.0)
    gw = Gateway(OpenAIService(fmt, engine, model="policy", context_length=None, max_tokens=64)).start()
    limits = Limits(max_calls=8, max_tokens=400, max_new_tokens=64, temperature=1.0, top_p=1.0, top_k=-1, seed=0)
    try:
        sessions = [gw.open(i, limits) for i in range(4)]
        for s, name in zip(sessions, [n for g in GROUPS for n in g], strict=True):
            CASES[name][0](openai.OpenAI(base_url=gw.base_url, api_key=s.key, max_retries=0),
                           openai.AsyncOpenAI(base_url=gw.base_url, api_key=s.key, max_retries=0))
        samples = _samples([(s, {}, s.trajectory(), None) for s in sessions], torch.arange(4), 0)
    finally:
        gw.close()
    assert [s.branches for s in sessions] == [2, 1, 2, 1]
    return samples, sessions, engine


class Plan:
    reference_on_actor = False

    def __init__(self, *roles: str):
        self.roles = roles

    def has(self, role: str) -> bool:
        return role in self.roles


class Cluster:
    """What `train_batch` asks of the cluster for these batches: the algorithm's advantages (the registry's own
    function), for PPO the critic's values (a known function of the column), old log-probs where they are read."""

    def advantages(self, algo_cfg, inputs):
        from relax import algorithms

        return algorithms.get(algo_cfg.name).compute_advantages(algo_cfg, inputs)

    def actor_logprobs(self, samples, step):  # (two optimizer steps read old log-probs: the engine's stand in)
        return samples.rollout_logp

    def values(self, samples):
        return 0.01 * (torch.arange(samples.response_ids.shape[1]) + 1.0).expand(samples.response_ids.shape).clone()


def config(*extra: str):
    from relax.config import load_config

    return load_config(["rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2", "tracking.enabled=false",
                        "train.micro_batch_size=1", *extra])


def batch_for(samples, *extra: str, plan=None):
    from relax.runner.train import train_batch

    return train_batch(config(*extra), plan or Plan(), Cluster(), samples, torch.tensor(RUN_REWARDS),
                       torch.ones(4, dtype=bool), step=0)


def runs_of(batch) -> list[int]:
    return batch.sample_id.tolist()


def hand_group_advantages(kind: str) -> list[float]:
    """Per run, computed here from RUN_REWARDS: GRPO (mean, Bessel std + 1e-6), RLOO, the REINFORCE++ baseline
    (before its whitening)."""
    out = []
    for g in range(2):
        r = RUN_REWARDS[2 * g:2 * g + 2]
        mean = sum(r) / 2
        std = (sum((x - mean) ** 2 for x in r) / 1) ** 0.5
        out += [{"grpo": (x - mean) / (std + 1e-6), "rloo": 2 * (x - mean), "baseline": x - mean}[kind] for x in r]
    return out


def test_every_branch_is_a_row_with_its_runs_advantage_grpo_and_rloo(group_runs):
    samples, sessions, engine = group_runs
    for algorithm, kind in (("grpo", "grpo"), ("rloo", "rloo")):
        batch, _ = batch_for(samples, f"algorithm={algorithm}")
        assert runs_of(batch) == [0, 0, 1, 2, 2, 3]  # each run's rows together, its main row first
        assert torch.equal(batch.rewards, torch.tensor(RUN_REWARDS)[batch.sample_id])
        expected = torch.tensor(hand_group_advantages(kind))[batch.sample_id][:, None] * batch.response_mask
        torch.testing.assert_close(batch.advantages, expected.float(), atol=1e-6, rtol=0)
        # every sampled token of a run in exactly one of its rows' loss masks
        for i, s in enumerate(sessions):
            assert int(batch.response_mask[batch.sample_id == i].sum()) == s.token_counts()[0]
    assert int(batch.response_mask.sum()) == sum(len(out) for _, out in engine.calls)


def test_token_level_advantages_read_each_rows_own_tokens_and_whiten_over_all_rows(group_runs):
    samples, _, _ = group_runs
    # REINFORCE++ baseline: C = R - mean_g on every valid token, whitened over every valid token of every row
    batch, _ = batch_for(samples, "algorithm=reinforce_pp_baseline")
    mask = batch.response_mask.bool()
    c = torch.tensor(hand_group_advantages("baseline"), dtype=torch.float64)[batch.sample_id][:, None].expand(
        mask.shape)[mask]
    torch.testing.assert_close(batch.advantages[mask].double(), (c - c.mean()) / c.var(unbiased=False).sqrt(),
                               atol=1e-5, rtol=0)
    # PPO's GAE (gamma = lambda = 1, no whitening): A_t = R - V_t on each row's own valid tokens
    batch, _ = batch_for(samples, "algorithm=ppo", "algorithm.normalize_advantages=false", "algorithm.kl_coef=0",
                         plan=Plan("critic"))
    values = Cluster().values(batch)
    expected = (torch.tensor(RUN_REWARDS)[batch.sample_id][:, None] - values) * batch.response_mask
    torch.testing.assert_close(batch.advantages, expected, atol=1e-6, rtol=0)


def test_negative_control_rows_taken_as_runs_get_wrong_advantages(group_runs):
    """The algorithm over the expanded rows as if each were a run of a group (no layers): wrong advantages."""
    from relax import algorithms
    from relax.algorithms.base import AdvantageInputs

    samples, _, _ = group_runs
    x = expand(samples)
    cfg = config().algorithm
    rows = AdvantageInputs(torch.tensor(RUN_REWARDS)[x.run], x.samples.response_mask.float(), 2)
    wrong = algorithms.get("grpo").compute_advantages(cfg, rows).advantages
    expected = torch.tensor(hand_group_advantages("grpo"))[x.run][:, None] * x.samples.response_mask
    assert not torch.allclose(wrong, expected.float(), atol=1e-3)


def test_a_global_batch_counts_runs_with_all_their_rows(group_runs):
    from relax.runner.optimizer_steps import global_batches

    samples, _, _ = group_runs
    steps = ["train.global_batch_size=2", "train.num_steps_per_rollout=2"]
    batch, _ = batch_for(samples, *steps)
    chunks = global_batches(config(*steps), batch)
    assert [runs_of(c) for _, c in chunks] == [[0, 0, 1], [2, 2, 3]]
    dynamic = [*steps, "train.use_dynamic_global_batch_size=true"]
    chunks = global_batches(config(*dynamic), batch_for(samples, *dynamic)[0])
    assert sorted(r for _, c in chunks for r in runs_of(c)) == [0, 0, 1, 2, 2, 3]
    assert all(len(set(runs_of(a)) & set(runs_of(b))) == 0 for (_, a), (_, b) in zip(chunks, chunks[1:], strict=False))


def test_per_turn_rewards_each_call_on_the_row_that_trains_it(make):
    """data.turn_rewards=per_turn: a call's reward on the last token of its answer in the row that owns it, the rest
    of the run's reward (here the agent's return value, 5) on every row's last token."""
    import requests

    from relax.runner.branch_rows import per_turn_rewards
    from relax.runner.rollout_driver.scoring import turn_token_rewards

    gw, engine, session, client, aclient = make()
    headers = {"Authorization": f"Bearer {session.key}"}

    def reward(value):
        assert requests.post(gw.base_url + "/relax/reward", json={"reward": value}, headers=headers,
                             timeout=10).status_code == 200

    reward(0.25)
    first = client.chat.completions.create(model="m", messages=USER)
    reward(1)
    client.chat.completions.create(model="m", messages=SIDE)
    reward(10)
    client.chat.completions.create(model="m", messages=USER + [message(first), FOLLOW_UP])
    reward(100)
    t = session.trajectory()
    t.rewards[-1] += 5.0  # the agent's return value, as AgentRollout.run adds it
    samples = _samples([(session, {}, t, None)], torch.tensor([0]), 0)
    total = torch.tensor([sum(samples.episodes[0]["turn_rewards"])])  # the run's reward (data.reward=none)
    assert float(total) == 116.25
    x = expand(samples)
    on_tokens = turn_token_rewards(x.samples, per_turn_rewards(x, total))
    gen = x.samples.response_mask.bool()
    ends = gen & ~torch.cat([gen[:, 1:], torch.zeros_like(gen[:, :1])], dim=1)
    placed = [on_tokens[r][ends[r]].tolist() for r in range(2)]
    assert placed == [[1.25, 105.0], [15.0]]
    assert float(on_tokens.sum()) == 116.25 + 5.0  # every call's reward once, the rest on each of the two rows


def test_saved_old_logprobs_of_the_other_rows_survive_a_checkpoint(group_runs):
    """`RolloutStream.save_old_logprobs` keeps the other rows' old log-probs in their records (plain lists, as a
    checkpoint stores them), and the expanded batch reads them back."""
    import io

    from relax.runner.branch_rows import fill_saved_old_logprobs

    samples = copy.deepcopy(group_runs[0])
    calls = []

    def logprobs(part, version):  # the trainer's, under each token's own weights: a stand-in with known values
        calls.append(len(part))
        return part.rollout_logp - 1.0

    fill_saved_old_logprobs(samples, logprobs, version=2)  # the engine's answers are of version 1: stale
    assert calls == [2]  # the two other rows, once
    buffer = io.BytesIO()
    torch.save(samples.episodes, buffer)
    samples.episodes = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    x = expand(samples)
    others = x.layer > 0
    mask = x.samples.response_mask.bool() & others[:, None]
    saved = x.samples.saved_old_logp
    torch.testing.assert_close(saved[mask], x.samples.rollout_logp[mask] - 1.0)
    assert saved[~others].isnan().all()  # the main rows' are the samples' own (None here: not yet computed)


class FullCluster(Cluster):
    """Every role the algorithms read, each with log-probs of a known offset from the engine's."""

    def reference_logprobs(self, samples):
        return (samples.rollout_logp - 0.1) * samples.response_mask

    def teacher_logprobs(self, samples):
        return (samples.rollout_logp - 0.2) * samples.response_mask


def grpo_family(a, mask: torch.Tensor, run: torch.Tensor) -> torch.Tensor:
    """GRPO's advantage by hand from its flags: per run (or the raw reward), broadcast, whitened over the valid tokens
    of every row when normalize_advantages."""
    per_run = torch.tensor(hand_group_advantages("grpo") if a.normalize_rewards else RUN_REWARDS, dtype=torch.float64)
    if a.normalize_rewards and not a.std_normalization:
        per_run = torch.tensor(hand_group_advantages("baseline"), dtype=torch.float64)
    adv = per_run[run][:, None] * mask
    if a.normalize_advantages:
        valid = mask.bool()
        v = adv[valid]
        adv[valid] = (v - v.mean()) / v.var(unbiased=False).sqrt()
    return adv


@pytest.mark.parametrize("algorithm", ["cispo", "grpo", "gspo", "m2po", "opd", "ppo", "reinforce_pp",
                                       "reinforce_pp_baseline", "rloo", "sapo"])
def test_every_algorithm_trains_every_row_with_its_runs_advantage(group_runs, algorithm):
    """Every registered algorithm over the rows of forked runs: one row per branch, advantages [rows, T], zero off
    the loss mask; by hand where the estimator is a group statistic of the run (the GRPO family, RLOO) or a known
    per-token value plus it (on-policy distillation: teacher - student = -0.2 here)."""
    from relax import algorithms
    from relax.runner.train import train_batch

    samples, _, _ = group_runs
    extra = ["teacher=smollm2_135m"] if algorithm == "opd" else []
    cfg = config(f"algorithm={algorithm}", *extra)
    algo = algorithms.get(algorithm)
    roles = Plan("reference", "teacher", "critic")
    batch, _ = train_batch(cfg, roles, FullCluster(), samples, torch.tensor(RUN_REWARDS), torch.ones(4, dtype=bool),
                           step=0)
    assert algo.name == algorithm and runs_of(batch) == [0, 0, 1, 2, 2, 3]
    mask = batch.response_mask
    assert batch.advantages.shape == mask.shape and bool(batch.advantages.isfinite().all())
    assert bool((batch.advantages[mask == 0] == 0).all())
    a = cfg.algorithm
    expected = None
    if algorithm in ("cispo", "grpo", "gspo", "m2po", "sapo"):
        expected = grpo_family(a, mask, batch.sample_id)
    elif algorithm == "rloo":
        expected = torch.tensor(hand_group_advantages("rloo"), dtype=torch.float64)[batch.sample_id][:, None] * mask
    elif algorithm == "opd":
        expected = -0.2 * mask + (a.reward_coef * grpo_family(a, mask, batch.sample_id) if a.reward_coef else 0)
    if expected is not None:
        torch.testing.assert_close(batch.advantages.double(), expected.double(), atol=1e-5, rtol=0)
