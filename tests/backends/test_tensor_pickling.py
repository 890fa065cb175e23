"""relax.roles.tensor_pickling: CPU tensors through Ray's own pickler (protocol 5, out-of-band buffers, as Ray calls
serialize their arguments and results) arrive equal, with their dtype and shape, writable and in memory of their own;
what it does not handle keeps torch's pickling."""

import pickle

import pytest
import torch
from ray import cloudpickle

from relax.roles import tensor_pickling


@pytest.fixture()
def installed():
    before = cloudpickle.CloudPickler.dispatch.get(torch.Tensor)
    tensor_pickling.install()
    yield
    if before is None:
        cloudpickle.CloudPickler.dispatch.pop(torch.Tensor, None)
    else:
        cloudpickle.CloudPickler.dispatch[torch.Tensor] = before


def _round_trip(obj):
    """As Ray sends an object: cloudpickle, protocol 5, buffers out of band (read-only on the other side)."""
    buffers: list[pickle.PickleBuffer] = []
    data = cloudpickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    received = [memoryview(bytes(b.raw())) for b in buffers]  # the receiver's copy: immutable bytes
    return pickle.loads(data, buffers=received), len(buffers)


CASES = {
    "float32": torch.randn(4, 3),
    "bfloat16": torch.randn(2, 5).to(torch.bfloat16),
    "float16": torch.randn(3).to(torch.float16),
    "int64": torch.arange(12).reshape(3, 4),
    "int32": torch.tensor([[-1, 2], [3, -4]], dtype=torch.int32),
    "uint8": torch.tensor([0, 255, 7], dtype=torch.uint8),
    "bool": torch.tensor([True, False, True]),
    "complex64": torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
    "scalar": torch.tensor(3.5),
    "empty": torch.zeros(0, 4),
    "strided view": torch.arange(20.0).reshape(4, 5)[:, 1:4].t(),
    "slice of a big storage": torch.arange(1000)[10:13],
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_cpu_tensor_arrives_equal_out_of_band_and_writable(installed, name):
    sent = CASES[name]
    got, n_buffers = _round_trip({"x": sent})
    got = got["x"]
    assert type(got) is torch.Tensor and got.dtype == sent.dtype and got.shape == sent.shape
    assert torch.equal(got, sent)
    assert n_buffers == 1  # the bytes travel beside the pickle, not inside it
    if got.numel():
        got.view(-1)[0] = got.view(-1)[-1]  # writable: not a view of Ray's (read-only) buffer
    assert got.untyped_storage().nbytes() == got.numel() * got.element_size()  # its own elements, not the storage


def test_the_bytes_of_a_view_are_its_own_elements_only(installed):
    big = torch.arange(1_000_000)  # 8 MB of storage, of which the view holds 24 bytes
    buffers: list[pickle.PickleBuffer] = []
    data = cloudpickle.dumps(big[10:13], protocol=5, buffer_callback=buffers.append)
    assert len(data) + sum(b.raw().nbytes for b in buffers) < 1000
    del cloudpickle.CloudPickler.dispatch[torch.Tensor]  # the control: torch's pickling ships the whole storage
    assert len(cloudpickle.dumps(big[10:13], protocol=5)) > 8_000_000


def test_what_it_does_not_handle_keeps_torchs_pickling(installed):
    grad = torch.ones(3, requires_grad=True)
    got, n_buffers = _round_trip(grad)
    assert got.requires_grad and torch.equal(got, grad)
    assert n_buffers == 0  # torch's pickling: in band
    param = torch.nn.Parameter(torch.ones(2))  # torch's reduction, whose plain data tensor may travel out of band
    got, _ = _round_trip(param)
    assert type(got) is torch.nn.Parameter and got.requires_grad and torch.equal(got, param)


def test_without_install_tensors_travel_in_band():
    """The negative control: Ray's pickler without the reduction writes the storage into the pickle."""
    before = cloudpickle.CloudPickler.dispatch.pop(torch.Tensor, None)
    try:
        _, n_buffers = _round_trip(torch.randn(4, 3))
        assert n_buffers == 0
    finally:
        if before is not None:
            cloudpickle.CloudPickler.dispatch[torch.Tensor] = before
