"""The local layer spec's norm (`SequenceParallelRMSNorm`) under CPU bf16 autocast, as a Megatron run with
model.dtype=bfloat16 (or auto on a bf16 CPU) runs it: fp32 weights, bf16 activations. It normalizes in fp32 and
returns bf16, the values a hand-computed RMSNorm gives (and the ones torch's own mixed-dtype fallback gave), without
torch's "Mismatch dtype between input and weight ... Cannot dispatch to fused implementation" warning on the
console. In fp32 it is torch's RMSNorm unchanged."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from types import SimpleNamespace

import torch

from relax.train.megatron.model import SequenceParallelRMSNorm

EPS = 1e-6


def _norm(hidden: int = 64) -> SequenceParallelRMSNorm:
    norm = SequenceParallelRMSNorm(SimpleNamespace(sequence_parallel=False), hidden, eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, hidden))
    return norm


def test_under_bf16_autocast_it_normalizes_in_fp32_and_returns_bf16_as_by_hand():
    torch.manual_seed(0)
    norm = _norm()
    x = (torch.randn(16, 64) * 3).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm(x)
    assert y.dtype == torch.bfloat16
    x64, w64 = x.double(), norm.weight.detach().double()
    hand = x64 / torch.sqrt((x64 ** 2).mean(-1, keepdim=True) + EPS) * w64
    assert torch.allclose(y.double(), hand, rtol=2 ** -8, atol=0)  # within one bf16 rounding of the exact value
    with warnings.catch_warnings():  # (the reference is the warning's own path)
        warnings.simplefilter("ignore")
        fallback = torch.rms_norm(x, (64,), norm.weight, EPS)
    assert torch.equal(y, fallback)  # torch's mixed-dtype fallback, bit for bit


def test_in_fp32_it_is_torchs_rmsnorm():
    norm = _norm()
    x = torch.randn(4, 64)
    assert torch.equal(norm(x), torch.rms_norm(x, (64,), norm.weight, EPS))


def test_no_mixed_dtype_warning_in_a_fresh_process():
    """torch warns of the mismatch once per process, so a fresh one shows whether the norm would print it."""
    code = textwrap.dedent("""
        import torch
        from types import SimpleNamespace
        from relax.train.megatron.model import SequenceParallelRMSNorm
        norm = SequenceParallelRMSNorm(SimpleNamespace(sequence_parallel=False), 64, eps=1e-6)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = norm(torch.nn.Linear(64, 64)(torch.randn(8, 64)))  # bf16 activations, as the layers' are
        y.float().sum().backward()
        print(y.dtype, norm.weight.grad.dtype)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["torch.bfloat16", "torch.float32"]
    assert "Mismatch dtype" not in out.stderr, out.stderr
