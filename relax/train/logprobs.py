"""Response-token log-probs without [N, T, V] fp32 tensors: a chunked linear + log-softmax + gather.

`response_logprobs` gives what `relax.models.hf.token_logprobs` defines (log p of each response token under
`softmax(logits / temperature)`, and the entropy of that distribution), but never holds the logits of more than
one chunk of tokens (`chunk_rows(V)`, ~64 MiB of fp32 logits) at once, in the forward or in the backward:

- the decoder (`model.get_decoder()`) runs once over prompt+response with the same position ids as the unchunked
  path; only the final hidden states h of positions P-1 .. P+T-2 at valid response tokens go further;
- `LinearLogSoftmax` takes h [M, H] and the lm_head weight W [V, H] (tied to the input embedding or not) and, per
  chunk of rows, computes z = (h @ W^T) in the matmul dtype, upcast to fp32, / temperature, its log-softmax,
  log p(target), lse = logsumexp(z) (= z[target] - log p(target)) and, when asked, the entropy -sum p log p (the
  same operations as the unchunked path, on a slice). It saves only h, the targets, lse and the entropy (a few
  numbers per token); the backward recomputes each chunk's z and applies

      dL/dz = g_logp * (onehot(target) - p) - g_ent * p * (log p + entropy),   log p = z - lse

  (the entropy's gradient w.r.t. the scaled logits is -p * (log p + entropy)), divides by the temperature and
  accumulates dL/dh = dL/dz @ W and dL/dW += dL/dz^T @ h chunk by chunk. The recomputation is one more
  [M, H] x [H, V] matmul than autograd's path; the [M, V] log-softmax, its gradient and their copies are gone.

Entropy: "metric" is computed in the same chunks of the forward and detached; "grad" (an entropy bonus, i.e.
`algorithm.entropy_coef > 0`) is supported by the same function: its gradient is the second term above, in the
same backward pass (no fallback).

Precision: under `torch.autocast` the matmul runs in the autocast dtype (bf16) and its output is upcast to fp32,
exactly as the Hugging Face `lm_head` under autocast followed by `.float()` (log-probs and entropies come out
identical to the unchunked path's); in the backward dL/dz is cast to that dtype for both matmuls, as autograd
does through the autocast cast. dL/dW is accumulated over chunks in fp32 (the unchunked bf16 path rounds the
whole product to bf16 once; here each chunk's product is rounded once): gradients differ by bf16 rounding
(measured <= 0.3% of a parameter's gradient norm, while bf16 itself is ~1-3% from fp32; see
tests/backends/test_chunked_logprobs.py). Without autocast the matmul runs in the weight's dtype (fp32: equal to
the unchunked path to ~1e-6). Everything after the matmul is fp32.

Which models: those whose logits are exactly `lm_head(decoder(...).last_hidden_state)` with a bias-free linear
head, no logit soft-capping or scaling: the Hugging Face Llama, Qwen2, Qwen3 and Mistral causal LMs (Relax's
`source=config` Qwen3 and the Llama of SmolLM2's GGUF among them), used as they are (not a subclass, no
instance-level `forward`, no forward hooks on the top-level module, which the decoder call would bypass). Any
other model takes the unchunked `relax.models.hf.response_logprobs_all` path: same results, more memory.

Masked response positions (right padding) are not computed at all: they hold 0 (log-prob and entropy) and get
no gradient.

`forward_logprobs` is the trainers' one call per micro-batch: the micro-batch laid out by `relax.train.packing`
(trimmed, or packed), under the compute precision (`autocast`), into `response_logprobs` or `packed_logprobs`.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch

from relax.batch import Samples
from relax.models.hf import entropy_from_logprobs, fp32_compute, response_hidden_states, response_logprobs_all
from relax.models.vision import is_vision_model, vision_response_logprobs
from relax.train.packing import Packed, pack, trimmed_sequences

# Logits per chunk (rows x vocabulary): 2^24, i.e. 64 MiB per fp32 [rows, V] work tensor (341 rows of SmolLM2's
# V = 49152). Smaller chunks recompute the head in more, smaller matmuls (slower); larger ones hold more memory.
# This budget bounds the head's memory whatever the micro-batch size (the choice is measured in
# docs/performance.md, "Actor memory").
CHUNK_ELEMENTS = 2**24


def chunk_rows(vocab_size: int) -> int:
    """Rows (tokens) per chunk for a vocabulary: CHUNK_ELEMENTS // vocab_size, at least 16."""
    return max(16, CHUNK_ELEMENTS // max(1, vocab_size))


# the causal LMs whose forward is `logits = lm_head(model(...).last_hidden_state[kept positions])`, nothing else
_PLAIN_HEAD_CLASSES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                                 "Qwen3MoeForCausalLM"})  # (MoE: without output_router_logits)
# config fields that, when set, post-process the logits in some architectures (Gemma 2, Cohere, Granite, ...)
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_softcapping", "logit_scale", "logits_scaling",
                     "output_multiplier_scale")


