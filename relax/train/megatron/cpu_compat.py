"""Run megatron-core on CPU processes (gloo): redirect the few CUDA-only call sites it has, nothing else.

megatron-core 0.16.1 trains on CPU with the local (non-Transformer-Engine) layer spec, except for a handful of
call sites that name CUDA outright. `enable()`:
- replaces the module-global `torch` of exactly the modules in `REDIRECTED_MODULES` by `_TorchOnCpu`, which
  forwards every attribute to torch except `torch.cuda.current_device()` (-> the CPU device),
  `torch.cuda.synchronize()` (-> no-op), CUDA streams (`Stream()`, `current_stream()`, `stream(...)` -> one stream
  that does nothing: CPU work is complete when issued), tensor factories called with `device="cuda"` (-> CPU) and
  `torch.autocast("cuda", ...)` (-> CPU autocast);
- replaces `clip_grad_by_total_norm_fp32` where the optimizer imported it by the same in-place scaling without
  its assertion that gradients are `torch.cuda.FloatTensor`s;
- while (and only while) the constructor of the distributed optimizer or of the bf16/fp16 optimizer wrapper
  runs, makes `torch.Tensor.type()` of a CPU tensor answer with the CUDA name those constructors check for;
- while `LanguageModule.setup_embeddings_and_output_layer` runs (tied embeddings with PP > 1), makes
  `tensor.cuda()` return the tensor itself;
- gives the all-to-all token dispatcher (MoE) its split sizes as NumPy arrays, as its device-to-host copy does on a GPU
  (`moe_utils.maybe_move_tensor_to_cpu` copies CUDA tensors only; `all_to_all_single` takes no tensor of sizes);
- makes the CUDA RNG state that activation recompute saves and restores around each recomputed layer
  (`tensor_parallel.random._get_cuda_rng_state` / `_set_cuda_rng_state`) an empty one: there is no CUDA generator
  (the CPU generator's state is still saved and restored by megatron-core itself);
- gives the autograd Functions in `AUTOCAST_FUNCTIONS` the CPU autocast state in their backward that their forward
  ran under, as `torch.amp.custom_fwd` / `custom_bwd` do on a GPU (bf16 autocast, model.dtype=bfloat16 or "auto" on a
  CPU with native bf16): megatron-core decorates its linear layers' Functions with `device_type="cuda"`, so on a CPU
  their backward ran outside autocast and multiplied a bf16 gradient by an fp32 weight ("expected m1 and m2 to have
  the same dtype"). Those are re-decorated with `device_type="cpu"` (the undecorated forward/backward is their
  `__wrapped__`); the router's gating Function and activation recompute's CheckpointFunction, which have no
  decorator, get one. With autocast off (fp32) the decorators change nothing.

Nothing is changed when CUDA is available: GPU runs use megatron-core untouched. `CALL_SITES` records, per
redirected module, how many lines match `CUDA_PATTERN` in the pinned megatron-core; tests/megatron compares it
with the installed sources, so an upgrade that adds or moves one fails a test instead of failing on a GPU-less
machine at run time.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch

# module -> number of lines matching CUDA_PATTERN in megatron-core 0.16.1 (checked by tests/megatron).
CALL_SITES: dict[str, int] = {
    "megatron.core.models.common.embeddings.rotary_pos_embedding": 3,  # inv_freq on torch.cuda.current_device()
    # GlobalMemoryBuffer (the attention's matmul buffer) on torch.cuda.current_device(), and 9 sites off the CPU
    # path (symmetric memory, NVTX/straggler tools, a packed-sequence helper, a parameter-hash check)
    "megatron.core.utils": 10,
    "megatron.core.transformer.utils": 2,  # default causal / sliding-window masks on "cuda"
    # total_num_tokens = torch.zeros(..., device="cuda"); torch.autocast("cuda", ...) when enable_autocast
    "megatron.core.pipeline_parallel.schedules": 4,
    "megatron.core.pipeline_parallel.p2p_communication": 8,  # shape tensors, torch.cuda.synchronize() (PP > 1)
    # grad/param buffers on torch.cuda.current_device(); a communication stream (overlap_grad_reduce only: off)
    "megatron.core.distributed.param_and_grad_buffer": 5,
    # loss-scale / overflow buffers on 'cuda'; Float16OptimizerWithFloat16Params.__init__'s tensor-type checks;
    # two `.cuda()` calls off the CPU path (CPU-offload helpers)
    "megatron.core.optimizer.optimizer": 9,
    # DistributedOptimizer.__init__'s tensor-type checks, its buffers on torch.cuda.current_device(); a
    # `.cuda()` in the DP-zero state gather (not used: checkpoints use the per-rank dp-reshardable state)
    "megatron.core.optimizer.distrib_optimizer": 6,
    # setup_embeddings_and_output_layer's weight.data.cuda() (made a no-op while it runs; see enable())
    "megatron.core.models.common.language_module.language_module": 1,
    # norm / zero-count buffers on 'cuda' (redirected) and the 'torch.cuda.FloatTensor' assertion (replaced)
    "megatron.core.optimizer.clip_grads": 6,
    # sequence parallelism: the all-gather / reduce-scatter buffers along the sequence (5 sites), and those of the
    # column-parallel linear's gathered input and its backward (8, of which the weight-gradient fusion's are off
    # the CPU path: gradient_accumulation_fusion=False)
    "megatron.core.tensor_parallel.mappings": 5,
    "megatron.core.tensor_parallel.layers": 8,
    # MoE (model.arch=qwen3_moe): the router moves its weight to torch.cuda.current_device() at every gating (and
    # builds its expert-bias / global aux-loss buffers there, not used); the all-to-all token dispatcher makes a
    # CUDA stream for its device-to-host copies of the split sizes, compares it with the current stream, waits on
    # it and enters it (4 sites; on CPU a stream that does nothing: the sizes are CPU tensors already)
    "megatron.core.transformer.moe.router": 6,
    "megatron.core.transformer.moe.token_dispatcher": 4,
}
REDIRECTED_MODULES: tuple[str, ...] = tuple(CALL_SITES)
# Modules the CPU runs load whose CUDA call sites stay as they are, with their counts (as CALL_SITES): none of these
# sites runs on the CPU path (one that ran would raise "Torch not compiled with CUDA enabled" in tests/megatron's
# TP=2, DP=2 and PP=2 runs). tests/megatron checks that every megatron.core module those runs load is in
# CALL_SITES or here, with its count: a new site anywhere on the path fails a test instead of a user's run.
UNREDIRECTED_SITES: dict[str, int] = {
    # imported by the packages Relax uses, never called: async checkpoint saving, FSDP, Transformer Engine, FP8,
    # fused MoE kernels, inference contexts, the NCCL allocator, CUDA graphs, YaRN, multi-token prediction, MoE
    "megatron.core.dist_checkpointing.strategies.async_utils": 3,
    "megatron.core.distributed.fsdp.mcore_fsdp_adapter": 1,
    "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp": 6,
    "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision": 1,
    "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer": 21,
    "megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor": 1,
    "megatron.core.distributed.fsdp.src.megatron_fsdp.utils": 3,
    "megatron.core.extensions.transformer_engine": 3,
    "megatron.core.fp8_utils": 2,
    "megatron.core.fusions.fused_indices_converter": 4,
    "megatron.core.inference.batch_dimensions_utils": 1,
    "megatron.core.inference.contexts.attention_context.mamba_metadata": 4,
    "megatron.core.inference.contexts.attention_context.mha_metadata": 1,
    "megatron.core.inference.contexts.dynamic_block_allocator": 2,
    "megatron.core.inference.contexts.dynamic_context": 20,
    "megatron.core.inference.unified_memory": 4,
    "megatron.core.inference.utils": 1,
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding": 3,
    "megatron.core.nccl_allocator": 7,
    "megatron.core.pipeline_parallel.combined_1f1b": 2,
    "megatron.core.pipeline_parallel.hybrid_cp_schedule": 2,
    "megatron.core.transformer.cuda_graphs": 2,
    # MoE: the legacy GroupedMLP's buffers (CPU runs build SequentialMLP), the aux-loss metrics tracker and the copy
    # of a CUDA tensor to the host (a CPU tensor is returned as it is)
    "megatron.core.transformer.moe.experts": 2,
    "megatron.core.transformer.moe.moe_utils": 2,
    # CUDA streams of features not used: shared experts' overlap (Qwen3-MoE has no shared experts), the hybrid
    # CPU-offloading optimizer, fine-grained activation offloading
    "megatron.core.transformer.moe.shared_experts": 8,
    "megatron.core.optimizer.cpu_offloading.hybrid_optimizer": 9,
    "megatron.core.pipeline_parallel.fine_grained_activation_offload": 14,
    "megatron.core.transformer.multi_token_prediction": 2,
    # used, on paths the CPU runs do not take: DDP's overlapped communication stream and memory-freeing helpers
    # (overlap_grad_reduce=False), the NCCL groups' barriers (gloo here), GPU weight initialisation
    # (use_cpu_initialization=True), CUDA RNG seeding (dropout: not used;
    # activation recompute's RNG states go through the replaced functions of _RNG), the broadcast of data (Relax
    # gives each rank its batch), loss scaling (fp16 only), timers and the rerun state machine (not enabled), the
    # MTP/inference branches of GPTModel and of attention, the layer's CUDA-graph and offloading branches
    "megatron.core.distributed.distributed_data_parallel": 5,
    "megatron.core.parallel_state": 5,
    "megatron.core.tensor_parallel.random": 2,
    "megatron.core.tensor_parallel.utils": 2,
    "megatron.core.tensor_parallel.data": 3,
    "megatron.core.pipeline_parallel.utils": 4,
    "megatron.core.optimizer.grad_scaler": 5,
    "megatron.core.timers": 3,
    "megatron.core.rerun_state_machine": 7,
    "megatron.core.models.gpt.gpt_model": 1,
    "megatron.core.transformer.attention": 1,
    "megatron.core.transformer.dot_product_attention": 2,
    "megatron.core.transformer.module": 1,
    "megatron.core.transformer.transformer_layer": 2,
}
# Autograd Functions (module -> class names) whose forward and backward are decorated with
# torch.amp.custom_fwd / custom_bwd(device_type="cpu") by enable(): their backward then runs under the CPU autocast
# state their forward saw. tests/megatron checks that every autograd Function of every megatron.core module the CPU
# runs load is here or in AUTOCAST_NEUTRAL, and that every one megatron-core decorates itself is here.
AUTOCAST_FUNCTIONS: dict[str, tuple[str, ...]] = {
    # the column/row-parallel linears' matmuls (custom_fwd/custom_bwd with device_type="cuda" in 0.16.1): forward
    # in bf16 under autocast, backward `grad_output.matmul(weight)` (bf16 x fp32 weight) needs autocast too
    "megatron.core.tensor_parallel.layers": ("LinearWithFrozenWeight",
                                             "LinearWithGradAccumulationAndAsyncCommunication"),
    # MoE: the router's gating linear (no decorator): its torch.mm is bf16 under autocast (as Hugging Face's router
    # F.linear is), its backward's torch.mm(grad_output, weight) is the same bf16 x fp32 product
    "megatron.core.transformer.moe.moe_utils": ("RouterGatingLinearFunction",),
    # activation recompute (model.gradient_checkpointing; no decorator): the backward runs the layer's forward again,
    # which must be under the autocast of the first forward (as torch.utils.checkpoint restores it), not in fp32
    "megatron.core.tensor_parallel.random": ("CheckpointFunction",),
}
# The other autograd Functions of the megatron.core modules the CPU runs load, audited as indifferent to autocast:
# no autocast-eligible op (matmul, linear, mm) in their backward, or not run on the CPU path at all.
AUTOCAST_NEUTRAL: dict[str, tuple[str, ...]] = {
    # communication only (copies, all-reduce, gathers, scatters, all-to-all): the gradient keeps the dtype it has
    "megatron.core.tensor_parallel.mappings": (
        "_CopyToModelParallelRegion", "_ReduceFromModelParallelRegion", "_ScatterToModelParallelRegion",
        "_GatherFromModelParallelRegion", "_ScatterToSequenceParallelRegion", "_GatherFromSequenceParallelRegion",
        "_ReduceScatterToSequenceParallelRegion", "_AllGatherFromTensorParallelRegion",
        "_ReduceScatterToTensorParallelRegion", "_AllToAll"),
    "megatron.core.utils": ("MakeViewlessTensor",),  # a view-free alias, gradient passed through
    # the aux-loss scaler (the router z-loss and the load-balancing loss: its backward passes the gradient through and
    # gives the loss a constant) and a straight-through estimator (not used by the router Relax sets)
    "megatron.core.transformer.moe.moe_utils": ("MoEAuxLossAutoScaler", "RandomSTE"),
    # selective recompute of single modules (Relax uses full recompute: CheckpointFunction)
    "megatron.core.tensor_parallel.random": ("CheckpointWithoutOutputFunction",),
    # not run on the CPU path: fusions (bias_activation_fusion, masked_softmax_fusion, apply_rope_fusion and the MoE
    # fusions are off; Relax computes log-probs itself, not with megatron-core's vocab-parallel cross entropy),
    # FSDP, fine-grained activation offloading, CUDA graphs, DeepEP / HybridEP dispatch, multi-token prediction
    "megatron.core.fusions.fused_bias_geglu": ("BiasGeGLUFunction", "GeGLUFunction", "WeightedQuickGeGLUFunction",
                                               "WeightedBiasQuickGeGLUFunction"),
    "megatron.core.fusions.fused_bias_gelu": ("GeLUFunction",),
    "megatron.core.fusions.fused_bias_swiglu": ("BiasSwiGLUFunction", "SwiGLUFunction", "WeightedSwiGLUFunction"),
    "megatron.core.fusions.fused_cross_entropy": ("_VocabParallelCrossEntropy",),
    "megatron.core.fusions.fused_indices_converter": ("IndicesToMultihot",),
    "megatron.core.fusions.fused_mla_yarn_rope_apply": ("ApplyMLARotaryEmbQ", "ApplyMLARotaryEmbKV"),
    "megatron.core.fusions.fused_softmax": ("ScaledUpperTriangMaskedSoftmax", "ScaledMaskedSoftmax", "ScaledSoftmax"),
    "megatron.core.fusions.fused_weighted_squared_relu": ("WeightedSquaredReLUFunction",),
    "megatron.core.tensor_parallel.cross_entropy": ("_VocabParallelCrossEntropy",),
    "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp": ("RegisterFSDPBackwardFunction",),
    "megatron.core.pipeline_parallel.fine_grained_activation_offload": (
        "FineGrainedOffloadingGroupCommitFunction", "FineGrainedOffloadingGroupStartFunction",
        "FineGrainedOffloadingBackwardRecordFunction"),
    "megatron.core.transformer.cuda_graphs": ("_CudagraphRecordNode", "_CudagraphReplayNode"),
    "megatron.core.transformer.moe.fused_a2a": ("FusedDispatch", "FusedCombine", "HybridEPDispatch",
                                                "HybridEPCombine"),
    "megatron.core.transformer.multi_token_prediction": ("MTPLossAutoScaler",),
}
# What counts as a CUDA-only call site in those modules.
CUDA_PATTERN = re.compile(
    r"torch\.cuda\.current_device\(\)|torch\.cuda\.synchronize\(\)|device=[\"']cuda[\"']|autocast\([\"']cuda[\"']"
    r"|'torch\.cuda\.\w+Tensor'|\.cuda\(\)|torch\.cuda\.(?:Stream|current_stream|stream)\("
)
# Modules whose `clip_grad_by_total_norm_fp32` (imported from clip_grads) is replaced.
_CLIP_IMPORTERS = ("megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads")
# (module, class) whose __init__ runs with CUDA tensor-type names for CPU tensors.
_TYPE_CHECKING_INITS = (("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params"),
                        ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer"))
# With tied embeddings and PP > 1 the last stage's copy of the embedding is synchronised by
# LanguageModule.setup_embeddings_and_output_layer, which moves it with `weight.data.cuda()`: a no-op there.
_EMBEDDING_SYNC = ("megatron.core.models.common.language_module.language_module", "LanguageModule",
                   "setup_embeddings_and_output_layer")
# The CUDA RNG state functions that activation recompute (CheckpointFunction) calls: replaced by ones of no state.
_RNG = ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", "_set_cuda_rng_state")
# The module whose `maybe_move_tensor_to_cpu` (imported from moe_utils) is replaced by `_move_to_host`.
_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
_FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange")
_CPU = torch.device("cpu")


def _cpu(device: Any) -> Any:
    return _CPU if device is not None and torch.device(device).type == "cuda" else device


class _StreamOnCpu:
    """A CUDA stream (and its event) on CPU: every operation is already complete, nothing to wait for."""

    def wait_stream(self, stream: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _StreamOnCpu:
        return self

    def synchronize(self) -> None:
        return None

    def __enter__(self) -> _StreamOnCpu:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


_CPU_STREAM = _StreamOnCpu()


class _CudaOnCpu:
    """`torch.cuda` as the redirected modules see it."""

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> _StreamOnCpu:  # noqa: N802 (torch.cuda's name)
        return _CPU_STREAM

    @staticmethod
    def current_stream(device: Any = None) -> _StreamOnCpu:
        return _CPU_STREAM

    @staticmethod
    def stream(stream: Any) -> _StreamOnCpu:
        return _CPU_STREAM

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchOnCpu:
    """`torch` as the redirected modules see it: factories with device="cuda" build CPU tensors."""

    cuda = _CudaOnCpu()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name in _FACTORIES:

            def factory(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
                return attr(*args, device=_cpu(device), **kwargs)

            return factory
        if name == "autocast":

            def autocast(device_type: str, *args: Any, **kwargs: Any) -> Any:
                return attr("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

            return autocast
        return attr


def _clip_grad_by_total_norm_fp32(parameters: Any, max_norm: float, total_norm: float,
                                  use_decoupled_grad: bool = False) -> None:
    """megatron-core's clip_grad_by_total_norm_fp32 (scale every gradient in place by max_norm / total_norm
    when that is < 1), without its assertion that gradients are CUDA tensors."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _move_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """moe_utils.maybe_move_tensor_to_cpu for tensors already on the CPU: what it makes of a CUDA tensor (a CPU
    tensor, or its NumPy array with `as_numpy`)."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor


