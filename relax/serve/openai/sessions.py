"""Training sessions of the OpenAI gateway: every call of one agent run recorded token by token, and the run's
trajectory built from the tokens the engine actually sampled.

Token continuity. A call whose messages extend an earlier call's conversation (its messages, then the answer it got,
then new messages: tool results, a user turn) gets as its prompt the earlier call's tokens, the tokens sampled for
that answer, and only the new messages rendered as tokens (`ChatFormat.continuation`): the sampled tokens are never
re-tokenized, so the trajectory trains exactly what was generated, even where rendering the conversation again would
tokenize an answer differently. A completion call extends an earlier one when its prompt starts with that call's
tokens (token ids) or text (a string).

Branches. Every choice of every call is kept as a branch (a `_Node`: the tokens appended to the branch it extends,
then its answer), so a call is matched against all of them, not only the latest call: the one it extends is the
branch with the longest conversation (chat) or context (completions) that its own is a strict continuation of. A
side call (a title, a judge), parallel calls that continue one answer, or a return to an earlier point of the
conversation thus leave the main conversation continuable. What is compared is what decides the tokens: an answer
the session recorded stands for its sampled tokens, so its `name` is ignored, and its content matches as recorded,
with its leading <think> block removed (Qwen3's template renders earlier turns without it), or with a block split
off into reasoning_content put back in front (null and missing content, tool call ids and extra fields such as
reasoning_content were never compared); a call with tool_choice "none" extends a conversation rendered with the
tools it lists (the model saw them). A call that extends no branch (the agent rewrote or dropped a message,
compacted its context, changed the tools or the chat_template_kwargs) starts a new segment: its prompt is rendered
whole.

The trained rows. A row holds one branch with its whole context (tokens of diverging branches cannot share a row
without changing what each token attended to), so a run trains one row per leaf of its tree (`rows`: the branches no
call continued), and every sampled token exactly once: the main row (the branch holding the most sampled tokens; a
tie: the later call, then the lower choice) first, owning every sampled token on it; then each other leaf in call
order (lower choice first), owning the sampled tokens of its branch that no earlier row owns (a side call's answer,
a parallel call's, a choice not continued, a segment left by an edit: its own answers after the point where it left
an earlier row's branch). A row's tokens before what it owns are context only, as an observation is (loss mask 0),
and are exactly what the engine saw. Rewards given per call (`POST /v1/relax/reward`) stay on the row that first owns
one of the call's answers; those given before any call on the main row's first. `trajectory` is the main row with
the reward of every call outside it added to its first call's (what the run's reward sums), `token_counts` the
sampled tokens and those in the rows' loss masks (`rollout/gateway_untrained_tokens`: their difference, 0).

Limits: `max_calls` calls per session, `max_tokens` tokens in a branch after its first prompt (answers and
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
from relax.serve.openai.chat import ChatFormat, split_reasoning
from relax.serve.openai.protocol import APIError, Params, same_message
from relax.serve.sglang.request import row_stream

FORMS = "relax_forms"  # on a recorded answer in a branch's messages: the contents that stand for its tokens


@dataclass
class Segment:
    """A trajectory: the first prompt, then every token after it (sampled or appended) with its log-prob and
    weight version; the conversation those tokens hold; the reward given per call."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)  # 1: the engine sampled it (trained), 0: appended
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    # 1: a sampled token a grammar constrained (its log-prob is of the masked distribution), 0: any other token
    constrained: list[int] = field(default_factory=list)
    messages: Optional[list[dict]] = None  # chat: the conversation so far, the last answer included
    text: str = ""  # completions: the text of prompt and tokens
    tools_key: str = ""  # the tools and chat_template_kwargs its conversation was rendered with
    stop_token: Optional[int] = None  # the token that ended the last answer (None: a length or stop-sequence end)
    cut: bool = False  # the last answer ended at its token limit (max_tokens, rollout.max_response_len, the budget)
    answers: list[str] = field(default_factory=list)  # the text of each answer
    rewards: list[float] = field(default_factory=list)  # per call

    def append(self, tokens: list[int], *, sampled: bool, logprobs: Optional[list[float]] = None,
               version: int = 0, constrained: Optional[list[int]] = None) -> None:
        self.tokens += tokens
        self.sampled += [int(sampled)] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.versions += [version if sampled else 0] * len(tokens)
        self.constrained += constrained if sampled and constrained is not None else [0] * len(tokens)

    @property
    def context(self) -> list[int]:
        return self.prompt + self.tokens


