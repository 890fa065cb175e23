"""`relax-serve`: Relax's embedded rollout engine as an SGLang-compatible HTTP server.

    relax-serve --port 30000 [--host 127.0.0.1] [--threads N] [--weight-version V] [--api-key K] [model=tiny ...]
    relax-serve --port 30000 --config resolved_config.json

The model is the one `relax-train` with the same overrides would build (or the one a resolved config JSON, as
`dataclasses.asdict(cfg)` writes it, describes). An override of a key relax-serve does not read (`READ_KEYS`: a
training option such as train.lr or rollout.temperature) is refused before the model loads, as Hydra's own keys are.
See `relax.serve.sglang.server` for the protocol.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
import signal
import socket
import sys
import threading
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from relax.algorithms.base import Violation
    from relax.config import ConfigError, RelaxConfig

USAGE_EXIT = 2
KEY_ENV = "RELAX_SERVE_API_KEY"  # the key, where --api-key is not given


def _fail(message: str, code: int = USAGE_EXIT, *, lines: bool = False) -> NoReturn:
    """Exit `code` with `message` on stderr: one line, or with `lines` as written (a config's problems, one a line,
    as relax-train lists them)."""
    print(f"relax-serve: error: {message if lines else ' '.join(message.split())}", file=sys.stderr)
    sys.exit(code)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage dump
        _fail(f"{message} (see relax-serve --help)")


def _port(text: str) -> int:
    """--port: a TCP port, 0 to 65535 (0: any free one), refused by the parser, before the model loads (the socket's
    own check came after it, as a traceback)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0 to 65535; 0: any free port)") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0 to 65535; 0: any free port)")
    return port


def host_problem(host: str) -> str | None:
    """Why relax-serve cannot bind `host`: neither an IP address nor a name this machine resolves (`0.0.0.0.0`, which
    the loopback check would otherwise call reachable beyond this machine); None when it can. "" (every interface,
    as for a socket) passes."""
    if host == "":
        return None
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        return None
    except (socket.gaierror, UnicodeError):
        return (f"--host {host} is not a valid address: give an IP address (127.0.0.1, ::1, 0.0.0.0) or a name "
                "this machine resolves (localhost)")


def _convert(tp: Any, value: Any, where: str) -> Any:
    """`value` (parsed JSON) as the annotated type `tp`: dataclasses built field by field, lists to tuples where a
    tuple is expected, ints to floats where a float is."""
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        return _convert(options[0], value, where) if len(options) == 1 else value
    if dataclasses.is_dataclass(tp):
        return _dataclass(tp, value, where)
    if origin is tuple or tp is tuple:
        return tuple(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _dataclass(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'the config'}: expected a JSON object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where or 'the config'}: unknown key(s) {', '.join(unknown)} for {cls.__name__}")
    prefix = f"{where}." if where else ""
    return cls(**{name: _convert(hints[name], value, f"{prefix}{name}") for name, value in data.items()})