@contextmanager
def _cuda_type_names() -> Iterator[None]:
    """`tensor.type()` of a CPU tensor reads 'torch.cuda.FloatTensor' (etc.) inside the block."""
    original = torch.Tensor.type

    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


@contextmanager
def _tensor_cuda_is_identity() -> Iterator[None]:
    """`tensor.cuda()` returns the tensor itself inside the block."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


# the code of the functions torch.amp.custom_fwd / custom_bwd return (whatever their device_type)
_AMP_CODES = frozenset({torch.amp.custom_fwd(lambda: None, device_type="cpu").__code__,
                        torch.amp.custom_bwd(lambda: None, device_type="cpu").__code__})


def amp_device(function: Any) -> Optional[str]:
    """The device_type of the torch.amp.custom_fwd / custom_bwd that made `function`; None if neither made it."""
    code = getattr(function, "__code__", None)
    if code not in _AMP_CODES:
        return None
    return inspect.getclosurevars(function).nonlocals.get("device_type")


def autograd_functions(module: Any) -> dict[str, type]:
    """The torch.autograd.Function subclasses defined in `module` (by name)."""
    return {name: cls for name, cls in vars(module).items() if isinstance(cls, type)
            and issubclass(cls, torch.autograd.Function) and cls.__module__ == module.__name__}


def _autocast_on_cpu(cls: type) -> None:
    """Decorate `cls`'s forward and backward with torch.amp.custom_fwd / custom_bwd(device_type="cpu"), in place of
    any torch.amp decorator they had."""
    for name, decorate in (("forward", torch.amp.custom_fwd), ("backward", torch.amp.custom_bwd)):
        function = getattr(cls, name)
        if amp_device(function) == "cpu":
            continue
        if amp_device(function) is not None:
            function = function.__wrapped__
        setattr(cls, name, staticmethod(decorate(function, device_type="cpu")))


def _within(context: Callable[[], Any], method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with context():
            return method(*args, **kwargs)

    return wrapped


_enabled = False


def needed() -> bool:
    """Whether the redirect applies: no CUDA device in this process."""
    return not torch.cuda.is_available()


def enable() -> bool:
    """Install the redirect (idempotent) when CUDA is absent; returns whether it is active."""
    global _enabled
    if _enabled or not needed():
        return _enabled
    shim = _TorchOnCpu()
    for name in REDIRECTED_MODULES:
        module = importlib.import_module(name)
        module.torch = shim  # type: ignore[attr-defined]
    for name in _CLIP_IMPORTERS:
        importlib.import_module(name).clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    importlib.import_module(_DISPATCHER).maybe_move_tensor_to_cpu = _move_to_host
    for name, cls_name in _TYPE_CHECKING_INITS:
        cls = getattr(importlib.import_module(name), cls_name)
        cls.__init__ = _within(_cuda_type_names, cls.__init__)
    cls = getattr(importlib.import_module(_EMBEDDING_SYNC[0]), _EMBEDDING_SYNC[1])
    setattr(cls, _EMBEDDING_SYNC[2], _within(_tensor_cuda_is_identity, getattr(cls, _EMBEDDING_SYNC[2])))
    random = importlib.import_module(_RNG[0])
    setattr(random, _RNG[1], lambda *args, **kwargs: None)
    setattr(random, _RNG[2], lambda *args, **kwargs: None)
    for name, classes in AUTOCAST_FUNCTIONS.items():
        module = importlib.import_module(name)
        for cls_name in classes:
            _autocast_on_cpu(getattr(module, cls_name))
    _enabled = True
    return True
