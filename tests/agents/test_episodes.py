"""Episodes in the embedded engine: token in, token out; the observation tokens are the chat template's; the KV cache
of earlier turns gives what re-running the whole context would; limits; and partial rollout across turns.

Independent references: the trainer's forward over the whole episode (log-probs of every generated token), the
engine's own single-turn generation from the full context (each turn re-prefilled), the environment's rule applied
by hand to the decoded guesses, and the chat template rendered by hand."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from relax.agents.episode import EpisodeMaker
from relax.agents.loops import AgentFactory
from relax.agents.protocol import Reply, UserCodeError
from relax.batch import continuation, extend_responses
from relax.config.schema import ModelConfig
from relax.data.tokenizer import build_tiny_tokenizer
from relax.models.hf import build_model
from relax.rollout.embedded import EmbeddedEngine
from relax.train.torch_policy import micro_batched_logprobs

G, TURN, LIMIT = 4, 4, 80  # 5 turns of 4 tokens and 4 observations of 11 fit in 80


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module", params=["fast", "generic"])
def engine(tok, request):
    """The engine on its Llama-family decoder (observations fed in chunks into its static cache) and on the model's
    own forward with a DynamicCache."""
    model = build_model(ModelConfig(), len(tok), tok.pad_token_id, seed=0, dtype=torch.float32, device="cpu")
    return EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                          fast_path=request.param == "fast")


def prompt_ids(tok) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": "guess"}], add_generation_prompt=True,
                                   tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def maker(tok, max_turns: int = 5, env: str = "guess_number", **kw) -> EpisodeMaker:
    return EpisodeMaker(AgentFactory(env, [], None, None), tok, max_turns=max_turns, max_tool_errors=3, **kw)


def run(engine, tok, m: EpisodeMaker, secrets=(3, 8), *, limit=LIMIT, **kw):
    episodes = [m.new({"label": str(s), "index": i}) for i, s in enumerate(secrets) for _ in range(G)]
    return engine.generate([prompt_ids(tok)] * len(secrets), n_samples_per_prompt=G, max_new_tokens=limit, seed=5,
                           temperature=1.0, episodes=episodes, turn_limit=TURN, **kw)


def segments(mask_row: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of the runs of 1 in a mask row."""
    out, start = [], None
    for i, v in enumerate(mask_row.tolist() + [0]):
        if v and start is None:
            start = i
        if not v and start is not None:
            out.append((start, i))
            start = None
    return out


def test_the_trainer_trains_exactly_the_sampled_tokens_of_every_turn(engine, tok):
    out = run(engine, tok, maker(tok))
    assert any(e["turns"] > 1 for e in out.episodes), "no episode had a second turn"
    gen, obs = out.response_mask.bool(), out.obs_mask().bool()
    assert not (gen & obs).any() and torch.equal((gen | obs).long(), out.present())
    # the trainer's log-probs over the whole episode (observations in context) at the generating weights
    logp = micro_batched_logprobs(engine.model, out, 3, device=torch.device("cpu"), compute_dtype=torch.float32,
                                  temperature=1.0)
    assert (logp - out.rollout_logp)[gen].abs().max() < 1e-5
    assert logp[obs].abs().max() == 0 and out.rollout_logp[obs].abs().max() == 0
    # negative control: shift the observation tokens' attention away and the trainer no longer agrees
    broken = replace(out, token_mask=out.response_mask)
    bad = micro_batched_logprobs(engine.model, broken, 3, device=torch.device("cpu"), compute_dtype=torch.float32,
                                 temperature=1.0)
    assert (bad - out.rollout_logp)[gen].abs().max() > 1e-3


