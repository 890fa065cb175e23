"""The sglang-router in front of the engines: one process, started from Python, workers added and removed over HTTP.

The router (the `sglang-router` wheel, Rust) spreads `/generate` requests over its workers by `policy`
(cache_aware keeps a prompt's requests on the engine that has its prefix cached). Engines join with
`POST /workers {"url": ...}` and leave with `DELETE /workers/<id>`; the router checks a worker's `/health`,
`/server_info` and `/model_info` when it joins.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import requests

from relax.rollout.sglang.client import auth_headers
from relax.rollout.sglang.keyed import KEY_ENV, keyed_command
from relax.rollout.sglang.process import free_port, log_tail, start_server, stop_process


class RouterError(RuntimeError):
    pass


class Router:
    """A running sglang-router on `host` (loopback by default), its log in `log_path`."""

    def __init__(self, *, host: str, policy: str, log_path: Path, startup_timeout_s: float,
                 request_timeout_s: float, api_key: str | None = None):
        """`api_key`: the router then requires it of its clients, and sends it to the servers with each request."""
        self.host, self.policy, self.log_path = host, policy, Path(log_path)
        self.api_key, self.headers = api_key, auth_headers(api_key)
        self.startup_timeout_s, self.request_timeout_s = startup_timeout_s, request_timeout_s
        self.url_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        self.port: int | None = None  # chosen when it starts
        self.proc: subprocess.Popen | None = None
        self.workers: dict[str, str] = {}  # url -> the router's worker id

    @property
    def url(self) -> str:
        return f"http://{self.url_host}:{self.port}"

    def command(self, port: int) -> list[str]:
        """The router's command line; its key, if any, goes through the environment (`keyed`), not in it."""
        args = ["--host", self.host, "--port", str(port), "--policy", self.policy, "--log-level", "warn",
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port("127.0.0.1")),
                "--request-timeout-secs", str(max(1, int(self.request_timeout_s))),
                # Relax decides when an engine is dead (and retries its requests): the router only routes. (Its own
                # health checks would also mark servers unhealthy while their memory is released for training.)
                "--disable-circuit-breaker", "--disable-retries", "--disable-health-check"]
        if self.api_key:
            return keyed_command("sglang_router.launch_router", args)
        return [sys.executable, "-m", "sglang_router.launch_router", *args]

    def start(self) -> Router:
        self.proc, self.port = start_server(self.command, host=self.host, url_host=self.url_host,
                                            log_path=self.log_path, timeout_s=self.startup_timeout_s,
                                            what="sglang-router",
                                            env={KEY_ENV: self.api_key} if self.api_key else None)
        return self

    def add(self, url: str) -> None:
        """Register the engine at `url` and wait until the router lists it as healthy."""
        r = requests.post(self.url + "/workers", json={"url": url}, timeout=30, headers=self.headers)
        if r.status_code >= 300:
            raise RouterError(f"sglang-router refused worker {url}: HTTP {r.status_code} {r.text[:300]}")
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            for w in self.list():
                if w.get("url") == url and w.get("is_healthy", True):
                    self.workers[url] = w["id"]
                    return
            time.sleep(0.1)
        raise RouterError(f"sglang-router did not activate worker {url} within {self.startup_timeout_s:g} s; "
                          f"router log {self.log_path}:\n{log_tail(self.log_path)}")

    def remove(self, url: str) -> None:
        """Take the engine at `url` out of the rotation (requests in flight to it are not cancelled)."""
        worker = self.workers.pop(url, None)
        if worker is None:
            worker = next((w["id"] for w in self.list() if w.get("url") == url), None)
        if worker is not None:
            requests.delete(f"{self.url}/workers/{worker}", timeout=30, headers=self.headers)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and any(w.get("url") == url for w in self.list()):
                time.sleep(0.05)

    def list(self) -> list[dict]:
        r = requests.get(self.url + "/workers", timeout=30, headers=self.headers)
        r.raise_for_status()
        return r.json().get("workers", [])

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None
