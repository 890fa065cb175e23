"""enable_token_auth turns Ray's token authentication on for this process when a token is available, in the Ray
that is already imported: Ray's C++ config reads RAY_AUTH_MODE once, at `import ray`, and relax-train imports Ray
long before it joins a cluster. Checked with Ray's own view of the mode (`ray._raylet.get_authentication_mode`), in a
fresh interpreter. The join itself: tests/experiments/test_submit.py
(test_relax_train_and_a_sweep_join_a_token_cluster_with_the_token_file_alone)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import ray  # first, as relax-train does: Ray's config is read here
from ray._raylet import AuthenticationMode, get_authentication_mode
from relax.runner.ray_auth import enable_token_auth

before = get_authentication_mode() == AuthenticationMode.TOKEN
on = enable_token_auth()
print(before, on, get_authentication_mode() == AuthenticationMode.TOKEN)
"""


def _probe(tmp_path, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    base["HOME"] = str(tmp_path)  # no ~/.ray/auth_token of the user's
    proc = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.mark.parametrize("where", ["RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "~/.ray/auth_token"])
def test_a_token_turns_token_auth_on_in_the_imported_ray(tmp_path, where):
    token = tmp_path / "token"
    token.write_text("secret-token")
    if where == "~/.ray/auth_token":
        (tmp_path / ".ray").mkdir()
        (tmp_path / ".ray" / "auth_token").write_text("secret-token")
        env = {}
    else:
        env = {where: "secret-token" if where == "RAY_AUTH_TOKEN" else str(token)}
    assert _probe(tmp_path, **env) == "False True True"


def test_without_a_token_or_with_the_mode_set_nothing_changes(tmp_path):
    assert _probe(tmp_path) == "False False False"
    assert _probe(tmp_path, RAY_AUTH_MODE="disabled", RAY_AUTH_TOKEN="secret-token") == "False False False"
    assert _probe(tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="secret-token") == "True True True"
