"""A final answer cut at its turn's limit (`rollout.max_response_len`) ends its episode with "length", as a cut
single-turn response does, on both rollout paths (the embedded engine's and SGLang's `run_episodes`), so that
`algorithm.mask_truncated` sees it; a final answer that ended with its stop token ends "stop", and an ending the
environment decided keeps its reason. A reply that does not end the episode carries no end reason.

Independent references: whether each row's last model token is the stop token (read from the sampled tokens), and
scripted server answers whose finish reason is given."""

from __future__ import annotations

import pytest
import torch

from relax.agents.episode import Episode, EpisodeMaker
from relax.agents.loops import AgentFactory
from relax.agents.render import ObservationRenderer
from relax.batch import FinishReason
from relax.config.schema import ModelConfig
from relax.data.tokenizer import build_tiny_tokenizer
from relax.models.hf import build_model
from relax.rollout.embedded import EmbeddedEngine
from relax.rollout.sglang.client import Sampling
from relax.rollout.sglang.episodes import run_episodes

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'


class Done:
    def reset(self, item):
        pass

    def step(self, action):
        return None, 1.0, True


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def scripted(tok, messages: list[str], env=None) -> Episode:
    """A tools episode whose turn k decodes to messages[k] (its tokens are [k])."""
    loop = AgentFactory(env, ["calculator"], None, None)()
    return Episode({"label": "7"}, loop, ObservationRenderer(tok), lambda tokens: messages[tokens[0]], max_turns=5,
                   max_tool_errors=3)


def test_a_final_answer_cut_at_its_limit_ends_length_and_one_that_stopped_ends_stop(tok):
    cut = scripted(tok, ["the answer is 4"])
    assert cut.turn_end([0], None, 10) is None and cut.end == FinishReason.LENGTH
    stopped = scripted(tok, ["the answer is 42"])  # the control: the same answer with its stop token
    assert stopped.turn_end([0], tok.eos_token_id, 10) is None and stopped.end == FinishReason.STOP


def test_a_cut_turn_with_a_complete_call_goes_on_and_the_environment_keeps_its_reason(tok):
    goes_on = scripted(tok, [CALL, "42"])
    obs = goes_on.turn_end([0], None, 10)  # a turn at its limit is answered like one with a stop token
    assert obs and goes_on.end is None and goes_on.tool_calls == 1
    judged = scripted(tok, ["my gues"], env="tests.agents.test_truncated_final_turn:Done")
    assert judged.turn_end([0], None, 10) is None and judged.end == FinishReason.ENV_DONE


def test_a_reply_that_does_not_end_the_episode_has_no_end_reason(tok):
    loop = AgentFactory(None, ["calculator"], None, None)()
    reply = loop.turn(CALL)
    assert not reply.done and reply.end is None and reply.messages == [{"role": "tool", "content": "42"}]


def test_the_embedded_engine_ends_a_cut_final_answer_length(tok):
    """Tools and no environment: the tiny model never writes a call, so each row's first turn is its final answer.
    A row whose turn ended on the stop token is "stop", one its 3-token limit cut is "length"."""
    model = build_model(ModelConfig(), len(tok), tok.pad_token_id, seed=0, dtype=torch.float32, device="cpu")
    engine = EmbeddedEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    maker = EpisodeMaker(AgentFactory(None, ["calculator"], None, None), tok, max_turns=3, max_tool_errors=3)
    prompt = tok(tok.apply_chat_template([{"role": "user", "content": "6 * 7"}], add_generation_prompt=True,
                                         tokenize=False), add_special_tokens=False)["input_ids"]
    episodes = [maker.new({"label": "42", "index": 0}) for _ in range(32)]
    samples = engine.generate([prompt], n_samples_per_prompt=32, max_new_tokens=40, seed=3, temperature=1.0,
                              episodes=episodes, turn_limit=3)
    expected = []
    for r in range(32):
        tokens = samples.response_ids[r][samples.response_mask[r].bool()].tolist()
        expected.append(FinishReason.STOP if tokens[-1] == tok.eos_token_id else FinishReason.LENGTH)
    assert samples.finish_reason == expected and [e["end"] for e in samples.episodes] == expected
    assert set(expected) == {FinishReason.STOP, FinishReason.LENGTH}  # both kinds drawn


def test_sglangs_episode_driver_ends_a_cut_final_answer_length(tok):
    """The SGLang path, its server scripted: the same final answer finished by its limit ("length", the turn's, not
    the episode's budget) and by its stop token."""
    ends = []
    for finish, ids in ((FinishReason.LENGTH, [20, 21, 22]), (FinishReason.STOP, [20, 21, tok.eos_token_id])):
        maker = EpisodeMaker(AgentFactory(None, ["calculator"], None, None), tok, max_turns=3, max_tool_errors=3)
        episode = maker.new({"label": "42", "index": 0})

        def send(payloads, ids=ids, finish=finish):
            return [(list(ids), [-0.5] * len(ids), finish, 1) for _ in payloads]

        samples = run_episodes(send, [[5, 6, 7]], torch.tensor([0]), torch.tensor([0]), [100], [episode], seed=0,
                               sampling=Sampling(3, 1.0, 1.0, -1, (tok.eos_token_id,)), turn_limit=3,
                               aborted=lambda: False, pad_token_id=tok.pad_token_id)
        ends.append((samples.finish_reason[0], samples.episodes[0]["end"]))
    assert ends == [(FinishReason.LENGTH, FinishReason.LENGTH), (FinishReason.STOP, FinishReason.STOP)]


def test_an_openai_agents_run_whose_last_answer_was_cut_ends_length(tok):
    """`data.openai_agent`: the run's last answer, a tool call its max_tokens cut (the engine's finish "length", no
    stop token), ends the sample "length" as the built-in loop's cut final turn does; the same answer finished by
    its stop token (the control) ends "stop". The agent is the official `openai` client through the gateway, the
    engine scripted."""
    import openai

    from relax.serve.openai.agents import _samples
    from relax.serve.openai.chat import ChatFormat
    from relax.serve.openai.gateway import Gateway
    from relax.serve.openai.service import OpenAIService
    from relax.serve.openai.sessions import Limits

    fmt = ChatFormat(tok, (tok.eos_token_id,))
    cut_call = fmt.encode('<tool_call>{"name": "calculator", "arguments": {"expression": "6 *')
    ends, finishes = [], []
    for finish, ids in (("length", cut_call), ("stop", cut_call + [tok.eos_token_id])):
        def engine(payloads, ids=ids, finish=finish):
            return [{"meta_info": {"output_token_logprobs": [[-0.25, t, None] for t in ids],
                                   "finish_reason": {"type": finish}, "weight_version": "1"}} for _ in payloads]

        gw = Gateway(OpenAIService(fmt, engine, model="policy", context_length=None, max_tokens=64)).start()
        try:
            limits = Limits(max_calls=4, max_tokens=400, max_new_tokens=64, temperature=1.0, top_p=1.0, top_k=-1,
                            seed=0)
            session = gw.open(0, limits)
            client = openai.OpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0)
            answer = client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "6 * 7?"}], max_tokens=len(ids),
                tools=[{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}])
            finishes.append(answer.choices[0].finish_reason)
            samples = _samples([(session, {}, session.trajectory(), None)], torch.tensor([0]), tok.pad_token_id)
        finally:
            gw.close()
        ends.append((samples.finish_reason[0], samples.episodes[0]["end"]))
    assert finishes == ["length", "stop"]  # what the agent saw: its call was cut, then not
    assert ends == [(FinishReason.LENGTH, FinishReason.LENGTH), (FinishReason.STOP, FinishReason.DONE)]
