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
(its group left out, the batch's first failure warned of).

`record()` is the episode as plain values (`Samples.episodes`): what the driver scores and logs, and what a
checkpoint or a partial rollout carries; `Episode.restore` rebuilds a running episode from it (its loop reset and
the model's earlier messages replayed).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Optional

from relax import progress
from relax.agents.bounded import StepTimeout, call_within
from relax.agents.parsers import message_decoder, opened_reasoning
from relax.agents.protocol import AgentLoop, Reply
from relax.agents.render import ObservationRenderer
from relax.batch import FinishReason, plain_reason


class Episode:
    """An episode of prompt `item` (a plain dict) with agent loop `loop`."""

    def __init__(self, item: dict, loop: AgentLoop, renderer: ObservationRenderer, decode: Callable[[list[int]], str],
                 *, max_turns: int, max_tool_errors: int, turn_timeout_s: Optional[float] = None,
                 source: str = "data.agent"):
        """`turn_timeout_s`: the limit on each `loop.turn` (`data.env_timeout_s` for a `data.agent` loop; None: none,
        as for the built-in loop, which bounds its environment's `step` itself); `source`: the option that named the
        loop, with its value, for the time-out's message."""
        self.item, self.loop, self.renderer, self.decode = item, loop, renderer, decode
        self.max_turns, self.max_tool_errors = max_turns, max_tool_errors
        self.turn_timeout_s, self.source = turn_timeout_s, source
        self.error: Optional[str] = None  # why the episode failed (a time-out): its group is left out
        self.turns = self.tool_calls = self.tool_errors = 0
        self.turn_rewards: list[float] = []
        self.actions: list[str] = []  # the model's message of each turn
        self.env_time = 0.0
        self.kv_reused = 0  # context tokens later turns reused from the cache instead of computing them again
        self.end: Optional[str] = None
        self.partial: list[int] = []  # tokens of a turn interrupted by an abort, continued on resume
        # the <think> block the context leaves open for the next turn ("": none), written before the turn's text
        self.opened = opened_reasoning(str(item.get("prompt_text") or ""))
        t0 = time.perf_counter()
        loop.reset(dict(item))
        self.env_time += time.perf_counter() - t0

    def turn_end(self, tokens: list[int], stop_token: Optional[int], context: int) -> Optional[list[int]]:
        """The model ended a turn with `tokens` (this call's, after any interrupted part; the stop token last, if
        `stop_token`); `context`: tokens before the next turn would start, prompt included. Returns the
        observation's tokens, or None: the episode is over (`end` set)."""
        tokens = self.partial + list(tokens)
        self.partial = []
        text = self.opened + self.decode(tokens)
        self.turns += 1
        self.actions.append(text)
        t0 = time.perf_counter()
        try:
            reply: Reply = call_within(lambda: self.loop.turn(text), self.turn_timeout_s,
                                       f"{self.source}: {type(self.loop).__name__}.turn")
        except StepTimeout as exc:
            self.env_time += time.perf_counter() - t0
            self.turn_rewards.append(0.0)
            self.end, self.error = FinishReason.TIMEOUT, str(exc)
            progress.tick()  # the wait is over: the rollout goes on (other episodes' waits are timed anew)
            return None
        self.env_time += time.perf_counter() - t0
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
        # (an image observation's tokens come with its images: relax.agents.render.VisionTokens)
        obs = list(reply.tokens) if reply.tokens is not None else self.renderer.tokens(reply.messages, stop_token)
        if not obs:
            raise ValueError(f"{type(self.loop).__name__}: an empty observation for an episode that is not done")
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
                "env_time": self.env_time, "kv_reused": self.kv_reused, "end": plain_reason(self.end),
                "partial": list(self.partial), "opened": self.opened, "error": self.error}

    @classmethod
    def restore(cls, record: dict, loop: AgentLoop, renderer: ObservationRenderer,
                decode: Callable[[list[int]], str], *, max_turns: int, max_tool_errors: int,
                turn_timeout_s: Optional[float] = None, source: str = "data.agent") -> Episode:
        """The running episode of `record` (see the module docstring)."""
        ep = cls(record["item"], loop, renderer, decode, max_turns=max_turns, max_tool_errors=max_tool_errors,
                 turn_timeout_s=turn_timeout_s, source=source)
        t0 = time.perf_counter()
        replay = getattr(loop, "replay", None)
        if callable(replay):
            replay(list(record["actions"]))
        else:
            for text in record["actions"]:
                loop.turn(text)
        ep.env_time = record["env_time"] + time.perf_counter() - t0
        ep.turns, ep.tool_calls, ep.tool_errors = record["turns"], record["tool_calls"], record["tool_errors"]
        ep.turn_rewards, ep.actions = list(record["turn_rewards"]), list(record["actions"])
        ep.kv_reused, ep.partial = record["kv_reused"], list(record["partial"])
        ep.opened = record.get("opened", ep.opened)  # (a record from before it was kept: the prompt's)
        return ep


def item_record(item: Any) -> dict:
    """A prompt item (`relax.data.datasets.PromptItem` or a dict) as the plain values an episode keeps (its token
    ids left out)."""
    record = dataclasses.asdict(item) if dataclasses.is_dataclass(item) else dict(item)
    record.pop("prompt_ids", None)
    return record


class EpisodeMaker:
    """Makes the episodes of a rollout process: fresh ones for prompt items, running ones from records."""

    def __init__(self, loops: Callable[[], AgentLoop], tokenizer: Any, *, max_turns: int, max_tool_errors: int,
                 processor: Any = None, wire: bool = False, turn_timeout_s: Optional[float] = None,
                 source: str = "data.agent"):
        self.loops, self.tokenizer = loops, tokenizer
        # processor: image observations; wire: their images kept as data URLs too (rollout=sglang's image_data)
        self.renderer = ObservationRenderer(tokenizer, processor, wire=wire)
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
        from relax.data.images import is_vision_model_config, load_processor
        from relax.data.tokenizer import load_tokenizer

        if not agentic(cfg) or cfg.data.openai_agent:  # an OpenAI agent program runs its episodes itself
            return None
        d, ro = cfg.data, cfg.rollout
        tokenizer = load_tokenizer(cfg.model)
        # auto: the one of the tokenizer's chat template; only data.tools reads calls, so an env-only or data.agent
        # run on a template whose call format Relax cannot read is not refused for it
        parser = get_parser(d.tool_parser, tokenizer) if d.tools else parse_hermes
        processor = load_processor(cfg.model, tokenizer) if is_vision_model_config(cfg.model) else None
        loops = AgentFactory(d.env, d.tools, d.agent, d.tool_timeout_s, parser, uses_reasoning(tokenizer),
                             env_timeout_s=d.env_timeout_s)
        return cls(loops, tokenizer,
                   max_turns=ro.max_turns, max_tool_errors=ro.max_tool_errors, processor=processor,
                   wire=processor is not None and ro.backend == "sglang",
                   turn_timeout_s=d.env_timeout_s if d.agent else None, source=f"data.agent={d.agent}")

    def new_for(self, items: list, n: int) -> list[Episode]:
        """`n` new episodes for each of `items` (a group each, consecutive)."""
        return [self.new(item_record(item)) for item in items for _ in range(n)]

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
