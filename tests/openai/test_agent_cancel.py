"""A run stopped at once (a second Ctrl-C) does not wait for an agent program's runs in flight: the rollout stream's
`cancel` event reaches `AgentRollout.run` (through `SGLangEngines.generate`), and `wake` stops the run's wait on its
agent worker processes, which are killed; the run raises CallsCancelled. Before, nothing but data.agent_timeout_s
ended such runs (the stream's close gave the pump up to 60 s, then left it).

`AgentRollout` as relax-train builds it (its agent worker processes, the gateway), over a scripted engine; the agent
makes one call with the official client, then hangs (tests/openai/hanging_agents.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from scripted import answer

from relax.rewards.worker_pool import CallsCancelled
from tests.agents.templates import family_tokenizer


class Script:
    """/generate answering every call with a few words; `called` once the first call arrived (an agent run is in
    flight, past its start)."""

    def __init__(self, tok):
        self.tok, self.called = tok, threading.Event()

    def __call__(self, payloads: list[dict]) -> list[dict]:
        self.called.set()
        ids = self.tok.encode("Fine.", add_special_tokens=False) + [self.tok.eos_token_id]
        return [answer(ids, "stop") for _ in payloads]


@pytest.mark.parametrize("when", ["in_flight", "before"])
def test_cancel_stops_the_agent_runs_and_kills_their_workers(when):
    from relax.config import load_config
    from relax.serve.openai.agents import AgentRollout

    tok = family_tokenizer("qwen3")
    cfg = load_config(["model=tiny", "rollout=sglang", "rollout.sglang.server=embedded",
                       "data.openai_agent=tests.openai.hanging_agents:run", "rollout.max_response_len=16",
                       "data.agent_workers=2", "data.agent_timeout_s=600"])
    script = Script(tok)
    rollout = AgentRollout(cfg, tok, eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id, send=script,
                           abort=lambda rids: None, host="127.0.0.1")
    items = [{"messages": [{"role": "user", "content": f"Start ({i})."}], "label": "", "index": i} for i in range(2)]
    cancel, raised = threading.Event(), []
    if when == "before":  # set before the run starts (the stream closed while the pump was about to call it)
        cancel.set()

    def go() -> None:
        try:
            rollout.run(items, torch.arange(2), seed=0, temperature=1.0, top_p=1.0, top_k=-1, cancel=cancel)
        except BaseException as exc:  # noqa: BLE001 - what run raised, for the assertions
            raised.append(exc)

    try:
        thread = threading.Thread(target=go)
        thread.start()
        if when == "in_flight":
            assert script.called.wait(120)  # an agent run made its call: it hangs now
            busy = [w.process for w in rollout.workers._workers]
            t0 = time.perf_counter()
            cancel.set()
            rollout.wake()
        else:
            busy, t0 = [], time.perf_counter()
        thread.join(60)
        assert not thread.is_alive() and time.perf_counter() - t0 < 10
        assert len(raised) == 1 and isinstance(raised[0], CallsCancelled), raised
        assert all(p.poll() is not None for p in busy)  # the hung runs' workers are gone
    finally:
        rollout.close()
