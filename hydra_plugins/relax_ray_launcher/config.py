"""The launcher's options, registered as `hydra/launcher=relax_ray` (set them as `hydra.launcher.<name>=...`)."""


from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class RelaxRayLauncherConf:
    _target_: str = "hydra_plugins.relax_ray_launcher.launcher.RelaxRayLauncher"
    # Ray to join; None: the config's cluster.address, else a local Ray instance started for the sweep.
    address: Optional[str] = None
    # Jobs running at once (a positive number; 0 or less is refused); None: as many as fit num_cpus / num_gpus each
    # into the cluster's resources.
    max_concurrent_jobs: Optional[int] = None
    # Resources one job needs, used to size the concurrency. The job's roles request their own Ray
    # resources, so the launcher's task reserves none (a reservation would be counted twice).
    num_cpus: float = 1.0
    num_gpus: Optional[float] = None  # None: the job's cluster.num_nodes * cluster.gpus_per_node
    # "module:function" called with each job's composed config (without `hydra`) before any job starts, and with
    # `overrides=` the job's own overrides where it has a parameter of that name;
    # whatever it raises marks the job invalid and the sweep stops with exit code 2. It may return a mapping
    # {what: value} of things the job needs to itself (Relax: its checkpoint directory); jobs that share one are
    # invalid too. None: no check.
    precheck: Optional[str] = "relax.runner.sweep_check:check_sweep_job"  # what a single run checks before Ray
    # Ctrl-C: how long the running jobs get to stop as a single run does on Ctrl-C (finish the step, write its
    # checkpoint, mark the MLflow run KILLED) before they are killed; a second Ctrl-C kills them at once.
    stop_timeout_s: float = 120.0
    # Create the MLflow parent run (and the sqlite store) when the config has a `tracking` node.
    tracking: bool = True
    # Extra ray.init() keyword arguments for a local Ray instance (e.g. num_cpus).
    ray_init: dict[str, Any] = field(default_factory=dict)


ConfigStore.instance().store(group="hydra/launcher", name="relax_ray", node=RelaxRayLauncherConf,
                             provider="relax_ray_launcher")