def config_from_json(path: str | Path) -> RelaxConfig:
    """The `RelaxConfig` of a JSON file written from `dataclasses.asdict(cfg)` of a resolved config, validated.

    Missing keys take their defaults; unknown keys are errors (ValueError naming them), as are violations of the
    config rules (`relax.config.ConfigError`).
    """
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"--config {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"--config {path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a JSON object")
    from relax import algorithms
    from relax.config import RelaxConfig, resolve
    from relax.config.validate import check

    algo = data.pop("algorithm", None)
    cfg = _dataclass(RelaxConfig, data, "")
    if algo is not None:
        if not isinstance(algo, dict) or not isinstance(algo.get("name"), str):
            raise ValueError("algorithm: expected an object with a name")
        algo_cls = algorithms.get(algo["name"]).config_cls
        cfg = dataclasses.replace(cfg, algorithm=_dataclass(algo_cls, algo, "algorithm"))
    return check(resolve(cfg))


# What relax-serve reads of Relax's config, traced in its code (relax/serve/sglang/server.py `_build`, `_server_info`
# and `_openai`; server_args.py; weights.py): the model it builds and serves (model.*, and seed: a model built from
# its config is initialised under it, and /get_server_info reports it), data.tool_parser (the OpenAI routes' calls),
# the SGLang server flags of a run's servers (rollout.lora_sync with LoRA: --enable-lora; rollout.routing_replay and
# rollout.record_routes: --enable-return-routed-experts; cluster.colocate: --enable-memory-saver), and what composes
# the config (plugins' config groups, an experiment's model; hydra.searchpath: `_hydra_key`). The OpenAI routes
# sample with each request's own parameters, not rollout.*; nothing here trains, evaluates or logs to MLflow.
READ_KEYS = ("model", "seed", "plugins", "experiment", "data.tool_parser", "rollout.lora_sync",
             "rollout.routing_replay", "rollout.record_routes", "cluster.colocate")
# model.* keys no server reads: activation recompute saves the trainer's memory in a backward; the engine has none
# (transformers recomputes only in training mode). model.lora_adapter_path has its own refusal (`_load`).
UNREAD_MODEL_KEYS = ("model.gradient_checkpointing",)




def _hydra_key(override: str) -> bool:
    """Whether `override` sets one of Hydra's own keys or chooses in one of its groups (`hydra.job.chdir=true`,
    `~hydra.run.dir`, `hydra/job_logging=disabled`, `hydra/launcher=basic`), `hydra.searchpath` aside."""
    from relax.config.store import override_key

    key = override_key(override)
    return key.startswith(("hydra.", "hydra/")) and key != "hydra.searchpath"


def _in_schema(key: str) -> bool:
    """Whether `key` (dotted) names a field of Relax's schema, a key of one of its free mappings (data.eval_sets.x) or
    an algorithm's option (algorithm.*: the algorithm chosen decides which)."""
    from relax.config.schema import RelaxConfig

    tp: Any = RelaxConfig
    for part in key.split("."):
        if tp is Any or typing.get_origin(tp) is dict or tp is dict:
            return True
        if not dataclasses.is_dataclass(tp):
            return False
        hints = typing.get_type_hints(tp)
        if part not in hints:
            return False
        tp = hints[part]
        if typing.get_origin(tp) in (typing.Union, types.UnionType):  # Optional[X]: X
            tp = next((a for a in typing.get_args(tp) if a is not type(None)), tp)
    return True


def _unread_key(override: str) -> bool:
    """Whether `override` sets (or deletes) a key of Relax's config that relax-serve never reads (`READ_KEYS`), or
    chooses in one of its groups that set only such keys (algorithm=, rollout=, data=, cluster=, teacher=,
    reward_model=). A key the schema lacks is not one: the config's check names it (`unknown key train.lrr (did you
    mean train.lr?)`), as Hydra's own keys are `_hydra_key`'s."""
    from relax.config.store import override_key

    key = override_key(override)
    if key in UNREAD_MODEL_KEYS:
        return True
    if key.startswith(("hydra.", "hydra/")):
        return False
    if any(key == read or key.startswith(read + ".") for read in READ_KEYS):
        return False
    return _in_schema(key)


def _no_effect(override: str) -> Violation | None:
    """The problem of `override` where it would do nothing in relax-serve: one of Hydra's own keys (`_hydra_key`:
    relax-serve runs no Hydra job) or a key relax-serve does not read (`_unread_key`); None where it acts."""
    from relax.algorithms.base import Violation
    from relax.config.store import override_key

    key = override_key(override)
    if _hydra_key(override):
        why = "relax-serve runs no Hydra job"
    elif _unread_key(override):
        read = ", ".join(f"{k}.*" if k == "model" else k for k in READ_KEYS)
        why = f"relax-serve does not read {key} (it reads {read})"
    else:
        return None
    return Violation((key,), f"{override}: {why}, so this override has no effect here: leave it out")


# The training cluster's placement rules (relax.config.validate's `_resources`, named by their keys) that
# cluster.colocate=false breaks without GPUs: "cluster.colocate=false has no effect without GPUs
# (cluster.gpus_per_node=0)", and "the roles need N GPU(s): ... + 1 for the teacher" (apart, a teacher algorithm's
# teacher gets a GPU of its own). They judge where relax-train places its roles; relax-serve places none
# (cluster.colocate is only its SGLang flag --enable-memory-saver here) and refuses the other cluster.* keys they
# name, so they would refuse cluster.colocate=false with no way out. Named one by one, so that another rule on
# cluster.* keys (one about something the server uses) is not exempted with them.
PLACEMENT_RULES = (
    frozenset({"cluster.colocate", "cluster.gpus_per_node"}),
    frozenset({"cluster.actor_gpus", "cluster.num_nodes", "cluster.gpus_per_node", "cluster.rollout_gpus"}),
)


def _placement_rule(violation: Violation) -> bool:
    """Whether `violation` is one of the placement rules relax-serve exempts (`PLACEMENT_RULES`)."""
    return frozenset(violation.fields) in PLACEMENT_RULES


def _without_placement_rules(exc: ConfigError) -> RelaxConfig:
    """The config of `exc` when the placement rules (`_placement_rule`) are all it breaks; else raises ConfigError
    with its other problems, also where its values did not compose (no config was built: `seed=abc` beside
    cluster.colocate=false is refused for seed alone)."""
    from relax.config import ConfigError

    kept = [v for v in exc.violations if not _placement_rule(v)]
    if exc.config is None or kept:
        raise ConfigError(kept or exc.violations, exc.algorithm) from None
    return exc.config


def _load(args: argparse.Namespace) -> RelaxConfig:
    """The config of the command line; exits 2 on a bad one: its problems in relax-train's list
    (`relax.cli.config_check.invalid_config`), any other mistake in one line."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from relax.cli.config_check import duplicate_problems, invalid_config, load, load_failure
    from relax.config import ConfigError

    # a key given twice is refused (Hydra would take the last silently), beside the config's other problems, which
    # are found with the last of each
    repeated, overrides = duplicate_problems(args.overrides, command="config")
    # Hydra's own keys and groups (hydra.job.chdir, hydra.run.dir, hydra/job_logging, the launcher's) configure a
    # Hydra job, which relax-serve does not run, and the keys it does not read (train.lr, rollout.temperature: see
    # READ_KEYS) would do nothing: each is refused in one line rather than accepted (or checked) to do nothing, and
    # left out of the composition, so that rollout.temperature=0 is named for doing nothing here, not for being 0.
    # hydra.searchpath is kept: it adds config groups to the composition relax-serve's config comes from
    unused = {o: v for o in overrides if (v := _no_effect(o)) is not None}
    refused = {v.fields[0] for v in unused.values()}
    extra = [*(r for r in repeated if r.fields[0] not in refused), *unused.values()]  # one line per such key
    overrides = [o for o in overrides if o not in unused]
    try:
        if args.config:
            return config_from_json(args.config)  # a run's own server: the adapters arrive with its weight updates
        try:
            cfg = load(overrides)  # relax-train's check
        except ConfigError as exc:
            cfg = _without_placement_rules(exc)  # cluster.colocate=false: no GPUs to place on here
        if extra:
            _fail(invalid_config(extra), lines=True)
        if cfg.model.lora_adapter_path:  # a training option: this server would serve the base without them
            _fail(f"model.lora_adapter_path={cfg.model.lora_adapter_path!r} continues training adapters in "
                  "relax-train; relax-serve serves model.path: to serve the base with these adapters, set "
                  "model.path to the adapter directory (merged into its base before start)")
        return cfg
    except (ConfigError, HydraException, OmegaConfBaseException) as exc:
        _fail(load_failure(exc, extra), lines=True)
    except (KeyError, ValueError, TypeError, FileNotFoundError) as exc:
        _fail(str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc))


def _check_reasoning_secret() -> None:
    """Exit 2 with one line where $RELAX_SERVE_REASONING_SECRET / $RELAX_SERVE_REASONING_SECRET_FILE cannot give the
    reasoning items' key (an empty secret, a file that cannot be read, both set): the Responses route reads them
    only at its first call, which would fail every call as a server error instead of refusing to start. The message
    names the variable and the file, never the secret."""
    from relax.serve.openai.protocol import APIError
    from relax.serve.openai.responses import ReasoningSeal

    try:
        ReasoningSeal.from_environment()
    except APIError as exc:
        _fail(str(exc))


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, start the server, serve until SIGINT/SIGTERM."""
    parser = _Parser(prog="relax-serve", description="Relax's embedded rollout engine behind SGLang's HTTP protocol.")
    parser.add_argument("--port", type=_port, required=True, help="port to listen on (0: any free port)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--config", default=None, help="a resolved RelaxConfig as JSON (dataclasses.asdict)")
    parser.add_argument("--weight-version", default="default", help="the initial weight_version (default: default)")
    parser.add_argument("--api-key", default=None,
                        help="the key every endpoint but /health* and /metrics requires (Authorization: Bearer), "
                             "as SGLang's --api-key; required beyond loopback. Prefer setting $RELAX_SERVE_API_KEY "
                             "(the default) to this flag: a key on the command line shows in the process list and "
                             "the shell's history")
    parser.add_argument("--weight-dir", action="append", default=[], metavar="DIR",
                        help="a directory (besides the model's own) whose files /update_weights_from_disk and "
                             "/load_lora_adapter may load; repeatable (default: the model's directory only)")
    parser.add_argument("--max-body-mb", type=float, default=None,
                        help="the largest request body accepted, in MiB (default: 256); larger ones get 413")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for relax-train (model=tiny ...)")
    args = parser.parse_intermixed_args(argv)
    if args.config and args.overrides:
        _fail("give either --config or overrides, not both")
    if args.threads is not None and args.threads < 1:
        _fail(f"--threads={args.threads}: must be >= 1")
    if (problem := host_problem(args.host)) is not None:
        _fail(problem)
    _check_reasoning_secret()
    cfg = _load(args)
    from relax.data.tokenizer import check_tokenizer_files
    from relax.models.hf import resolve_model_path
    from relax.models.peft_merge import ensure_merged
    from relax.serve.http import is_loopback
    from relax.serve.sglang.server import EmbeddedServer

    if cfg.model.source != "config":
        try:
            ensure_merged(cfg.model)  # a PEFT adapter directory: its base with the adapters merged, before loading
            path = resolve_model_path(cfg.model)  # a missing model directory or file: a usage error, before binding
            if cfg.model.source == "hf":  # no tokenizer files: a usage error too, not a failed load's traceback
                check_tokenizer_files(path)
        except (FileNotFoundError, ValueError) as exc:
            _fail(str(exc))
    key_source = "--api-key"
    if args.api_key is None:  # the flag not given: the variable, named where it is wrong
        args.api_key, key_source = os.environ.get(KEY_ENV), f"${KEY_ENV}"
    if args.api_key is not None and not args.api_key.strip():
        _fail("--api-key: an empty key" if key_source == "--api-key" else
              f"${KEY_ENV} is set but empty (--api-key not given): an empty key; set it to the key, or unset it")
    if args.api_key is None and not is_loopback(args.host):
        # such a server would refuse every request but health (403), from loopback too: refused before it binds
        _fail(f"--host {args.host} is reachable beyond this machine: give a key (--api-key, or "
              "$RELAX_SERVE_API_KEY, which keeps it out of the process list), or bind a loopback address")
    for directory in args.weight_dir:
        if not os.path.isdir(directory):
            _fail(f"--weight-dir {directory}: not a directory")
    if args.max_body_mb is not None and args.max_body_mb <= 0:
        _fail(f"--max-body-mb={args.max_body_mb:g}: must be > 0")
    from relax.serve.http import MAX_BODY_BYTES

    limit = MAX_BODY_BYTES if args.max_body_mb is None else int(args.max_body_mb * 2**20)
    server = EmbeddedServer(cfg, host=args.host, port=args.port, threads=args.threads,
                            weight_version=args.weight_version, api_key=args.api_key, max_body_bytes=limit,
                            weight_dirs=tuple(args.weight_dir))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start()
    except OSError as exc:
        _fail(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
    try:
        while not stop.is_set():
            try:
                server.wait_ready(0.5)
                break
            except TimeoutError:
                continue
    except RuntimeError as exc:
        server.shutdown()
        _fail(str(exc), code=1)
    if not stop.is_set():
        print(f"relax-serve: listening on {server.url}", flush=True)
        stop.wait()
    server.shutdown()


if __name__ == "__main__":
    main()
