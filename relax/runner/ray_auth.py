"""Ray's token authentication for a driver that joins a cluster (relax-train with cluster.address, relax-submit)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def enable_token_auth(environ: Optional[dict[str, str]] = None) -> bool:
    """Send Ray's auth token when one is available (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token).

    Ray's client only attaches the token with RAY_AUTH_MODE=token; a user who has a token most likely
    means to use it, so it is turned on unless RAY_AUTH_MODE is set explicitly. Returns whether it is on.
    """
    own = environ is None
    environ = os.environ if environ is None else environ
    mode = environ.get("RAY_AUTH_MODE")
    if mode is not None:
        return mode.lower() == "token"
    path = environ.get("RAY_AUTH_TOKEN_PATH")
    has_token = bool(environ.get("RAY_AUTH_TOKEN")) or (bool(path) and Path(path).is_file()) or \
        (Path.home() / ".ray" / "auth_token").is_file()
    if has_token:
        environ["RAY_AUTH_MODE"] = "token"
        if own:
            _refresh_ray_config()
    return has_token


def _refresh_ray_config() -> None:
    """Make this process's Ray read RAY_AUTH_MODE again. Ray's C++ config caches the environment when ray is first
    imported (relax-train imports it long before it joins a cluster), so the variable alone leaves ray.init
    sending no token; Ray refreshes it the same way when it turns token auth on for a local instance
    (ray._private.authentication.authentication_token_setup._enable_token_auth)."""
    try:
        from ray._raylet import Config
    except ImportError:  # no Ray here: nothing cached, its import will read the variable
        return
    Config.initialize("")
