"""`relax-submit`: run `relax-train <overrides>` on an existing Ray cluster through the Ray Jobs API.

    relax-submit --address http://HEAD:8265 -- algorithm=rloo model=qwen3_0.6b cluster=8xgpu

The job's runtime environment uploads the working directory (this checkout by default, so the
cluster runs exactly the code and conf/ you have) and sets environment variables (`--env KEY=VAL`;
MODEL_DIR, DATA_DIR and the other variables in FORWARDED_ENV are passed on when set here). The
entrypoint is `python -m relax.cli.train`, i.e. relax-train, which works from the uploaded checkout
whether or not Relax is installed on the nodes. With Ray's token authentication (Ray >= 2.52; on
by default for local clusters since 2.59) the client sends the token found in RAY_AUTH_TOKEN,
RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, see launch/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

USAGE_EXIT = 2
FORWARDED_ENV = ("MODEL_DIR", "DATA_DIR", "EXP_DIR", "RLOO_DATA_CACHE_DIR", "HF_HOME")
# Never uploaded: run outputs, stores and caches (Ray caps a working_dir upload at a few hundred MiB).
EXCLUDES = [".git", "**/__pycache__", "outputs", "multirun", "mlruns", "mlflow.db", "compare", "*.egg-info",
            ".pytest_cache", ".ruff_cache", "**/checkpoints", "*.pt", "*.safetensors", "*.gguf"]
TRAIN_ENTRYPOINT = "python -m relax.cli.train"
EXIT_CODES = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 130}


def default_working_dir() -> Path:
    """This checkout when Relax runs from one (its conf/ and code travel with the job), else the cwd."""
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").is_file() and (repo / "conf" / "config.yaml").is_file():
        return repo
    return Path.cwd()


def parse_env(items: list[str], environ: Optional[dict[str, str]] = None) -> dict[str, str]:
    """FORWARDED_ENV variables that are set here, then `--env KEY=VAL` (which wins)."""
    environ = dict(os.environ) if environ is None else environ
    env = {k: environ[k] for k in FORWARDED_ENV if environ.get(k)}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--env expects KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def build_submission(overrides: list[str], *, working_dir: Path, env: dict[str, str],
                     entrypoint: Optional[str] = None, submission_id: Optional[str] = None,
                     entrypoint_num_cpus: Optional[float] = None) -> dict[str, Any]:
    """Keyword arguments of `JobSubmissionClient.submit_job` (kept apart from the network call to test it)."""
    command = entrypoint or TRAIN_ENTRYPOINT
    if overrides:
        command += " " + " ".join(shlex.quote(o) for o in overrides)
    runtime_env: dict[str, Any] = {"working_dir": str(working_dir), "excludes": list(EXCLUDES)}
    if env:
        runtime_env["env_vars"] = dict(env)
    payload: dict[str, Any] = {"entrypoint": command, "runtime_env": runtime_env}
    if submission_id:
        payload["submission_id"] = submission_id
    if entrypoint_num_cpus is not None:
        payload["entrypoint_num_cpus"] = entrypoint_num_cpus
    return payload


async def _follow(client: Any, job_id: str) -> None:
    async for lines in client.tail_job_logs(job_id):
        sys.stdout.write(lines)
        sys.stdout.flush()


def submit_with_retry(client: Any, payload: dict[str, Any], wait_s: float = 90.0) -> str:
    """submit_job, retried while a just-started head has no job agent yet ("try again later")."""
    import time

    t0 = time.monotonic()
    while True:
        try:
            return client.submit_job(**payload)
        except RuntimeError as exc:
            if "try again later" not in str(exc) or time.monotonic() - t0 > wait_s:
                raise
            time.sleep(2.0)


def wait_for_status(client: Any, job_id: str, poll_s: float = 1.0, timeout_s: Optional[float] = None) -> str:
    """Poll until the job is terminal; returns its status name."""
    import time

    t0 = time.monotonic()
    while True:
        status = str(client.get_job_status(job_id))
        status = status.split(".")[-1]
        if status in EXIT_CODES:
            return status
        if timeout_s is not None and time.monotonic() - t0 > timeout_s:
            return status
        time.sleep(poll_s)


def exit_code(client: Any, job_id: str, status: str) -> int:
    """The entrypoint's own exit code when Ray reports it (2 = invalid config), else one per status."""
    try:
        code = getattr(client.get_job_info(job_id), "driver_exit_code", None)
    except Exception:  # noqa: BLE001 - older servers
        code = None
    if isinstance(code, int) and (status != "SUCCEEDED" or code == 0):
        return code
    return EXIT_CODES.get(status, 1)


