"""The embedded server's load (`relax.serve.sglang.scheduler.Load`) in SGLang's two shapes.

- `GET /get_load` (SGLang's legacy `GetLoadReqOutput`): a list with one dict per data-parallel rank (one here):
  `dp_rank` (null, as SGLang's without data parallelism), `num_reqs` (running + waiting), `num_waiting_reqs`,
  `num_tokens` (of the running samples and the waiting ones), `num_pending_tokens` (of the waiting ones), `ts_tic`.
  slime polls it after an abort until `num_reqs` is 0.
- `GET /v1/loads` (`entrypoints/v1_loads.py`): {"timestamp", "version", "accelerator", "num_accelerators",
  "loads": [one dict per rank]} with `dp_rank`, `timestamp`, `num_running_reqs`, `num_waiting_reqs`,
  `num_waiting_uncached_tokens`, `num_used_tokens`, `num_total_tokens`, `max_total_num_tokens`,
  `max_running_requests`, `token_usage`, `gen_throughput`, `cache_hit_rate`, `utilization`, and the `queues`
  section; query parameters `include` (comma-separated sections: core, memory, spec, lora, disagg, queues, all),
  `dp_rank` (0) and `format` (json only). The engine has no token pool, no cache and no limit on running samples:
  `max_total_num_tokens` and `max_running_requests` are null, `token_usage` and `cache_hit_rate` 0, `utilization`
  1 while a batch runs, else 0.

A request is a sample here, as in SGLang (an input with n=2 counts 2).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any, Optional

from relax.serve.sglang.request import RequestError
from relax.serve.sglang.scheduler import Load

VALID_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
VERSION = "relax-embedded"


def get_load(load: Load) -> list[dict[str, Any]]:
    """The /get_load answer."""
    return [{"dp_rank": None, "num_reqs": load.running + load.waiting, "num_waiting_reqs": load.waiting,
             "num_tokens": load.used_tokens + load.pending_tokens, "num_pending_tokens": load.pending_tokens,
             "ts_tic": time.time()}]


def v1_loads(load: Load, query: dict, accelerator: Optional[str]) -> dict[str, Any]:
    """The /v1/loads answer for `query`'s parameters (RequestError naming a bad one)."""
    include = _sections(query.get("include"))
    if str(query.get("dp_rank", 0)) != "0":
        raise RequestError(f"dp_rank={query['dp_rank']!r}: this server has one data-parallel rank, 0")
    if query.get("format") not in (None, "json"):
        raise RequestError(f"format={query['format']!r} is not supported by the embedded server: only json")
    rank: dict[str, Any] = {
        "dp_rank": 0, "timestamp": time.time(), "num_running_reqs": load.running, "num_waiting_reqs": load.waiting,
        "num_waiting_uncached_tokens": load.pending_tokens, "num_used_tokens": load.used_tokens,
        "num_total_tokens": load.used_tokens + load.pending_tokens, "max_total_num_tokens": None,
        "max_running_requests": None, "token_usage": 0.0, "gen_throughput": load.throughput, "cache_hit_rate": 0.0,
        "utilization": 1.0 if load.running else 0.0}
    if include is None or include & {"all", "queues"}:
        rank["queues"] = {"waiting": load.waiting - load.paused, "grammar": 0, "paused": load.paused, "retracted": 0}
    return {"timestamp": datetime.now(UTC).isoformat(), "version": VERSION, "accelerator": accelerator,
            "num_accelerators": 1, "loads": [rank]}


def _sections(include: Any) -> Optional[set[str]]:
    """The sections `include` names (None: all)."""
    if not include:
        return None
    names = {s.strip() for s in str(include).split(",") if s.strip()}
    if not names <= VALID_SECTIONS:
        raise RequestError(f"Invalid include sections: {names - VALID_SECTIONS}. "
                           f"Valid options: {sorted(VALID_SECTIONS)}")
    return names
