"""Agent programs that speak the OpenAI API as a rollout (`data.openai_agent`): each sample is one run of the user's
function `run(item, base_url, api_key) -> reward or None`, in its own session of the training gateway.

The function gets the prompt item as a dict (`messages`: the prompt as chat messages, `label`, `prompt_text`, `index`,
`source`), the gateway's `base_url` and its session's key, and uses any OpenAI client with them. Runs go to worker
processes (`relax.rewards.worker_pool.RewardWorkers`, `data.agent_workers` of them), each with a time limit
(`data.agent_timeout_s`): a run that raises or runs past it is killed, its session ended, and the sample counts as a
failed reward call (its group is left out, as for any failed reward), unless it raised its framework's exception for a
cut answer after its last answer was cut (it ends "length") or its framework's turn-limit exception after all the calls
`rollout.max_turns` allows, the last one answered (it ends "max_turns"; `_end_of_run`): those keep their trajectory. A
run that made no call fails the same way. When a run returns, its session's main row (`relax.serve.openai.sessions`: the
branch holding the most sampled tokens) becomes the sample: the first prompt as the prompt, then every later token,
trained where the engine sampled it. A run that forked (a side call, parallel calls, a choice not continued, a segment
left by an edit) has more rows (`Session.rows`, one per branch, each owning the sampled tokens no earlier row owns);
they travel in the sample's episode record (`branch_rows`, plain lists) and the trainer trains them with the main row
(`relax.runner.branch_rows`), so that every sampled token is trained exactly once; the record counts them
(`sampled_tokens`, `trained_tokens`, `branches`: `rollout/gateway_untrained_tokens`,
`rollout/gateway_branches_per_run`). Its reward: what the function returned (None: nothing), plus the rewards given per
call (`POST /v1/relax/reward`), plus `data.reward` on the last answer (unless `data.reward=none`); every row of a run
trains with it (docs/agents.md). """

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Optional

import torch

from relax.agents.episode import item_record
from relax.agents.parsers import get_parser
from relax.batch import EpisodeRow, FinishReason, Samples, episode_samples, plain_reason
from relax.models.hf import context_length
from relax.serve.openai.agent_call import CUT_ANSWER_ERROR, TURN_LIMIT_ERROR, call_agent
from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.gateway import Gateway, WatchedSend
from relax.serve.openai.service import OpenAIService
from relax.serve.openai.sessions import FORMS, Limits, Segment, Session

AGENT_CALL = "run(item, base_url, api_key)"


def load_agent(spec: str) -> Callable[..., Any]:
    """The function `data.openai_agent` names ('package.module:function'), checked against how each worker calls it
    (`relax.serve.openai.agent_call.call_agent`: `fn(item, base_url, api_key)`, synchronously, a number or None back):
    `AgentSpecError` (a ValueError) naming what is wrong, before anything starts, rather than a TypeError (or a
    coroutine returned) on every episode of a run that then trains nothing."""
    import inspect

    from relax.agents.loops import AgentSpecError, load_callable
    from relax.imports import call_mismatch

    fn = load_callable(spec, "data.openai_agent", {}, f"a function {AGENT_CALL}")
    wanted = f"an agent is a function {AGENT_CALL} -> float | None (docs/agents.md)"
    if inspect.isclass(fn):  # calling it makes an instance, never a reward (a pydantic model, an agent's class)
        raise AgentSpecError(f"data.openai_agent={spec!r}: {spec} is a class, and Relax calls the agent as "
                             f"{AGENT_CALL} and takes what it returns as the reward; {wanted}")
    call = getattr(fn, "__call__", None)  # noqa: B004 (a callable object's own method: async there too)
    if any(inspect.iscoroutinefunction(f) or inspect.isasyncgenfunction(f) for f in (fn, call)):
        raise AgentSpecError(f"data.openai_agent={spec!r}: {spec} is async, and Relax calls the agent as "
                             f"{AGENT_CALL} in a worker process without awaiting it; {wanted}; run an async one "
                             f"inside it: return asyncio.run(...)")
    if any(inspect.isgeneratorfunction(f) for f in (fn, call)):
        raise AgentSpecError(f"data.openai_agent={spec!r}: {spec} is a generator function (it yields), and Relax "
                             f"calls the agent as {AGENT_CALL} and takes what it returns as the reward; {wanted}; "
                             f"return the reward rather than yield it")
    mismatch = call_mismatch(fn, {}, "http://127.0.0.1:1/v1", "key")
    if mismatch is not None:
        signature, why = mismatch
        raise AgentSpecError(f"data.openai_agent={spec!r}: {spec}{signature} cannot be called as {AGENT_CALL} "
                             f"({why}); {wanted}")
    return fn


