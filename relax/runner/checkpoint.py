"""Checkpoint directories: written under a temporary name, then renamed, so none is ever half-written.

Layout of `<save_dir>/step_000040/`: `policy/` (HF format, safetensors, plus optimizer and scheduler
state), `critic/` (PPO), `state.json` (step, data position). Generation and data order are derived
from (seed, step), so no other RNG state is needed to resume exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from relax.runner.errors import RunError

PREFIX = "step_"
STATE = "state.json"


def step_dir(save_dir: Path, step: int) -> Path:
    return save_dir / f"{PREFIX}{step:06d}"


def staging_dir(save_dir: Path, step: int) -> Path:
    path = save_dir / f".tmp-{PREFIX}{step:06d}"
    if path.exists():
        shutil.rmtree(path)  # left over from an interrupted save
    path.mkdir(parents=True)
    return path


def commit(staging: Path, final: Path, state: dict) -> Path:
    (staging / STATE).write_text(json.dumps(state, indent=2))
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    return final


def latest(save_dir: Path) -> Path | None:
    done = sorted(p for p in save_dir.glob(f"{PREFIX}*") if (p / STATE).is_file()) if save_dir.is_dir() else []
    return done[-1] if done else None


def find(resume: str | None, save_dir: Path) -> Path | None:
    """train.resume: None (fresh start), "auto" (latest in save_dir, fresh if none) or a directory."""
    if resume is None:
        return None
    if resume == "auto":
        return latest(save_dir)
    path = Path(resume)
    if not (path / STATE).is_file():
        found = latest(path)
        if found is None:
            raise RunError(f"train.resume={resume}: no checkpoint there (expected {STATE} or {PREFIX}* directories)")
        path = found
    return path


def read_state(path: Path) -> dict:
    return json.loads((path / STATE).read_text())
