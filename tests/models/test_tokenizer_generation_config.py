"""`model.source=config` with `model.tokenizer` a Hugging Face directory stops on the eos ids of that directory's
generation_config.json, as a model directory's (`model.source=hf`) does (`relax.data.tokenizer.stop_token_ids`).
Checked by generation: a seeded sample of the tiny model through relax-serve's engine, with and without the file; the
extra eos id is a token the model generates without it, so with it the same answer ends right there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests

from relax.config import load_config
from relax.data.tokenizer import ModelFileError, build_tiny_tokenizer, load_tokenizer, stop_token_ids
from relax.serve.sglang.server import EmbeddedServer

PROMPT = [1, 20, 4, 5, 2, 1, 22, 6]
N = 12
SEED = 3  # a seeded sample draws the same tokens from every server (only a stop ends it earlier)


def generate(tokenizer_dir: Path) -> dict:
    """relax-serve's engine (in this process) on the tiny model with `model.tokenizer=tokenizer_dir`: one
    /generate of PROMPT, sampled at temperature 1 from the random stream of SEED."""
    server = EmbeddedServer(load_config(["model=tiny", "model.dtype=float32", f"model.tokenizer={tokenizer_dir}"]),
                            port=0, threads=1)
    server.start()
    try:
        server.wait_ready(120)
        sampling = {"temperature": 1.0, "sampling_seed": SEED, "max_new_tokens": N}
        return requests.post(f"{server.url}/generate", timeout=60,
                             json={"input_ids": PROMPT, "sampling_params": sampling}).json()
    finally:
        server.shutdown()


def test_a_tokenizer_directory_generation_config_eos_ends_a_response(tmp_path):
    tokenizer = build_tiny_tokenizer()
    tokenizer.save_pretrained(str(tmp_path))
    eos = tokenizer.eos_token_id
    free = generate(tmp_path)["output_ids"]
    assert len(free) == N and eos not in free  # it runs to the length limit: nothing stops it early
    # the extra eos: a token generated after the first one, at its first place
    extra = next(t for t in free[1:] if t not in (eos, free[0]))
    at = free.index(extra)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, extra]}))
    answer = generate(tmp_path)
    assert answer["output_ids"] == free[:at + 1]  # the same tokens, ending at the extra eos
    assert answer["meta_info"]["finish_reason"]["type"] == "stop"
    cfg = load_config(["model=tiny", f"model.tokenizer={tmp_path}"])
    assert stop_token_ids(cfg.model, load_tokenizer(cfg.model)) == tuple(sorted({eos, extra}))
    # an unreadable file is named, as a model directory's is
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelFileError, match=rf"model.tokenizer={tmp_path}: {tmp_path}/generation_config.json cannot "
                                             "be read"):
        stop_token_ids(cfg.model, load_tokenizer(cfg.model))
