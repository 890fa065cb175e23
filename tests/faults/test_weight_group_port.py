"""The weight-update group's rendezvous port (issue 44, "Waits without an end"): rank 0's store listens before the
servers are told its port, on one the kernel picked as it bound it, so no other process can take it in between."""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from relax.config import load_config
from relax.data.tokenizer import load_tokenizer
from relax.models.hf import build_model
from relax.rollout.sglang import broadcast_sync
from relax.rollout.sglang import process as process_module
from relax.rollout.sglang.client import post

pytestmark = pytest.mark.slow  # starts relax-serve

TINY = ["model=tiny", "model.dtype=float32"]


# ---------------------------------------------------------------------------- the weight-update group's port
@pytest.fixture(scope="module")
def relax_serve(tmp_path_factory) -> Iterator[str]:
    """relax-serve (the embedded engine's SGLang-compatible server) in its own process, the tiny model: its URL."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    # start_server: another port when the one picked free was taken before the server bound it (a run's own way)
    proc, port = process_module.start_server(
        lambda port: [sys.executable, "-m", "relax.cli.serve", "--port", str(port), "--threads", "1", *TINY],
        host="127.0.0.1", url_host="127.0.0.1", log_path=log, timeout_s=120, what="relax-serve")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process_module.stop_process(proc)


def test_the_weight_group_rendezvous_port_cannot_be_taken_before_rank_0_binds_it(relax_serve, monkeypatch):
    """Another process takes the port that was free when it was chosen, before rank 0's store binds it: the group
    still forms (rank 0 listens before the servers are told the port) and the weights arrive. Today's code told the
    servers the chosen port and then failed to bind it ("address already in use"), its servers waiting meanwhile on
    a port rank 0 does not hold."""
    url = relax_serve
    cfg = load_config(TINY)
    tok = load_tokenizer(cfg.model)
    state = build_model(cfg.model, len(tok), tok.pad_token_id, seed=5).state_dict()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # "another process took it": every port lookup the sender could make returns the one held here
        for module in (broadcast_sync, process_module):
            monkeypatch.setattr(module, "free_port", lambda host="127.0.0.1": port, raising=False)
        sync = broadcast_sync.BroadcastSync([url], master_address="127.0.0.1", backend="gloo", timeout_s=20)
        done: list[Any] = []
        pushing = threading.Thread(target=lambda: done.append(_push_or_error(sync, state)), daemon=True)
        pushing.start()
        pushing.join(60)
        try:
            assert not pushing.is_alive(), "the weight push did not end"
            assert done and not isinstance(done[0], BaseException), done
            assert post(url, "/get_weight_version", {})["weight_version"] == "11"
        finally:
            sync.close()


def _push_or_error(sync: broadcast_sync.BroadcastSync, state: dict[str, torch.Tensor]) -> Any:
    try:
        return sync.broadcast(state.items(), 11, bucket_bytes=1 << 20)
    except BaseException as exc:  # noqa: BLE001 - the test reports it
        return exc
