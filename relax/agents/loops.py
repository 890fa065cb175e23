"""The built-in agent loop and the registry of environments and agent loops.

`ToolsAndEnvironment` answers a model turn with its tool calls' results when it made any (`data.tools`; the calls
read by the `data.tool_parser` parser, each answered in its place: a result, or the error of a malformed call), else
with the environment's step (`data.env`); with neither, the turn is the model's final answer and the episode ends
("stop"). A turn's reasoning is taken off before its calls are read (`relax.agents.parsers.without_reasoning`, the
function the OpenAI gateway splits `reasoning_content` with, for templates that use <think>): a call written inside a
<think> block is thought, not made, so the same turn ends an episode here as it ends an agent's run through the
gateway. `data.agent` names a loop of the user's instead (`relax.agents.protocol.AgentLoop`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

from relax.agents.bounded import Bounded
from relax.agents.grid_walk import GridWalk
from relax.agents.guess_number import GuessNumber
from relax.agents.parsers import CallError, ParsedMessage, ToolParser, parse_hermes, without_reasoning
from relax.agents.protocol import AgentLoop, Reply, UserCodeError, as_step
from relax.agents.tools import ToolRunner, get_tools
from relax.batch import FinishReason
from relax.imports import resolve_component

BUILTIN_ENVS: dict[str, Callable[[], Any]] = {"guess_number": GuessNumber, "grid_walk": GridWalk}


class AgentSpecError(ValueError):
    """`data.env` or `data.agent` names nothing usable; raised at start."""


def load_callable(spec: str, option: str, builtins: dict[str, Callable[..., Any]],
                  expected: str = "a class or a factory called with no arguments") -> Callable[..., Any]:
    """What option `option`'s value `spec` names: a built-in name or 'package.module:attr', callable
    (`AgentSpecError` naming the option otherwise)."""
    known = "one of {builtins} or " if builtins else ""
    unknown = "{option}={spec!r}: unknown; expected " + known + "'package.module:attr' ({what})"
    value = resolve_component(builtins, option, spec, error=AgentSpecError, unknown=unknown, what=expected)
    if not callable(value):
        raise AgentSpecError(f"{option}={spec!r} is not callable ({expected})")
    return value


class ToolsAndEnvironment:
    """The built-in agent loop (see the module docstring). `env_factory` builds one environment per episode;
    `parser` reads the model's tool calls; `reasoning`: the chat template uses <think> blocks
    (`relax.agents.parsers.uses_reasoning`), whose calls are not read. `step_timeout_s`: the limit on each call of
    the environment's (made and reset, each `step`, each replayed step: `data.env_timeout_s`, `relax.agents.bounded`;
    None: none), whose time-out names `env_name`. `start_reset` and `start_turn` start those calls for the episode
    (`relax.agents.episode`), which waits on them later, so that the calls of a batch's episodes run together."""

    def __init__(self, env_factory: Optional[Callable[[], Any]], runner: Optional[ToolRunner],
                 parser: ToolParser = parse_hermes, reasoning: bool = True, *,
                 step_timeout_s: Optional[float] = None, env_name: str = "data.env"):
        self.env_factory, self.runner, self.parser, self.reasoning = env_factory, runner, parser, reasoning
        self.step_timeout_s, self.env_name = step_timeout_s, env_name
        self.env: Any = None

    def calls(self, text: str) -> ParsedMessage:
        """The tool calls of a turn: its text after its reasoning block, read by the parser."""
        return self.parser(without_reasoning(text) if self.reasoning else text)

    def _name(self, method: str) -> str:
        """What a time-out names: the option and the environment's method ("data.env=my_envs:Search: Search.step")."""
        cls = type(self.env).__name__ if self.env is not None else getattr(self.env_factory, "__name__", "env")
        return f"{self.env_name}: {cls}.{method}"

    def reset(self, item: dict) -> None:
        self.start_reset(item).result()

    def start_reset(self, item: dict, replay: Sequence[str] = ()) -> Bounded[None]:
        """The environment made and reset for `item`, then the environment's steps of the earlier turns `replay`
        made again (a resumed episode: tool turns are skipped, tools are stateless), or its own `replay` of them;
        started in a thread, each call bounded by `step_timeout_s`."""
        if self.env_factory is None:
            return Bounded.done(None)
        factory = self.env_factory

        def make() -> None:
            self.env = factory()
            self.env.reset(item)

        calls: list[tuple[str, Callable[[], Any]]] = [(self._name("reset"), make)]
        steps = [t for t in replay if self.runner is None or not self.calls(t).items]
        if steps and callable(getattr(factory, "replay", None)):  # (a class with its own replay: one call)
            calls.append((self._name("replay"), lambda: self.env.replay(steps)))
        elif steps:  # each step bounded as a live one (an environment a factory function made may replay itself)
            calls += [(self._name("step"), lambda k=k: self._replay_step(steps, k)) for k in range(len(steps))]
        return Bounded(calls, self.step_timeout_s)

    def _tool_reply(self, text: str, last: bool = False, errors_left: Optional[int] = None) -> Optional[Reply]:
        if self.runner is None:
            return None
        parsed = self.calls(text)
        if not parsed.items:
            return None
        if last:
            # the episode's last turn (rollout.max_turns): no one reads the results, so the calls are not run (a
            # sandbox run, a side effect, a cost), unless their failures could reach rollout.max_tool_errors, which
            # decides how the episode ends ("tool_errors" or "max_turns"); a malformed call fails without running
            malformed = sum(isinstance(item, CallError) for item in parsed.items)
            decides = errors_left is not None and malformed < errors_left <= len(parsed.items)
            if not decides:
                return Reply(tool_calls=len(parsed.items), tool_errors=malformed)
        results = iter(self.runner(parsed.calls))
        messages, errors = [], 0
        for item in parsed.items:  # in the order of the calls: the model matches results to calls by position
            if isinstance(item, CallError):
                content, failed = f"Error: {item.message}", True
            else:
                result = next(results)
                content, failed = result.content, result.error
            messages.append({"role": "tool", "content": content})
            errors += failed
        return Reply(messages=messages, tool_calls=len(parsed.items), tool_errors=errors)

    def turn(self, text: str) -> Reply:
        return self.start_turn(text).result()

    def _replay_step(self, steps: list[str], k: int) -> None:
        own = getattr(self.env, "replay", None)
        if not callable(own):
            self.env.step(steps[k])
        elif k == 0:
            own(steps)

    def start_turn(self, text: str, last: bool = False, errors_left: Optional[int] = None) -> Bounded[Reply]:
        """The reply to a model turn: its tool calls' results (answered here), or the environment's step, started in
        a thread and bounded by `step_timeout_s`. `last`: the episode's last turn, whose tool calls are counted but
        not run (no observation follows), unless their failures could bring the episode's failed calls to
        rollout.max_tool_errors (`errors_left` more; None: no such limit); an environment's step still runs (its
        reward and done count)."""
        reply = self._tool_reply(text, last, errors_left)
        if reply is not None:
            return Bounded.done(reply)
        if self.env is None:
            return Bounded.done(Reply(done=True, end=FinishReason.STOP))
        env = self.env
        name = type(env).__name__
        return Bounded([(self._name("step"), lambda: env.step(text))], self.step_timeout_s,
                       then=lambda value: self._step_reply(as_step(value, name), name))

    @staticmethod
    def _step_reply(step: Any, name: str) -> Reply:
        if step.done:
            return Reply(reward=step.reward, done=True, end=FinishReason.ENV_DONE)
        if step.observation is None:
            raise UserCodeError(f"{name}.step returned no observation for an episode that is not done")
        return Reply(messages=[{"role": "user", "content": step.observation}], reward=step.reward)

    def replay(self, actions: list[str]) -> None:
        """The environment's steps of earlier turns again (tool turns are skipped: tools are stateless), or its own
        `replay` of them, bounded as `start_reset`'s."""
        if self.env is None:
            return
        steps = [t for t in actions if self.runner is None or not self.calls(t).items]
        if not steps:
            return
        own = getattr(self.env, "replay", None)
        env = self.env
        calls: list[tuple[str, Callable[[], Any]]] = [(self._name("replay"), lambda: own(steps))] if callable(own) \
            else [(self._name("step"), lambda text=text: env.step(text)) for text in steps]
        Bounded(calls, self.step_timeout_s).result()


