"""One episode's state machine, driven by a rollout engine turn by turn.

The engine samples a model turn until a stop token; `Episode.turn_end` hands the turn's text to the agent loop and
returns the observation's tokens to append (the engine feeds them to the model without sampling, keeping its KV
cache: earlier turns are never computed again), or None when the episode is over, with `end` saying why
(`relax.agents.protocol.END_REASONS`). A single-turn rollout is the case without a loop: the first turn ends it.

A turn's text is what the model wrote after the context: when the context ended inside a <think> block its generation
prompt opened (Qwen3.5's `<think>\n`), that opening is written before the sampled text, so the agent loop, the
environment and `data.reward` read the turn as they read one whose model wrote `<think>` itself (Qwen3's): the tool
loop takes the reasoning off before reading calls, and the text scored is the same.

A turn's answer that does not come within `data.env_timeout_s` (an environment's `step`, an agent loop's `turn`:
`relax.agents.bounded`) ends the episode with "timeout" and its `error`, which the driver fails like a reward call
(its group left out, the batch's first failure warned of); so does a `reset`, or a step a resumed episode replays,
that does not (the episode's first turn then ends it). The engines end the turns of a round together (`turn_ends`:
every episode's call started before any is waited on) and a batch's episodes are made together
(`EpisodeMaker.new_for`, `restore_all`: their resets started before any is waited on), so that episodes whose calls
hang together cost one `data.env_timeout_s`, not one each.

`record()` is the episode as plain values (`Samples.episodes`): what the driver scores and logs, and what a
checkpoint or a partial rollout carries; `Episode.restore` rebuilds a running episode from it (its loop reset and
the model's earlier messages replayed).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

from relax import progress
from relax.agents.bounded import Bounded, StepTimeout
from relax.agents.parsers import harmony_call_names, message_decoder, opened_reasoning
from relax.agents.protocol import AgentLoop, Reply, as_reply, observation_problem
from relax.agents.render import ObservationRenderer
from relax.batch import FinishReason, plain_reason


class Episode:
    """An episode of prompt `item` (a plain dict) with agent loop `loop`."""

    def __init__(self, item: dict, loop: AgentLoop, renderer: ObservationRenderer, decode: Callable[[list[int]], str],
                 *, max_turns: int, max_tool_errors: int, turn_timeout_s: Optional[float] = None,
                 source: str = "data.agent", replay: Sequence[str] = (), wait: bool = True):
        """`turn_timeout_s`: the limit on each `loop.reset` and `loop.turn` (`data.env_timeout_s` for a `data.agent`
        loop; None: none, as for the built-in loop, which bounds its environment's calls itself); `source`: the
        option that named the loop, with its value, for the time-out's message. The loop's reset starts here, then
        the model's earlier messages `replay` are replayed (a resumed episode); `wait` False: they are waited on by
        `settle` (or the first turn), so that a batch's episodes reset at the same time."""
        self.item, self.loop, self.renderer, self.decode = item, loop, renderer, decode
        self.max_turns, self.max_tool_errors = max_turns, max_tool_errors
        self.turn_timeout_s, self.source = turn_timeout_s, source
        self.error: Optional[str] = None  # why the episode failed (a time-out): its group is left out
        self.turns = self.tool_calls = self.tool_errors = 0
        self.turn_rewards: list[float] = []
        self.actions: list[str] = []  # the model's message of each turn
        # the messages that answered each turn but the last (an observation given as tokens: their text, as a user
        # message): with `actions`, the episode's conversation (`conversation`), which data.reward may ask for
        self.observations: list[list[dict]] = []
        self.env_time = 0.0
        self.kv_reused = 0  # context tokens later turns reused from the cache instead of computing them again
        self.end: Optional[str] = None
        self.partial: list[int] = []  # tokens of a turn interrupted by an abort, continued on resume
        # the <think> block the context leaves open for the next turn ("": none), written before the turn's text
        self.opened = opened_reasoning(str(item.get("prompt_text") or ""))
        self._turn: Optional[tuple[Optional[int], int, Optional[Bounded[Reply]]]] = None  # begun, not ended
        t0 = time.perf_counter()
        self._setup: Optional[Bounded[Any]] = self._start_setup(list(replay))
        self.env_time += time.perf_counter() - t0
        if wait:
            self.settle()

    def _start_setup(self, replay: list[str]) -> Bounded[Any]:
        """The loop's reset, then the replay of `replay` (the built-in loop's own, `start_reset`), started."""
        start = getattr(self.loop, "start_reset", None)
        if callable(start):
            return start(dict(self.item), replay)
        loop, name = self.loop, f"{self.source}: {type(self.loop).__name__}"
        calls: list[tuple[str, Callable[[], Any]]] = [(f"{name}.reset", lambda: loop.reset(dict(self.item)))]
        own = getattr(loop, "replay", None)
        if replay and callable(own):
            calls.append((f"{name}.replay", lambda: own(list(replay))))
        elif replay:
            calls += [(f"{name}.turn", lambda text=text: loop.turn(text)) for text in replay]
        return Bounded(calls, self.turn_timeout_s)

    def _fail(self, exc: StepTimeout) -> None:
        self.end, self.error = FinishReason.TIMEOUT, str(exc)
        progress.tick()  # the wait is over: the rollout goes on (other episodes' waits are timed anew)

    def settle(self) -> None:
        """Wait for the reset (and replay) started when the episode was made; past `turn_timeout_s` the episode
        fails ("timeout", `error`), and its first turn ends it."""
        setup, self._setup = self._setup, None
        if setup is None:
            return
        try:
            setup.result()
        except StepTimeout as exc:
            self._fail(exc)
        finally:
            self.env_time += setup.seconds

    def turn_end(self, tokens: list[int], stop_token: Optional[int], context: int) -> Optional[list[int]]:
        """The model ended a turn with `tokens` (this call's, after any interrupted part; the stop token last, if
        `stop_token`); `context`: tokens before the next turn would start, prompt included. Returns the
        observation's tokens, or None: the episode is over (`end` set)."""
        self.begin_turn(tokens, stop_token, context)
        return self.end_turn()

    def begin_turn(self, tokens: list[int], stop_token: Optional[int], context: int) -> None:
        """The first half of `turn_end`: the turn recorded and the loop's answer started (an environment's step runs
        in its thread from now on); `end_turn` waits for it."""
        self.settle()
        tokens = self.partial + list(tokens)
        self.partial = []
        text = self.opened + self.decode(tokens)
        self.turns += 1
        self.actions.append(text)
        if self.error is not None:  # its reset or replay timed out: this turn ends it
            self._turn = (stop_token, context, None)
            return
        t0 = time.perf_counter()
        start = getattr(self.loop, "start_turn", None)
        if callable(start):  # the built-in loop: tools answered here, the environment's step bounded by the loop
            # (the last turn's tool calls are not run: `ToolsAndEnvironment.start_turn`; a resumed episode's restored
            # `turns` makes the same decision)
            pending: Bounded[Reply] = start(text, last=self.turns >= self.max_turns,
                                            errors_left=self.max_tool_errors - self.tool_errors)
        else:
            loop = self.loop
            pending = Bounded([(f"{self.source}: {type(loop).__name__}.turn", lambda: loop.turn(text))],
                              self.turn_timeout_s)
        self.env_time += time.perf_counter() - t0
        self._turn = (stop_token, context, pending)

    def end_turn(self) -> Optional[list[int]]:
        """The second half of `turn_end` (its return value): the loop's answer waited for and read."""
        if self._turn is None:
            raise RuntimeError("Episode.end_turn without begin_turn")
        (stop_token, context, pending), self._turn = self._turn, None
        if pending is None:
            self.turn_rewards.append(0.0)
            return None
        try:
            reply: Reply = pending.result()
        except StepTimeout as exc:
            self.turn_rewards.append(0.0)
            self._fail(exc)
            return None
        finally:
            self.env_time += pending.seconds
        reply = as_reply(reply, type(self.loop).__name__)
        self.turn_rewards.append(float(reply.reward))
        self.tool_calls += reply.tool_calls
        self.tool_errors += reply.tool_errors
        if reply.done:
            # a final answer (no call, no environment: "stop") whose turn its limit cut is a truncated response, as a
            # single-turn one is ("length": algorithm.mask_truncated sees it); an ending the loop itself decided
            # (env_done, its own string) is kept: the environment judged that message
            reason = reply.end or FinishReason.ENV_DONE
            cut = stop_token is None and reason == FinishReason.STOP
            self.end = FinishReason.LENGTH if cut else reason
            return None
        if self.tool_errors >= self.max_tool_errors:
            self.end = FinishReason.TOOL_ERRORS
            return None
        if self.turns >= self.max_turns:
            self.end = FinishReason.MAX_TURNS
            return None
        if (problem := observation_problem(reply, type(self.loop).__name__)) is not None:
            raise problem  # checked before rendering: the template would wrap no messages in a turn of its markers
        # (an image observation's tokens come with its images: relax.agents.render.VisionTokens)
        # (a harmony template names a tool result by the call it answers: `turn_calls`)
        obs = list(reply.tokens) if reply.tokens is not None else self.renderer.tokens(
            reply.messages, stop_token, turn_calls(self.loop, self.actions[-1]))
        self.observations.append([dict(m) for m in reply.messages] if reply.tokens is None else
                                 [{"role": "user", "content": self.decode(obs)}])
        self.kv_reused += context
        self.opened = opened_reasoning(self.renderer.tokenizer.decode(list(obs[-16:])))
        return obs

    @property
    def reward(self) -> float:
        return sum(self.turn_rewards)

    def record(self) -> dict[str, Any]:
        # plain values only (`end` a plain string, not a FinishReason): checkpoints carry the record
        return {"item": dict(self.item), "turns": self.turns, "tool_calls": self.tool_calls,
                "tool_errors": self.tool_errors, "turn_rewards": list(self.turn_rewards), "actions": list(self.actions),
                "observations": [list(o) for o in self.observations],
                "env_time": self.env_time, "kv_reused": self.kv_reused, "end": plain_reason(self.end),
                "partial": list(self.partial), "opened": self.opened, "error": self.error}

    @classmethod
    def restore(cls, record: dict, loop: AgentLoop, renderer: ObservationRenderer,
                decode: Callable[[list[int]], str], *, max_turns: int, max_tool_errors: int,
                turn_timeout_s: Optional[float] = None, source: str = "data.agent", wait: bool = True) -> Episode:
        """The running episode of `record` (see the module docstring); `wait` as for a new one."""
        ep = cls(record["item"], loop, renderer, decode, max_turns=max_turns, max_tool_errors=max_tool_errors,
                 turn_timeout_s=turn_timeout_s, source=source, replay=list(record["actions"]), wait=False)
        ep.env_time += record["env_time"]
        ep.turns, ep.tool_calls, ep.tool_errors = record["turns"], record["tool_calls"], record["tool_errors"]
        ep.turn_rewards, ep.actions = list(record["turn_rewards"]), list(record["actions"])
        ep.observations = [list(o) for o in record.get("observations", [])]  # (none in a record from before)
        ep.kv_reused, ep.partial = record["kv_reused"], list(record["partial"])
        ep.opened = record.get("opened", ep.opened)  # (a record from before it was kept: the prompt's)
        if wait:
            ep.settle()
        return ep


def turn_calls(loop: Any, text: str) -> list[str]:
    """The names of the calls a turn made, for a chat template that names a tool result after its call (gpt-oss's):
    the recipients of its harmony messages (a malformed call's too), else the calls the built-in loop's tool parser
    read (a parser of one's own)."""
    from relax.agents.loops import ToolsAndEnvironment

    names = harmony_call_names(text)
    if names or not isinstance(loop, ToolsAndEnvironment):
        return names
    return [call.name for call in loop.calls(text).calls]


def turn_ends(turns: Sequence[tuple[Any, list[int], Optional[int], int]]) -> list[Optional[list[int]]]:
    """`turn_end` of each (episode, tokens, stop token, context) of a round, in order: every episode's answer is
    started before any is waited on, so that calls that hang together cost one `data.env_timeout_s`. An object
    with only `turn_end` (an engine's own rows) is called in its place."""
    began = []
    for episode, tokens, stop_token, context in turns:
        begin = getattr(episode, "begin_turn", None)
        if callable(begin):
            begin(tokens, stop_token, context)
        began.append(callable(begin))
    return [episode.end_turn() if b else episode.turn_end(tokens, stop_token, context)
            for (episode, tokens, stop_token, context), b in zip(turns, began, strict=True)]


def conversation(record: dict, prompt: list[dict]) -> list[dict]:
    """An episode's conversation (what `data.reward`'s `messages` receives): an OpenAI-style agent's as its gateway
    kept it (`messages`); otherwise the prompt's messages `prompt`, then each turn's model message (an assistant
    message) followed by what answered it (`observations`)."""
    if record.get("messages"):
        return [dict(m) for m in record["messages"]]
    out = [dict(m) for m in prompt]
    observations = record.get("observations") or []
    for i, action in enumerate(record.get("actions") or []):
        out.append({"role": "assistant", "content": action})
        if i < len(observations):
            out.extend(dict(m) for m in observations[i])
    return out


def item_record(item: Any) -> dict:
    """A prompt item (`relax.data.datasets.PromptItem` or a dict) as the plain values an episode keeps (its token
    ids left out)."""
    record = dataclasses.asdict(item) if dataclasses.is_dataclass(item) else dict(item)
    record.pop("prompt_ids", None)
    return record


class EpisodeMaker:
    """Makes the episodes of a rollout process: fresh ones for prompt items, running ones from records."""

    def __init__(self, loops: Callable[[], AgentLoop], tokenizer: Any, *, max_turns: int, max_tool_errors: int,
                 processor: Any = None, wire: bool = False, blank: bool = False,
                 turn_timeout_s: Optional[float] = None, source: str = "data.agent"):
        self.loops, self.tokenizer = loops, tokenizer
        # processor: image observations; wire: their images kept as data URLs too (rollout=sglang's image_data);
        # blank: data.blank_images, the observations' images grey as the prompts' are
        self.renderer = ObservationRenderer(tokenizer, processor, wire=wire, blank=blank)
        self._text = message_decoder(tokenizer)  # keeps the tool-call markers a tokenizer makes special
        self.limits = dict(max_turns=max_turns, max_tool_errors=max_tool_errors, turn_timeout_s=turn_timeout_s,
                           source=source)

    @classmethod
    def for_config(cls, cfg: Any) -> Optional[EpisodeMaker]:
        """The episodes of a run's agentic rollouts (`data.env`, `data.tools`, `data.agent` with the rollout's
        limits), or None for single-turn data and for an agent program (`data.openai_agent`)."""
        from relax.agents.loops import AgentFactory
        from relax.agents.parsers import get_parser, parse_hermes, uses_reasoning
        from relax.config.derive import agentic
        from relax.data.images import vision_data
        from relax.data.tokenizer import load_tokenizer

        if not agentic(cfg) or cfg.data.openai_agent:  # an OpenAI agent program runs its episodes itself
            return None
        d, ro = cfg.data, cfg.rollout
        tokenizer = load_tokenizer(cfg.model)
        # auto: the one of the tokenizer's chat template; only data.tools reads calls, so an env-only or data.agent
        # run on a template whose call format Relax cannot read is not refused for it
        parser = get_parser(d.tool_parser, tokenizer) if d.tools else parse_hermes
        # the prompts' VisionData: one reading of the processor, data.blank_images and the rollout's wire format
        vision = vision_data(cfg, tokenizer)
        loops = AgentFactory(d.env, d.tools, d.agent, d.tool_timeout_s, parser, uses_reasoning(tokenizer),
                             env_timeout_s=d.env_timeout_s, sandbox=d.sandbox)
        return cls(loops, tokenizer,
                   max_turns=ro.max_turns, max_tool_errors=ro.max_tool_errors,
                   processor=vision.processor if vision else None, wire=bool(vision and vision.wire),
                   blank=bool(vision and vision.blank),
                   turn_timeout_s=d.env_timeout_s if d.agent else None, source=f"data.agent={d.agent}")

    def new_for(self, items: list, n: int) -> list[Episode]:
        """`n` new episodes for each of `items` (a group each, consecutive), their resets made at the same time."""
        episodes = [Episode(item_record(item), self.loops(), self.renderer, self.decode, wait=False, **self.limits)
                    for item in items for _ in range(n)]
        for episode in episodes:
            episode.settle()
        return episodes

    def restore_all(self, records: list[dict]) -> list[Episode]:
        """The running episodes of `records`, their resets and replays made at the same time."""
        episodes = [Episode.restore(r, self.loops(), self.renderer, self.decode, wait=False, **self.limits)
                    for r in records]
        for episode in episodes:
            episode.settle()
        return episodes

    def close(self) -> None:
        close = getattr(self.loops, "close", None)
        if callable(close):
            close()

    def decode(self, tokens: list[int]) -> str:
        return self._text(tokens)

    def new(self, item: dict) -> Episode:
        return Episode(item, self.loops(), self.renderer, self.decode, **self.limits)

    def restore(self, record: dict) -> Episode:
        return Episode.restore(record, self.loops(), self.renderer, self.decode, **self.limits)
