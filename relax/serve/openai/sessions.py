"""Training sessions of the OpenAI gateway: every call of one agent run recorded token by token, and the run's
trajectory built from the tokens the engine actually sampled.

Token continuity. A call whose messages extend an earlier call's conversation (its messages, then the answer it got,
then new messages: tool results, a user turn) gets as its prompt the earlier call's tokens, the tokens sampled for
that answer, and only the new messages rendered as tokens (`ChatFormat.continuation`): the sampled tokens are never
re-tokenized, so the trajectory trains exactly what was generated, even where rendering the conversation again would
tokenize an answer differently. A completion call extends an earlier one when its prompt starts with that call's
tokens (token ids) or text (a string). A call that extends none (the agent rewrote or dropped a message, compacted
its context, or changed the tools) starts a new segment: its prompt is rendered whole, and the segments before it
are closed. The run's trajectory is its last segment (the one that reached the final answer); earlier segments are
counted (`rollout/gateway_segments_per_episode`) and not trained: their tokens were not the context of the answer.

With n > 1, each choice may be continued; the next call continues the one its messages contain (choice 0 when
the run ends there).

Limits: `max_calls` calls per session, `max_tokens` tokens in the trajectory after its first prompt (answers and
appended messages: the episode budget, `rollout.max_episode_tokens`), each answer at most `max_new_tokens`; a call
past a limit is refused (HTTP 400) and the session ends with that reason; a call after the session ended is refused
(HTTP 403). Sampling is the run's (`rollout.temperature`, `rollout.top_p`: the distribution the trainer's log-probs
are taken at); each choice's random stream comes from the run's seed, the sample id and the call, or, when the call
gives a `seed`, from that seed and the sample id (the same call gets the same answer within a sample, and the
samples of a group still differ).
"""

from __future__ import annotations

import copy
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from relax.batch import FinishReason
from relax.rollout.sglang.client import sample_seed
from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.protocol import APIError, Params, same_message
from relax.serve.sglang.request import row_stream


