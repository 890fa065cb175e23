"""Replay a run's MLflow spool into the store: `python -m relax.tracking.spool <spool file> [--uri URI] [--attempts N]`.

A run whose store was still unavailable when it ended prints the path of its spool
(`<checkpoint dir>/mlflow-spool-<run id>.jsonl`) and this command. It writes the spooled metrics (with their
original steps and timestamps), params, tags, artifacts and final run status into the run, in order, and
deletes the spool once everything is in. `--uri` when the store has moved (default: the URI recorded in the
spool). Exit status: 0 everything is in the store (or there was nothing to do), 1 the store is still
unavailable (run it again later; what is done stays done), 2 the run is not in that store. Running it again,
or after a replay cut off midway, writes nothing twice. The format and the guarantees are described in
`relax.tracking.spool_file`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from relax.tracking.mlflow_run import quiet_mlflow_logging
from relax.tracking.spool_file import (
    REJECTED_CODES,
    REPLAY_COMMAND,
    SPOOL_PREFIX,
    SPOOL_SUFFIX,
    ReplayResult,
    Spool,
    is_rejection,
    is_store_error,
    short_error,
    spool_path,
)

__all__ = [
    "REJECTED_CODES",
    "REPLAY_COMMAND",
    "SPOOL_PREFIX",
    "SPOOL_SUFFIX",
    "ReplayResult",
    "Spool",
    "is_rejection",
    "is_store_error",
    "main",
    "short_error",
    "spool_path",
]


def main(argv: Optional[list[str]] = None) -> int:
    """Replay a spool into its store (see the module docstring); returns the exit status."""
    parser = argparse.ArgumentParser(prog=REPLAY_COMMAND, description="Load the MLflow writes a Relax run kept in "
                                     "a local spool (the store was unavailable) into the store, exactly once.")
    parser.add_argument("spool", help="the mlflow-spool-<run id>.jsonl file the run named")
    parser.add_argument("--uri", default=None, help="tracking store URI (default: the one recorded in the spool)")
    parser.add_argument("--attempts", type=int, default=3, help="passes before giving up (default 3)")
    parser.add_argument("--backoff", type=float, default=1.0, help="seconds before the 2nd pass, doubling (default 1)")
    args = parser.parse_args(argv)
    path = Path(args.spool)
    if not path.exists():
        print(f"{path}: no such spool (already replayed?); nothing to do")
        return 0
    spool = Spool(path)
    if not spool.pending:
        spool.remove_if_done()
        print(f"{path}: every record is already in the store; spool removed")
        return 0
    uri = args.uri or spool.uri
    if not uri:
        print(f"{path}: the spool names no store; pass --uri", file=sys.stderr)
        return 2
    from mlflow import MlflowClient

    quiet_mlflow_logging()
    client = MlflowClient(tracking_uri=uri)
    try:
        client.get_run(spool.run_id)
    except Exception as exc:
        if is_store_error(exc) and not is_rejection(exc):
            print(f"the store {uri} is still unavailable ({short_error(exc)}); {spool.describe()} wait in {path}; "
                  "run this again later", file=sys.stderr)
            return 1
        print(f"run {spool.run_id} is not in the store {uri} ({short_error(exc)}); pass the right --uri",
              file=sys.stderr)
        return 2
    what = spool.describe()
    result = spool.replay(client, attempts=max(1, args.attempts), backoff_s=args.backoff)
    line = (f"run {spool.run_id} at {uri}: {result.records} records replayed ({result.metrics} metric values "
            f"written, {result.duplicates} already there)")
    if result.set_aside:
        line += f"; {result.set_aside} refused by the store, kept in {spool.rejected_path}"
    if not result.done:
        print(f"{line}; {result.pending} still pending, the store failed: {short_error(result.error)}; "
              "run this again later", file=sys.stderr)
        return 1
    spool.remove_if_done()
    print(f"{line}; was: {what}; spool removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
