"""A tiny Hydra app for the sweep-launcher tests: each job sleeps, may raise, and logs one MLflow child run."""

import json
import os
import signal
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
    if HydraConfig.get().job.num == cfg.fail_job:
        raise RuntimeError(f"boom before its run (job {cfg.fail_job})")
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
        Path(cfg.record_dir).mkdir(exist_ok=True)
        (Path(cfg.record_dir) / f"started-{HydraConfig.get().job.num}").touch()  # its run is open
        if HydraConfig.get().job.num == cfg.crash_job:  # a crash with its run open (kill -9, out of memory): no
            os.kill(os.getpid(), signal.SIGKILL)  # handler of this process runs, so nothing ends the run here
        until = time.time() + cfg.sleep_s
        while time.time() < until:  # short sleeps: Ray's interrupt (ray.cancel) is handled between them, as a real
            time.sleep(0.05)  # run handles it between its waits
        end = time.time()
        record = {"num": HydraConfig.get().job.num, "start": start, "end": end, "pid": os.getpid(),
                  "niceness": os.nice(0)}
        (Path(cfg.record_dir) / f"{record['num']}.json").write_text(json.dumps(record))
        if cfg.seed == cfg.fail_seed and cfg.lr == cfg.fail_lr:
            raise RuntimeError(f"boom (seed={cfg.seed})")
    return {"final_reward": cfg.lr * cfg.seed + 2}


if __name__ == "__main__":
    app()