@dataclass
class Segment:
    """A trajectory: the first prompt, then every token after it (sampled or appended) with its log-prob and
    weight version; the conversation those tokens hold; the reward given per call."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)  # 1: the engine sampled it (trained), 0: appended
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    messages: Optional[list[dict]] = None  # chat: the conversation so far, the last answer included
    text: str = ""  # completions: the text of prompt and tokens
    tools_key: str = ""  # the tools and chat_template_kwargs its conversation was rendered with
    stop_token: Optional[int] = None  # the token that ended the last answer (None: a length or stop-sequence end)
    answers: list[str] = field(default_factory=list)  # the text of each answer
    rewards: list[float] = field(default_factory=list)  # per call

    def append(self, tokens: list[int], *, sampled: bool, logprobs: Optional[list[float]] = None,
               version: int = 0) -> None:
        self.tokens += tokens
        self.sampled += [int(sampled)] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.versions += [version if sampled else 0] * len(tokens)

    @property
    def context(self) -> list[int]:
        return self.prompt + self.tokens


@dataclass
class Limits:
    max_calls: int
    max_tokens: int  # tokens after the first prompt
    max_new_tokens: int  # per answer
    temperature: float
    top_p: float
    top_k: int
    seed: int


class SessionEnded(APIError):
    def __init__(self, reason: str):
        super().__init__(f"this session has ended ({reason}); start a new run for more calls", status=403,
                         kind="permission_error", code="session_ended")


class Session:
    """One agent run's calls (see the module docstring); thread-safe (an agent may call concurrently, though the
    order of its calls then decides which extends which)."""

    def __init__(self, key: str, sample_id: int, limits: Limits):
        self.key, self.sample_id, self.limits = key, sample_id, limits
        self.closed: list[Segment] = []
        self.candidates: list[Segment] = []  # the last call's choices, each a possible continuation
        self.calls = 0
        self.tool_calls = 0
        self.ended: Optional[str] = None  # why the session ended (None: open)
        self.overrides = 0  # calls whose temperature or top_p the run's replaced
        self.pending_reward = 0.0  # rewards given before any call
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ Session protocol (service.py)
    def chat_prompt(self, messages: list[dict], tools: Optional[list[dict]], fmt: ChatFormat,
                    template_kwargs: Optional[dict] = None) -> tuple[list[int], Any]:
        # a call extends a conversation rendered with the same tools and chat_template_kwargs (they change what
        # the template writes around every message: Qwen3's enable_thinking=false an empty think block after
        # each generation prompt); its new messages render with them too
        key = repr(tools) + json.dumps(template_kwargs or {}, sort_keys=True)
        with self._lock:
            self._check_open()
            for seg in self.candidates:
                old = seg.messages
                if (old is not None and seg.tools_key == key and len(messages) > len(old)
                        and all(same_message(a, b) for a, b in zip(messages, old, strict=False))):
                    new = messages[len(old):]
                    delta = fmt.continuation(new, seg.stop_token, template_kwargs)
                    return seg.context + delta, ("extend", seg, delta, messages)
            return fmt.prompt(messages, tools, template_kwargs), ("new", None, [], messages, key)

    def completion_prompt(self, prompt: Any, fmt: ChatFormat) -> tuple[list[int], Any]:
        with self._lock:
            self._check_open()
            for seg in self.candidates:
                if seg.messages is not None:
                    continue
                if isinstance(prompt, list) and len(prompt) > len(seg.context) and \
                        prompt[:len(seg.context)] == seg.context:
                    delta = list(prompt[len(seg.context):])
                    return list(prompt), ("extend", seg, delta, None)
                if isinstance(prompt, str) and seg.text and len(prompt) > len(seg.text) and prompt.startswith(seg.text):
                    delta = fmt.encode(prompt[len(seg.text):])
                    return seg.context + delta, ("extend", seg, delta, prompt)
            tokens = list(prompt) if isinstance(prompt, list) else fmt.encode(prompt)
            return tokens, ("new", None, [], prompt if isinstance(prompt, str) else None, "")

    def admit(self, p: Params, prompt_len: int, limit: int, context: Any) -> tuple[Params, int, list[int]]:
        lim = self.limits
        with self._lock:
            self._check_open()
            if self.calls >= lim.max_calls:
                self._end(FinishReason.MAX_TURNS)
                raise APIError(f"this session made its {lim.max_calls} calls (rollout.max_turns)", code="max_calls")
            base = context[1]  # the segment this call extends (None: it starts one)
            used = 0 if base is None else prompt_len - len(base.prompt)
            left = lim.max_tokens - used
            if left < 1:
                self._end(FinishReason.LENGTH)
                raise APIError(f"this session's trajectory holds {used} tokens, its limit "
                               f"(rollout.max_episode_tokens={lim.max_tokens})", code="max_tokens")
            call = self.calls
            self.calls += 1
            if p.temperature not in (None, lim.temperature) or p.top_p not in (None, lim.top_p) \
                    or p.top_k not in (-1, lim.top_k):
                self.overrides += 1  # the agent asked for other sampling
        p = copy.copy(p)
        p.temperature, p.top_p, p.top_k = lim.temperature, lim.top_p, lim.top_k
        # the agent's own seed: the same answer for the same call within this sample (other samples of its group
        # still differ); without one, the stream of (run seed, sample, call)
        base = sample_seed(p.seed, self.sample_id, -1) if p.seed is not None else sample_seed(lim.seed, self.sample_id,
                                                                                                call)
        seeds = [row_stream(base, k) for k in range(p.n)]
        return p, max(1, min(limit, lim.max_new_tokens, left)), seeds

    def record(self, context: Any, prompt: list[int], choices: list) -> None:
        kind, base, delta, conversation = context[:4]
        new = []
        for sampled, choice, message in choices:
            if kind == "extend":
                seg = copy.deepcopy(base)
                seg.append(delta, sampled=False)
            else:
                seg = Segment(prompt=list(prompt), tools_key=context[4])
            seg.append(choice.tokens, sampled=True, logprobs=choice.logprobs, version=sampled.version)
            # a stop token ended it (not a stop string, where the engine also stops with finish STOP)
            ended = choice.tokens[-1] if choice.tokens and len(choice.tokens) == len(sampled.tokens) \
                and sampled.finish == FinishReason.STOP and sampled.stop_string is None else None
            seg.stop_token = ended
            seg.answers.append(choice.think_text + choice.text)  # a <think> block split off still counts
            seg.rewards.append(0.0)
            if message is not None:
                seg.messages = list(conversation) + [message]
            else:  # a completion continues by text only where the text is what the engine saw
                # OpenAI's finish_reason "stop" without a stop token: a stop sequence cut the text
                cut = choice.finish_reason == "stop" and ended is None
                seg.text = conversation + choice.text if isinstance(conversation, str) and not cut else ""
            new.append(seg)
        with self._lock:
            if kind == "new" and self.candidates:
                self.closed.append(self.candidates[0])
            self.candidates = new
            self.tool_calls += sum(len(c.tool_calls or ()) for _, c, _ in choices)

    # ------------------------------------------------------------------ the run's side
    def add_reward(self, value: float) -> None:
        """A reward for the session's latest call (before any call: for its first)."""
        with self._lock:
            if self.candidates:
                for seg in self.candidates:
                    seg.rewards[-1] += value
            else:
                self.pending_reward += value

    def end(self, reason: str) -> None:
        with self._lock:
            self._end(reason)

    def _end(self, reason: str) -> None:
        if self.ended is None:
            self.ended = reason

    def _check_open(self) -> None:
        if self.ended is not None:
            raise SessionEnded(self.ended)

    def trajectory(self) -> Optional[Segment]:
        """The run's trajectory (its last segment, choice 0), rewards of closed segments folded into its first
        call; None if no call was made."""
        with self._lock:
            if not self.candidates:
                return None
            seg = copy.deepcopy(self.candidates[0])
            earlier = self.pending_reward + sum(sum(s.rewards) for s in self.closed)
            seg.rewards[0] += earlier
            return seg

    @property
    def segments(self) -> int:
        return len(self.closed) + (1 if self.candidates else 0)