def enable_token_auth(environ: Optional[dict[str, str]] = None) -> bool:
    """Send Ray's auth token when one is available (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token).

    Ray's client only attaches the token with RAY_AUTH_MODE=token; a user who has a token most likely
    means to use it, so it is turned on unless RAY_AUTH_MODE is set explicitly. Returns whether it is on.
    """
    environ = os.environ if environ is None else environ
    mode = environ.get("RAY_AUTH_MODE")
    if mode is not None:
        return mode.lower() == "token"
    path = environ.get("RAY_AUTH_TOKEN_PATH")
    has_token = bool(environ.get("RAY_AUTH_TOKEN")) or (bool(path) and Path(path).is_file()) or \
        (Path.home() / ".ray" / "auth_token").is_file()
    if has_token:
        environ["RAY_AUTH_MODE"] = "token"
    return has_token


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="relax-submit",
        description="Submit `relax-train <overrides>` to a Ray cluster (Ray Jobs API) and follow its logs.",
        epilog="Example: relax-submit --address http://HEAD:8265 -- algorithm=rloo model=qwen3_0.6b cluster=8xgpu",
    )
    p.add_argument("--address", default=os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS"),
                   help="Ray dashboard address, e.g. http://HEAD:8265 (default: $RAY_API_SERVER_ADDRESS, $RAY_ADDRESS)")
    p.add_argument("--working-dir", type=Path, default=None,
                   help="directory uploaded as the job's working_dir (default: this Relax checkout, else the cwd)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VAL", help="environment variable (repeatable)")
    p.add_argument("--entrypoint", default=None,
                   help=f"command instead of `{TRAIN_ENTRYPOINT}`; the overrides are appended to it")
    p.add_argument("--submission-id", default=None, help="job id to use (default: Ray picks one)")
    p.add_argument("--entrypoint-num-cpus", type=float, default=None, help="CPUs reserved for the driver")
    p.add_argument("--no-follow", action="store_true", help="print the job id and return at once")
    p.add_argument("--dry-run", action="store_true", help="print what would be submitted; contact nothing")
    p.add_argument("overrides", nargs="*", help="relax-train overrides (after --)")
    return p


def main(argv: Optional[list[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        env = parse_env(args.env)
    except ValueError as exc:
        parser.error(str(exc))
    working_dir = (args.working_dir or default_working_dir()).resolve()
    if not working_dir.is_dir():
        parser.error(f"--working-dir {working_dir} is not a directory")
    payload = build_submission(args.overrides, working_dir=working_dir, env=env, entrypoint=args.entrypoint,
                               submission_id=args.submission_id, entrypoint_num_cpus=args.entrypoint_num_cpus)
    if args.dry_run:
        import json

        print(json.dumps(payload, indent=2))
        return
    if not args.address:
        parser.error("--address is required (e.g. http://HEAD:8265), or set RAY_API_SERVER_ADDRESS")
    enable_token_auth()
    from ray.job_submission import JobSubmissionClient

    try:
        client = JobSubmissionClient(args.address)
        job_id = submit_with_retry(client, payload)
    except Exception as exc:  # noqa: BLE001 - connection refused, auth failure, bad runtime_env ...
        print(f"relax-submit: error: cannot submit to {args.address}: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(USAGE_EXIT)
    print(f"submitted job {job_id} to {args.address}: {payload['entrypoint']}", flush=True)
    if args.no_follow:
        print(f"follow it with: ray job logs --address {args.address} --follow {job_id}")
        return
    try:
        asyncio.run(_follow(client, job_id))
    except KeyboardInterrupt:
        print(f"\nstopped following; the job goes on. Stop it with: ray job stop --address {args.address} {job_id}",
              file=sys.stderr)
        sys.exit(130)
    status = wait_for_status(client, job_id)
    code = exit_code(client, job_id, status)
    print(f"job {job_id}: {status} (exit code {code})", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    main()