class AgentRollout:
    """The gateway and the agent workers of a run; `run` makes one batch of samples."""

    def __init__(self, cfg: Any, tokenizer: Any, *, eos_token_ids: tuple[int, ...], pad_token_id: int,
                 send: Callable[[list[dict]], list[dict]], abort: Callable[[list[str]], None], host: str):
        from relax.rewards.worker_pool import RewardWorkers

        self.cfg, self.pad_token_id = cfg, pad_token_id
        fmt = ChatFormat(tokenizer, eos_token_ids, get_parser(cfg.data.tool_parser, tokenizer))
        # an agent's call is bounded by the room left under the model's context, as the engines are
        # a call whose agent left (killed at its time limit, its client timed out) is aborted: `abort(rids)`
        watched = WatchedSend(send, abort)
        service = OpenAIService(fmt, watched, model=cfg.model.name, context_length=context_length(cfg.model),
                                max_tokens=cfg.rollout.max_response_len)
        self.gateway = Gateway(service, host=host, watched=watched).start()
        d = cfg.data
        self.workers = RewardWorkers(load_agent(d.openai_agent), processes=d.agent_workers, caller=call_agent,
                                     limit_name="data.agent_timeout_s", what="agent")
        self._previous: list[Session] = []

    def close(self) -> None:
        self.workers.close()
        self.gateway.close()

    def wake(self) -> None:
        """From another thread, once it set the `cancel` event of the `run` in progress: that run reads it now."""
        self.workers.wake()

    def run(self, items: list, sample_ids: torch.Tensor, *, seed: int, temperature: float, top_p: float,
            top_k: int, cancel: Optional[threading.Event] = None) -> Samples:
        """One agent run per sample (`len(sample_ids) // len(items)` per item, in order). `cancel`, set by another
        thread (which then calls `wake`), stops the runs in flight, also when set before this call: their worker
        processes are killed and it raises CallsCancelled (a run stopped at once would otherwise wait for them up to
        data.agent_timeout_s)."""
        ro, d = self.cfg.rollout, self.cfg.data
        G = len(sample_ids) // len(items)
        self.gateway.forget(self._previous)
        limits = Limits(max_calls=ro.max_turns, max_tokens=ro.max_episode_tokens, max_new_tokens=ro.max_response_len,
                        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        sessions = [self.gateway.open(int(s), limits) for s in sample_ids]
        self._previous = sessions  # forgotten at the next run, also when this one is cancelled
        records = [item_record(items[i // G]) for i in range(len(sessions))]
        outcomes, late = self.workers.run([(r, self.gateway.base_url, s.key) for r, s in zip(records, sessions,
                                                                                                strict=True)],
                                          d.agent_timeout_s, cancel=cancel)
        rows = []
        for s, record, (value, error), was_late in zip(sessions, records, outcomes, late, strict=True):
            self.gateway.close_session(s, _end_of_run(s, error, was_late))
            trajectory = s.trajectory()
            if trajectory is None:  # nothing to train: a failed sample
                error = error or "the agent made no call through the gateway"
                trajectory = Segment(prompt=[self.pad_token_id])
            elif error is not None and s.ended in (FinishReason.MAX_TURNS, FinishReason.LENGTH):
                # a run stopped by its session's limit (a call past it, or all its calls made: `_end_of_run`) or
                # by its framework's exception on a cut answer: its trajectory is the sample
                error = None
            if value is not None:
                trajectory.rewards[-1] += value
            rows.append((s, record, trajectory, error))
        return _samples(rows, sample_ids, self.pad_token_id)


def _end_of_run(s: Session, error: Optional[str], was_late: bool) -> str:
    """Why the run's session ends, once its run is over (a session its limit already ended keeps that reason).

    A run that raised a framework's exception for a cut answer (`agent_call.CUT_ANSWER_EXCEPTIONS`: openai-agents'
    ModelBehaviorError, the openai SDK's LengthFinishReasonError, ...) after its last answer was cut ends "length",
    as one its session's limit stopped: openai-agents raises on every answer cut by max_tokens (Responses:
    `incomplete`; chat: one left with no text, a Qwen3 answer cut inside <think>), and such a run is a truncated
    episode, not a failed one; any other exception there (the agent's own: a RuntimeError in its code) is a failed
    run. A run that raised its framework's turn-limit exception (`agent_call.TURN_LIMIT_EXCEPTIONS`: openai-agents'
    MaxTurnsExceeded, LangGraph's GraphRecursionError, pydantic-ai's UsageLimitExceeded) after its session made all
    the calls `rollout.max_turns` allows, the last one answered, ends "max_turns", as a call past the limit would
    have ended it: the framework's own limit equals rollout.max_turns, it stopped itself instead of making that call,
    and the run reached its limit, it did not fail. Any other exception (an agent that crashed after its last
    answer), or a turn-limit exception after fewer calls or with the last call not answered, is a failed run."""
    if was_late:
        return FinishReason.TIMEOUT
    if error is None:
        return FinishReason.DONE
    if error.startswith(CUT_ANSWER_ERROR) and _ended_on_a_cut_answer(s):
        return FinishReason.LENGTH
    if error.startswith(TURN_LIMIT_ERROR) and _used_every_call(s):
        return FinishReason.MAX_TURNS
    return FinishReason.ERROR


def _used_every_call(s: Session) -> bool:
    """Whether the session made every call its limit allows (`limits.max_calls`) and its last admitted call was
    answered (recorded)."""
    last = s.calls - 1
    return s.calls >= s.limits.max_calls and any(n.call == last for n in s.nodes)


def _ended_on_a_cut_answer(s: Session) -> bool:
    """Whether the session's last call was answered, its answer cut at its token limit (finish "length"), and no call
    came after it (the latest recorded call is the last one admitted)."""
    last = s.latest
    return last is not None and s.calls == last + 1 and any(n.cut for n in s.nodes if n.call == last)


def _samples(rows: list[tuple[Session, dict, Segment, Optional[str]]], sample_ids: torch.Tensor,
             pad_token_id: int) -> Samples:
    out = []
    for s, record, t, error in rows:
        rows_of_run = s.rows() if s.calls else []
        sampled = s.token_counts()[0]
        # a run whose last answer its token limit cut (a final tool call cut by max_tokens) ends "length", as the
        # built-in loop's cut final turn does (relax.agents.episode): algorithm.mask_truncated sees it
        end = s.ended if s.ended in (FinishReason.MAX_TURNS, FinishReason.LENGTH, FinishReason.TIMEOUT) \
            else FinishReason.ERROR if error else FinishReason.LENGTH if t.cut else FinishReason.DONE
        # the run's other rows (one per branch beyond the main one), as plain lists: they go wherever the sample
        # goes (dynamic sampling, the buffer, a checkpoint) and become rows of the training batch
        others = [{"prompt": list(r.prompt), "ids": list(r.tokens), "logp": list(r.logprobs),
                   "generated": list(r.sampled), "version": list(r.versions), "turn_rewards": list(r.rewards),
                   "constrained": list(r.constrained)}
                  for r in rows_of_run[1:]]
        episode = {"item": record, "turns": len(t.answers), "tool_calls": s.tool_calls, "tool_errors": 0,
                   "turn_rewards": list(t.rewards), "actions": list(t.answers), "env_time": 0.0, "kv_reused": 0,
                   "end": plain_reason(end), "partial": [], "segments": s.segments, "calls": s.calls,
                   "sampling_overrides": s.overrides, "error": error, "branches": max(1, len(rows_of_run)),
                   # the main row's own turn rewards (`turn_rewards` adds those of the calls outside it)
                   "row_turn_rewards": list(rows_of_run[0].rewards) if rows_of_run else list(t.rewards),
                   "branch_rows": others,
                   # the conversation (chat), the last answer included: what data.reward's `messages` receives
                   # (without the session's own FORMS key: a frozenset a checkpoint's weights_only load refuses)
                   "messages": [{k: v for k, v in m.items() if k != FORMS} for m in t.messages]
                   if t.messages else None,
                   # the session's sampled tokens and those in its rows' loss masks (the main row's and the others')
                   "sampled_tokens": sampled, "trained_tokens": sum(t.sampled) + sum(sum(o["generated"])
                                                                                     for o in others)}
        out.append(EpisodeRow(t.prompt, t.tokens, t.logprobs, t.sampled, t.versions,
                              end if end in (FinishReason.MAX_TURNS, FinishReason.LENGTH) else FinishReason.STOP,
                              episode, t.constrained))
    return episode_samples(out, sample_ids, pad_token_id)
