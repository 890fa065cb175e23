"""The embedded server's guards (issue 44, defect 3 c-e), over real HTTP to a real `EmbeddedServer` in this process:
which endpoints answer without the key (SGLang exempts only /health* and /metrics), the key checked before a body is
read, the body's size bounded, weights loaded only from the job's own directories, and shared memory mapped only
when the sender made it (another process's segment is refused, by the pid `/proc` says holds the connection)."""

from __future__ import annotations

import json
import multiprocessing
import socket
import time

import pytest
import requests
import torch

from relax.config import load_config
from relax.models import lora
from relax.rollout.sglang import wire
from relax.serve.sglang.server import EmbeddedServer

KEY = "k3y-for-tests"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 64 * 1024  # the test server's body limit
TINY = ["model=tiny", "model.dtype=float32"]
LORA = ["rollout=sglang", "rollout.sglang.server=embedded", "model=tiny", "model.lora_rank=4", "model.lora_alpha=8",
        "rollout.lora_sync=adapter", "model.dtype=float32"]
GENERATE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("job")


@pytest.fixture(scope="module")
def server(job_dir):
    """A keyed server with a 64 KiB body limit whose job directory is `job_dir`."""
    srv = EmbeddedServer(load_config(TINY), port=0, threads=1, api_key=KEY, max_body_bytes=LIMIT,
                         weight_dirs=(str(job_dir),))
    srv.start()
    srv.wait_ready(120)
    yield srv
    srv.shutdown()


