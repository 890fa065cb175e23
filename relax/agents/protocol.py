"""The interfaces users write against: an environment, an agent loop, and what either answers to a model turn.

An **environment** (`data.env`) is a class (or a factory) called with no arguments once per episode, with
- `reset(item: dict) -> None`: a new episode for a prompt item (`prompt`, `label`, `index`, ... as plain values);
  the prompt itself is the first observation the model sees;
- `step(action: str) -> (observation: str | None, reward: float, done: bool)` (or a `Step`): the model's message of
  one turn in, the environment's answer out. The observation is rendered as a user turn with the chat template. For
  a vision-language model it may also be a list of content parts, text (`{"type": "text", "text": ...}`) and images
  (`{"type": "image", "image": <a PIL image, a path, a data: URL or base64>}`): an image observation, rendered with
  the template's image placeholders and expanded by the model's processor (`relax.agents.render`).

An **agent loop** (`data.agent`) is for anything else: a class (or factory) with `reset(item)` and
`turn(text: str) -> Reply`, which decides each observation itself (messages rendered with the chat template, or
token ids appended as they are).

Resuming an episode (partial rollout, a checkpoint): the loop is rebuilt by `reset(item)` and the model's earlier
messages replayed through `replay(actions)` (default: `turn` on each, results discarded). Environments must
therefore be deterministic functions of their item and the actions so far, or implement `replay` themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Protocol, Union

from relax.batch import FinishReason
from relax.rewards.calls import RewardSpecError

# Why an episode ended (`Samples.finish_reason` of its row): the model stopped with no tool call and no environment
# (its final answer), a token limit cut it (a turn's `rollout.max_response_len` or the episode's
# `rollout.max_episode_tokens`), the environment said done, `rollout.max_turns` turns were taken, or
# `rollout.max_tool_errors` tool calls failed.
END_REASONS = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ENV_DONE, FinishReason.MAX_TURNS,
               FinishReason.TOOL_ERRORS)


class UserCodeError(RewardSpecError, TypeError):
    """User code (an environment, an agent loop, a tool-call parser of one's own) returned what its interface does not
    allow; the message names the code and what was expected. A user's mistake, not a bug: relax-train prints the
    message alone (exit 2), where it was raised in the driver (a RewardSpecError to relax-train) and where a role
    raised it on Ray (`relax.runner.watchdog` makes it a RunError); still a TypeError to code that catches those."""


class Step(NamedTuple):
    observation: Optional[Union[str, list]]
    reward: float
    done: bool


@dataclass
class Reply:
    """An agent loop's answer to one model turn.

    `messages`: chat messages ({"role", "content"}) rendered with the chat template after the model's turn, or
    `tokens`: token ids appended as they are (exactly one of them unless `done`). `reward` adds to the episode's
    reward (the turn's reward); `done` ends the episode, with `end` as its reason (a `FinishReason`, or a string of the
    loop's own; None: "env_done"). A reply that does not end the episode has no reason (`end` None)."""

    messages: list[dict] = field(default_factory=list)
    tokens: Optional[list[int]] = None
    reward: float = 0.0
    done: bool = False
    end: Optional[str] = None
    tool_calls: int = 0
    tool_errors: int = 0


class Environment(Protocol):
    def reset(self, item: dict) -> None: ...

    def step(self, action: str) -> Union[Step, tuple]: ...


class AgentLoop(Protocol):
    def reset(self, item: dict) -> None: ...

    def turn(self, text: str) -> Reply: ...


def as_reply(value: Any, where: str) -> Reply:
    """An agent loop's `turn` result, checked (a UserCodeError naming `where`, the loop's class, otherwise): a
    `Reply` whose reward is a number and that does not give both `messages` and `tokens`. (Whether it carries an
    observation is `observation_problem`'s: only a turn that the episode goes on after needs one.)"""
    if not isinstance(value, Reply):
        raise UserCodeError(f"{where}.turn returned {value!r:.200}; expected a relax.agents.protocol.Reply")
    try:
        float(value.reward)
    except (TypeError, ValueError):
        raise UserCodeError(f"{where}.turn returned a Reply with the reward {value.reward!r:.80}; expected a "
                            "number") from None
    if value.tokens is not None and value.messages:
        raise UserCodeError(f"{where}.turn returned a Reply with both messages and tokens; give one of them")
    return value


def observation_problem(reply: Reply, where: str) -> Optional[UserCodeError]:
    """Why `reply`, a turn the episode goes on after, has no observation for the model's next turn (no messages and
    no tokens: the easy bug of a loop that forgets its observation, which the chat template would otherwise render
    as an empty turn), else None."""
    if (reply.tokens is not None and len(reply.tokens) == 0) or (reply.tokens is None and not reply.messages):
        return UserCodeError(f"{where}: an empty observation for an episode that is not done (a Reply without "
                             "messages or tokens, and not done)")
    return None


def as_step(value: Any, where: str) -> Step:
    """An environment's `step` result as a `Step`, checked (a UserCodeError naming `where` otherwise)."""
    try:
        observation, reward, done = value
    except (TypeError, ValueError):
        raise UserCodeError(f"{where}.step returned {value!r}; expected (observation, reward, done)") from None
    if isinstance(observation, list):  # content parts: text and images (an image observation)
        for part in observation:
            if not isinstance(part, dict) or part.get("type") not in ("text", "image"):
                raise UserCodeError(f"{where}.step: an observation given as a list holds content parts "
                                f"({{'type': 'text', 'text': ...}} or {{'type': 'image', 'image': ...}}), got "
                                f"{str(part)[:80]!r}")
    elif observation is not None and not isinstance(observation, str):
        raise UserCodeError(f"{where}.step: the observation must be a string, a list of content parts or None, got "
                        f"{type(observation).__name__}")
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise UserCodeError(f"{where}.step returned the reward {reward!r}; expected a number") from None
    return Step(observation, reward, bool(done))
