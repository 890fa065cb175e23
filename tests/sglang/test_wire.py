"""The weight-update wire formats: flattened buckets, the serialized payloads, the restricted unpickler, and the
update process group (two processes broadcasting over gloo, beside a default process group and without one)."""

from __future__ import annotations

import base64
import dataclasses
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import types
from collections import OrderedDict
from pathlib import Path

import psutil
import pytest
import torch

from relax.rollout.sglang import wire
from tests.ports import free_ports

pytestmark = pytest.mark.slow  # starts processes (tests/README.md)

REPO = Path(__file__).resolve().parents[2]


def named_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(5, 3, generator=g)),
        ("bf16", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("half", torch.randn(2, 2, generator=g).half()),
        ("int64", torch.arange(6).reshape(2, 3)),
        ("bool", torch.tensor([True, False, True])),
        ("scalar", torch.tensor(3.5)),
        ("strided", torch.randn(4, 6, generator=g).t()),  # not contiguous
    ]


def same(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> bool:
    return [n for n, _ in a] == [n for n, _ in b] and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for (_, x), (_, y) in zip(a, b, strict=True))


def test_flatten_unflatten_round_trip_keeps_names_dtypes_shapes_values():
    named = named_tensors()
    flat = wire.flatten_bucket(named)
    t = flat["flattened_tensor"]
    assert t.dtype == torch.uint8 and t.dim() == 1
    meta = flat["metadata"]
    assert [m.name for m in meta] == [n for n, _ in named]
    assert all(m.numel == m.end_idx - m.start_idx == x.numel() * x.element_size() for m, (_, x) in zip(
        meta, named, strict=True))
    # each tensor starts at the next multiple of ALIGN_BYTES (so that it can be viewed as its dtype)
    assert meta[0].start_idx == 0 and all(b.start_idx == -(-a.end_idx // wire.ALIGN_BYTES) * wire.ALIGN_BYTES
                                          for a, b in zip(meta, meta[1:], strict=False))
    assert t.numel() == meta[-1].end_idx
    assert same(wire.unflatten_bucket(flat), named)


def test_empty_unaligned_and_bad_buckets():
    flat = wire.flatten_bucket([])
    assert flat["flattened_tensor"].numel() == 0 and wire.unflatten_bucket(flat) == []
    with pytest.raises(ValueError, match="flattened_tensor"):
        wire.unflatten_bucket({"flattened_tensor": torch.zeros(3), "metadata": []})
    packed = torch.cat([torch.ones(1, dtype=torch.uint8), torch.arange(3, dtype=torch.int32).view(torch.uint8)])
    unaligned = {"flattened_tensor": packed, "metadata": [wire.FlattenedTensorMetadata(
        name="i", shape=torch.Size([3]), dtype=torch.int32, start_idx=1, end_idx=13, numel=12)]}
    assert torch.equal(wire.unflatten_bucket(unaligned)[0][1], torch.arange(3, dtype=torch.int32))
    bad = wire.flatten_bucket([("x", torch.zeros(4))])
    bad["metadata"][0].end_idx = 99
    with pytest.raises(ValueError, match="x: bytes"):
        wire.unflatten_bucket(bad)


def test_buckets_respect_the_size_and_give_a_large_tensor_its_own():
    tensors = [("a", torch.zeros(10)), ("b", torch.zeros(10)), ("big", torch.zeros(100)), ("c", torch.zeros(5))]
    groups = list(wire.buckets(tensors, 80))  # 40 bytes per small tensor
    assert [[n for n, _ in g] for g in groups] == [["a", "b"], ["big"], ["c"]]
    assert [[n for n, _ in g] for g in wire.buckets(tensors, 10_000)] == [["a", "b", "big", "c"]]
    assert list(wire.buckets([], 10)) == []
    with pytest.raises(ValueError):
        list(wire.buckets(tensors, 0))


def test_serialize_deserialize_round_trip_in_process():
    strategy = torch.multiprocessing.get_sharing_strategy()
    named = named_tensors()
    payload = wire.serialize(wire.flatten_bucket(named))
    assert isinstance(payload, str)
    obj = wire.deserialize(payload)
    assert isinstance(obj["metadata"][0], wire.FlattenedTensorMetadata)
    assert same(wire.unflatten_bucket(obj), named)
    plain = [("p", torch.nn.Parameter(torch.ones(3))), ("empty", torch.empty(0)),
             ("od", OrderedDict(a=torch.arange(3)))]
    back = wire.deserialize(wire.serialize(plain))
    assert isinstance(back[0][1], torch.nn.Parameter) and back[1][1].numel() == 0
    assert torch.equal(back[2][1]["a"], torch.arange(3))
    assert torch.multiprocessing.get_sharing_strategy() == strategy  # file_system only during the dump


def test_an_unrelated_process_reads_the_tensors_through_shared_memory():
    """The receiver is not a child of the sender: file_system sharing, no multiprocessing authkey."""
    named = named_tensors()
    flat = wire.flatten_bucket(named)
    payload = wire.serialize(flat)
    code = ("import sys, torch; from relax.rollout.sglang import wire; "
            "obj = wire.deserialize(sys.stdin.read()); "
            "print(';'.join(f'{n}:{t.double().sum().item():.6f}' for n, t in wire.unflatten_bucket(obj)))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    expected = ";".join(f"{n}:{t.double().sum().item():.6f}" for n, t in named)
    assert out.stdout.strip() == expected
    del flat  # the sender keeps its tensors alive until the receiver answered


def _share_with_a_stopped_manager(stop_s: float, retry_s: tuple, queue) -> None:
    """In a fresh process (a manager that once timed out answers later and leaves its late answers queued, so a
    second stop in one process would not be felt): stop this process's torch_shm_manager for `stop_s`, as a loaded
    machine delays it, and share the test's tensors."""
    wire.SHM_MANAGER_RETRY_S = retry_s
    pauses = []
    wire.time.sleep = lambda s, real=wire.time.sleep: (pauses.append(s), real(s))
    wire.serialize(torch.zeros(1))  # torch starts the manager on first use
    mine = [p for p in psutil.Process().children() if p.name() == "torch_shm_manager"]
    if not mine:
        queue.put(("error", "torch started no shared-memory manager"))
        return
    pid = mine[0].pid
    os.kill(pid, signal.SIGSTOP)
    timer = threading.Timer(stop_s, os.kill, (pid, signal.SIGCONT))
    timer.start()
    named = named_tensors()
    try:
        payload = wire.serialize(wire.flatten_bucket(named))
    except RuntimeError as exc:
        queue.put(("error", str(exc).splitlines()[0]))
        return
    finally:
        timer.cancel()
        os.kill(pid, signal.SIGCONT)
    queue.put(("ok", pauses, same(wire.unflatten_bucket(wire.deserialize(payload)), named)))


def _in_a_fresh_process(stop_s: float, retry_s: tuple) -> tuple:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_share_with_a_stopped_manager, args=(stop_s, retry_s, queue))
    proc.start()
    try:
        return queue.get(timeout=120)
    finally:
        proc.join(30)


def test_a_shared_memory_manager_that_times_out_is_retried():
    """The manager (a real one, stopped for 2.5 s) misses torch's 1 s deadline: the share waits and succeeds."""
    result = _in_a_fresh_process(2.5, wire.SHM_MANAGER_RETRY_S)
    assert result[0] == "ok", result
    _, pauses, equal = result
    assert pauses, "the manager answered at once: the test did not make it time out"
    assert equal


def test_a_shared_memory_manager_that_never_answers_fails_with_a_message():
    result = _in_a_fresh_process(30, (0.1,))
    assert result[0] == "error", result
    assert "torch_shm_manager" in result[1] and "did not answer in 2 tries" in result[1]
    assert "weight_sync=distributed" in result[1]


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo unpickled",))


@pytest.mark.parametrize("obj, refused", [
    ([_Evil()], "system"),
    ({"f": eval}, "builtins.eval"),
    ([("x", getattr)], "builtins.getattr"),
    ([torch.zeros(2)], "torch.storage._load_from_bytes"),  # a tensor pickled the plain way (torch.load inside)
])
def test_the_restricted_unpickler_refuses_other_globals(obj, refused):
    payload = base64.b64encode(pickle.dumps(obj)).decode()
    with pytest.raises(pickle.UnpicklingError, match=f"refused global .*{refused}"):
        wire.deserialize(payload)


def test_with_sglang_importable_buckets_carry_sglangs_metadata_class_which_unpickles_as_ours(monkeypatch):
    """A sender with sglang installed pickles SGLang's class (a real server can load it); we read it as ours."""
    parts = wire.SGLANG_METADATA_MODULE.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    fake = dataclasses.make_dataclass("FlattenedTensorMetadata", [f.name for f in dataclasses.fields(
        wire.FlattenedTensorMetadata)])
    fake.__module__ = wire.SGLANG_METADATA_MODULE
    sys.modules[wire.SGLANG_METADATA_MODULE].FlattenedTensorMetadata = fake
    named = named_tensors()[:3]
    flat = wire.flatten_bucket(named)
    assert type(flat["metadata"][0]) is fake
    payload = wire.serialize(flat)
    assert wire.SGLANG_METADATA_MODULE.encode() in base64.b64decode(payload)
    obj = wire.deserialize(payload)
    assert type(obj["metadata"][0]) is wire.FlattenedTensorMetadata
    assert same(wire.unflatten_bucket(obj), named)


def test_a_payload_may_name_only_shared_memory_segments_torch_made(tmp_path):
    """The handle of a CPU tensor is the name of its segment in /dev/shm; a payload naming any other file there (one
    of another program, say) is refused before anything is opened."""
    import re

    tensor = torch.arange(6, dtype=torch.float32)
    data = base64.b64decode(wire.serialize([("w", tensor)]))
    name = re.search(rb"/torch_\d+_\d+_\d+", data).group()
    other = b"/other" + name[len(b"/other"):]  # same length: the pickle stays well-formed
    with pytest.raises(pickle.UnpicklingError, match="refused shared-memory segment"):
        wire.deserialize(base64.b64encode(data.replace(name, other)))
    assert torch.equal(wire.deserialize(base64.b64encode(data))[0][1], tensor)  # the real name still loads


def test_not_base64_is_a_value_error():
    with pytest.raises(ValueError, match="base64"):
        wire.deserialize("not base64 !!")


def _member(port: int, rank: int, queue, default_port: int) -> None:
    if rank == 0:  # a trainer has its own default group (alone in it here); the update group forms beside it
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{default_port}", rank=0,
                                             world_size=1)
    group = wire.init_update_group("127.0.0.1", port, rank, 2, "relax_test_group", "gloo", 60)
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3) if rank == 0 else torch.zeros(2, 3)
    torch.distributed.broadcast(tensor, src=0, group=group)
    bf16 = torch.full((4,), 1.5, dtype=torch.bfloat16) if rank == 0 else torch.zeros(4, dtype=torch.bfloat16)
    torch.distributed.broadcast(bf16, src=0, group=group)
    queue.put((rank, tensor.tolist(), bf16.float().tolist(), torch.distributed.is_initialized()))
    wire.destroy_update_group(group)
    if rank == 0:
        torch.distributed.destroy_process_group()


def test_two_processes_broadcast_through_an_update_group_with_and_without_a_default_group():
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port, default_port = free_ports(2)
    procs = [ctx.Process(target=_member, args=(port, rank, queue, default_port)) for rank in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=90) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert [p.exitcode for p in procs] == [0, 0]
    for rank, tensor, bf16, default_group in results:
        assert tensor == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
        assert bf16 == [1.5] * 4
        assert default_group is (rank == 0)
