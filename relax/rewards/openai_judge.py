"""A judge behind an OpenAI-compatible API (`reward_model.engine=openai`): SGLang's or vLLM's servers, `relax-serve`,
a vendor's endpoint. One chat completion per question, `reward_model.batch_size` of them at a time, each bounded by
`reward_model.timeout_s`; the key is read from the environment variable `reward_model.api_key_env` when the client is
made (never from a command line, never written to a log or an error message).

A request that fails (refused, timed out, an HTTP error, an answer without a message) is retried `RETRIES` times with
a growing pause; if it still fails, its answer is None and its error kept: the caller counts it as a failed score.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import requests

RETRIES = 2  # more tries of a failed request
BACKOFF_S = 0.5  # the pause before the first retry; it doubles


class OpenAIJudge:
    """Chat completions at `url` (the API's base, `.../v1`) for `model`, `concurrency` requests at a time."""

    def __init__(self, url: str, *, model: Optional[str], api_key_env: Optional[str], max_new_tokens: int,
                 temperature: float, timeout_s: float, concurrency: int):
        self.endpoint = url.rstrip("/") + "/chat/completions"
        self.model = model or "default"
        self.max_new_tokens, self.temperature, self.timeout_s = max_new_tokens, temperature, timeout_s
        key = os.environ.get(api_key_env, "").strip() if api_key_env else ""
        if api_key_env and not key:
            raise ValueError(f"reward_model.api_key_env={api_key_env}: the environment variable is not set")
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="judge-http")
        self._session = requests.Session()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._session.close()

    def answer(self, questions: list[str]) -> tuple[list[Optional[str]], list[Optional[str]]]:
        """(answers, errors): each question's answer text (None: failed) and why it failed."""
        results = list(self._pool.map(self._one, questions))
        return [a for a, _ in results], [e for _, e in results]

    def _one(self, question: str) -> tuple[Optional[str], Optional[str]]:
        body = {"model": self.model, "messages": [{"role": "user", "content": question}],
                "max_tokens": self.max_new_tokens, "temperature": self.temperature}
        error = None
        for attempt in range(RETRIES + 1):
            if attempt:
                time.sleep(BACKOFF_S * 2 ** (attempt - 1))
            try:
                reply = self._session.post(self.endpoint, json=body, headers=self._headers, timeout=self.timeout_s)
            except requests.Timeout:
                error = f"{self.endpoint}: no answer within reward_model.timeout_s={self.timeout_s:g}"
                continue
            except requests.RequestException as exc:
                error = f"{self.endpoint}: {type(exc).__name__}: {exc}"
                continue
            if reply.status_code != 200:
                error = f"{self.endpoint}: HTTP {reply.status_code}: {reply.text[:300]}"
                if reply.status_code in (400, 401, 403, 404, 422):  # the request itself is wrong: no retry helps
                    break
                continue
            try:
                content = reply.json()["choices"][0]["message"]["content"]
            except (ValueError, KeyError, IndexError, TypeError):
                error = f"{self.endpoint}: an answer without choices[0].message.content: {reply.text[:300]}"
                continue
            return ("" if content is None else str(content)), None
        return None, error
