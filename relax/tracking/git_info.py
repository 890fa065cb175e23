"""The code a run ran: git commit and dirty state of the Relax source tree and of the user's project, as run tags.

- `relax.git_commit`, `relax.git_dirty` (true | false): the git checkout Relax is imported from (found from
  `relax.__file__`; the package's files must be tracked there, so an installed copy inside another repository, e.g.
  a virtualenv in a project, does not count). Absent when Relax is not a git checkout (installed from a wheel).
- `relax.project_git_commit`, `relax.project_git_dirty`, `relax.project_git_root`: the git repository of the
  working directory (where relax-train was started: the user's rewards, data and configs), or of `$RELAX_PROJECT_DIR`
  where that is set (the recipe scripts set it to where they were started before running relax-train in EXP_DIR),
  when it is one and not Relax's own checkout.
- `mlflow.source.git.commit`: MLflow's tag for the commit of the code that ran (its UI shows it). MLflow sets it
  itself when the entry script lives in a git repository (a Python script of yours that starts the run); otherwise
  (relax-train, whose entry point is an installed script) it is set to Relax's commit.

Dirty means `git status --porcelain` lists something: changes to tracked files or untracked files that are not
ignored. A run from a dirty tree cannot be reproduced from its commit alone. Each question is one `git` call with a
timeout (`GIT_TIMEOUT_S`); without git, outside a repository, or when git fails or times out, the tags are left out
(and a dirty state that cannot be read is left out alone). Git's optional locks are off, so a concurrent git command
of the user never meets a lock taken by a run starting.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import relax

GIT_COMMIT_TAG = "relax.git_commit"
GIT_DIRTY_TAG = "relax.git_dirty"
PROJECT_GIT_COMMIT_TAG = "relax.project_git_commit"
PROJECT_GIT_DIRTY_TAG = "relax.project_git_dirty"
PROJECT_GIT_ROOT_TAG = "relax.project_git_root"
MLFLOW_GIT_COMMIT_TAG = "mlflow.source.git.commit"  # mlflow.utils.mlflow_tags.MLFLOW_GIT_COMMIT
GIT_TIMEOUT_S = 5.0
PROJECT_DIR_ENV = "RELAX_PROJECT_DIR"  # the project directory, where it is not the working directory


@dataclass(frozen=True)
class GitState:
    root: str  # the repository's top-level directory
    commit: str  # HEAD
    dirty: Optional[bool]  # None: `git status` failed or timed out


def _git(args: list[str], cwd: str | os.PathLike[str]) -> Optional[str]:
    """stdout of `git <args>` in `cwd`, or None if git is missing, fails or times out."""
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, errors="replace",
                             timeout=GIT_TIMEOUT_S, stdin=subprocess.DEVNULL,
                             env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})
    except (OSError, subprocess.SubprocessError, ValueError):  # no git, no such directory, timeout
        return None
    return out.stdout if out.returncode == 0 else None


def _head(path: str | os.PathLike[str]) -> Optional[tuple[str, str]]:
    """(top-level directory, HEAD commit) of the repository that holds `path`, or None."""
    out = _git(["rev-parse", "--show-toplevel", "HEAD"], path)
    lines = out.split("\n") if out is not None else []
    if len(lines) < 2 or not lines[0] or len(lines[1]) < 40:  # not a repository, or no commit yet
        return None
    return lines[0], lines[1]


def _state(root: str, commit: str) -> GitState:
    status = _git(["status", "--porcelain"], root)
    return GitState(root=root, commit=commit, dirty=None if status is None else bool(status.strip()))


def git_state(path: str | os.PathLike[str]) -> Optional[GitState]:
    """Commit and dirty state of the repository that holds `path` (a directory); None outside one (or without a
    commit yet, or without git)."""
    head = _head(path)
    return _state(*head) if head is not None else None


def relax_source_state() -> Optional[GitState]:
    """The git checkout Relax is imported from, or None (see the module docstring)."""
    package = Path(relax.__file__).resolve().parent
    head = _head(package)
    if head is None:
        return None
    if not _git(["ls-files", "--", "__init__.py"], package):  # an installed copy inside some repository
        return None
    return _state(*head)


def _tags(state: GitState, commit_tag: str, dirty_tag: str) -> dict[str, str]:
    tags = {commit_tag: state.commit}
    if state.dirty is not None:
        tags[dirty_tag] = "true" if state.dirty else "false"
    return tags


def git_tags(cwd: Optional[str | os.PathLike[str]] = None) -> dict[str, str]:
    """The git tags of a run started in `cwd` (default: `$RELAX_PROJECT_DIR`, else the current directory); see the
    module docstring.

    `mlflow.source.git.commit` is included (Relax's commit); the caller keeps MLflow's own if it has one.
    """
    tags: dict[str, str] = {}
    relax_state = relax_source_state()
    if relax_state is not None:
        tags.update(_tags(relax_state, GIT_COMMIT_TAG, GIT_DIRTY_TAG))
        tags[MLFLOW_GIT_COMMIT_TAG] = relax_state.commit
    try:
        project = git_state(cwd if cwd is not None else os.environ.get(PROJECT_DIR_ENV) or os.getcwd())
    except OSError:  # the working directory was removed
        project = None
    if project is not None and (relax_state is None or os.path.realpath(project.root)
                                != os.path.realpath(relax_state.root)):
        tags.update(_tags(project, PROJECT_GIT_COMMIT_TAG, PROJECT_GIT_DIRTY_TAG))
        tags[PROJECT_GIT_ROOT_TAG] = project.root
    return tags
