"""`relax-compare`: the arms of an experiment side by side, from MLflow. Logic: relax.tracking.compare."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

USAGE_EXIT = 2


def _tags(values: list[str]) -> dict[str, str]:
    out = {}
    for v in values:
        key, sep, value = v.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--tag expects KEY=VALUE, got {v!r}")
        out[key] = value
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="relax-compare",
        description="Compare the arms of an experiment: final values over seeds, paired differences to a control "
                    "arm with 95% CIs (Student t below 5 seed pairs, else bootstrap), learning curves (PNG) and a CSV, "
                    "logged back to MLflow. "
                    "With no selector: the most recent sweep in the store.",
    )
    p.add_argument("--uri", default="sqlite:///mlflow.db", help="MLflow tracking URI (default: %(default)s)")
    sel = p.add_argument_group("which runs")
    sel.add_argument("--experiment", help="MLflow experiment name")
    sel.add_argument("--sweep", help="sweep id (the sweep_id tag that relax-train -m sets)")
    sel.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE", help="tag filter (repeatable)")
    sel.add_argument("--run-ids", nargs="+", default=[], metavar="RUN_ID", help="these runs only")
    sel.add_argument("--include-unfinished", action="store_true", help="keep FAILED/KILLED/RUNNING runs")
    how = p.add_argument_group("how")
    how.add_argument("--by", action="append", default=None, metavar="KEY[,KEY...]",
                     help="tag or param to group runs by (default: arm); several keys, as a comma list or the option "
                          "repeated, make an arm of each combination of their values, named KEY=VALUE,KEY=VALUE")
    how.add_argument("--metrics", nargs="+", default=None, metavar="METRIC",
                     help="default: rollout/raw_reward and every eval/* present")
    how.add_argument("--last-k", type=int, default=10,
                     help="final value of a training metric = mean of a run's last K logged values (default: 10)")
    how.add_argument("--eval-last-k", type=int, default=1, metavar="K",
                     help="final value of an eval/* metric = mean of a run's last K evaluations (default: 1, the "
                          "evaluation of the final weights)")
    how.add_argument("--control", help="control arm: paired differences by seed against it")
    how.add_argument("--bootstrap", type=int, default=10_000, metavar="N",
                     help="bootstrap resamples, used from 5 seed pairs on (10000)")
    how.add_argument("--seed", type=int, default=0, help="bootstrap RNG seed (default: 0)")
    how.add_argument("--band", choices=("minmax", "std"), default="minmax", help="band around the mean curve")
    out = p.add_argument_group("output")
    out.add_argument("--out", type=Path, default=None, help="directory for compare.csv and compare.png "
                                                             "(default: compare/<sweep id or time>)")
    out.add_argument("--no-log", action="store_true", help="do not log the CSV and PNG to MLflow")
    return p


def main(argv: Optional[list[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        tags = _tags(args.tag)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.last_k < 1:
        parser.error("--last-k must be >= 1")
    if args.eval_last_k < 1:
        parser.error(f"--eval-last-k must be >= 1 (the number of last evaluations averaged), got {args.eval_last_k}")
    if args.bootstrap < 1:
        parser.error(f"--bootstrap must be >= 1 (the number of bootstrap resamples), got {args.bootstrap}")
    from relax.tracking.compare import CompareError, by_keys

    try:
        by = by_keys(args.by or ["arm"])
    except CompareError as exc:
        parser.error(str(exc))
    from relax.config.credentials import without_secrets
    from relax.runner.endpoints import tracking_store_unreachable
    from relax.tracking.compare import compare
    from relax.tracking.mlflow_run import bound_http_retries
    from relax.tracking.spool_file import is_store_error, short_error

    # a server that is not there: said in seconds, as relax-train does, where MLflow's client retries for minutes
    if (why := tracking_store_unreachable(args.uri, "--uri")) is not None:
        print(f"relax-compare: error: {why}", file=sys.stderr)
        sys.exit(USAGE_EXIT)
    bound_http_retries(args.uri)  # one that goes away meanwhile: seconds too (the user's MLFLOW_HTTP_* win)
    try:
        result = compare(uri=args.uri, experiment=args.experiment, sweep=args.sweep, tags=tags,
                         run_ids=args.run_ids, by=by, metrics=args.metrics, last_k=args.last_k,
                         control=args.control, n_boot=args.bootstrap, seed=args.seed, band=args.band,
                         out_dir=args.out, log=not args.no_log, include_unfinished=args.include_unfinished,
                         eval_last_k=args.eval_last_k)
    except CompareError as exc:
        print(f"relax-compare: error: {exc}", file=sys.stderr)
        sys.exit(USAGE_EXIT)
    except Exception as exc:
        if not is_store_error(exc):  # a bug: its traceback is the report
            raise
        print(f"relax-compare: error: cannot read the MLflow store {without_secrets(args.uri)}: {short_error(exc)}",
              file=sys.stderr)
        sys.exit(USAGE_EXIT)
    print(result.text)
    print()
    print(f"wrote {result.csv_path} and {result.png_path}" +
          (f"; logged to MLflow run {result.logged_to} (artifacts/compare/)" if result.logged_to else ""))


if __name__ == "__main__":
    main()
