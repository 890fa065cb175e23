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
    environ = os.environ if environ is None else environ
    mode = environ.get("RAY_AUTH_MODE")
    if mode is not None:
        return mode.lower() == "token"
    path = environ.get("RAY_AUTH_TOKEN_PATH")
    has_token = bool(environ.get("RAY_AUTH_TOKEN")) or (bool(path) and Path(path).is_file()) or \
        (Path.home() / ".ray" / "auth_token").is_file()
    if has_token:
        environ["RAY_AUTH_MODE"] = "token"
    return has_token
