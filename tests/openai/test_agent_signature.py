"""`data.openai_agent` is checked before anything starts against how Relax calls it (docs/agents.md: a function
`run(item, base_url, api_key) -> float | None`, called in a worker process by
`relax.serve.openai.agent_call.call_agent`): a function of another signature, a class (a pydantic model) or an async
function is refused by the pre-start check, naming the option, the attribute's signature and the call, where it used
to pass (`dry_run=true` said it "loads") and then fail every episode with a TypeError, the run training nothing and
exiting 0."""

from __future__ import annotations

import functools
import inspect

import pydantic
import pytest
from relax_train_inprocess import relax_train

from relax.agents.loops import AgentSpecError
from relax.serve.openai.agent_call import call_agent
from relax.serve.openai.agents import load_agent

EMBEDDED = ["rollout=sglang", "rollout.sglang.server=embedded", "rollout.max_turns=2"]


def calc(expression: str) -> float:  # a tool, not an agent: named by mistake
    return float(len(expression))


def keyword_only(item: dict, base_url: str, *, api_key: str) -> float:
    return 1.0


class Answer(pydantic.BaseModel):  # a structured output's model, named by mistake
    answer: str


async def async_run(item: dict, base_url: str, api_key: str) -> float:
    return 1.0


def generator_run(item: dict, base_url: str, api_key: str):
    yield 1.0


class AsyncCallable:
    async def __call__(self, item: dict, base_url: str, api_key: str) -> float:
        return 1.0


async_object = AsyncCallable()


def run(item: dict, base_url: str, api_key: str) -> float:
    return 1.0


def run_with_options(item: dict, base_url: str, api_key: str, max_calls: int = 3, **options: object) -> float:
    return 1.0


def run_of_anything(*args: object) -> float:
    return float(len(args))


class Callable3:
    def __call__(self, item: dict, base_url: str, api_key: str) -> float:
        return 1.0


callable_object = Callable3()
bound_run = functools.partial(run_with_options, max_calls=5)


@pytest.mark.parametrize("name, why", [
    ("calc", "calc(expression: 'str') -> 'float' cannot be called as run(item, base_url, api_key) (too many "
             "positional arguments)"),
    ("keyword_only", "keyword_only(item: 'dict', base_url: 'str', *, api_key: 'str') -> 'float' cannot be called "
                     "as run(item, base_url, api_key) (too many positional arguments)"),
    ("Answer", "Answer is a class, and Relax calls the agent as run(item, base_url, api_key) and takes what it "
               "returns as the reward"),
    ("async_run", "async_run is async, and Relax calls the agent as run(item, base_url, api_key) in a worker "
                  "process without awaiting it"),
    ("async_object", "async_object is async"),
    ("generator_run", "generator_run is a generator function (it yields), and Relax calls the agent as "
                      "run(item, base_url, api_key) and takes what it returns as the reward"),
])
def test_an_agent_that_cannot_be_called_as_run_is_refused_naming_its_signature(name, why):
    spec = f"{__name__}:{name}"
    with pytest.raises(AgentSpecError) as info:
        load_agent(spec)
    message = str(info.value)
    assert message.startswith(f"data.openai_agent={spec!r}: {spec}"), message
    assert why in message and "run(item, base_url, api_key) -> float | None" in message, message
    # independent of the check: called as the worker calls it, it fails or gives no number (the run's every episode)
    fn = globals()[name]
    if name.startswith("async"):  # a coroutine, never awaited by the worker: "the agent returned <coroutine ...>"
        made = fn({"messages": []}, "http://127.0.0.1:1/v1", "key")
        assert inspect.iscoroutine(made)
        made.close()
    elif name == "generator_run":  # a generator, no reward: the run's every episode fails
        value, error = call_agent(fn, {"messages": []}, "http://127.0.0.1:1/v1", "key")
        assert value is None and error.startswith("the agent returned a generator: "), error
    else:
        value, error = call_agent(fn, {"messages": []}, "http://127.0.0.1:1/v1", "key")
        assert value is None and "TypeError" in error, error


@pytest.mark.parametrize("name", ["run", "run_with_options", "run_of_anything", "callable_object", "bound_run"])
def test_an_agent_callable_as_run_loads(name):
    """The control: what `call_agent` calls with a reward back passes, defaults, *args, objects and partials too."""
    fn = load_agent(f"{__name__}:{name}")
    assert call_agent(fn, {"messages": []}, "http://127.0.0.1:1/v1", "key")[0] is not None


@functools.wraps(async_run)
def traced_run(item: dict, base_url: str, api_key: str):  # a tracing decorator's shape over an async agent
    return async_run(item, base_url, api_key)


def test_an_async_agent_behind_a_sync_decorator_fails_each_episode_saying_so(recwarn):
    """A sync wrapper may run its async function with asyncio.run (legitimate), so it is not refused before start;
    one that returns the coroutine fails its episode with a message that says what happened and what to do, and the
    coroutine is closed (no 'was never awaited' warning). Before: "the agent returned <coroutine object ...>" and
    the RuntimeWarning."""
    import gc
    import warnings

    assert load_agent(f"{__name__}:traced_run") is traced_run
    warnings.simplefilter("always")
    value, error = call_agent(traced_run, {"messages": []}, "http://127.0.0.1:1/v1", "key")
    gc.collect()
    assert value is None and error.startswith("the agent returned a coroutine: an agent must be a synchronous "
                                              "function"), error
    assert "asyncio.run" in error
    assert not [w for w in recwarn if "never awaited" in str(w.message)], [str(w.message) for w in recwarn]


def test_dry_run_and_start_refuse_a_wrong_agent_before_ray(monkeypatch, tmp_path, capfd):
    """The pre-start check: `dry_run=true` fails the `openai_agent` line with the message (exit 1, no traceback),
    and the real start stops with the same message before Ray; the control (a `run` that fits) passes it."""
    from relax.config import load_config
    from relax.runner.cluster import RayRuntime
    from relax.runner.errors import RunError
    from relax.runner.preflight import preflight
    from relax.runner.train import run as start

    monkeypatch.delenv("MODEL_DIR", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(tmp_path)
    spec = f"{__name__}:calc"
    code, out, err = relax_train(["dry_run=true", *EMBEDDED, f"data.openai_agent={spec}"], capfd)
    line = (f"data.openai_agent={spec!r}: {spec}(expression: 'str') -> 'float' cannot be called as "
            "run(item, base_url, api_key)")
    assert code != 0 and line in out + err and "Traceback" not in out + err, (code, out, err)

    def refuse(self):
        raise AssertionError("Ray started: the pre-start check did not stop the run")

    monkeypatch.setattr(RayRuntime, "__enter__", refuse)
    cfg = load_config([*EMBEDDED, f"data.openai_agent={spec}"])
    with pytest.raises(RunError) as info:
        start(cfg, output_dir=tmp_path / "out")
    assert str(info.value).startswith(line) and str(info.value) == preflight(cfg).problems["openai_agent"]

    good = preflight(load_config([*EMBEDDED, f"data.openai_agent={__name__}:run"]), only=("model", "tokenizer",
                                                                                        "openai_agent"))
    assert good.ok, good.problems