def chunked_head(model: torch.nn.Module) -> Optional[tuple[torch.nn.Module, torch.Tensor]]:
    """(decoder, lm_head weight [V, H]) when `model`'s logits are exactly `decoder(...).last_hidden_state @ W^T`
    and nothing observes its forward; None otherwise (then only the unchunked path gives the same results)."""
    cls = type(model)
    if cls.__name__ not in _PLAIN_HEAD_CLASSES or not cls.__module__.startswith("transformers.models."):
        return None
    if "forward" in vars(model) or model._forward_hooks or model._forward_pre_hooks:
        return None
    config = getattr(model, "config", None)
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or head._forward_hooks or head._forward_pre_hooks:
        return None
    return model.get_decoder(), head.weight


def matmul_dtype(device_type: str, weight: torch.Tensor) -> torch.dtype:
    """The dtype `lm_head` multiplies in: the autocast dtype when autocast is on for the device, else the weight's."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 after a bf16/fp16/fp32 matmul (fp64 stays fp64, which the gradient checks use)."""
    return torch.promote_types(dtype, torch.float32)


class _Buffers:
    """[chunk, V] work tensors reused by every chunk of one forward or backward (fewer fresh pages to fault in):
    `z` in the output dtype, `aux` (optional) likewise, `low` in the matmul dtype when that is lower."""

    def __init__(self, rows: int, vocab: int, dtype: torch.dtype, device: torch.device, aux: bool) -> None:
        out = _out_dtype(dtype)
        self.z = torch.empty(rows, vocab, dtype=out, device=device)
        self.aux = torch.empty(rows, vocab, dtype=out, device=device) if aux else None
        self.low = torch.empty(rows, vocab, dtype=dtype, device=device) if dtype != out else None

    def logits(self, h: torch.Tensor, w: torch.Tensor, dtype: torch.dtype, temperature: float) -> torch.Tensor:
        """(h @ w^T) / temperature of one chunk: the matmul in `dtype` (w is in it already), upcast, in `z`."""
        c = h.shape[0]
        z = self.z[:c]
        if self.low is None:
            torch.mm(h.to(dtype), w.t(), out=z)
        else:
            low = self.low[:c]
            torch.mm(h.to(dtype), w.t(), out=low)
            z.copy_(low)
        if temperature != 1.0:
            z.div_(temperature)
        return z


