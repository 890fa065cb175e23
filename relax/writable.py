"""Whether a directory can be written, tried rather than read from permission bits (which say yes to root and nothing
of a read-only filesystem): for the checks before anything starts, of the checkpoint directory
(`relax.runner.checkpoint`), of the MLflow sqlite store's directory (`relax.tracking.mlflow_run`) and of Hydra's
output directory (`relax.cli.train.output_dir_problem`).

Beside the layers (docs/design.md), with the standard library only: every layer may use it, and relax-train checks
Hydra's output directory before Hydra's main runs, where no torch is loaded.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def try_writing(directory: Path) -> None:
    """Create an empty file in `directory` and remove it (OSError if it cannot be created): whether the directory can
    be written is tried, not read from permission bits, which say yes to root and nothing of a read-only filesystem.
    The file is new by its unique name (O_EXCL) and empty, so nothing half-written can be left or clobbered."""
    path = directory / f".relax-probe-{uuid.uuid4().hex}"
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    os.unlink(path)


def nearest_existing(path: Path) -> Path:
    """`path` if it exists, else its nearest parent that does: where a directory that is not there yet would be
    created (a relative `path` ends at `.`, the working directory). It may be a file (not a directory)."""
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    return existing
