"""WeightBuffers: the actor's weights as byte arrays, equal bit for bit after the trip, shipped out of band."""

from __future__ import annotations

import pickle

import pytest
import torch

from relax.models.weight_buffers import WeightBuffers, as_state_dict
from relax.rollout.embedded import EmbeddedEngine
from tests.backends.test_rollout_embedded import PAD, PROMPTS, tiny_model


def mixed_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(7, 5, generator=g)
    return {
        "embed.weight": emb,
        "lm_head.weight": emb,  # tied: the same tensor under two names
        "bf16": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "transposed": torch.randn(4, 6, generator=g).t(),  # not contiguous
        "scalar": torch.tensor(2.5),
        "ids": torch.arange(5, dtype=torch.int64),
        "empty": torch.zeros(0, 3),
    }


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert torch.equal(got[name], value), name


def test_round_trip_keeps_names_dtypes_shapes_and_bits():
    state = mixed_state()
    wb = WeightBuffers.of(state)
    assert_same(wb.tensors(), state)
    assert wb.slots[0] == wb.slots[1] and len(wb.arrays) == len(state) - 1  # the tied weight travels once
    assert wb.nbytes == sum(t.numel() * t.element_size() for k, t in state.items() if k != "lm_head.weight")


def test_contiguous_tensors_are_not_copied_on_the_sender():
    state = mixed_state()
    wb = WeightBuffers.of(state)
    assert wb.arrays[wb.slots[0]].ctypes.data == state["embed.weight"].data_ptr()
    assert wb.arrays[wb.slots[2]].ctypes.data == state["bf16"].data_ptr()


def test_pickle_protocol_5_ships_every_array_out_of_band():
    """What Ray's serializer does: the pickle itself holds the names and shapes, the bytes go as buffers."""
    state = {f"w{i}": torch.randn(256, 256) for i in range(4)}
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(WeightBuffers.of(state), protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 4 and len(payload) < 4096
    assert_same(pickle.loads(payload, buffers=buffers).tensors(), state)


def test_an_engine_loads_them_like_the_state_dict():
    source = tiny_model(seed=1).state_dict()
    a = EmbeddedEngine(tiny_model(), eos_token_ids=[], pad_token_id=PAD)
    b = EmbeddedEngine(tiny_model(), eos_token_ids=[], pad_token_id=PAD)
    a.load_weights(source, version=1)
    b.load_weights(as_state_dict(WeightBuffers.of(source)), version=1)
    assert_same(b.model.state_dict(), a.model.state_dict())
    out_a = a.generate(PROMPTS, max_new_tokens=5, temperature=0.0, seed=0)
    out_b = b.generate(PROMPTS, max_new_tokens=5, temperature=0.0, seed=0)
    assert torch.equal(out_a.response_ids, out_b.response_ids)


def test_as_state_dict_passes_a_state_dict_through():
    state = mixed_state()
    assert as_state_dict(state) is state


def test_weights_on_a_gpu_are_refused():
    meta = torch.empty(2, device="meta")
    with pytest.raises(ValueError, match="w is on meta"):
        WeightBuffers.of({"w": meta})


@pytest.mark.slow
def test_through_ray_the_receiver_reads_the_object_store_in_place(ray_local):
    ray = ray_local

    @ray.remote(num_cpus=0)
    class Sender:
        def __init__(self, state: dict[str, torch.Tensor]):
            self.state = state

        def weights(self) -> WeightBuffers:
            return WeightBuffers.of(self.state)

        def change(self) -> None:
            self.state["embed.weight"].add_(1.0)  # after the call returned: the shipped weights keep their values

    sender = Sender.remote(mixed_state())
    ref = sender.weights.remote()
    ray.get(sender.change.remote())
    got = ray.get(ref)
    assert_same(got.tensors(), mixed_state())
    # read-only arrays: views of the store's shared memory, not a copy the deserializer made
    assert all(not a.flags.writeable for a in got.arrays if a.nbytes > 0)