class LinearLogSoftmax(torch.autograd.Function):
    """(log p(target) [M], entropy [M] or an empty tensor) of `softmax((hidden @ weight^T) / temperature)`, fp32,
    computed `chunk` rows at a time; see the module docstring for the math and what is saved."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int, dtype: torch.dtype, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        M = hidden.shape[0]
        logp = torch.empty(M, dtype=_out_dtype(dtype), device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        buf = _Buffers(min(chunk, M), weight.shape[0], dtype, hidden.device, aux=False)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for s in range(0, M, chunk):
                e = min(M, s + chunk)
                z = buf.logits(hidden[s:e], w, dtype, temperature)
                lp_all = torch.log_softmax(z, dim=-1)
                t = targets[s:e, None]
                lp = lp_all.gather(1, t).squeeze(1)
                logp[s:e] = lp
                lse[s:e] = z.gather(1, t).squeeze(1) - lp  # logsumexp(z), read off the target's column
                if with_entropy:  # -sum p log p, as entropy_from_logprobs, with z as scratch
                    ent[s:e] = torch.exp(lp_all, out=z).mul_(lp_all).sum(-1).neg_()
                del lp_all
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp: Optional[torch.Tensor], g_ent: Optional[torch.Tensor]):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if g_ent is not None and ent.numel() == 0:
            g_ent = None
        if (g_logp is None and g_ent is None) or not (need_h or need_w):
            return None, None, None, None, None, None, None
        temperature, chunk, dtype = ctx.temperature, ctx.chunk, ctx.dtype
        M = hidden.shape[0]
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=_out_dtype(dtype), device=weight.device) if need_w else None
        buf = _Buffers(min(chunk, M), weight.shape[0], dtype, hidden.device, aux=g_ent is not None)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for s in range(0, M, chunk):
                e = min(M, s + chunk)
                grad = buf.logits(hidden[s:e], w, dtype, temperature)
                grad.sub_(lse[s:e, None])  # log p
                if g_ent is not None:  # -p * (g_logp + g_ent * (log p + entropy))
                    p = torch.exp(grad, out=buf.aux[: e - s])
                    grad.add_(ent[s:e, None]).mul_(g_ent[s:e, None])
                    if g_logp is not None:
                        grad.add_(g_logp[s:e, None])
                    grad.mul_(p).neg_()
                else:  # -p * g_logp
                    grad.exp_().mul_(g_logp[s:e, None].neg())
                if g_logp is not None:  # + g_logp at the target
                    grad.scatter_add_(1, targets[s:e, None], g_logp[s:e, None])
                if temperature != 1.0:  # d(z / temperature)
                    grad.div_(temperature)
                if buf.low is not None:  # as autograd casts the gradient through the autocast cast
                    grad = buf.low[: e - s].copy_(grad)
                h = hidden[s:e].to(dtype)
                if need_h:
                    if grad_h.dtype == grad.dtype:
                        torch.mm(grad, w, out=grad_h[s:e])
                    else:
                        grad_h[s:e] = torch.mm(grad, w)
                if need_w:
                    if grad_w.dtype == grad.dtype:
                        grad_w.addmm_(grad.t(), h)
                    else:
                        grad_w.add_(torch.mm(grad.t(), h))
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None, None


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                    entropy: bool = False, chunk_size: Optional[int] = None,
                    dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(log p(targets) [M], entropy [M] or None) of `softmax((hidden @ weight^T) / temperature)`, fp32, in chunks of
    `chunk_size` rows (default `chunk_rows(V)`). hidden [M, H], weight [V, H], targets [M]; `dtype`: the matmul's
    (default: `matmul_dtype`)."""
    if chunk_size is None:
        chunk_size = chunk_rows(weight.shape[0])
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    if dtype is None:
        dtype = matmul_dtype(hidden.device.type, weight)
    logp, ent = LinearLogSoftmax.apply(hidden, weight, targets, float(temperature), int(chunk_size), dtype,
                                       entropy)
    return logp, (ent if entropy else None)


def response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_start: int,
    response_len: int,
    *,
    temperature: float = 1.0,
    entropy: str = "none",
    chunk_size: Optional[int] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(log p(response token) [N, T] fp32, entropy [N, T] fp32 or None) of `softmax(logits / temperature)`.

    Inputs as `relax.models.hf.token_logprobs` takes them ([N, P+T], prompt left-padded, response
    right-padded from column P = `response_start`). entropy: "grad" (with a gradient) | "metric" (detached) |
    "none". Masked response positions hold 0. Runs under the caller's autocast/grad mode. Chunked (see the module
    docstring; `chunk_size` rows, default `chunk_rows(V)`) when `chunked_head(model)` allows it, else the unchunked
    `response_logprobs_all`.
    """
    if entropy not in ("none", "metric", "grad"):
        raise ValueError(f"entropy={entropy!r}: expected none, metric or grad")
    P, T = response_start, response_len
    head = chunked_head(model)
    if head is None:
        return _unchunked(model, input_ids, attention_mask, P, T, temperature, entropy)
    if P < 1:
        raise ValueError("token_logprobs needs at least one prompt column (response_start >= 1)")
    if input_ids.shape[1] != P + T:
        raise ValueError(f"input_ids has {input_ids.shape[1]} columns, expected response_start+response_len={P + T}")
    decoder, weight = head
    hidden = response_hidden_states(decoder, input_ids, attention_mask, P, T)  # [N, T, H]
    N, H = hidden.shape[0], hidden.shape[-1]
    targets = input_ids[:, P:]
    valid = attention_mask[:, P:] != 0
    every = bool(valid.all())
    h = hidden.reshape(N * T, H) if every else hidden[valid]
    tgt = targets.reshape(N * T) if every else targets[valid]
    logp_v, ent_v = linear_logprobs(h, weight, tgt, temperature=temperature, entropy=entropy != "none",
                                    chunk_size=chunk_size, dtype=matmul_dtype(input_ids.device.type, weight))
    if entropy == "metric":
        ent_v = ent_v.detach()

    def place(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if x is None:
            return None
        return x.view(N, T) if every else x.new_zeros(N, T).masked_scatter(valid, x)

    return place(logp_v), place(ent_v)


def _unchunked(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, P: int, T: int,
               temperature: float, entropy: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`response_logprobs` through the [N, T, V] log-softmax of `response_logprobs_all` (any causal LM)."""
    logp_all = response_logprobs_all(model, input_ids, attention_mask, P, T, temperature)
    valid = attention_mask[:, P:] != 0
    logp = logp_all.gather(-1, input_ids[:, P:].unsqueeze(-1)).squeeze(-1).masked_fill(~valid, 0.0)
    if entropy == "grad":
        return logp, entropy_from_logprobs(logp_all).masked_fill(~valid, 0.0)
    if entropy == "metric":
        with torch.no_grad():
            return logp, entropy_from_logprobs(logp_all.detach()).masked_fill(~valid, 0.0)
    return logp, None