def test_observations_are_the_environments_answers_rendered_by_the_chat_template(engine, tok):
    out = run(engine, tok, maker(tok))
    for r in range(len(out)):
        secret, record = int(out.episodes[r]["item"]["label"]), out.episodes[r]
        turns = segments(out.response_mask[r])
        assert len(turns) == record["turns"]
        for k, (a, b) in enumerate(turns):
            text = tok.decode(out.response_ids[r, a:b].tolist(), skip_special_tokens=True)
            assert text == record["actions"][k]
            digit = re.search(r"\d", text)
            found = digit is not None and int(digit.group()) == secret
            if k + 1 < len(turns):  # an observation follows: the rule by hand, rendered by hand
                assert not found
                feedback = "?" if digit is None else ("+" if secret > int(digit.group()) else "-")
                ended_by_stop = out.response_ids[r, b - 1] == tok.eos_token_id
                expected = ("" if ended_by_stop else "<|im_end|>") + \
                    f"\n<|im_start|>user\n{feedback}<|im_end|>\n<|im_start|>assistant\n"
                c, d = b, turns[k + 1][0]
                assert tok.decode(out.response_ids[r, c:d].tolist()) == expected
            else:
                assert out.finish_reason[r] == ("env_done" if found else "max_turns")
                assert sum(record["turn_rewards"]) == (max(0.2, 1 - 0.2 * k) if found else 0.0)


def test_the_kv_cache_of_earlier_turns_gives_what_re_prefilling_each_turn_gives(engine, tok):
    """Each turn generated again by the engine's plain single-turn path from the whole context as its prompt (the
    same random stream positions): the same tokens and log-probs, while the multi-turn call computed none of that
    context twice (`kv_reused`)."""
    out = run(engine, tok, maker(tok))
    P = prompt_ids(tok)
    checked = 0
    for r in range(len(out)):
        for a, b in segments(out.response_mask[r])[1:]:
            context = P + out.response_ids[r, :a].tolist()
            again = engine.generate([context], max_new_tokens=TURN, seed=5, sample_ids=torch.tensor([r]),
                                    positions=torch.tensor([a]), budgets=torch.tensor([b - a]))
            n = int(again.response_mask.sum())
            assert again.response_ids[0, :n].tolist() == out.response_ids[r, a:b].tolist()
            assert torch.allclose(again.rollout_logp[0, :n], out.rollout_logp[r, a:b], atol=1e-5)
            checked += 1
        assert out.episodes[r]["kv_reused"] == sum(len(P) + a for a, _ in segments(out.obs_mask()[r]))
    assert checked > 0


def test_max_turns_and_the_episode_token_limit_end_episodes(engine, tok):
    class Never:
        """An environment that never ends and answers a fixed symbol."""

        def reset(self, item):
            pass

        def step(self, action):
            return "?", 0.0, False

    m = EpisodeMaker(lambda: _Env(Never()), tok, max_turns=3, max_tool_errors=3)
    out = run(engine, tok, m, limit=200)
    assert out.finish_reason == ["max_turns"] * len(out) and all(e["turns"] == 3 for e in out.episodes)
    assert all(len(segments(out.response_mask[r])) == 3 for r in range(len(out)))
    short = run(engine, tok, EpisodeMaker(lambda: _Env(Never()), tok, max_turns=50, max_tool_errors=3), limit=30)
    assert set(short.finish_reason) == {"length"} and int(short.present().sum(1).max()) <= 30


class _Says:
    """An agent loop whose every turn answers `reply` (a user's loop with a bug, below)."""

    def __init__(self, reply):
        self.reply = reply

    def reset(self, item):
        pass

    def turn(self, text):
        return self.reply


@pytest.mark.parametrize("reply, says", [
    ("hi", "_Says.turn returned 'hi'; expected a relax.agents.protocol.Reply"),
    (Reply(messages=[{"role": "user", "content": "?"}], reward="high"),
     "_Says.turn returned a Reply with the reward 'high'; expected a number"),
    (Reply(messages=[{"role": "user", "content": "?"}], tokens=[1, 2]),
     "_Says.turn returned a Reply with both messages and tokens; give one of them"),
    # the loop forgot its observation: without the check, the template rendered an empty turn of its markers and
    # every episode went on to rollout.max_turns
    (Reply(), "_Says: an empty observation for an episode that is not done"),
    (Reply(tokens=[]), "_Says: an empty observation for an episode that is not done"),
])
def test_an_agent_loops_wrong_reply_is_a_user_code_error(engine, tok, reply, says):
    """A `turn` that returns what `Reply` does not allow stops the rollout with one line naming the loop (a
    UserCodeError: relax-train prints it alone, exit 2), not an AttributeError deep in the episode."""
    m = EpisodeMaker(lambda: _Says(reply), tok, max_turns=3, max_tool_errors=3)
    with pytest.raises(UserCodeError) as caught:
        run(engine, tok, m)
    assert str(caught.value).startswith(says), str(caught.value)
    # the same answers that end the episode are fine: an ending needs no observation
    ended = run(engine, tok, EpisodeMaker(lambda: _Says(Reply(reward=1.0, done=True)), tok, max_turns=3,
                                          max_tool_errors=3))
    assert ended.finish_reason == ["env_done"] * len(ended)


