"""The client side of SGLang's HTTP protocol: `/generate` requests for Relax's samples, and their answers as `Samples`.

One request per sample (`n=1`), each with its own `sampling_seed` derived from (seed, sample id, position): a
sample is then the same whichever engine answers it, and a request retried after an engine died gives the same
tokens. (`n=G` in one request would share the prompt's prefill, but SGLang gives the G copies the same
`sampling_seed`, i.e. identical samples; the router's cache-aware policy and the servers' prefix caches share
the prompt's prefill anyway.)

Requests go out concurrently (aiohttp, up to `max_in_flight` at once); one that fails (connection refused or reset,
HTTP 5xx, no worker) is retried with backoff until `request_timeout_s` has passed since it was first sent: each
request has its own deadline, so a long rollout (more requests than go out at once, or an episode's later turns) is
not cut off by a deadline of the whole batch. `pause()` makes the requests
not yet sent come back as aborted with no tokens (the engines were paused; the caller resumes them from their
prefix), as the requests the engines aborted come back with their partial tokens.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from dataclasses import dataclass

import requests
import torch

from relax.batch import FinishReason, Samples

# SGLang's finish_reason.type (its wire strings, left) -> Samples.finish_reason
FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


class EngineRequestError(RuntimeError):
    """A request failed for good (a 4xx answer, or retries ran out of time). Its text names the endpoint and what
    went wrong, an answer's body cut short (for logs); `status` and `body`: the HTTP status and whole body of the
    engine's error answer, None and "" where there was none (the connection failed, no answer in time, an answer
    that is not one), so a caller decides on what the engine answered (`error_code`), not on the text."""

    def __init__(self, message: str, *, status: int | None = None, body: str = ""):
        super().__init__(message)
        self.status, self.body = status, body

    @property
    def error(self) -> dict:
        """The error object of a JSON body: relax's engine's and the OpenAI API's `{"error": {"message", "type",
        "param", "code"}}`, SGLang's `{"error": {"message"}}` (`{"error": "..."}` for a missing key: its message)
        and `{"object": "error", "message", "code"}`; {} for another body."""
        try:
            answer = json.loads(self.body) if self.body else None
        except ValueError:
            return {}
        if not isinstance(answer, dict):
            return {}
        error = answer.get("error")
        if isinstance(error, dict):
            return error
        if isinstance(error, str):
            return {"message": error}
        return answer if answer.get("object") == "error" else {}

    @property
    def error_message(self) -> str | None:
        """The message of the body's error, whole; None without one."""
        message = self.error.get("message")
        return message if isinstance(message, str) else None

    @property
    def error_code(self) -> str | int | None:
        """The code of the body's error (relax's engine: `grammar_dead_end` at a grammar's dead end; SGLang's
        `{"object": "error"}` repeats the HTTP status there); None without one."""
        return self.error.get("code")


def sample_seed(seed: int, sample_id: int, position: int) -> int:
    """The `sampling_seed` of a sample's tokens from `position` on: a 63-bit hash of the three."""
    digest = hashlib.blake2b(f"{seed}:{sample_id}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_token_ids: tuple[int, ...]

    def params(self, max_new_tokens: int, seed: int) -> dict:
        """SGLang's `sampling_params`: the stop token stays in the output (Relax trains on it)."""
        return {"max_new_tokens": int(max_new_tokens), "temperature": float(self.temperature),
                "top_p": float(self.top_p), "top_k": int(self.top_k), "n": 1,
                "stop_token_ids": list(self.stop_token_ids), "ignore_eos": False, "no_stop_trim": True,
                "skip_special_tokens": False, "sampling_seed": int(seed)}


def generate_payload(input_ids: list[int], sampling: Sampling, *, max_new_tokens: int, seed: int,
                     image_data: list[str] | None = None, routed_experts: bool = False) -> dict:
    """One `/generate` body; `image_data`: the prompt's images (SGLang's field, one list for this one input), whose
    image tokens `input_ids` already holds, expanded as the model's processor expands them; `routed_experts`: ask for
    the experts of every token (SGLang's `return_routed_experts`, `relax.rollout.sglang.routes`)."""
    payload = {"input_ids": list(map(int, input_ids)), "sampling_params": sampling.params(max_new_tokens, seed),
               "return_logprob": True, "logprob_start_len": -1, "stream": False}
    if image_data:
        payload["image_data"] = list(image_data)
    if routed_experts:
        payload["return_routed_experts"] = True
    return payload


def payload_images(vision: dict | None) -> list[str] | None:
    """The `image_data` of a prompt's vision inputs (`relax.data.images.VisionData` with `wire`), None without
    images."""
    if vision is None:
        return None
    if not vision.get("image_data"):
        raise ValueError("a prompt with images has no image_data to send (its data was read without "
                         "VisionData.wire, which rollout=sglang needs)")
    return list(vision["image_data"])


def parse_answer(answer: dict, default_version: int,
                 prompt_len: int | None = None) -> tuple[list[int], list[float], FinishReason, int]:
    """(token ids, log-probs, finish reason, weight version) of one `/generate` answer. `prompt_len`: the tokens
    the prompt holds (with images: their image tokens too); an answer that counts other `prompt_tokens` placed the
    images into a different number of tokens than the trainer scores, an error."""
    meta = answer.get("meta_info") or {}
    if prompt_len is not None and meta.get("prompt_tokens") is not None and int(meta["prompt_tokens"]) != prompt_len:
        raise EngineRequestError(f"the server read the prompt with its images as {meta['prompt_tokens']} tokens, the "
                                 f"trainer's prompt has {prompt_len}: the server's processor expands the images into "
                                 "a different number of image tokens than the run's")
    pairs = meta.get("output_token_logprobs") or []
    ids = [int(p[1]) for p in pairs]
    logps = [float(p[0]) for p in pairs]
    if not pairs and answer.get("output_ids"):
        raise EngineRequestError("the engine answered without output_token_logprobs (return_logprob=true was sent)")
    reason = (meta.get("finish_reason") or {}).get("type", "abort")
    if reason not in FINISH:
        raise EngineRequestError(f"unknown finish_reason {meta.get('finish_reason')!r}")
    try:
        version = int(meta.get("weight_version"))
    except (TypeError, ValueError):  # a server that never got weights from Relax ("default"): its initial ones
        version = default_version
    return ids, logps, FINISH[reason], version


def to_samples(prompts: list[list[int]], answers: list[tuple[list[int], list[float], str, int]], *,
               sample_ids: torch.Tensor, pad_token_id: int, engine_time: float,
               routes: tuple[list, tuple[int, int, int]] | None = None) -> Samples:
    """Rows in the order of `prompts` (one prompt per row): prompts left-padded, responses right-padded. `routes`:
    (each answer's decoded routed experts, or None; the model's (MoE layers, top-k, experts)), placed as
    `Samples.routed_experts` (`relax.rollout.sglang.routes.place`)."""
    N = len(prompts)
    P = max(len(p) for p in prompts)
    T = max([len(a[0]) for a in answers] + [1])
    prompt_ids = torch.full((N, P), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(N, P, dtype=torch.long)
    ids = torch.full((N, T), pad_token_id, dtype=torch.long)
    logp = torch.zeros(N, T, dtype=torch.float32)
    mask = torch.zeros(N, T, dtype=torch.long)
    versions = torch.zeros(N, dtype=torch.long)
    for i, (prompt, (tokens, lps, _, version)) in enumerate(zip(prompts, answers, strict=True)):
        prompt_ids[i, P - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        prompt_mask[i, P - len(prompt):] = 1
        ids[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        logp[i, :len(tokens)] = torch.tensor(lps, dtype=torch.float32)
        mask[i, :len(tokens)] = 1
        versions[i] = version
    routed = None
    if routes is not None:
        from relax.rollout.sglang.routes import place

        per_row, (layers, top_k, experts) = routes
        routed = place([(len(p), len(a[0]), r) for p, a, r in zip(prompts, answers, per_row, strict=True)], P, T,
                       layers, top_k, experts)
    return Samples(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=ids, response_mask=mask,
                   rollout_logp=logp, finish_reason=[a[2] for a in answers], routed_experts=routed,
                   weight_version=int(versions.min()) if N else 0, engine_time=engine_time,
                   dropped_mass=float("nan"),  # SGLang does not report what top-k/top-p removed
                   sample_id=torch.as_tensor(sample_ids, dtype=torch.long).clone(),
                   token_version=mask * versions[:, None])


def auth_headers(api_key: str | None) -> dict[str, str]:
    """What a server started with `--api-key` wants with every request (nothing without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def post(url: str, path: str, body: dict | None = None, *, timeout: float = 60.0, ok: tuple[int, ...] = (200,),
         api_key: str | None = None) -> dict:
    """POST a JSON body (SGLang's control endpoints want one, `{}` at least), with the server's key; the JSON
    answer, or an error naming the endpoint."""
    try:
        r = requests.post(url + path, json=body if body is not None else {}, timeout=timeout,
                          headers=auth_headers(api_key))
    except requests.RequestException as exc:
        raise EngineRequestError(f"POST {url}{path}: {type(exc).__name__}: {exc}") from None
    if r.status_code not in ok:
        raise EngineRequestError(f"POST {url}{path}: HTTP {r.status_code} {r.text[:500]}", status=r.status_code,
                                 body=r.text)
    try:
        out = r.json()
    except ValueError:
        return {}
    if isinstance(out, dict) and out.get("success") is False:
        raise EngineRequestError(f"POST {url}{path}: {out.get('message')}")
    return out if isinstance(out, dict) else {"answer": out}


class GenerateClient:
    """Sends `/generate` requests to one URL (the router) and collects the answers."""

    def __init__(self, url: str, *, request_timeout_s: float, max_in_flight: int = 512, api_key: str | None = None):
        self.url, self.request_timeout_s, self.max_in_flight = url, request_timeout_s, max_in_flight
        self.headers = auth_headers(api_key)
        self._paused = threading.Event()
        self._posting = 0  # requests sent and not answered yet
        self._posted = threading.Condition()
        self.retries = 0  # requests sent again after a failure (an engine died, the router had no worker)

    def pause(self) -> None:
        """From now on, requests not yet sent return as aborted with no tokens (until `unpause`)."""
        self._paused.set()

    def unpause(self) -> None:
        self._paused.clear()

    @property
    def paused(self) -> bool:
        return self._paused.is_set()

    def wait_answered(self, timeout: float) -> bool:
        """Wait until no request is out (sent, not answered); whether none is."""
        with self._posted:
            return self._posted.wait_for(lambda: self._posting == 0, timeout=timeout)

    def generate(self, payloads: list[dict]) -> list[dict]:
        """The answers to `payloads`, in order."""
        return asyncio.run(self._all(payloads))

    async def _all(self, payloads: list[dict]) -> list[dict]:
        import aiohttp

        limit = asyncio.Semaphore(self.max_in_flight)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
        connector = aiohttp.TCPConnector(limit=self.max_in_flight)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=self.headers) as session:
            return list(await asyncio.gather(*(self._one(session, p, limit) for p in payloads)))

    async def _one(self, session, payload: dict, limit: asyncio.Semaphore) -> dict:
        import aiohttp

        backoff, last = 0.05, "not sent"
        async with limit:
            deadline = time.monotonic() + self.request_timeout_s  # this request's, from its first attempt
            while True:
                if self._paused.is_set():
                    return {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "paused"},
                                                            "output_token_logprobs": []}}
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineRequestError(f"POST {self.url}/generate: a request was not answered within "
                                             f"{self.request_timeout_s:g} s of its first attempt "
                                             f"(rollout.sglang.request_timeout_s); last error: {last}")
                with self._posted:
                    self._posting += 1
                try:
                    async with session.post(self.url + "/generate", json=payload,
                                            timeout=aiohttp.ClientTimeout(total=left)) as r:
                        text = await r.text()
                        if r.status == 200:
                            answer = json.loads(text)
                            return answer[0] if isinstance(answer, list) else answer
                        last = f"HTTP {r.status} {text[:300]}"
                        if 400 <= r.status < 500 and r.status not in (404, 408, 429):
                            raise EngineRequestError(f"POST {self.url}/generate: {last}", status=r.status, body=text)
                except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
                    last = f"{type(exc).__name__}: {exc}"
                finally:
                    with self._posted:
                        self._posting -= 1
                        self._posted.notify_all()
                self.retries += 1
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
