"""Fixtures of the OpenAI tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def engine():
    """The embedded engine's SGLang-compatible server with the tiny model (fp32), in this process: what the
    gateway tests send their /generate requests to."""
    from relax.config import load_config
    from relax.serve.sglang.server import EmbeddedServer

    server = EmbeddedServer(load_config(["model=tiny", "model.dtype=float32"]), port=0, threads=1)
    server.start()
    server.wait_ready(120)
    yield server
    server.shutdown()