@dataclass(eq=False)
class _Node:
    """One choice of one call: a branch from its segment's first prompt to this answer. It holds only its own
    tokens (the messages appended to the branch it extends, then the answer); the rest is its parent's."""

    parent: Optional[_Node]
    prompt: list[int]  # the segment's first prompt (shared along the branch)
    delta: list[int]  # appended after the parent's answer ([] for a segment's first call)
    tokens: list[int]  # sampled
    logprobs: list[float]
    version: int
    constrained: list[int]  # per sampled token, 1 where a grammar constrained it (`Sampled.constrained`)
    call: int  # the session's call number (admission order)
    choice: int
    answer: str  # the answer's text, a <think> block split off included
    messages: Optional[list[dict]]  # chat: the conversation, this answer (with FORMS) last
    text: str  # completions: the text of prompt and tokens ("" where it is not what the engine saw)
    tools_key: str
    stop_token: Optional[int]
    cut: bool  # the engine ended this answer at its token limit (finish "length")
    length: int  # tokens after the first prompt, to the end of this answer
    sampled_total: int  # sampled tokens from the segment's start to here
    extended: bool = False  # a later call continued it (it is no longer a leaf)

    def path(self) -> list[_Node]:
        out, node = [], self
        while node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    @property
    def context(self) -> list[int]:
        out = list(self.prompt)
        for n in self.path():
            out += n.delta + n.tokens
        return out


@dataclass
class _Call:
    """What the prompt methods hand to `admit` and `record` (opaque to the service)."""

    base: Optional[_Node]  # the branch the call extends (None: it starts a segment)
    delta: list[int]
    conversation: Any  # chat: the call's messages; completions: its prompt string (None: token ids)
    tools_key: str = ""
    call: int = -1  # set by admit
    opened: str = ""  # the <think> block the prompt leaves open (Qwen3.5's generation prompt), written before answers


def _forms(content: str, think_text: str) -> frozenset:
    """The contents an agent may send back for a recorded answer whose message content is `content` (the answer's
    <think> block, when split off, is `think_text`): as answered, with the block put back, without it."""
    forms = {content.strip(), (think_text + content).strip()}
    split = split_reasoning(content)
    if split is not None:
        forms.add(content[split[1]:].strip())
    return frozenset(forms)


def _calls(m: dict) -> tuple:
    return tuple((c["name"], json.dumps(c["arguments"], sort_keys=True)) for c in m.get("tool_calls") or ())


