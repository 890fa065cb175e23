"""What a run shows and records: the MLflow run, the progress line and the closing summary."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from relax.config.schema import RelaxConfig
from relax.runner.metrics import RAW_REWARD
from relax.runner.plan import Plan


def _hydra_overrides() -> list[str]:
    """The command-line overrides of this job when Hydra runs it (relax-train, sweeps), else []."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    return list(HydraConfig.get().overrides.task)


@dataclass
class RunResult:
    run_id: str | None
    history: list[tuple[int, dict[str, float]]]
    first_reward: float  # mean of the first 10 steps
    final_reward: float  # mean of the last 10 steps
    best_reward: float

    def series(self, key: str) -> list[float]:
        return [m[key] for _, m in self.history if key in m]


class Session:
    def __init__(self, cfg: RelaxConfig, plan: Plan, output_dir: Path, dictconfig=None):
        self.cfg, self.plan, self.output_dir, self.dictconfig = cfg, plan, output_dir, dictconfig
        self.rewards: list[float] = []
        self.history: list[tuple[int, dict[str, float]]] = []  # (step, metrics) as logged
        self.steps = 0

    def __enter__(self) -> Session:
        from omegaconf import OmegaConf

        from relax.runner.summary import config_summary
        from relax.tracking.mlflow_run import NullTracker, Tracker
        from relax.tracking.params import TAG_OVERRIDES, flatten_config, overrides_text, standard_tags
        from relax.tracking.progress import Progress

        cfg = self.cfg
        self.t0 = time.perf_counter()
        print(config_summary(cfg), file=sys.stderr)
        print(self.plan.render(), file=sys.stderr)
        if cfg.tracking.enabled:
            tags = standard_tags(cfg)
            overrides = _hydra_overrides()
            if overrides:
                tags[TAG_OVERRIDES] = overrides_text(overrides)
            self.tracker = Tracker.start(cfg.tracking, run_name=cfg.tracking.run_name, tags=tags,
                                         params=flatten_config(cfg), parent_run_id=cfg.tracking.parent_run_id)
        else:
            self.tracker = NullTracker()
        self.tracker.__enter__()
        resolved = OmegaConf.to_yaml(OmegaConf.structured(cfg))
        self.tracker.log_text(resolved, "config.yaml")
        self.tracker.log_text(self.plan.render() + "\n", "plan.txt")
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.resolved.yaml").write_text(resolved)
        self.progress = Progress(cfg.train.num_rollout, enabled=cfg.tracking.progress)
        return self

    def note(self, message: str) -> None:
        self.progress.write(message)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.tracker.log_metrics(metrics, step)
        self.history.append((step, dict(metrics)))
        if RAW_REWARD in metrics:
            self.rewards.append(metrics[RAW_REWARD])
        self.steps = step + 1
        self.progress.update(step + 1, metrics)

    def finish(self) -> RunResult:
        """Flush tracking and print the summary (final = mean reward of the last 10 steps)."""
        self.tracker.flush()
        k = min(10, len(self.rewards)) or 1
        final = sum(self.rewards[-k:]) / k if self.rewards else float("nan")
        first = sum(self.rewards[:k]) / k if self.rewards else float("nan")
        best = max(self.rewards) if self.rewards else float("nan")
        extra = {"first 10 steps reward": first, "steps": self.steps,
                 "wall time": f"{time.perf_counter() - self.t0:.0f} s", "outputs": str(self.output_dir)}
        self.progress.summary(final, best, getattr(self.tracker, "run_id", None), self.tracker.ui_command(), extra)
        return RunResult(getattr(self.tracker, "run_id", None), self.history, first, final, best)

    def __exit__(self, exc_type, exc, tb) -> None:
        self.progress.close()
        self.tracker.__exit__(exc_type, exc, tb)
