"""How the lines that Ray forwards from its workers to the driver are printed (a single run's Ray, relax.runner.cluster,
and a sweep's, hydra_plugins.relax_ray_launcher): one decision for both."""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence


def plain_ray_log_prefix(environ: MutableMapping[str, str], streams: Sequence[object]) -> None:
    """RAY_COLOR_PREFIX=0 in `environ` unless every one of `streams` is a terminal (or the user set it): Ray wraps the
    `(Role pid=...)` / `(_execute_job pid=...)` prefix of each forwarded line in ANSI colour codes, which a log file
    or a pipe keeps raw. Ray's driver reads the variable at each line it prints (ray._private.worker.print_worker_logs),
    so it must be set before ray.init's log forwarding starts printing."""
    def tty(stream: object) -> bool:
        isatty = getattr(stream, "isatty", None)
        return bool(isatty()) if callable(isatty) else False

    if not all(tty(s) for s in streams):
        environ.setdefault("RAY_COLOR_PREFIX", "0")
