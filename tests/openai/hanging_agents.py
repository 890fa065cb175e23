"""An agent program for tests/openai/test_agent_cancel.py (`data.openai_agent=tests.openai.hanging_agents:run`): one
call through the gateway, then it hangs (a stuck tool, a framework waiting on a lost connection) until its worker
process is killed."""

from __future__ import annotations

import threading

from openai import OpenAI


def run(item: dict, base_url: str, api_key: str) -> None:
    with OpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        client.chat.completions.create(model="policy", messages=item["messages"])
    threading.Event().wait()  # never set: only its time limit, or a cancel, ends the run
