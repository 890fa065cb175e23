"""One rollout engine server (an SGLang server, or `relax-serve`) as a Ray actor's child process.

The Ray actor holds the engine's resources (its GPUs, or CPU share, in the plan's placement group) and starts
the server on its node; the server dies with the actor (kill -9 included). The driver talks to the server over
HTTP (`relax.runner.rollout_driver.sglang_engines`), never through this actor, except to start, inspect and stop it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
from pathlib import Path

from relax.config.schema import ModelConfig, RelaxConfig
from relax.roles.heartbeat import HeartbeatLink, start_heartbeat
from relax.rollout.sglang.keyed import KEY_ENV, keyed_command
from relax.rollout.sglang.process import SERVE_KEY_ENV, log_tail, start_server, stop_process


def resolve_model_path(model_cfg: ModelConfig) -> Path:
    """`relax.models.hf.resolve_model_path`, imported when called: relax.models.hf imports torch and transformers,
    which this actor (the launcher and watcher of one server process) otherwise never needs; each replica's actor
    process would pay seconds of CPU for them."""
    from relax.models.hf import resolve_model_path as resolve

    return resolve(model_cfg)


def server_command(cfg: RelaxConfig, *, host: str, port: int, threads: int | None, config_path: Path,
                   api_key: str | None = None) -> list[str]:
    """The command that starts the engine server of `cfg.rollout.sglang.server` on `host:port` (`api_key`: SGLang's
    `--api-key`, given through the environment by `relax.rollout.sglang.keyed` (`KEY_ENV`); relax-serve takes its
    key from the environment too, `SERVE_KEY_ENV`: neither is in the process list or the launch log)."""
    sg = cfg.rollout.sglang
    if sg.server == "embedded":
        # --weight-dir: the run's directory (where the adapters it sends are written) is the one it may load from
        cmd = [sys.executable, "-m", "relax.cli.serve", "--host", host, "--port", str(port), "--config",
               str(config_path), "--weight-dir", str(Path(config_path).parent)]
        return cmd + (["--threads", str(threads)] if threads else [])
    c = cfg.cluster

    # the weights the actor ships are in the rollout dtype: bf16 on GPUs unless model.dtype says otherwise
    dtype = "bfloat16" if cfg.model.dtype == "auto" else cfg.model.dtype
    cmd = ["--model-path", str(resolve_model_path(cfg.model)), "--host", host, "--dtype", dtype,
           "--port", str(port), "--tp-size", str(c.rollout_gpus_per_engine), "--base-gpu-id", "0",
           "--random-seed", str(cfg.seed)]  # SGLang's arguments (the module to run comes last)
    # no --trust-remote-code: the trainer loads the model without remote code too (transformers' own architectures)
    if c.colocate:  # the actor shares the GPU: SGLang may take only part of it, and releases it while training
        cmd += ["--mem-fraction-static", "0.4", "--enable-memory-saver"]
    if cfg.rollout.routing_replay or cfg.rollout.record_routes:  # each answer carries its tokens' routed experts
        cmd += ["--enable-return-routed-experts"]
    m = cfg.model
    if m.lora_rank > 0 and cfg.rollout.lora_sync == "adapter":  # updates load the adapters (/load_lora_adapter)
        # SGLang takes layer names (q_proj), not PEFT's dotted suffixes (self_attn.q_proj): the last names, a superset
        # of the layers the adapters are on (the adapter directory holds only those)
        targets = ["all"] if list(m.lora_target_modules) == ["all-linear"] else list(
            dict.fromkeys(t.rsplit(".", 1)[-1] for t in m.lora_target_modules))
        cmd += ["--enable-lora", "--max-lora-rank", str(m.lora_rank), "--lora-target-modules", *targets,
                "--max-loras-per-batch", "2"]
    args = cmd + list(sg.extra_args or [])
    # the key reaches SGLang through the environment (`keyed`, KEY_ENV, which `start` sets), not its command line
    return keyed_command("sglang.launch_server", args) if api_key else [
        sys.executable, "-m", "sglang.launch_server", *args]


class EngineServer:
    """Starts and watches one engine server process; `start` returns its URL once `/health` answers 200."""

    def __init__(self, cfg: RelaxConfig, index: int, *, threads: int | None, log_dir: str,
                 heartbeat: HeartbeatLink | None = None):
        start_heartbeat(self, heartbeat)  # the actor's own liveness; the server's is its /health (the manager's)
        self.cfg, self.index, self.threads = cfg, index, threads
        self.log_dir = Path(log_dir)
        self.log_path = self.log_dir / f"engine{index}-{os.getpid()}.log"
        self.proc = None
        self.url: str | None = None

    def ping(self) -> str:
        return "ok"

    def start(self, api_key: str | None = None) -> str:
        """Start the server (with `api_key`, which it then requires of every request but health and information);
        its URL once healthy."""
        sg = self.cfg.rollout.sglang
        if sg.server == "sglang" and importlib.util.find_spec("sglang") is None:
            raise RuntimeError(f"rollout.sglang.server=sglang: the package sglang is not installed on this node "
                               f"(python {sys.executable}); install it with `pip install sglang` (GPU nodes), or use "
                               "rollout.sglang.server=embedded")
        import ray

        host = sg.host
        address = "127.0.0.1" if host in ("127.0.0.1", "localhost") else ray.util.get_node_ip_address()
        config_path = self.log_dir / f"engine{self.index}-{os.getpid()}.json"
        config_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the run's, private (another node's)
        config_path.write_text(json.dumps(dataclasses.asdict(self.cfg)))
        env = {"OMP_NUM_THREADS": str(self.threads)} if self.threads else {}
        if api_key:  # through the environment, readable by this user only, never the command line
            env[SERVE_KEY_ENV if sg.server == "embedded" else KEY_ENV] = api_key

        def command(port: int) -> list[str]:
            return server_command(self.cfg, host=host, port=port, threads=self.threads, config_path=config_path,
                                  api_key=api_key if sg.server == "sglang" else None)

        self.proc, port = start_server(command, host=host, url_host=address, log_path=self.log_path,
                                       timeout_s=sg.startup_timeout_s, what=f"rollout engine {self.index}", env=env)
        self.url = f"http://{address}:{port}"
        return self.url

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def log(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def stop(self) -> None:
        stop_process(self.proc)
