"""A tiny Hydra app for the sweep-launcher tests: each job sleeps, may raise, and logs one MLflow child run."""

import json
import os
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig


def check(cfg: DictConfig) -> None:
    """The launcher's precheck: a negative learning rate is a config error."""
    if cfg.lr < 0:
        raise ValueError(f"lr={cfg.lr} must be >= 0")


@hydra.main(config_path="dummy_conf", config_name="config", version_base=None)
def app(cfg: DictConfig) -> dict:
    from relax.config.schema import TrackingConfig
    from relax.tracking.mlflow_run import Tracker
    from relax.tracking.params import overrides_text
    from relax.tracking.run_options import RunOptions

    start = time.time()
    t = cfg.tracking
    tags = {"seed": str(cfg.seed), "arm": t.arm or "default",
            "overrides": overrides_text(HydraConfig.get().overrides.task)}
    if t.sweep_id:
        tags["sweep_id"] = t.sweep_id
    tracker = Tracker.start(TrackingConfig(uri=t.uri, experiment=t.experiment),
                            RunOptions(background=False, announce=False), tags=tags, parent_run_id=t.parent_run_id)
    with tracker:
        for step in range(3):
            tracker.log_metrics({"rollout/raw_reward": cfg.lr * cfg.seed + step}, step)
        time.sleep(cfg.sleep_s)
        end = time.time()
        Path(cfg.record_dir).mkdir(exist_ok=True)
        record = {"num": HydraConfig.get().job.num, "start": start, "end": end, "pid": os.getpid(),
                  "niceness": os.nice(0)}
        (Path(cfg.record_dir) / f"{record['num']}.json").write_text(json.dumps(record))
        if cfg.seed == cfg.fail_seed and cfg.lr == cfg.fail_lr:
            raise RuntimeError(f"boom (seed={cfg.seed})")
    return {"final_reward": cfg.lr * cfg.seed + 2}


if __name__ == "__main__":
    app()