class AgentFactory:
    """Builds the agent loop of each episode from the data config: `data.agent`, or `ToolsAndEnvironment` over
    `data.env` and `data.tools` (their calls read by `tool_parser`, `relax.agents.parsers.get_parser` of
    data.tool_parser; `reasoning`: the chat template uses <think> blocks; `env_timeout_s`: the limit on each
    environment step, data.env_timeout_s). Everything is loaded (and named in errors) when the factory is made."""

    def __init__(self, env: Optional[str], tools: list[str] | tuple[str, ...], agent: Optional[str],
                 tool_timeout_s: Optional[float], tool_parser: ToolParser = parse_hermes, reasoning: bool = True,
                 env_timeout_s: Optional[float] = None, sandbox: Any = None):
        if agent and (env or tools):
            raise AgentSpecError("data.agent decides every observation itself; it cannot be combined with data.env "
                                 "or data.tools")
        self.agent = load_callable(agent, "data.agent", {}) if agent else None
        self.env = load_callable(env, "data.env", BUILTIN_ENVS) if env else None
        self.tools = get_tools(list(tools), sandbox) if tools else {}  # sandbox: data.sandbox (the python tool's)
        self.runner = ToolRunner(self.tools, tool_timeout_s) if self.tools else None
        self.tool_parser, self.reasoning = tool_parser, reasoning
        self.env_timeout_s, self.env_name = env_timeout_s, f"data.env={env}"

    def __call__(self) -> AgentLoop:
        if self.agent is not None:
            return self.agent()
        return ToolsAndEnvironment(self.env, self.runner, self.tool_parser, self.reasoning,
                                   step_timeout_s=self.env_timeout_s, env_name=self.env_name)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
