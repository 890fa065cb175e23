"""rollout=sglang: engine servers behind sglang-router, driven over SGLang's HTTP protocol.

`SGLangEngines` implements `relax.runner.rollout_driver.stream.Engines` like the embedded replicas do:

- start: one server per rollout replica (`EngineServer` Ray actors placed by the plan, each starting
  `sglang.launch_server` or `relax-serve`), or the servers at `rollout.sglang.urls`; the router in front;
- generate / resume: one `/generate` request per sample through the router (`relax.rollout.sglang.client`);
  `resume` continues interrupted responses from prompt + prefix with `max_new_tokens` reduced;
- abort (partial rollout): `/pause_generation {"mode": "abort"}` on every server; the responses in flight come
  back with their partial tokens; `load_weights` then flushes the cache, updates, and `/continue_generation`;
- load_weights: the published weights to every server, tagged with their version, which every answer reports back
  (`Samples.token_version`). The weights never come here: `push` (the runner's) has the actor's process send its
  snapshot of that version (an ObjectRef) itself (`relax.rollout.sglang.weight_sync.WeightSender`). Colocated in
  sync mode the servers release their memory after each rollout and resume it before the next update;
- faults: a watchdog thread polls each server's `/health`; after `health_failures` misses in a row the server is
  taken out of the router, replaced (a new actor and process), given the current weights and put back. Requests
  it was answering fail and are retried through the router; a retried request has the same `sampling_seed`, so
  no sample is lost or generated twice.
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import requests
import torch

from relax.agents.episode import EpisodeMaker
from relax.batch import Samples, continuation, extend_responses
from relax.config.schema import RelaxConfig
from relax.data.tokenizer import load_tokenizer
from relax.metrics import ENGINE_RETRIES, FAULT_RESTARTS_ROLLOUT, SYNC_BYTES, WEIGHT_BUCKETS
from relax.roles.workers import WEIGHTS_GROUP
from relax.rollout.grammar import DEAD_END_CODE
from relax.rollout.sglang.adapter_sync import adapter_name
from relax.rollout.sglang.client import (
    EngineRequestError,
    GenerateClient,
    Sampling,
    auth_headers,
    generate_payload,
    parse_answer,
    payload_images,
    post,
    sample_seed,
    to_samples,
)
from relax.rollout.sglang.episodes import run_episodes
from relax.rollout.sglang.process import StartupError, wait_healthy
from relax.rollout.sglang.router import Router
from relax.rollout.sglang.routes import decode as decode_routes
from relax.rollout.sglang.routes import moe_shape
from relax.rollout.sglang.weight_sync import WeightSender, WeightTarget
from relax.rollout.vision import prompt_vision
from relax.runner.errors import RoleFailure, RunError
from relax.runner.watchdog import Watchdog, first_line
from relax.serve.openai.agents import AgentRollout
from relax.serve.openai.protocol import APIError

ABORT_RECHECK_S = 0.2  # an abort sends /abort_request again this often until every request sent is answered
HEALTH_TIMEOUT_S = 20.0  # SGLang's limit on a /health check's generation (HEALTH_CHECK_TIMEOUT)
API_KEY_ENV = "RELAX_SGLANG_API_KEY"  # the key of the servers at rollout.sglang.urls (their --api-key)
Push = Callable[[object, int, list[str], WeightTarget, bool, "list[int] | None"], dict]


def actor_push(actor, watch: Watchdog, process: str, ranks: list[tuple[object, str]] | None = None, *,
               timeout_s: float):
    """rollout=sglang's `SGLangEngines.push`: the actor's process sends the weights (the ObjectRef of its snapshot of
    a version) to the servers itself (`PolicyForwarding.push_weights`); the driver only waits, `timeout_s`
    (rollout.sglang.request_timeout_s) at most for the whole update: a sender keeps beating while it is stuck (a
    broadcast that never completes), so its heartbeats alone would not end the wait. Each of the actor's calls to a
    server has that timeout too. A dead actor, or one whose update is not done in time, is a RoleFailure (the graph
    restarts) naming the version and the servers; a server that refuses is a RunError naming the servers.

    `ranks`: (handle, process name) of each actor rank (Megatron); a push's `senders` names, per url, the rank that
    sends to it (`Plan.weight_senders`: CUDA IPC handles from the rank on the server's GPU), all at once. Without
    `senders`, `actor` (rank 0) sends to every url."""

    def push(weights, version: int, urls: list[str], target, regroup: bool,
             senders: list[int] | None = None) -> dict[str, int]:
        import ray

        parts: dict[int, list[str]] = {}
        for url, rank in zip(urls, senders or [0] * len(urls), strict=True):
            parts.setdefault(rank, []).append(url)
        calls = []
        for rank, part in parts.items():
            if rank and ranks is None:
                raise ValueError(f"actor_push: senders name actor rank {rank}, but no ranks were given")
            handle, name = (actor, process) if rank == 0 else ranks[rank]
            call = handle.push_weights.options(concurrency_group=WEIGHTS_GROUP)  # beside the actor's train step
            calls.append((call.remote(weights, version, part, target, regroup), name))
        try:
            sent = watch.get(calls, progress=False, deadline=(timeout_s, "rollout.sglang.request_timeout_s"))
        except ray.exceptions.RayTaskError as exc:
            raise RunError(f"rollout=sglang: the actor could not send weights to {', '.join(urls)}: "
                           f"{first_line(exc.cause or exc)}") from None
        except RoleFailure as failure:  # what it was doing
            raise RoleFailure(failure.process, f"{failure.cause} (sending the weights of version {version} to "
                                               f"{', '.join(urls)})") from None
        # every sender sends the whole version: its buckets and bytes once
        return {"buckets": max(s["buckets"] for s in sent), "bytes": sent[0]["bytes"]}

    return push


def agent_refusal(exc: EngineRequestError) -> APIError:
    """The training gateway's error for a /generate request the servers did not answer, decided on what the engine
    answered (`exc.status`, the code of its error body), not on the error's text: a grammar's dead end (relax's
    engine's HTTP 400 with code grammar_dead_end) the error relax-serve's engine gives (that code and the engine's
    message, whole, which the chat route answers as a 400 naming the field that asked for the grammar), without the
    servers' internal address; another 4xx the agent's bad request (400), the rest (5xx, no answer in time, no
    connection) the servers' failure (503)."""
    if exc.status == 400 and exc.error_code == DEAD_END_CODE and exc.error_message:
        return APIError(exc.error_message, code=DEAD_END_CODE)
    refused = exc.status is not None and 400 <= exc.status < 500
    return APIError(str(exc), status=400 if refused else 503,
                    kind="invalid_request_error" if refused else "server_error")


class SGLangEngines:
    """`start_server(i)` returns a new `EngineServer` actor for replica i (None: `rollout.sglang.urls`).
    `push(weights, version, urls, target, regroup, senders)` sends published weights to the servers at `urls` and
    returns {"buckets", "bytes"}: the runner's has the actor send them (None: a `WeightSender` in this process, for
    weights given here as tensors). `senders`: per replica, the actor rank that sends its weights
    (`Plan.weight_senders`; None: rank 0)."""

    def __init__(self, cfg: RelaxConfig, *, eos_token_ids: tuple[int, ...], pad_token_id: int, log_dir: Path,
                 start_server: Callable[[int], object] | None, push: Push | None = None,
                 senders: list[int] | None = None):
        self.cfg, self.sg = cfg, cfg.rollout.sglang
        self.eos_token_ids, self.pad_token_id = tuple(eos_token_ids), pad_token_id
        self.log_dir, self.start_server = Path(log_dir), start_server
        self.servers: list = []
        self.urls: list[str] = []
        self.router: Router | None = None
        c = cfg.cluster
        self.sync = self.sg.weight_sync  # resolved (relax.config.derive)
        self.release = c.colocate and cfg.train.mode == "sync" and self.sg.release_memory
        # rollout.lora_sync=adapter: each update is a PEFT adapter directory the servers load (/load_lora_adapter),
        # named after its version, and every request names it; the base weights stay resident (only the KV cache is
        # released between rollouts)
        self.adapters = cfg.model.lora_rank > 0 and cfg.rollout.lora_sync == "adapter"
        self._adapter: str | None = None  # the adapter the servers hold
        # rollout.routing_replay / record_routes: every request asks for the experts of its tokens (SGLang's
        # return_routed_experts), which travel with the samples; (MoE layers, top-k, experts) to read them
        self.routes = (moe_shape(cfg.model) if cfg.rollout.routing_replay or cfg.rollout.record_routes
                       else None)
        # the servers' key: a new one for the servers Relax launches (and its router), $RELAX_SGLANG_API_KEY for the
        # servers at rollout.sglang.urls (none when unset); hex, never taken for a command-line option
        self.api_key = secrets.token_hex(24) if self.sg.urls is None else os.environ.get(API_KEY_ENV) or None
        self.target = WeightTarget(mode="adapter" if self.adapters else self.sync, bucket_bytes=self.sg.bucket_mb << 20,
                                   tp_size=c.rollout_gpus_per_engine, timeout_s=self.sg.request_timeout_s,
                                   host=self.sg.host, adapter_root=str(Path(log_dir) / "lora-adapters"),
                                   api_key=self.api_key)
        self._local: WeightSender | None = None
        if push is None:
            self._local = WeightSender(self.target, cfg.model)
            push = lambda weights, version, urls, target, regroup, senders: self._local.push(  # noqa: E731
                weights, version, urls, regroup=regroup)
        self._send_weights = push
        self.senders = senders  # per replica, the actor rank that sends its weights (`Plan.weight_senders`)
        self._lock = threading.RLock()  # weight pushes, memory release and replacing a server
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._failed: RunError | None = None
        self._last: tuple[object, int] | None = None  # the weights the servers should hold (an ObjectRef), version
        self._version = 0  # what the servers hold (their initial weights are version 0)
        self._released = False  # the servers' memory is released (colocated, sync mode, between rollouts)
        self._paused = False  # /pause_generation was sent (partial rollout) and not yet continued
        self._updating = False  # weights or memory being changed on the servers (`_make_ready`)
        self._gen: int | None = None  # the generation running now
        self._aborted: int | None = None  # the generation `abort` named
        self.restarts = 0
        self._retries_seen = 0
        self._buckets = 0
        self._sync_bytes: int | None = None  # of the last weight update (perf/sync_bytes)
        self.episodes = EpisodeMaker.for_config(cfg)  # None: single-turn responses (or an OpenAI agent's)
        self.agents = None  # data.openai_agent: the gateway and the agent workers (started with the servers)
        self._in_flight = 0  # engine calls under way (an agent batch loads new weights once they are done)
        self._flight = threading.Condition()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> SGLangEngines:
        sg = self.sg
        if sg.urls is not None:
            self.urls = list(sg.urls)
            for i, u in enumerate(self.urls):
                # a server the user started: reachable (the `endpoints` check before Ray), but maybe never healthy;
                # its log is its own
                try:
                    wait_healthy(u + "/health", None, sg.request_timeout_s,
                                 what=f"the SGLang server of rollout.sglang.urls[{i}]")
                except StartupError as exc:
                    raise RunError(f"{exc}; rollout.sglang.request_timeout_s bounds this wait, and that server's "
                                   "own log says why") from None
        else:
            if not self.servers:
                self.servers = [self.start_server(i) for i in range(self.cfg.rollout.num_replicas)]
            self.urls = self._started([s.start.remote(self.api_key) for s in self.servers])
        self.router = Router(host=sg.host, policy=sg.router_policy, log_path=self.log_dir / "router.log",
                             startup_timeout_s=sg.startup_timeout_s, request_timeout_s=sg.request_timeout_s,
                             api_key=self.api_key).start()
        for u in self.urls:
            self.router.add(u)
        self.client = GenerateClient(self.router.url, request_timeout_s=sg.request_timeout_s, api_key=self.api_key)
        self._watchdog = threading.Thread(target=self._watch, name="relax-sglang-watchdog", daemon=True)
        self._watchdog.start()
        if self.cfg.data.openai_agent and self.agents is None:
            self.agents = AgentRollout(self.cfg, load_tokenizer(self.cfg.model), eos_token_ids=self.eos_token_ids,
                                       pad_token_id=self.pad_token_id, send=self._agent_send,
                                       abort=self._agent_abort, host=sg.host)
        return self

    def _started(self, refs: list) -> list[str]:
        """The URLs of servers being started (`EngineServer.start` refs), or a RunError with the failing log."""
        import ray

        try:
            return ray.get(refs, timeout=self.sg.startup_timeout_s + 60)
        except ray.exceptions.RayTaskError as exc:
            raise RunError(f"a rollout engine server failed to start: {exc.cause}") from None
        except ray.exceptions.GetTimeoutError:
            raise RunError(f"the rollout engine servers did not start within {self.sg.startup_timeout_s:g} s "
                           f"(rollout.sglang.startup_timeout_s); logs in {self.log_dir}") from None

    def close(self) -> None:
        """Stop what the engines started: the episodes' tools, the agents' gateway, the watchdog, the router, the
        servers' processes; servers the user started (`rollout.sglang.urls`) get their memory and the last weights
        back. Every step runs whatever an earlier one did (a dead actor cannot send those weights: the router must
        stop all the same), and none raises: the run's outcome, or the exception that ends it, stands (a RunError
        must not become a RoleFailure that restarts the graph). What failed is printed, naming what was not done."""
        self._stop.set()
        problems: list[str] = []

        def step(what: str, action: Callable[[], object]) -> None:
            try:
                action()
            except Exception as exc:  # noqa: BLE001 - reported below; the other steps still run
                problems.append(f"{what}: {first_line(exc)}")

        if self.episodes is not None:
            step("closing the episodes' tools", self.episodes.close)
        if self.agents is not None:
            step("stopping the agents' gateway", self.agents.close)
        if self._watchdog is not None:
            self._watchdog.join(timeout=10)
        if self.sg.urls is not None and self._released and self._failed is None and self._last is not None:
            # servers the user started stay usable: resident, with the last weights
            step(f"giving the servers at {', '.join(self.urls)} (rollout.sglang.urls) their memory and the weights of "
                 f"version {self._last[1]} back (they may be left released, or with older weights)", self._restore)
        if self._local is not None:
            step("leaving the weight-update group", self._local.close)
        if self.router is not None:
            step("stopping the router", self.router.stop)
        if self.servers:  # their processes, before Ray kills the actors (which would take them down too)
            step("stopping the servers' processes", self._stop_servers)
        if problems:
            print("rollout=sglang: shutting down, " + "; ".join(problems) + " (every other step was done)",
                  file=sys.stderr, flush=True)

    def _stop_servers(self, timeout_s: float = 15.0) -> None:
        """Each server actor stops its process; an actor still busy after `timeout_s` (a replacement still starting:
        its stop waits behind the start) is killed, and its server process with it (PR_SET_PDEATHSIG,
        `relax.rollout.sglang.process`): no server outlives the run, also where the Ray instance does. ray.kill only
        asks: the killed actors' stop calls are waited for (they fail once the actor is dead), so that their servers
        are going when the run returns, not some time after."""
        import ray

        refs = [s.stop.remote() for s in self.servers]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for server, ref in zip(self.servers, refs, strict=True):
            if ref in pending:
                ray.kill(server)
        if pending:
            ray.wait(pending, num_returns=len(pending), timeout=timeout_s)

    def _restore(self) -> None:
        """The user's servers resident with the last weights (`close`); the lock is waited for as long as a weight
        update may take (rollout.sglang.request_timeout_s: one in progress ends by then)."""
        if not self._lock.acquire(timeout=self.sg.request_timeout_s):
            raise RunError(f"a weight update still held the servers after {self.sg.request_timeout_s:g} s "
                           "(rollout.sglang.request_timeout_s)")
        try:
            self._make_ready(push=True)
        finally:
            self._lock.release()

    # ------------------------------------------------------------------ Engines
    def _sampling(self, evaluation: bool) -> Sampling:
        ro = self.cfg.rollout
        if evaluation:
            return Sampling(ro.max_response_len, ro.eval_temperature, ro.eval_top_p, -1, self.eos_token_ids)
        return Sampling(ro.max_response_len, ro.temperature, ro.top_p, ro.top_k, self.eos_token_ids)

    def _send_raw(self, payloads: list[dict], gen_id: int | None) -> list[dict]:
        """One `/generate` request per payload through the router; the answers in the same order."""
        self._raise_if_failed()
        self._gen = gen_id
        if gen_id is None or gen_id != self._aborted:
            self.client.unpause()
        with self._lock:
            self._make_ready()
            with self._flight:
                self._in_flight += 1
            if self.adapters:  # the adapter of the weights just made ready (SGLang: a request names its adapter)
                payloads = [{**p, "lora_path": self._adapter} for p in payloads]
        try:
            answers = self.client.generate(payloads)
        finally:
            self._gen = None
            with self._flight:
                self._in_flight -= 1
                self._flight.notify_all()
        self._raise_if_failed()  # a server declared dead meanwhile: its requests may have come back empty
        return answers

    @property
    def loads_weights_in_flight(self) -> bool:
        """Agent batches take new weights between their calls (`RolloutStream.publish` loads them at once)."""
        return self.agents is not None

    def _send(self, payloads: list[dict], gen_id: int | None, raw: list | None = None) -> list:
        """`_send_raw`, the answers parsed (and, given `raw`, appended to it as they came)."""
        try:
            answers = self._send_raw(payloads, gen_id)
            if raw is not None:
                raw.extend(answers)
        except RunError:
            raise
        except Exception as exc:
            self._raise_if_failed()
            raise RunError(f"rollout=sglang: {exc}") from None
        return [parse_answer(a, self._version, len(p["input_ids"]) if p.get("image_data") else None)
                for p, a in zip(payloads, answers, strict=True)]

    def _agent_abort(self, rids: list[str]) -> None:
        """Stop the gateway's requests `rids` (their agent left): each server aborts those it holds."""
        for rid in rids:
            self._each("/abort_request", {"rid": rid})

    def _agent_send(self, payloads: list[dict]) -> list[dict]:
        """`_send_raw` for the gateway: a request the servers refuse is the agent's bad request (`agent_refusal`)."""

        try:
            return self._send_raw(payloads, None)
        except EngineRequestError as exc:
            raise agent_refusal(exc) from None

    def _done(self, out: Samples, t0: float) -> Samples:
        """A call's samples, timed; colocated in sync mode the servers then release their memory."""
        out.engine_time = time.perf_counter() - t0
        if self.release:
            with self._lock:
                self._each("/release_memory_occupation", {"tags": ["kv_cache"]} if self.adapters else {})
                self._released = True
        return out

    def _run(self, rows: list[list[int]], budgets: list[int], seeds: list[int], sample_ids: torch.Tensor,
             sampling: Sampling, gen_id: int | None, vision: list | None = None) -> Samples:
        """One request per row through the router, answers as `Samples` rows in the same order; `vision`: each
        row's images (None: none), sent as SGLang's `image_data` and kept on the rows for the trainer."""
        t0 = time.perf_counter()
        images = [None] * len(rows) if vision is None else [payload_images(v) for v in vision]
        payloads = [generate_payload(r, sampling, max_new_tokens=b, seed=s, image_data=im,
                                     routed_experts=self.routes is not None)
                    for r, b, s, im in zip(rows, budgets, seeds, images, strict=True)]
        raw: list[dict] = []
        answers = self._send(payloads, gen_id, raw)
        routes = None if self.routes is None else (self._answer_routes(raw, answers), self.routes)
        out = to_samples(rows, answers, sample_ids=sample_ids, pad_token_id=self.pad_token_id, engine_time=0.0,
                         routes=routes)
        if vision is not None:  # the servers' vision-tower time is not reported over SGLang's protocol
            out = replace(out, vision=list(vision), vision_time=float("nan"))
        return self._done(out, t0)

    def _answer_routes(self, raw: list[dict], answers: list) -> list[torch.Tensor | None]:
        """Each answer's routed experts [fed tokens, layers, k] (`relax.rollout.sglang.routes`), None for an answer
        without tokens (a request the pause answered before sending); RunError for an answer with tokens and none."""
        layers, top_k, _ = self.routes
        per_row: list[torch.Tensor | None] = []
        for a, (tokens, *_) in zip(raw, answers, strict=True):
            meta = a.get("meta_info") or {}
            if "routed_experts" not in meta:
                if tokens:
                    raise RunError("rollout=sglang: an answer came without meta_info.routed_experts although "
                                   "rollout.routing_replay/record_routes asked for them: the server was not "
                                   "started with --enable-return-routed-experts, or it answers them only to "
                                   "requests that carry return_routed_experts, which sglang-router 0.3.2 drops "
                                   "(the embedded servers answer them to every request)")
                per_row.append(None)
                continue
            try:
                per_row.append(decode_routes(meta["routed_experts"], layers, top_k))
            except ValueError as exc:
                raise RunError(f"rollout=sglang: {exc}") from None
        return per_row

    def _send_routed(self, payloads: list[dict], gen_id: int | None) -> tuple[list, list]:
        """`_send` with each answer's routed experts (`_answer_routes`)."""
        raw: list[dict] = []
        answers = self._send(payloads, gen_id, raw)
        return answers, self._answer_routes(raw, answers)

    def _run_episodes(self, prompts: list[list[int]], sample_ids: torch.Tensor, positions: torch.Tensor,
                      budgets: list[int], episodes: list, *, seed: int, sampling: Sampling,
                      gen_id: int | None, vision: list | None = None) -> Samples:
        """Agentic episodes, a `/generate` request per turn (`relax.rollout.sglang.episodes`); `vision`: each row's
        images so far (None: none), sent with every turn with the image observations' after them."""
        t0 = time.perf_counter()
        send = self._send_routed if self.routes is not None else self._send  # run_episodes' two contracts
        out = run_episodes(lambda payloads: send(payloads, gen_id), prompts, sample_ids, positions,
                           budgets, episodes, seed=seed, sampling=sampling,
                           turn_limit=self.cfg.rollout.max_response_len,
                           aborted=lambda: gen_id is not None and gen_id == self._aborted,
                           pad_token_id=self.pad_token_id, vision=vision, routes=self.routes)
        return self._done(out, t0)

    def generate(self, prompts: list[list[int]], sample_ids: torch.Tensor, *, seed: int, gen_id: int | None = None,
                 evaluation: bool = False, items: list | None = None,
                 cancel: threading.Event | None = None) -> Samples:
        """Responses to `prompts`, a group each; with agentic data, episodes that start from `items`. `cancel`: stops
        an agent program's runs (`AgentRollout.run`), which no abort ends."""
        G = len(sample_ids) // len(prompts)
        rows = [p for p in prompts for _ in range(G)]
        sampling = self._sampling(evaluation)
        if self.agents is not None:  # the agent programs' calls through the gateway
            if items is None:
                raise ValueError("SGLangEngines.generate: an agent rollout needs the prompt items")
            t0 = time.perf_counter()
            return self._done(self.agents.run(items, sample_ids, seed=seed, temperature=sampling.temperature,
                                              top_p=sampling.top_p, top_k=sampling.top_k, cancel=cancel), t0)
        vision = prompt_vision(items)
        if self.episodes is not None:
            if items is None:
                raise ValueError("SGLangEngines.generate: an agentic rollout needs the prompt items")
            limit = self.cfg.rollout.max_episode_tokens
            return self._run_episodes(rows, sample_ids, torch.zeros(len(rows), dtype=torch.long), [limit] * len(rows),
                                      self.episodes.new_for(items, G), seed=seed, sampling=sampling, gen_id=gen_id,
                                      vision=None if vision is None else [v for v in vision for _ in range(G)])
        seeds = [sample_seed(seed, int(s), 0) for s in sample_ids]
        return self._run(rows, [sampling.max_new_tokens] * len(rows), seeds, sample_ids, sampling, gen_id,
                         vision=None if vision is None else [v for v in vision for _ in range(G)])

    def resume(self, partial: Samples, *, seed: int, gen_id: int | None = None) -> Samples:
        ro = self.cfg.rollout
        if self.episodes is not None:  # the running episodes again: their loops reset and earlier turns replayed
            job = continuation(partial, ro.max_episode_tokens)
            more = self._run_episodes(job.prompts, job.sample_ids, job.positions, [int(b) for b in job.budgets],
                                      self.episodes.restore_all(partial.episodes), seed=seed,
                                      sampling=self._sampling(False), gen_id=gen_id, vision=partial.vision)
            return extend_responses(partial, more, pad_token_id=self.pad_token_id)
        job = continuation(partial, ro.max_response_len)
        seeds = [sample_seed(seed, int(s), int(p)) for s, p in zip(job.sample_ids, job.positions, strict=True)]
        more = self._run(job.prompts, [int(b) for b in job.budgets], seeds, job.sample_ids, self._sampling(False),
                         gen_id, vision=partial.vision)
        return extend_responses(partial, more, pad_token_id=self.pad_token_id)

    def wake(self) -> None:
        """From another thread, once it set the `cancel` event of the `generate` in progress: the agent programs' runs
        (data.openai_agent), which no abort ends, are cancelled now (`AgentRollout.wake`)."""
        if self.agents is not None:
            self.agents.wake()

    def abort(self, gen_id: int) -> None:
        """Interrupt generation `gen_id`: requests not sent yet return empty, the servers abort the rest (their
        answers carry the partial tokens); nothing more is generated until the next weight update or call."""
        self._aborted = gen_id
        self.client.pause()
        if self._gen == gen_id:
            with self._lock:
                self._paused = True  # first: the watchdog then no longer expects /health to generate
                self._each("/pause_generation", {"mode": "abort"})
                # requests that reach a paused server wait there: abort them until every request sent has its
                # answer (one still on its way when the servers paused arrives after the first abort)
                deadline = time.monotonic() + self.sg.request_timeout_s
                while True:
                    self._each("/abort_request", {"abort_all": True})
                    if self.client.wait_answered(ABORT_RECHECK_S):
                        break
                    if time.monotonic() > deadline:
                        raise RunError(f"rollout=sglang: requests were still unanswered "
                                       f"{self.sg.request_timeout_s:g} s (rollout.sglang.request_timeout_s) after "
                                       "their generation was aborted")

    def load_weights(self, weights, version: int) -> None:
        """`weights` of `version` to every server: what the run published (the ObjectRef of the actor's snapshot),
        which `push` has the actor send; or, without the runner's `push`, a state dict or `WeightBuffers`."""
        with self._lock:  # (requests not yet sent wait here)
            if self.agents is not None:  # an agent batch may be running: its requests in flight end with their
                with self._flight:       # weights first, so that each answer has one version
                    if not self._flight.wait_for(lambda: self._in_flight == 0, timeout=self.sg.request_timeout_s):
                        raise RunError(f"rollout=sglang: requests in flight did not end within "
                                       f"{self.sg.request_timeout_s:g} s (rollout.sglang.request_timeout_s) for a "
                                       "weight update")
            self._last = (weights, int(version))
            self._make_ready(push=True)

    def metrics(self) -> dict[str, float]:
        retries = self.client.retries
        out = {FAULT_RESTARTS_ROLLOUT: float(self.restarts), ENGINE_RETRIES: float(retries - self._retries_seen)}
        if self._sync_bytes is not None:
            out[SYNC_BYTES] = float(self._sync_bytes)
        if self._buckets:
            out[WEIGHT_BUCKETS] = float(self._buckets)
        self._retries_seen = retries
        return out

    # ------------------------------------------------------------------ weights and memory (under self._lock)
    def _make_ready(self, push: bool = False) -> None:
        """Servers resident, holding `self._last`, not paused."""
        self._updating = True
        try:
            self._ready(push)
        finally:
            self._updating = False

    def _ready(self, push: bool) -> None:
        if self._released:
            if self._last is None:
                raise RunError("rollout=sglang: the servers released their memory before any weights were published")
            self._each("/resume_memory_occupation", {})
            self._released = False
            push = self._last is not None
        if self._paused:
            self._flush()
        if push or (self._last is not None and self._last[1] != self._version):
            self._push(self.urls)
        if self._paused:
            self._each("/continue_generation", {})
            self._paused = False

    def _push(self, urls: list[str], regroup: bool = False) -> None:
        """`self._last` to the servers at `urls` (`regroup`: a weight-update group is formed anew); a server that died
        meanwhile is left to the watchdog, which gives its replacement the weights."""
        weights, version = self._last
        for attempt in range(2):
            try:
                senders = [self.senders[self.urls.index(u)] for u in urls] if self.senders else None
                sent = self._send_weights(weights, version, list(urls), self.target, regroup, senders)
                break
            except RoleFailure:
                raise
            except Exception:
                live = [u for u in urls if self._answers(u)]
                if attempt or live == urls:
                    raise
                urls, regroup = live, True
        self._buckets, self._sync_bytes = sent["buckets"], sent["bytes"]
        if self.adapters:
            self._adapter = adapter_name(version)
        self._version = version

    def _flush(self) -> None:
        """`/flush_cache` on every server, polling while a server still finishes requests (HTTP 400)."""
        deadline = time.monotonic() + self.sg.request_timeout_s
        for url in self.urls:
            while self._answers(url):
                r = requests.post(url + "/flush_cache", json={}, timeout=60, headers=auth_headers(self.api_key))
                if r.status_code == 200:
                    break
                if time.monotonic() > deadline:
                    raise RunError(f"rollout=sglang: {url}/flush_cache still busy (HTTP {r.status_code}) after "
                                   f"{self.sg.request_timeout_s:g} s")
                time.sleep(0.05)

    def _each(self, path: str, body: dict) -> None:
        """POST to every server; one that does not answer at all is dead and left to the watchdog."""
        for url in self.urls:
            try:
                post(url, path, body, timeout=self.sg.request_timeout_s, api_key=self.api_key)
            except EngineRequestError:
                if self._answers(url):
                    raise

    # ------------------------------------------------------------------ faults
    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise self._failed

    def _held(self) -> bool:
        """Generation is held on purpose: memory released, paused, or weights loading. SGLang's `/health` generates a
        token, which waits then: a healthy server would miss checks."""
        return self._released or self._paused or self._updating

    def _alive(self, i: int, url: str) -> bool:
        """Whether replica i answers: `/health`, except while generation is held (`_held`, also when it began during
        the check), when it must answer `/get_model_info`, or the process of a server Relax launched be alive."""
        if not self._held():
            if self._healthy(url):
                return True
            if not self._held():
                return False
        if self._answers(url):  # alive, whatever it does
            return True
        if not self.servers:  # a server the user started: nothing else to ask
            return False
        import ray

        try:
            return bool(ray.get(self.servers[i].alive.remote(), timeout=max(5.0, self.sg.health_check_interval_s)))
        except Exception:  # the actor died, or does not answer
            return False

    def _healthy(self, url: str) -> bool:
        """SGLang's `/health` answers 200: a one-token generation, or any output of the scheduler, within SGLang's own
        limit of `HEALTH_TIMEOUT_S` (a busy scheduler can take seconds to make its next output)."""
        return self._get_ok(url + "/health", max(HEALTH_TIMEOUT_S, self.sg.health_check_interval_s))

    def _answers(self, url: str) -> bool:
        """The server answers a request that does not generate (`/get_model_info`): alive, whatever it is doing."""
        return self._get_ok(url + "/get_model_info", max(5.0, self.sg.health_check_interval_s))

    def _get_ok(self, url: str, timeout: float) -> bool:
        try:
            return requests.get(url, timeout=timeout, headers=auth_headers(self.api_key)).status_code == 200
        except requests.RequestException:
            return False

    def _watch(self) -> None:
        misses = [0] * len(self.urls)
        while not self._stop.wait(self.sg.health_check_interval_s):
            for i, url in enumerate(list(self.urls)):
                misses[i] = 0 if self._alive(i, url) else misses[i] + 1
                if misses[i] >= self.sg.health_failures and self._failed is None:
                    misses[i] = 0
                    try:
                        self._replace(i, url)
                    except Exception as exc:  # noqa: BLE001 - the loop reports it at its next rollout call
                        self._failed = exc if isinstance(exc, RunError) else RunError(
                            f"rollout=sglang: replacing the engine at {url} failed: {exc}")
                        self.client.pause()

    def _replace(self, i: int, url: str) -> None:
        """Take the dead server at `url` (replica i) out of the router and put a new one in its place."""
        import ray

        self.router.remove(url)
        print(f"rollout=sglang: the engine at {url} missed {self.sg.health_failures} health checks; replacing it",
              flush=True)
        if not self.servers:
            raise RunError(f"rollout=sglang: the server at {url} (rollout.sglang.urls) stopped answering /health; "
                           "Relax did not start it and cannot restart it")
        if self.restarts >= self.sg.max_engine_restarts:
            raise RunError(f"rollout=sglang: the engine at {url} died and rollout.sglang.max_engine_restarts="
                           f"{self.sg.max_engine_restarts} restarts are used up; engine logs in {self.log_dir}")
        self.restarts += 1
        ray.kill(self.servers[i])
        self.servers[i] = self.start_server(i)
        new = self._started([self.servers[i].start.remote(self.api_key)])[0]
        with self._lock:
            self.urls[i] = new
            if self._last is not None:  # a weight-update group includes every server: formed anew
                group = self.target.mode == "distributed"
                self._push(self.urls if group else [new], regroup=group)
            if self._released:
                post(new, "/release_memory_occupation", {"tags": ["kv_cache"]} if self.adapters else {},
                     timeout=self.sg.request_timeout_s, api_key=self.api_key)
            if self._paused:
                post(new, "/pause_generation", {"mode": "abort"}, timeout=self.sg.request_timeout_s,
                     api_key=self.api_key)
        self.router.add(new)
