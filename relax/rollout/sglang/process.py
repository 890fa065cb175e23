"""Server processes (SGLang engines, relax-serve, the router): start, wait until healthy, stop, read the log."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import requests

SERVE_KEY_ENV = "RELAX_SERVE_API_KEY"  # where relax-serve takes its key from when --api-key is not given


class StartupError(RuntimeError):
    """A server process exited or did not become healthy; the message carries the end of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the server binds it a moment later; a clash fails its start loudly)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host not in ("", "0.0.0.0") else "0.0.0.0", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the process that started it dies (kill -9 included)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the parent's stop() is the only cleanup
        pass


def start_process(cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `cmd` with stdout and stderr appended to `log_path`; it dies with this process."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, preexec_fn=_die_with_parent,
                                start_new_session=True)


def log_tail(log_path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(Path(log_path).read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log: {exc})"


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout_s: float, *, what: str,
                 log_path: Path | None = None) -> None:
    """Poll `url` until it answers 200; fail early when `proc` exits, and after `timeout_s`, with the end of
    `log_path` (None: a server this process did not start, whose log it cannot read)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"

    def log() -> str:
        return "" if log_path is None else f"; log {log_path}:\n{log_tail(log_path)}"

    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise StartupError(f"{what} exited with code {proc.returncode} before it was healthy{log()}")
        try:
            r = requests.get(url, timeout=5)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except requests.RequestException as exc:
            last = type(exc).__name__
        time.sleep(0.1)
    raise StartupError(f"{what} at {url} was not healthy within {timeout_s:g} s (last: {last}){log()}")


PORT_TAKEN = "Address already in use"  # what a server that lost its port to another process logs, and exits with
PORT_ATTEMPTS = 3


def start_server(command: Callable[[int], list[str]], *, host: str, url_host: str, log_path: Path, timeout_s: float,
                 what: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    """Start `command(port)` on a free port of `host` and wait until `http://url_host:port/health` answers; returns
    (process, port). A port is free when it is chosen, not when the server binds it: when another process took it in
    between (the server exits saying so), another port is tried, up to `PORT_ATTEMPTS` in all."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = free_port(host)
        start = log_path.stat().st_size if log_path.exists() else 0  # the log is appended to: this attempt's part
        proc = start_process(command(port), log_path, env)
        try:
            wait_healthy(f"http://{url_host}:{port}/health", proc, timeout_s, what=what, log_path=log_path)
            return proc, port
        except StartupError:
            with open(log_path, "rb") as log:
                log.seek(start)
                lost_port = proc.poll() is not None and PORT_TAKEN.encode() in log.read()
            if not lost_port or attempt == PORT_ATTEMPTS:
                stop_process(proc)
                raise
    raise AssertionError("unreachable")


def stop_process(proc: subprocess.Popen | None, grace_s: float = 5.0) -> None:
    """SIGTERM the process group, SIGKILL after `grace_s`."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except (subprocess.TimeoutExpired, ProcessLookupError, PermissionError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait(grace_s)
