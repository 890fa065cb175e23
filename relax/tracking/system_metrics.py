"""MLflow's system metrics (CPU, memory, disk, network, GPU where one is visible) for a Relax run.

The values are collected and named by the monitors of MLflow's `SystemMetricsMonitor` (`mlflow.system_metrics.metrics`:
CPU and memory, disk, network, and NVIDIA GPUs when `nvidia-ml-py` is installed and a GPU is visible, else AMD ones
with `pyrsmi`), under MLflow's names (`system/cpu_utilization_percentage`, `system/gpu_0_utilization_percentage`, ...).
`SystemMetricsMonitor`'s own loop is not used: it writes straight to the store and, at the first store error, stops
for the rest of the run; it also reads the run from the store at every sample (and in older MLflow 3 releases it
reaches only the store of the global tracking URI). Here a daemon thread takes one sample every `interval_s` seconds and
hands it to the run's tracker (`Tracker.log_system_metrics`), so the values go through the same buffered writes as
the training metrics, and through the spool during an outage.

A sample is the mean over the interval for CPU utilization (psutil's since the previous sample), the current value
for the others. The step of a sample is its index in the run (0, 1, 2, ...; a reopened run continues after the last
one), as with MLflow's own monitor; MLflow's UI plots them against time. `stop` joins the thread and takes one last
sample (the time since the previous one), so every run with system metrics has at least one; a sample that does not
return (a monitor that hangs) is waited for at most `stop`'s `timeout_s` (the tracker's bound, `CLOSE_JOIN_S`).

The values are those of the machine that runs the tracker (the driver of relax-train): on a multi-node cluster,
other nodes are not covered. `MLFLOW_SYSTEM_METRICS_NODE_ID` inserts a node name (`system/<node>/...`), as in MLflow.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable, Mapping
from typing import Any, Optional

from relax.metrics import SYSTEM_PREFIX

logger = logging.getLogger(__name__)

THREAD_NAME = "relax-system-metrics"
NODE_ID_ENV = "MLFLOW_SYSTEM_METRICS_NODE_ID"  # MLflow's: a node name between the prefix and the metric's name
_NVIDIA_DRIVER = "/proc/driver/nvidia/version"
_BASE_MONITORS = ("cpu_monitor.CPUMonitor", "disk_monitor.DiskMonitor", "network_monitor.NetworkMonitor")
_GPU_MONITORS = ("gpu_monitor.GPUMonitor", "rocm_monitor.ROCMMonitor")  # the first that starts, as MLflow does


class SystemMetrics:
    """Samples MLflow's system metrics every `interval_s` seconds in a daemon thread and passes each sample to
    `log(metrics, step)` with steps `first_step`, `first_step + 1`, ...

    `start` starts the thread; `stop` (idempotent) ends it and logs a last sample. A sample that fails (a monitor's
    error) is skipped with one warning for the run; `log` itself must not raise for a store outage (the tracker's
    write path spools).
    """

    def __init__(self, log: Callable[[Mapping[str, float], int], None], interval_s: float, *,
                 first_step: int = 0) -> None:
        if not interval_s > 0:
            raise ValueError(f"the system metrics interval must be > 0 seconds, got {interval_s}")
        self.monitors = _monitors()
        self.has_gpu_monitor = len(self.monitors) > len(_BASE_MONITORS)
        node = os.environ.get(NODE_ID_ENV)
        self._prefix = SYSTEM_PREFIX + (f"{node}/" if node else "")
        self._log = log
        self.interval_s = float(interval_s)
        self.step = first_step  # the step of the next sample
        self.samples = 0  # logged by this object
        self._failed = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._stopped = False
        self._sample_lock = threading.Lock()
        if not self.has_gpu_monitor and _nvidia_driver_present():
            logger.warning("system metrics: no GPU metrics, MLflow's GPU monitor did not start (it needs nvidia-ml-py: "
                           "pip install nvidia-ml-py); CPU, memory, disk and network are recorded")
        self._collect()  # the first CPU reading starts psutil's interval; the first sample covers the time from here

    @property
    def alive(self) -> bool:
        """Whether the sampling thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> SystemMetrics:
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()
        return self

    def stop(self, *, last_sample: bool = True, timeout_s: Optional[float] = None) -> bool:
        """End the thread, then log a last sample unless `last_sample=False`. The thread is joined for at most
        `timeout_s` (None: until it ends): one still inside a sample then (a monitor's reading or the write of its
        values that does not return) is left behind, a daemon, with a warning that says so, and the last sample is
        not taken (it would wait on the same call). True when the thread ended."""
        if self._stopped:
            return True
        self._stopped = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("system metrics: the sampling thread did not stop within %g s: a sample it took (a "
                               "monitor's reading or the write of its values) did not return; it is left behind, "
                               "and the last sample is not taken (the %d samples logged before are kept)", timeout_s,
                               self.samples)
                return False
        if last_sample:
            self.sample()
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def _collect(self) -> dict[str, float]:
        """One reading of every monitor, as SystemMetricsMonitor takes it (collect, aggregate, clear)."""
        values: dict[str, float] = {}
        for monitor in self.monitors:
            monitor.collect_metrics()
            values.update(monitor.aggregate_metrics())
            monitor.clear_metrics()
        return {self._prefix + k: float(v) for k, v in values.items()}

    def sample(self) -> None:
        """Collect one sample and log it at the next step; a failure is skipped (one warning for the run)."""
        with self._sample_lock:
            try:
                values = self._collect()
                if not values:
                    return
                self._log(values, self.step)
            except Exception as exc:
                if not self._failed:
                    self._failed = True
                    logger.warning("system metrics: a sample failed and is skipped (%s: %s); sampling goes on (this "
                                   "warning is not repeated)", type(exc).__name__, exc)
                return
            self.step += 1
            self.samples += 1


def _monitor_class(name: str) -> Any:
    import importlib

    module, cls = name.rsplit(".", 1)
    return getattr(importlib.import_module(f"mlflow.system_metrics.metrics.{module}"), cls)


def _monitors() -> list[Any]:
    """The monitors SystemMetricsMonitor starts with: CPU (and memory), disk, network, and a GPU one if one starts."""
    monitors = [_monitor_class(name)() for name in _BASE_MONITORS]
    for name in _GPU_MONITORS:
        try:
            monitors.append(_monitor_class(name)())  # ImportError without its library, RuntimeError without a GPU
            break
        except Exception:
            continue
    return monitors


def _nvidia_driver_present() -> bool:
    """An NVIDIA driver on this machine (cheap: no library is loaded)."""
    return os.path.exists(_NVIDIA_DRIVER) or shutil.which("nvidia-smi") is not None
