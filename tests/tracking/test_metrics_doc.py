"""docs/training.md, "Metrics": the list a user reads to find a run's MLflow keys names what a default run logs, and
only names that relax/metrics.py (where every name is defined once) defines."""

from __future__ import annotations

import re
from pathlib import Path

import relax.metrics as M

DOC = Path(__file__).resolve().parents[2] / "docs" / "training.md"

# The keys that a default GRPO run (relax-train data=jsonl ... data.reward=<a function>, 2 steps, CPU) logged at
# every step, read from its MLflow store, that the list once lacked (beside those it had: rollout/raw_reward, ...).
DEFAULT_RUN_KEYS = ("rollout/reward_timeouts", "rollout/mismatch_k1", "rollout/mismatch_k3",
                    "rollout/mismatch_log_ppl_diff", "rollout/mismatch_ratio_p05", "rollout/mismatch_ratio_p50",
                    "rollout/mismatch_ratio_p95",
                    "train/skipped_steps", "perf/sync_bytes", "perf/rollout_engine_time", "perf/actor_compute_time",
                    "perf/overhead_time", "perf/overhead_fraction", "fault/restarts")


def _section() -> str:
    text = DOC.read_text()
    start = text.index("\n## Metrics\n")
    return text[start:text.index("\n## ", start + 1)]


def _defined() -> set[str]:
    names: set[str] = set()
    for value in vars(M).values():
        if isinstance(value, str):
            names.add(value)
        elif isinstance(value, tuple):
            names.update(v for v in value if isinstance(v, str))
    return names


def test_the_metrics_list_names_what_a_default_run_logs():
    section = _section()
    missing = [k for k in DEFAULT_RUN_KEYS if f"`{k}`" not in section]
    assert not missing, f"docs/training.md, Metrics, lacks {missing}"


def test_every_name_the_metrics_list_gives_in_full_is_defined_in_relax_metrics():
    names = re.findall(r"`((?:rollout|train|perf|critic|fault|eval)/[a-z0-9_/]+)`", _section())
    assert len(names) > 40
    defined = _defined()
    unknown = [n for n in names if n not in defined and not n.endswith("/")]
    assert not unknown, f"docs/training.md, Metrics, names {unknown}, which relax/metrics.py does not define"
