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


@pytest.fixture
def scripted_gateway():
    """make(fmt, texts) -> (gateway, script, session, client) over a scripted engine (tests/openai/scripted.py);
    every gateway closed after the test."""
    from tests.openai.scripted import ScriptedGateways

    gateways = ScriptedGateways()
    yield gateways.make
    gateways.close()


@pytest.fixture(scope="module")
def gateways():
    """The module's scripted gateways (`ScriptedGateways`: `.make(fmt, texts)`), closed after its last test."""
    from tests.openai.scripted import ScriptedGateways

    made = ScriptedGateways()
    yield made
    made.close()


@pytest.fixture(scope="module")
def smol():
    """The chat format of SmolLM2-135M-Instruct's tokenizer (the GGUF's) and its stop tokens."""
    from relax.config import load_config
    from relax.data.tokenizer import load_tokenizer, stop_token_ids
    from relax.serve.openai.chat import ChatFormat

    cfg = load_config(["model=smollm2_135m"])
    tok = load_tokenizer(cfg.model)
    return ChatFormat(tok, tuple(stop_token_ids(cfg.model, tok)))
