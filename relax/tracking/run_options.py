"""How a tracker writes and reports its run: the options `Tracker.start` and `Tracker.reopen` share, as one record.

The caller builds it once and passes it to whichever of the two it calls (relax-train starts a new run or continues
the one of a checkpoint with the same options). What identifies and describes the run stays with each call: the run
name, params and parent of a new run, the step a reopened run continues from, and the tags either sets. Imports
nothing heavy, so that building one costs nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, TextIO

DEFAULT_FINAL_REPLAY_S = 30.0  # how long `finish` keeps trying to replay a spool before leaving it on disk


@dataclass(frozen=True)
class RunOptions:
    """The options of `Tracker.start` and `Tracker.reopen` (and of `NullTracker.start`, which ignores them).

    `flush_every_steps`, `flush_interval_s`: metrics are written every that many training steps or seconds, whichever
    comes first. `nonfinite`: "skip" (counted in a tag) or "log" (see `relax.tracking.mlflow_run`). `background`: a
    daemon thread writes (False: the `log_metrics` call that makes a flush due writes, for tests). `announce`: print
    one line naming the run, the store and the UI command to `stream` (None: stderr), which also receives what
    `finish` prints about a spool left on disk. `spool_dir`: where the run's spool goes during an outage (None:
    `default_spool_dir`). `final_replay_s`: how long `finish` retries replaying the spool. `system_metrics_s`: sample
    MLflow's system metrics every that many seconds (None: none).

    The values are checked where they were before this record existed (by `start`/`reopen` and the `Tracker`), so
    a bad one fails at the same point with the same message.
    """

    flush_every_steps: int = 10
    flush_interval_s: float = 15.0
    nonfinite: str = "skip"
    background: bool = True
    announce: bool = True
    stream: Optional[TextIO] = None
    spool_dir: Optional[str | os.PathLike[str]] = None
    final_replay_s: float = DEFAULT_FINAL_REPLAY_S
    system_metrics_s: Optional[float] = None


DEFAULT_RUN_OPTIONS = RunOptions()  # the default of every `options` parameter (frozen, so one shared instance is safe)
