"""What a run's rendezvous stores listen on (issue 44, defect 3 a), as the operating system shows it
(`/proc/net/tcp`, `/proc/net/tcp6`): the address the ranks were given, not every interface."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from relax.models.rendezvous import free_port
from relax.rollout.sglang import wire

REPO = Path(__file__).resolve().parents[2]


def listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) of the sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            address, _, hexport = fields[1].partition(":")
            if fields[3] == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


LOOPBACK = "0100007F"  # 127.0.0.1 in /proc/net/tcp


def other_address() -> str | None:
    """An address of this machine other than loopback (None when it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_the_weight_update_groups_store_listens_on_its_address_only():
    port = free_port("127.0.0.1")
    group = wire.init_update_group("127.0.0.1", port, 0, 1, "security-test", "gloo", 30)
    try:
        assert listening(port) == {LOOPBACK}  # torch's own store: every interface ("::" or 0.0.0.0)
        if (address := other_address()) is not None:
            with socket.socket() as s:
                assert s.connect_ex((address, port)) != 0  # not reachable from another interface
    finally:
        wire.destroy_update_group(group)


def test_the_weight_senders_store_listens_on_its_address_only():
    """BroadcastSync's rank 0 (`wire.host_update_store`, a port the kernel picks as it binds)."""
    store, port = wire.host_update_store("127.0.0.1", 30)
    try:
        assert listening(port) == {LOOPBACK}
    finally:
        del store


def test_the_megatron_rank_0_holds_its_rendezvous_port_before_the_ranks_meet(monkeypatch):
    """The port rank 0 hands the other ranks is already its store's when they get it: no other process can take it
    between the choice and the bind (a port found free and bound a moment later could be lost)."""
    import ray.util

    from relax.roles.megatron_actor import MegatronRank

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    rank = object.__new__(MegatronRank)  # rendezvous alone: no process group, no model
    rank.world_size = 1
    address, port = rank.rendezvous()
    try:
        assert address == "127.0.0.1" and listening(port) == {LOOPBACK}
        with socket.socket() as s, pytest.raises(OSError):
            s.bind(("127.0.0.1", port))
    finally:
        rank.__dict__.pop("_store", None)  # the store closes its socket as it goes


MEGATRON_RANK = textwrap.dedent("""
    import sys
    from relax.train.megatron import parallel
    port = int(sys.argv[1])
    parallel.initialize(0, 1, master_addr="127.0.0.1", master_port=port, backend="gloo", timeout_s=60)
    print("READY", flush=True)
    sys.stdin.read()
    parallel.shutdown()
""")


@pytest.mark.slow  # megatron-core's import: seconds of CPU
def test_the_megatron_rendezvous_listens_on_the_master_address_only():
    port = free_port("127.0.0.1")
    rank = subprocess.Popen([sys.executable, "-c", MEGATRON_RANK, str(port)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert rank.stdout.readline().strip() == "READY"
        assert listening(port) == {LOOPBACK}
    finally:
        rank.stdin.close()
        assert rank.wait(120) == 0