def packed_logprobs(model: torch.nn.Module, packed: Packed, *, temperature: float = 1.0, entropy: str = "none",
                    chunk_size: Optional[int] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`response_logprobs` of a packed micro-batch (`relax.train.packing`): (log p [N, T], entropy [N, T] or
    None), T = `packed.response_len`; the same values up to float rounding, without computing any padding."""
    if entropy not in ("none", "metric", "grad"):
        raise ValueError(f"entropy={entropy!r}: expected none, metric or grad")
    head = chunked_head(model)
    if head is not None:
        decoder, weight = head
        out = decoder(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
        h = out.last_hidden_state[0, packed.before]
        logp_v, ent_v = linear_logprobs(h, weight, packed.targets, temperature=temperature,
                                        entropy=entropy != "none", chunk_size=chunk_size,
                                        dtype=matmul_dtype(packed.input_ids.device.type, weight))
    else:  # any causal LM: the logits at the response positions, then the log-softmax of response_logprobs_all
        logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits
        logp_all = torch.log_softmax(logits[0, packed.before].float() / temperature, dim=-1)
        logp_v = logp_all.gather(-1, packed.targets.unsqueeze(-1)).squeeze(-1)
        ent_v = entropy_from_logprobs(logp_all) if entropy != "none" else None
    if entropy == "metric":
        ent_v = ent_v.detach()
    return packed.place(logp_v), (packed.place(ent_v) if ent_v is not None else None)


def autocast(device: torch.device, compute_dtype: torch.dtype):
    """bf16 autocast when the compute dtype is bf16, else nothing (fp32)."""
    if compute_dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=compute_dtype)


def forward_logprobs(model: torch.nn.Module, mb: Samples, *, device: torch.device, compute_dtype: torch.dtype,
                     temperature: float, entropy: str = "none",
                     packed: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor], int]:
    """(logp [B, T'], entropy [B, T'] or None, T') of a micro-batch: the trainers' forward, under the compute
    precision (`autocast`).

    The micro-batch as `relax.train.packing` lays it out: trimmed of all-padding columns (`trimmed_sequences`), into
    `response_logprobs`; with `packed` (train.pack_sequences) as one packed sequence without padding (`pack`), into
    `packed_logprobs`. Log-probs of `softmax(logits / temperature)`, the rollout's sampling distribution. entropy:
    "grad" (with a gradient) | "metric" (detached) | "none". Masked positions hold 0; the values are those of
    `relax.models.hf.token_logprobs` up to float rounding. The modules the model's class keeps in fp32 (the routers
    of DeepSeek-V3 / GLM-4.5) compute in fp32 under bf16 autocast, as the rollout engine's do (`fp32_compute`).
    """
    if compute_dtype != torch.float32:
        fp32_compute(model, compute_dtype)
    if mb.vision is not None or is_vision_model(model):  # the model's own multimodal forward (relax.models.vision)
        if packed:  # one row without padding, each sequence's own 3-D positions (relax.train.vision_packing)
            from relax.train.vision_packing import packed_vision_logprobs

            with autocast(device, compute_dtype):
                return packed_vision_logprobs(model, mb, device, temperature=temperature, entropy=entropy)
        ids, mask, P, T = trimmed_sequences(mb)
        rows = mb.vision if mb.vision is not None else [None] * len(mb)
        with autocast(device, compute_dtype):
            logp, ent = vision_response_logprobs(model, ids.to(device), mask.to(device), rows, P, T,
                                                 temperature=temperature, entropy=entropy)
        return logp, ent, T
    if packed:
        p = pack(mb).to(device)
        with autocast(device, compute_dtype):
            logp, ent = packed_logprobs(model, p, temperature=temperature, entropy=entropy)
        return logp, ent, p.response_len
    ids, mask, P, T = trimmed_sequences(mb)
    ids, mask = ids.to(device), mask.to(device)
    with autocast(device, compute_dtype):
        logp, ent = response_logprobs(model, ids, mask, P, T, temperature=temperature, entropy=entropy)
    return logp, ent, T
