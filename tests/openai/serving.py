"""relax-serve's engine server in the test process, for the OpenAI-route tests that need a real one over HTTP."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def tiny_server(directory: Path, tokenizer: Any, *overrides: str) -> Iterator[str]:
    """The tiny random-weight model (fp32, seed 3, 2048 positions) served with `tokenizer` (saved into `directory`),
    and the config `overrides`, on a free loopback port, ready: its URL; shut down after."""
    from relax.config import load_config
    from relax.serve.sglang.server import EmbeddedServer

    tokenizer.save_pretrained(directory)
    cfg = load_config(["model=tiny", "model.dtype=float32", f"model.tokenizer={directory}",
                       "model.max_position_embeddings=2048", "seed=3", *overrides])
    srv = EmbeddedServer(cfg, host="127.0.0.1", port=0, threads=1)
    srv.start()
    try:
        srv.wait_ready(120)
        yield f"http://127.0.0.1:{srv.port}"
    finally:
        srv.shutdown()