def raw_request(port: int, head: str, body: bytes = b"", timeout: float = 20.0) -> tuple[int, str, float]:
    """Send `head` (request line and headers) and `body` on a fresh socket; (status, answer body, seconds until
    the answer came). The connection may announce more body than it sends: a server that reads the body first
    would wait for the rest."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head.encode() + b"\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        header, _, rest = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in header.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(rest) < length:
            chunk = s.recv(65536)
            if not chunk:
                break
            rest += chunk
    return int(header.split(b" ")[1]), rest.decode(errors="replace"), time.monotonic() - start


def test_information_endpoints_need_the_key_only_health_is_open(server):
    base = server.url
    for path in ("/health", "/health_generate"):
        assert requests.get(base + path, timeout=60).status_code == 200, path
    for path in ("/get_server_info", "/server_info", "/get_model_info", "/model_info", "/get_weight_version",
                 "/v1/models", "/get_load", "/v1/loads"):
        refused = requests.get(base + path, timeout=60)
        assert refused.status_code == 401, (path, refused.status_code, refused.text)
        assert requests.get(base + path, timeout=60, headers=AUTH).status_code == 200, path
    assert requests.post(base + "/generate", json=GENERATE, timeout=60, headers=AUTH).status_code == 200


def test_the_key_is_checked_before_the_body_is_read(server):
    # a client without the key announces a gigabyte and sends nothing of it: refused at once, not read
    status, body, took = raw_request(server.port, "POST /generate HTTP/1.1\r\nHost: x\r\n"
                                     "Content-Type: application/json\r\nContent-Length: 1000000000\r\n")
    assert status == 401 and "API key" in body
    assert took < 10


def test_a_body_over_the_limit_is_refused_with_413_before_it_is_read(server):
    status, body, took = raw_request(server.port, "POST /generate HTTP/1.1\r\nHost: x\r\n"
                                     f"Authorization: Bearer {KEY}\r\nContent-Length: 1000000000\r\n")
    assert status == 413 and f"limit of {LIMIT} bytes" in json.loads(body)["error"]["message"]
    assert took < 10
    # chunked: refused once the chunks pass the limit
    chunk = b"x" * (LIMIT // 2 + 1)
    chunks = b"".join(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" for _ in range(2)) + b"0\r\n\r\n"
    status, body, _ = raw_request(server.port, "POST /generate HTTP/1.1\r\nHost: x\r\n"
                                  f"Authorization: Bearer {KEY}\r\nTransfer-Encoding: chunked\r\n", chunks)
    assert status == 413
    # a body under the limit is served
    padded = {**GENERATE, "padding": "y" * (LIMIT // 2)}
    assert requests.post(server.url + "/generate", json=padded, timeout=60, headers=AUTH).status_code == 200


def _state(server) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in server.engine.model.state_dict().items()}


def test_weights_load_from_the_jobs_directories_only(server, job_dir, tmp_path):
    from safetensors.torch import save_file

    before = _state(server)
    changed = {k: v + 1.0 for k, v in before.items()}
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    save_file(changed, str(outside / "model.safetensors"))
    post = lambda path: requests.post(server.url + "/update_weights_from_disk",  # noqa: E731
                                      json={"model_path": str(path)}, headers=AUTH, timeout=60)
    refused = post(outside)
    assert refused.status_code == 400 and "not one of this job's directories" in refused.json()["message"]
    link = job_dir / "link-out"
    link.symlink_to(outside, target_is_directory=True)  # a link inside the job's directory leads out of it
    assert post(link).status_code == 400
    assert all(torch.equal(before[k], v) for k, v in _state(server).items())  # nothing was loaded
    inside = job_dir / "v1"
    inside.mkdir()
    save_file(changed, str(inside / "model.safetensors"))
    loaded = post(inside)
    assert loaded.status_code == 200, loaded.text
    assert all(torch.equal(changed[k], v) for k, v in _state(server).items())
    save_file(before, str(inside / "model.safetensors"))
    assert post(inside).status_code == 200


def test_adapters_load_from_the_jobs_directories_only(tmp_path):
    cfg = load_config(LORA)
    job = tmp_path / "job"
    job.mkdir()
    srv = EmbeddedServer(cfg, port=0, threads=1, weight_dirs=(str(job),))
    srv.start()
    try:
        srv.wait_ready(120)
        state = srv.engine.model.state_dict()
        adapters = {k: torch.full_like(state[k], 0.01) for k in srv.engine.adapter_keys}
        for directory in (tmp_path / "other", job / "v1"):
            lora.write_adapter_dir(directory, adapters, cfg.model)
        body = {"lora_name": "relax-v1", "lora_path": str(tmp_path / "other")}
        refused = requests.post(srv.url + "/load_lora_adapter", json=body, timeout=60)
        assert refused.status_code == 400 and "not one of this job's directories" in refused.json()["message"]
        assert srv.lora_name is None
        loaded = requests.post(srv.url + "/load_lora_adapter", json={**body, "lora_path": str(job / "v1")},
                               timeout=60)
        assert loaded.status_code == 200 and srv.lora_name == "relax-v1", loaded.text
    finally:
        srv.shutdown()


def _sender(conn, name: str, size: int) -> None:
    """Another process (forked: no second import of torch) that makes a segment and keeps it until told."""
    t = torch.full((size,), 7.0)
    conn.send(wire.serialize(wire.flatten_bucket([(name, t)])))
    conn.recv()


def test_shared_memory_of_another_process_is_refused(server):
    post = lambda payload: requests.post(  # noqa: E731
        server.url + "/update_weights_from_tensor", headers=AUTH, timeout=60,
        json={"serialized_named_tensors": [payload], "load_format": "flattened_bucket"})
    bias = next(k for k, v in server.engine.model.state_dict().items() if v.dim() == 1)  # a norm's weight
    size = server.engine.model.state_dict()[bias].numel()
    here, there = multiprocessing.get_context("fork").Pipe()
    sender = multiprocessing.get_context("fork").Process(target=_sender, args=(there, bias, size))
    sender.start()
    try:
        assert here.poll(60)
        foreign = here.recv()
        before = server.engine.model.state_dict()[bias].clone()
        refused = post(foreign)  # a segment made by the sender process, posted by this one
        assert refused.status_code == 400 and f"made by process {sender.pid}" in refused.json()["message"]
        assert torch.equal(server.engine.model.state_dict()[bias], before)
    finally:
        here.send("done")
        sender.join(30)
    own = torch.full((size,), 3.0)
    payload = wire.serialize(wire.flatten_bucket([(bias, own)]))  # made by this process, which sends it
    loaded = post(payload)
    assert loaded.status_code == 200, loaded.text
    assert torch.equal(server.engine.model.state_dict()[bias], own)
    restore = wire.serialize(wire.flatten_bucket([(bias, before)]))
    assert post(restore).status_code == 200


def test_the_training_gateway_refuses_a_body_over_the_limit_before_reading_it():
    from relax.serve.http import MAX_BODY_BYTES
    from relax.serve.openai.gateway import Gateway

    gateway = Gateway(None).start()  # the body is refused before any session or service is looked at
    try:
        status, body, took = raw_request(gateway.port, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                         f"Content-Length: {MAX_BODY_BYTES + 1}\r\n")
        assert status == 413 and f"limit of {MAX_BODY_BYTES} bytes" in json.loads(body)["error"]["message"]
        assert took < 10
    finally:
        gateway.close()


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("localhost", True), ("::1", True),
    ("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("2001:db8::1", False),
    ("no-such-host.invalid", False),  # does not resolve: never taken for loopback
])
def test_loopback_is_what_the_address_is_not_how_it_is_spelt(host, loopback):
    from relax.serve.http import is_loopback

    assert is_loopback(host) is loopback


def test_an_ipv6_loopback_server_binds_and_answers_without_a_key():
    """`relax-serve --host ::1` failed to bind (an AF_INET socket: "Address family for hostname not supported"): the
    server picks the family from the address, and ::1 is loopback, so no key is needed; its URL brackets the
    address. Control: bound to :: (every interface) without a key, it refuses the guarded endpoints."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    for host, open_ in (("::1", True), ("::", False)):
        srv = EmbeddedServer(load_config(TINY), host=host, port=0, threads=1)
        srv.start()
        try:
            srv.wait_ready(120)
            assert srv.url.startswith("http://[")
            url = srv.url if host == "::1" else f"http://[::1]:{srv.port}"
            assert requests.get(f"{url}/health", timeout=10).status_code == 200
            code = requests.get(f"{url}/get_model_info", timeout=10).status_code
            assert (code == 200) is open_, (host, code)
        finally:
            srv.shutdown()
