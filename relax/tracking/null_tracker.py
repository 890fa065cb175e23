"""The tracker of a run without tracking (`tracking.enabled=false`): `Tracker`'s interface, doing nothing, so that the
loop needs no `if`s."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional

from relax.tracking.inputs import DatasetRecord
from relax.tracking.run_options import DEFAULT_RUN_OPTIONS, RunOptions

if TYPE_CHECKING:
    from relax.config.schema import TrackingConfig

RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")  # how an MLflow run ends


class NullTracker:
    """The `Tracker` interface doing nothing, for `tracking.enabled=false`: the loop needs no `if`s."""

    def __init__(self) -> None:
        self.run_id: Optional[str] = None
        self.experiment_id: Optional[str] = None
        self.uri: Optional[str] = None
        self.status: Optional[str] = None
        self.nonfinite_counts: dict[str, int] = {}

    @classmethod
    def start(
        cls,
        tracking_cfg: Optional[TrackingConfig] = None,
        options: RunOptions = DEFAULT_RUN_OPTIONS,
        *,
        run_name: Optional[str] = None,
        tags: Optional[Mapping[str, str]] = None,
        params: Optional[Mapping[str, str]] = None,
        parent_run_id: Optional[str] = None,
    ) -> NullTracker:
        """Same signature as `Tracker.start` (`tracking_cfg` may be left out); opens nothing."""
        return cls()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_params(self, params: Mapping[str, str]) -> None:
        pass

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def log_artifact(self, path: str, artifact_path: Optional[str] = None) -> None:
        pass

    def set_tags(self, tags: Mapping[str, str]) -> None:
        pass

    def log_inputs(self, datasets: Sequence[DatasetRecord]) -> None:
        pass

    def flush(self) -> None:
        pass

    def finish(self, status: str = "FINISHED") -> None:
        if status not in RUN_STATUSES:
            raise ValueError(f"status must be one of {RUN_STATUSES}, got {status!r}")
        if self.status is None:
            self.status = status

    def ui_command(self) -> Optional[str]:
        return None

    def __enter__(self) -> NullTracker:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.finish("FINISHED")
        else:
            self.finish("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")
