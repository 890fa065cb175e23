"""Experiment tracking: one MLflow run per training job, config params and tags, the git state of the code
(`git_info`), the prompt sets as dataset inputs (`inputs`), MLflow's system metrics (`system_metrics`), the terminal
progress line.
 MLflow itself is imported lazily, when a
run starts, so importing this package stays cheap.

Layer 2 of 0-9 (docs/design.md): imports Relax packages of lower layers only.
"""

from relax.tracking.mlflow_run import (
    NullTracker,
    RunTracker,
    Tracker,
    TrackingUnavailable,
    resolve_tracking_uri,
    start_tracker,
)
from relax.tracking.params import STANDARD_TAG_KEYS, flatten_config, standard_tags
from relax.tracking.progress import Progress, summary
from relax.tracking.run_options import RunOptions

__all__ = [
    "STANDARD_TAG_KEYS",
    "NullTracker",
    "Progress",
    "RunOptions",
    "RunTracker",
    "Tracker",
    "TrackingUnavailable",
    "flatten_config",
    "resolve_tracking_uri",
    "standard_tags",
    "start_tracker",
    "summary",
]