class _Env:
    """An environment as an agent loop (what `ToolsAndEnvironment` does without tools)."""

    def __init__(self, env):
        self.env = env

    def reset(self, item):
        self.env.reset(item)

    def turn(self, text):
        obs, reward, done = self.env.step(text)
        return Reply(messages=[{"role": "user", "content": obs}], reward=reward, done=done)


@pytest.mark.parametrize("abort_at", [12, 17])
def test_partial_rollout_continues_interrupted_turns_with_new_weights_token_by_token(engine, tok, abort_at):
    """Interrupted mid-episode (some rows mid-turn, some while their observation was fed) and continued from the
    checkpointable record with other weights: the tokens before the interruption are the uninterrupted run's, each
    token keeps the version that generated it, and the continued episodes end as episodes do."""
    m = maker(tok)
    full = run(engine, tok, m)
    calls = {"n": 0}

    def abort() -> bool:
        calls["n"] += 1
        return calls["n"] >= abort_at

    first = run(engine, tok, m, should_abort=abort)
    assert set(first.finish_reason) <= {"abort"} | set(full.finish_reason) and "abort" in first.finish_reason
    rows = torch.tensor([i for i, f in enumerate(first.finish_reason) if f == "abort"])
    partial = first.select(rows)
    n = partial.present().sum(1)
    mid_turn = [bool(rec["partial"]) for rec in partial.episodes]
    mid_obs = [bool(partial.obs_mask()[k, n[k] - 1]) for k in range(len(partial))]  # ends in its observation
    assert any(mid_turn) if abort_at == 17 else any(mid_obs), (mid_turn, mid_obs)
    for k, r in enumerate(rows.tolist()):  # what was generated before the abort is the uninterrupted run's
        assert partial.response_ids[k, :n[k]].tolist() == full.response_ids[r, :n[k]].tolist()
        assert torch.equal(partial.response_mask[k, :n[k]], full.response_mask[r, :n[k]])
    job = continuation(partial, LIMIT)

    def resume(version: int):
        episodes = [m.restore(rec) for rec in partial.episodes]
        more = engine.generate(job.prompts, max_new_tokens=int(job.budgets.max()), seed=5, sample_ids=job.sample_ids,
                               positions=job.positions, budgets=job.budgets, episodes=episodes, turn_limit=TURN)
        return extend_responses(partial, more)

    # with the same weights the continued episodes are the uninterrupted ones (the environment replayed, the
    # interrupted turn's tokens carried over)
    same = resume(0)
    whole = full.select(rows)
    assert same.finish_reason == whole.finish_reason
    assert torch.equal(same.response_ids, whole.response_ids[:, :same.response_ids.shape[1]])
    assert torch.equal(same.response_mask, whole.response_mask[:, :same.response_ids.shape[1]])
    assert [e["turn_rewards"] for e in same.episodes] == [e["turn_rewards"] for e in whole.episodes]
    assert [e["actions"] for e in same.episodes] == [e["actions"] for e in whole.episodes]
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    try:  # new weights (version 1): the continuation samples from another policy
        engine.load_weights({k: v + 0.01 * torch.randn_like(v) for k, v in state.items()}, version=1)
        done = resume(1)
    finally:
        engine.load_weights(state, version=0)
    assert "abort" not in done.finish_reason
    versions = done.versions()
    for k in range(len(done)):
        gen = done.response_mask[k].bool()
        assert (versions[k, :n[k]][gen[:n[k]]] == 0).all() and (versions[k, n[k]:][gen[n[k]:]] == 1).all()
        rec = done.episodes[k]
        assert len(segments(done.response_mask[k])) == rec["turns"] == len(rec["actions"])
        # an interrupted turn is one turn: its text is the tokens of both parts
        for (a, b), text in zip(segments(done.response_mask[k]), rec["actions"], strict=True):
            assert tok.decode(done.response_ids[k, a:b].tolist(), skip_special_tokens=True) == text