def _same(sent: dict, old: dict) -> bool:
    """Whether a message of a call stands for `old` of a branch: a recorded answer (its sampled tokens, whatever
    name the agent gives it) by its tool calls and one of its content forms; any other message as it means."""
    forms = old.get(FORMS)
    if forms is None:
        return same_message(sent, old)
    return sent["role"] == "assistant" and _calls(sent) == _calls(old) and (sent.get("content") or "").strip() in forms


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
    """One agent run's calls (see the module docstring); thread-safe (an agent may call concurrently: each call
    extends the longest branch recorded when it arrives)."""

    def __init__(self, key: str, sample_id: int, limits: Limits):
        self.key, self.sample_id, self.limits = key, sample_id, limits
        self.nodes: list[_Node] = []  # every choice of every call, in the order recorded
        self.rewards: list[float] = []  # per call (admission order)
        self.latest: Optional[int] = None  # the call recorded last (where a reward goes)
        self.calls = 0
        self.tool_calls = 0
        self.ended: Optional[str] = None  # why the session ended (None: open)
        self.overrides = 0  # calls whose temperature or top_p the run's replaced
        self.pending_reward = 0.0  # rewards given before any call
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ Session protocol (service.py)
    def chat_prompt(self, messages: list[dict], tools: Optional[list[dict]], fmt: ChatFormat,
                    template_kwargs: Optional[dict] = None,
                    offered: Optional[list[dict]] = None) -> tuple[list[int], Any]:
        # a call extends a conversation rendered with the same tools and chat_template_kwargs (they change what
        # the template writes around every message: Qwen3's enable_thinking=false an empty think block after
        # each generation prompt); its new messages render with them too. `offered`: the tools the call lists,
        # which with tool_choice "none" are not `tools` (not rendered in a new prompt) yet are those of the
        # conversation it continues
        kwargs = json.dumps(template_kwargs or {}, sort_keys=True)
        key = repr(tools) + kwargs
        keys = {key, repr(offered or tools) + kwargs}
        with self._lock:
            self._check_open()
            best = None
            for node in reversed(self.nodes):  # the longest match; among equals, the latest
                old = node.messages
                if (old is not None and node.tools_key in keys and len(messages) > len(old)
                        and (best is None or len(old) > len(best.messages))
                        and all(_same(a, b) for a, b in zip(messages, old, strict=False))):
                    best = node
            if best is not None:
                # (the calls the answer made: gpt-oss's template names a tool result after its call)
                calls = tuple(c["name"] for c in best.messages[-1].get("tool_calls") or ()) if best.messages else ()
                delta = fmt.continuation(messages[len(best.messages):], best.stop_token, template_kwargs, calls)
                prompt, call = best.context + delta, _Call(best, delta, best.messages + messages[len(best.messages):],
                                                           best.tools_key)
            else:
                prompt, call = fmt.prompt(messages, tools, template_kwargs), _Call(None, [], list(messages), key)
            call.opened = fmt.opening(prompt)
            return prompt, call

    def completion_prompt(self, prompt: Any, fmt: ChatFormat) -> tuple[list[int], Any]:
        with self._lock:
            self._check_open()
            best, best_len, best_ctx = None, -1, None
            for node in reversed(self.nodes):
                if node.messages is not None:
                    continue
                if isinstance(prompt, list):
                    ctx = node.context
                    if len(prompt) > len(ctx) > best_len and prompt[:len(ctx)] == ctx:
                        best, best_len, best_ctx = node, len(ctx), ctx
                elif node.text and len(prompt) > len(node.text) > best_len and prompt.startswith(node.text):
                    best, best_len = node, len(node.text)
            if best is not None and isinstance(prompt, list):
                return list(prompt), _Call(best, list(prompt[len(best_ctx):]), None)
            if best is not None:
                delta = fmt.encode(prompt[len(best.text):])
                return best.context + delta, _Call(best, delta, prompt)
            tokens = list(prompt) if isinstance(prompt, list) else fmt.encode(prompt)
            return tokens, _Call(None, [], prompt if isinstance(prompt, str) else None)

    def admit(self, p: Params, prompt_len: int, limit: int, context: Any) -> tuple[Params, int, list[int]]:
        lim = self.limits
        with self._lock:
            self._check_open()
            if self.calls >= lim.max_calls:
                self._end(FinishReason.MAX_TURNS)
                n = lim.max_calls
                raise APIError(f"this session made its {n} call{'s' if n > 1 else ''}, all that rollout.max_turns={n} "
                               "allows (it defaults to 1: set it to the calls your agent makes, a tool loop included)",
                               code="max_calls")
            base = context.base  # the branch this call extends (None: it starts a segment)
            used = 0 if base is None else prompt_len - len(base.prompt)
            left = lim.max_tokens - used
            if left < 1:
                self._end(FinishReason.LENGTH)
                raise APIError(f"this session's trajectory holds {used} tokens, its limit "
                               f"(rollout.max_episode_tokens={lim.max_tokens})", code="max_tokens")
            call = context.call = self.calls
            self.calls += 1
            self.rewards.append(0.0)
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
        c: _Call = context
        base = c.base
        new = []
        for k, (sampled, choice, message) in enumerate(choices):
            # a stop token ended it (not a stop string, where the engine also stops with finish STOP)
            ended = choice.tokens[-1] if choice.tokens and len(choice.tokens) == len(sampled.tokens) \
                and sampled.finish == FinishReason.STOP and sampled.stop_string is None else None
            messages, text = None, ""
            if message is not None:
                forms = _forms(message.get("content") or "", choice.think_text)
                messages = list(c.conversation) + [{**message, FORMS: forms}]
            else:  # a completion continues by text only where the text is what the engine saw
                # OpenAI's finish_reason "stop" without a stop token: a stop sequence cut the text
                cut = choice.finish_reason == "stop" and ended is None
                text = c.conversation + choice.text if isinstance(c.conversation, str) and not cut else ""
            delta = list(c.delta) if base is not None else []
            before = (base.length, base.sampled_total) if base is not None else (0, 0)
            new.append(_Node(
                parent=base, prompt=base.prompt if base is not None else list(prompt), delta=delta,
                tokens=list(choice.tokens), logprobs=list(choice.logprobs), version=sampled.version, call=c.call,
                constrained=list(sampled.constrained or [0] * len(sampled.tokens))[:len(choice.tokens)],
                # a <think> block split off still counts, with the opening the prompt wrote for it (Qwen3.5's): the
                # text data.reward scores reads as one whose model wrote <think> itself (Qwen3's)
                choice=k, answer=c.opened + choice.think_text + choice.text,
                messages=messages, text=text, tools_key=c.tools_key, stop_token=ended,
                cut=sampled.finish == FinishReason.LENGTH,
                length=before[0] + len(delta) + len(choice.tokens), sampled_total=before[1] + len(choice.tokens)))
        with self._lock:
            if base is not None:
                base.extended = True
            self.nodes += new
            self.latest = c.call
            self.tool_calls += sum(len(ch.tool_calls or ()) for _, ch, _ in choices)

    # ------------------------------------------------------------------ the run's side
    def add_reward(self, value: float) -> None:
        """A reward for the session's latest call (before any call: for its first)."""
        with self._lock:
            if self.latest is not None:
                self.rewards[self.latest] += value
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

    def _row(self) -> Optional[_Node]:
        """The main branch: the one holding the most sampled tokens (a tie: the later call, the lower choice)."""
        leaves = [n for n in self.nodes if not n.extended]
        return max(leaves, key=lambda n: (n.sampled_total, n.call, -n.choice)) if leaves else None

    def _leaves(self) -> list[_Node]:
        """The rows' branches in row order: the main one, then the other leaves by call, then choice."""
        main = self._row()
        if main is None:
            return []
        return [main] + sorted((n for n in self.nodes if not n.extended and n is not main),
                               key=lambda n: (n.call, n.choice))

    def trajectory(self) -> Optional[Segment]:
        """The main row (`_row`), the rewards of calls outside it (and those given before any call) added to its first
        call's; None if no call was made."""
        with self._lock:
            row = self._row()
            if row is None:
                return None
            path = row.path()
            seg = Segment(prompt=list(row.prompt), messages=copy.deepcopy(row.messages), text=row.text,
                          tools_key=row.tools_key, stop_token=row.stop_token, cut=row.cut)
            for n in path:
                seg.append(n.delta, sampled=False)
                seg.append(n.tokens, sampled=True, logprobs=n.logprobs, version=n.version, constrained=n.constrained)
                seg.answers.append(n.answer)
                seg.rewards.append(self.rewards[n.call])
            on = {n.call for n in path}
            seg.rewards[0] += self.pending_reward + sum(r for i, r in enumerate(self.rewards) if i not in on)
            return seg

    def rows(self) -> list[Segment]:
        """One row per leaf of the session's tree, the main one first (see the module docstring): each holds its
        branch's whole context, `sampled` 1 only on the tokens it owns, `rewards` one per answer it owns (a call's
        reward on the first row owning one of its answers, 0 on its other answers; the rewards given before any call
        on the main row's first), `answers` every answer of its branch. [] if no call was made."""
        with self._lock:
            owned: set[int] = set()
            placed: set[int] = set()
            out = []
            for leaf in self._leaves():
                seg = Segment(prompt=list(leaf.prompt), messages=copy.deepcopy(leaf.messages), text=leaf.text,
                              tools_key=leaf.tools_key, stop_token=leaf.stop_token)
                for n in leaf.path():
                    seg.append(n.delta, sampled=False)
                    seg.answers.append(n.answer)
                    if id(n) in owned:  # an earlier row trains it: context here
                        seg.append(n.tokens, sampled=False)
                        continue
                    owned.add(id(n))
                    seg.append(n.tokens, sampled=True, logprobs=n.logprobs, version=n.version,
                               constrained=n.constrained)
                    seg.rewards.append(self.rewards[n.call] if n.call not in placed else 0.0)
                    placed.add(n.call)
                out.append(seg)
            if out:
                out[0].rewards[0] += self.pending_reward
            return out

    def token_counts(self) -> tuple[int, int]:
        """(tokens the engine sampled in this session, those in the loss masks of its rows)."""
        with self._lock:
            return sum(len(n.tokens) for n in self.nodes), sum(sum(r.sampled) for r in self.rows())

    @property
    def segments(self) -> int:
        """Calls that extended no branch (each starts a segment)."""
        with self._lock:
            return sum(n.parent is None and n.choice == 0 for n in self.nodes)

    @property
    def branches(self) -> int:
        """Branches no call continued: the rows the run trains."""
        with self._lock:
            return sum(not n.extended for n in self.nodes)
