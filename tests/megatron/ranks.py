"""One rank of a multi-process Megatron check: `python ranks.py SCENARIOS RANK WORLD PORT OUTDIR`.

SCENARIOS is one scenario or several, comma-separated, run one after the other in the same processes (a rank
process spends seconds importing megatron-core): each sets up megatron-core's parallel state for its own TP x PP
over the one process group and runs several checks in OUTDIR/<scenario>. Rank 0 writes the measured values to
OUTDIR/result.json, one entry per scenario; tests/megatron/test_megatron_cpu.py asserts on them.
Reference values come from the torch backend (TorchPolicy / transformers) in the same process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "backends"), str(ROOT / "tests" / "faults")]

import fault_scenarios  # noqa: E402  (tests/megatron/fault_scenarios.py)
import moe_scenarios  # noqa: E402  (tests/megatron/moe_scenarios.py)
from conftest import random_batch, random_samples  # noqa: E402  (tests/backends/conftest.py)

from relax.algorithms.grpo import GRPOConfig  # noqa: E402
from relax.batch import TrainBatch  # noqa: E402
from relax.config.schema import ModelConfig, TrainConfig  # noqa: E402
from relax.models.hf import build_model  # noqa: E402
from relax.train.megatron import convert, parallel  # noqa: E402
from relax.train.megatron.policy import MegatronPolicy  # noqa: E402
from relax.train.torch_policy import TorchPolicy  # noqa: E402

VOCAB = 33  # not a multiple of 2: TP=2 exercises the vocabulary padding
PAD = 0
SEED = 3
MODEL = ModelConfig(name="tiny-test", source="config", dtype="float32", hidden_size=32, num_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                    max_position_embeddings=64)
TRAIN = TrainConfig(lr=1e-2, clip_grad=1.0, num_rollout=3, lr_schedule="cosine", warmup_steps=1)
STEPS = 3


def batches(n: int = 8) -> list[TrainBatch]:
    """Off-policy batches (old_logp given, so the ratio is not 1) of random left/right-padded rows, with the pad
    token also as a real token (a policy may sample it): HF never trains the pad row's embedding on its lookups."""
    out = []
    for s in range(STEPS):
        b = random_batch(n, P=5, T=4, seed=10 + s)
        b.prompt_ids[0, -1] = PAD  # the last prompt token is real in every row (prompts are left-padded)
        b.response_ids[1, 0] = PAD  # so is the first response token
        old = -torch.rand(b.response_ids.shape, generator=torch.Generator().manual_seed(s)) - 2.0
        out.append(b.with_(old_logp=old * b.response_mask, rollout_logp=old * b.response_mask))
    return out


def megatron_logits(policy: MegatronPolicy, ids: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [B, L, VOCAB] of unpadded rows (gathered over tensor parallelism)."""
    policy.model.eval()
    ids = ids.to(policy.device)
    with torch.no_grad():
        out = policy.model(ids, torch.arange(ids.shape[1], device=ids.device).expand_as(ids), None)
    parts = policy._gather_tensor("output_layer.weight", out)
    return torch.cat(parts, dim=-1)[..., :VOCAB]


def logits_checks(policy: MegatronPolicy, res: dict) -> None:
    hf = build_model(MODEL, VOCAB, PAD, seed=SEED).eval()
    hf.set_attn_implementation("eager")  # megatron's local attention is the eager computation
    ids = torch.randint(1, VOCAB, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    res["logits_max_diff"] = float((megatron_logits(policy, ids).cpu() - ref).abs().max())
    # negative control: the same weights with k and v swapped in the conversion
    state = dict(hf.state_dict())
    for i in range(MODEL.num_layers):
        k, v = f"model.layers.{i}.self_attn.k_proj.weight", f"model.layers.{i}.self_attn.v_proj.weight"
        state[k], state[v] = state[v], state[k]
    state.pop("lm_head.weight")
    swapped = convert.hf_to_megatron(policy.spec, state.__getitem__, tp_rank=policy.tp_rank, tp_size=policy.tp)
    good = {convert.local_to_global(k, 0): v.clone() for k, v in policy._module().state_dict().items()
            if not k.endswith("_extra_state")}
    policy._load_megatron(policy._module(), swapped)
    res["negative_control_diff"] = float((megatron_logits(policy, ids).cpu() - ref).abs().max())
    policy._load_megatron(policy._module(), good)


def train_parity(policy: MegatronPolicy, torch_policy: TorchPolicy, algo, res: dict, prefix: str,
                 *, per_token: bool, mbs: int, ckpt_dir: str | None = None) -> None:
    """STEPS steps of both backends on the same batches; per-step metrics side by side. With `ckpt_dir`, the
    Megatron trainer saves before the last step, and the last step is redone after loading that checkpoint."""
    rows = []
    for i, b in enumerate(batches()):
        if ckpt_dir is not None and i == STEPS - 1:
            policy.save_checkpoint(ckpt_dir)
        m = policy.train_step(b, algo, per_token=per_token, micro_batch_size=mbs, rollout_mismatch=i == 0)
        t = torch_policy.train_step(b, algo, per_token=per_token, micro_batch_size=mbs, rollout_mismatch=i == 0)
        rows.append({"megatron": m, "torch": t})
    res[prefix] = rows
    if ckpt_dir is not None:
        after = policy.state_dict_for_rollout()
        policy.load_checkpoint(ckpt_dir)
        redo = policy.train_step(batches()[-1], algo, per_token=per_token, micro_batch_size=mbs)
        res[prefix + "_resume"] = {"first": rows[-1]["megatron"], "again": redo}
        again = policy.state_dict_for_rollout()
        if again:
            res[prefix + "_resume_weight_diff"] = max(float((after[k] - again[k]).abs().max()) for k in after)


def scenario_tp2(rank: int, out: Path, res: dict) -> None:
    """TP=2: logits/negative control, log-prob and gradient parity, 3-step train, weight sync, resume, export."""
    algo = GRPOConfig()
    policy = MegatronPolicy(MODEL, TRAIN, vocab_size=VOCAB, pad_token_id=PAD, seed=SEED, temperature=0.7)
    torch_policy = TorchPolicy(MODEL, TRAIN, vocab_size=VOCAB, pad_token_id=PAD, seed=SEED, temperature=0.7,
                               num_threads=1)
    logits_checks(policy, res)
    samples = random_samples(7, 6, 5, seed=1, vocab=VOCAB)
    res["logprob_max_diff"] = float((policy.compute_logprobs(samples, 3)
                                     - torch_policy.compute_logprobs(samples, 3)).abs().max())
    b = batches()[0]
    policy.accumulate_gradients(b, algo, per_token=True, micro_batch_size=3)
    torch_policy.accumulate_gradients(b, algo, per_token=True, micro_batch_size=3)
    grads = policy.gradients_hf()
    if rank == 0:
        ref = {n: p.grad for n, p in torch_policy.model.named_parameters()}
        res["grad_rel_diff"] = {n: float((grads[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-12))
                                for n in grads}
        res["grad_keys_missing"] = sorted(set(ref) - set(grads))
    torch_policy.optimizer.zero_grad(set_to_none=True)
    train_parity(policy, torch_policy, algo, res, "train", per_token=True, mbs=3,
                 ckpt_dir=str(out / "ckpt"))
    # weight sync -> the embedded rollout engine: its rollout log-probs equal the trainer's
    weights = policy.state_dict_for_rollout(torch.float32)
    trainer_logp = None
    if rank == 0:
        from relax.rollout.embedded import EmbeddedEngine

        engine = EmbeddedEngine(build_model(MODEL, VOCAB, PAD, seed=SEED + 1), eos_token_ids=[1], pad_token_id=PAD)
        engine.load_weights(weights, version=1)
        gen = engine.generate([[3, 4, 5], [6, 7]], n_samples_per_prompt=3, max_new_tokens=5, temperature=0.7,
                              seed=0)
        torch.save(gen, out / "gen.pt")
    torch.distributed.barrier()
    gen = torch.load(out / "gen.pt", weights_only=False)
    trainer_logp = policy.compute_logprobs(gen, 4)
    if rank == 0:
        res["rollout_vs_trainer_logp_max_diff"] = float((trainer_logp - gen.rollout_logp * gen.response_mask)
                                                        .abs().max())
    # HF export
    policy.save_hf(out / "hf")
    if rank == 0:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(str(out / "hf"), dtype=torch.float32).eval()
        sd = loaded.state_dict()
        res["export_weight_max_diff"] = max(float((sd[k] - v).abs().max()) for k, v in weights.items())
        ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            res["export_tied"] = bool(loaded.config.tie_word_embeddings)
            ref = loaded(input_ids=ids).logits
        res["export_logits_max_diff"] = float((megatron_logits(policy, ids).cpu() - ref).abs().max())
    else:
        megatron_logits(policy, torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5)))


def scenario_tp2sp(rank: int, out: Path, res: dict) -> None:
    """TP=2 with sequence parallelism (train.sequence_parallel): log-prob and gradient parity (norm gradients are
    partial per rank until finalize sums them), rows of odd length (padded to a multiple of TP), 3-step train;
    then the norms' `sequence_parallel` marks removed as a negative control (their gradients stay partial)."""
    sp = dataclasses.replace(TRAIN, tensor_parallel_size=2, sequence_parallel=True)
    algo = GRPOConfig()
    policy = MegatronPolicy(MODEL, sp, vocab_size=VOCAB, pad_token_id=PAD, seed=SEED, temperature=0.7)
    torch_policy = TorchPolicy(MODEL, TRAIN, vocab_size=VOCAB, pad_token_id=PAD, seed=SEED, temperature=0.7,
                               num_threads=1)
    res["sequence_parallel"] = bool(policy.config.sequence_parallel)
    samples = random_samples(7, 6, 5, seed=1, vocab=VOCAB)
    res["lengths"] = sorted({int(mb.tokens.shape[1]) for mb in policy._micro_batches(samples, 3)})
    res["logprob_max_diff"] = float((policy.compute_logprobs(samples, 3)
                                     - torch_policy.compute_logprobs(samples, 3)).abs().max())

    def grad_rel_diff() -> dict:
        b = batches()[0]
        policy.accumulate_gradients(b, algo, per_token=True, micro_batch_size=3)
        torch_policy.accumulate_gradients(b, algo, per_token=True, micro_batch_size=3)
        grads = policy.gradients_hf()
        ref = {n: p.grad for n, p in torch_policy.model.named_parameters()}
        torch_policy.optimizer.zero_grad(set_to_none=True)
        return {n: float((grads[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-12)) for n in grads}

    res["grad_rel_diff"] = grad_rel_diff()
    train_parity(policy, torch_policy, algo, res, "train", per_token=True, mbs=3)
    for module in policy._module().modules():  # negative control
        if isinstance(getattr(module, "weight", None), torch.Tensor) and hasattr(module.weight, "sequence_parallel"):
            module.weight.sequence_parallel = False
    res["unmarked_grad_rel_diff"] = grad_rel_diff()


def scenario_dp2(rank: int, out: Path, res: dict) -> None:
    """TP=1 x DP=2 with the distributed optimizer: exact logits, GRPO and M2PO training parity, resume."""
    from relax.algorithms.m2po import M2POConfig

    policy = MegatronPolicy(MODEL, TRAIN, vocab_size=VOCAB, pad_token_id=PAD, seed=SEED,
                            use_distributed_optimizer=True)
    torch_policy = TorchPolicy(MODEL, TRAIN, vocab_size=VOCAB, pad_token_id=PAD, seed=SEED, num_threads=1)
    logits_checks(policy, res)
    train_parity(policy, torch_policy, GRPOConfig(), res, "train", per_token=True, mbs=3,
                 ckpt_dir=str(out / "ckpt"))
    policy = MegatronPolicy(MODEL, TRAIN, vocab_size=VOCAB, pad_token_id=PAD, seed=SEED)
    torch_policy = TorchPolicy(MODEL, TRAIN, vocab_size=VOCAB, pad_token_id=PAD, seed=SEED, num_threads=1)
    res["saved_bytes"] = saved_bytes(policy)
    train_parity(policy, torch_policy, M2POConfig(), res, "m2po", per_token=True, mbs=2)
    # model.gradient_checkpointing: megatron-core's activation recompute against HF's gradient checkpointing
    recompute = dataclasses.replace(MODEL, gradient_checkpointing=True)
    policy = MegatronPolicy(recompute, TRAIN, vocab_size=VOCAB, pad_token_id=PAD, seed=SEED)
    torch_policy = TorchPolicy(recompute, TRAIN, vocab_size=VOCAB, pad_token_id=PAD, seed=SEED, num_threads=1)
    res["recompute_saved_bytes"] = saved_bytes(policy)
    train_parity(policy, torch_policy, GRPOConfig(), res, "recompute", per_token=True, mbs=3)


def scenario_agg_dp2(rank: int, out: Path, res: dict) -> None:
    """TP=1 x DP=2: algorithm.loss_agg_mode's response-level token sums (seq-mean-token-sum, and -norm over
    loss_scale_factor) trained 3 steps on both backends, the Megatron trainer with a different micro-batch size from
    the torch one's (the loss divides by the step's responses, whatever the split over micro-batches and ranks)."""
    for mode, factor in (("seq-mean-token-sum", None), ("seq-mean-token-sum-norm", 5.0)):
        algo = GRPOConfig(loss_agg_mode=mode, loss_scale_factor=factor)
        policy = MegatronPolicy(MODEL, TRAIN, vocab_size=VOCAB, pad_token_id=PAD, seed=SEED)
        torch_policy = TorchPolicy(MODEL, TRAIN, vocab_size=VOCAB, pad_token_id=PAD, seed=SEED, num_threads=1)
        rows = []
        for b in batches():
            m = policy.train_step(b, algo, per_token=False, micro_batch_size=1)
            t = torch_policy.train_step(b, algo, per_token=False, micro_batch_size=3)
            rows.append({"megatron": m, "torch": t})
        res[mode] = rows


def saved_bytes(policy: MegatronPolicy) -> int:
    """Bytes the autograd graph keeps for the backward at the end of one batch's forward (one micro-batch; packed
    before the backward unpacks anything: a recomputed layer's own graph, built in the backward, is not counted)."""
    total, backward = 0, False

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if not backward:
            total += t.numel() * t.element_size()
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        nonlocal backward
        backward = True
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        policy.accumulate_gradients(batches(16)[0], GRPOConfig(), per_token=True, micro_batch_size=16)
    policy.optimizer.zero_grad()
    return total


def scenario_pp2(rank: int, out: Path, res: dict) -> None:
    """PP=2 (1F1B schedule, tied embedding copied to the last stage): log-probs, 3-step train, gathered weights."""
    algo = GRPOConfig()
    policy = MegatronPolicy(MODEL, TRAIN, vocab_size=VOCAB, pad_token_id=PAD, seed=SEED)
    torch_policy = TorchPolicy(MODEL, TRAIN, vocab_size=VOCAB, pad_token_id=PAD, seed=SEED, num_threads=1)
    samples = random_samples(7, 6, 5, seed=1, vocab=VOCAB)
    res["logprob_max_diff"] = float((policy.compute_logprobs(samples, 3)
                                     - torch_policy.compute_logprobs(samples, 3)).abs().max())
    train_parity(policy, torch_policy, algo, res, "train", per_token=True, mbs=3)
    weights = policy.state_dict_for_rollout()
    if rank == 0:
        ref = torch_policy.state_dict_for_rollout()
        res["weight_keys_missing"] = sorted(set(ref) - set(weights) - {"lm_head.weight"})
        res["weight_max_diff"] = max(float((weights[k] - ref[k]).abs().max()) for k in weights)
    pp2_gather_buckets(rank, out, res)


def peak_cpu_bytes(fn):
    """(fn(), about the most CPU bytes that fn's allocations held at once beyond what existed before): the torch
    profiler's memory accounting (each op's own allocations less its frees, and frees outside ops), summed in time
    order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        value = fn()
    now = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        now += e.self_cpu_memory_usage
        peak = max(peak, now)
    return value, peak


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def received_bytes(fn):
    """(fn(), the tensor bytes this rank received from other ranks while fn ran), counted at torch.distributed's
    receiving calls (point-to-point receives, all-gathers of tensors and of objects, broadcasts from another rank)."""
    dist, me, got = torch.distributed, torch.distributed.get_rank(), [0]
    saved = {name: getattr(dist, name) for name in ("recv", "recv_object_list", "all_gather", "all_gather_object",
                                                     "broadcast", "broadcast_object_list")}

    def counting(name):
        def call(*args, **kwargs):
            out = saved[name](*args, **kwargs)
            first = args[0] if args else next(iter(kwargs.values()))
            group = kwargs.get("group")
            mine = dist.get_rank(group) if group is not None else me
            if name in ("all_gather", "all_gather_object"):
                got[0] += sum(_tensor_bytes(x) for i, x in enumerate(first) if i != mine)
            elif name.startswith("broadcast"):
                src = kwargs.get("src", args[1] if len(args) > 1 else None)
                got[0] += 0 if src == me else _tensor_bytes(first)
            else:
                got[0] += _tensor_bytes(first)
            return out
        return call

    for name in saved:
        setattr(dist, name, counting(name))
    try:
        return fn(), got[0]
    finally:
        for name, f in saved.items():
            setattr(dist, name, f)


def pp2_gather_buckets(rank: int, out: Path, res: dict) -> None:
    """The PP=2 weight gather to the sending rank (global rank 0) in small buckets, of an 8-layer model (4 layers per
    stage): the sender gets exactly the HF model's weights (built from the same seed, never trained); what each rank
    receives and the most CPU memory it holds meanwhile, with the size of its largest (Megatron, fused) parameter.
    Each rank's measurements go to OUTDIR/pp2/gather<rank>.json; rank 0 reads the other's after a barrier."""
    model = dataclasses.replace(MODEL, num_layers=8)
    policy = MegatronPolicy(model, TRAIN, vocab_size=VOCAB, pad_token_id=PAD, seed=SEED)
    hf = build_model(model, VOCAB, PAD, seed=SEED)
    sizes = {k: v.numel() * v.element_size() for k, v in hf.state_dict().items()}
    bucket = max(sizes.values())  # the largest tensor: every bucket holds one to a few tensors
    policy.gather_bucket_bytes = bucket
    (weights, received), peak = peak_cpu_bytes(lambda: received_bytes(policy.state_dict_for_rollout))
    mine = {"peak_bytes": peak, "received_bytes": received, "bucket_bytes": bucket, "keys": len(weights),
            "largest_param_bytes": max(p.numel() * p.element_size() for p in policy._module().parameters())}
    if rank == 0:
        ref = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied: not sent
        mine["keys_differ"] = sorted(set(ref) ^ set(weights))
        mine["max_diff"] = max(float((weights[k] - ref[k]).abs().max()) for k in ref if k in weights)
        stage0 = [k for k in ref if k.startswith(("model.embed_tokens", *(f"model.layers.{i}." for i in range(4))))]
        mine["first_stage_bytes"] = sum(sizes[k] for k in stage0)
        mine["model_bytes"] = sum(sizes[k] for k in ref)
    (out / f"gather{rank}.json").write_text(json.dumps(mine))
    torch.distributed.barrier()
    if rank == 0:
        res["gather"] = {r: json.loads((out / f"gather{r}.json").read_text())
                         for r in range(torch.distributed.get_world_size())}


def scenario_gpu(rank: int, out: Path, res: dict) -> None:
    """CUDA/NCCL (tests/gpu): fp32 logits, log-prob and 3-step parity with the torch backend on the same GPU (with
    Transformer Engine's layers where it is installed), with sequence parallelism where there are two GPUs, then a
    3-step train with bf16 parameters (Megatron's mixed precision) against the torch backend's autocast."""
    policy = MegatronPolicy(MODEL, TRAIN, vocab_size=VOCAB, pad_token_id=PAD, seed=SEED)
    res["layer_spec"] = policy.layer_spec  # train.layer_spec=auto: Transformer Engine's where it is installed
    torch_policy = TorchPolicy(MODEL, TRAIN, vocab_size=VOCAB, pad_token_id=PAD, seed=SEED)
    hf = build_model(MODEL, VOCAB, PAD, seed=SEED, device=policy.device).eval()
    ids = torch.randint(1, VOCAB, (3, 9), generator=torch.Generator().manual_seed(0)).to(policy.device)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    res["logits_max_diff"] = float((megatron_logits(policy, ids) - ref).abs().max())
    samples = random_samples(7, 6, 5, seed=1, vocab=VOCAB)
    res["logprob_max_diff"] = float((policy.compute_logprobs(samples, 3)
                                     - torch_policy.compute_logprobs(samples, 3)).abs().max())
    train_parity(policy, torch_policy, GRPOConfig(), res, "train", per_token=True, mbs=3)
    if policy.layer_spec == "transformer_engine":  # packed sequences through TE's THD attention (pack_sequences)
        packed = MegatronPolicy(MODEL, dataclasses.replace(TRAIN, pack_sequences=True,
                                                           layer_spec="transformer_engine"),
                                vocab_size=VOCAB, pad_token_id=PAD, seed=SEED)
        torch_policy = TorchPolicy(MODEL, TRAIN, vocab_size=VOCAB, pad_token_id=PAD, seed=SEED)
        res["packed_logprob_max_diff"] = float((packed.compute_logprobs(samples, 3)
                                                - torch_policy.compute_logprobs(samples, 3)).abs().max())
        train_parity(packed, torch_policy, GRPOConfig(), res, "train_packed", per_token=True, mbs=3)
    if policy.tp > 1:  # two GPUs or more: sequence parallelism over the tensor-parallel ranks
        sp = MegatronPolicy(MODEL, dataclasses.replace(TRAIN, sequence_parallel=True), vocab_size=VOCAB,
                            pad_token_id=PAD, seed=SEED)
        torch_policy = TorchPolicy(MODEL, TRAIN, vocab_size=VOCAB, pad_token_id=PAD, seed=SEED)
        res["sp_logprob_max_diff"] = float((sp.compute_logprobs(samples, 3)
                                            - torch_policy.compute_logprobs(samples, 3)).abs().max())
        train_parity(sp, torch_policy, GRPOConfig(), res, "train_sp", per_token=True, mbs=3)
    bf16 = dataclasses.replace(MODEL, dtype="bfloat16")
    policy = MegatronPolicy(bf16, TRAIN, vocab_size=VOCAB, pad_token_id=PAD, seed=SEED, params_dtype=torch.bfloat16,
                            use_distributed_optimizer=policy.dp > 1)
    torch_policy = TorchPolicy(bf16, TRAIN, vocab_size=VOCAB, pad_token_id=PAD, seed=SEED)
    train_parity(policy, torch_policy, GRPOConfig(), res, "train_bf16", per_token=True, mbs=3)


def bf16_parity(model: ModelConfig, res: dict) -> None:
    """`model` in bf16 (model.dtype=bfloat16: fp32 parameters, bf16 autocast) on both backends, beside each backend in
    fp32 (the scale of bf16's rounding) and the Megatron one with activation recompute: log-probs of the same samples,
    then STEPS GRPO steps of each on the same batches."""
    bf16 = dataclasses.replace(model, dtype="bfloat16")
    kw = dict(vocab_size=VOCAB, pad_token_id=PAD, seed=SEED)
    s = random_samples(8, 6, 5, seed=1, vocab=VOCAB)
    mask = s.response_mask.bool()
    policies = {"megatron": MegatronPolicy(bf16, TRAIN, **kw), "torch": TorchPolicy(bf16, TRAIN, num_threads=1, **kw),
                "megatron_fp32": MegatronPolicy(model, TRAIN, **kw),
                "torch_fp32": TorchPolicy(model, TRAIN, num_threads=1, **kw),
                "megatron_recompute": MegatronPolicy(dataclasses.replace(bf16, gradient_checkpointing=True), TRAIN,
                                                     **kw)}
    config = policies["megatron"].config
    res["autocast"] = [config.enable_autocast, str(config.autocast_dtype), str(policies["megatron"].params_dtype)]
    logp = {k: p.compute_logprobs(s, 3)[mask] for k, p in policies.items()}
    res["logp_diff"] = {f"{a}-{b}": float((logp[a] - logp[b]).abs().max())
                        for a, b in (("megatron", "torch"), ("torch", "torch_fp32"), ("megatron", "megatron_fp32"),
                                     ("megatron_recompute", "megatron"))}
    res["steps"] = {k: [p.train_step(b, GRPOConfig(), per_token=True, micro_batch_size=3) for b in batches()]
                    for k, p in policies.items()}


def scenario_bf16(rank: int, out: Path, res: dict) -> None:
    """bf16 autocast on CPU (TP=1 x DP=2), the dense model and the MoE one: see bf16_parity. A failure is recorded
    (res[arch]["failed"]) instead of raised, so that it fails the bf16 tests alone."""
    for arch, model in (("dense", MODEL), ("moe", moe_scenarios.MOE)):
        res[arch] = {}
        try:
            bf16_parity(model, res[arch])
        except Exception:
            res[arch]["failed"] = traceback.format_exc()


SCENARIOS = {"tp2": (scenario_tp2, 2, 1), "tp2sp": (scenario_tp2sp, 2, 1), "dp2": (scenario_dp2, 1, 1),
             "pp2": (scenario_pp2, 1, 2), "bf16": (scenario_bf16, 1, 1), "agg_dp2": (scenario_agg_dp2, 1, 1),
             "gpu": (scenario_gpu, None, 1)}  # name: (function, TP (None: every rank), PP[, EP])
SCENARIOS.update(moe_scenarios.scenarios(TRAIN, batches, train_parity))  # mixture of experts, EP=1 and EP=2
SCENARIOS.update(fault_scenarios.SCENARIOS)  # tests/faults' non-finite skip and checkpoint refusal, TP=1 x DP=2


def main() -> None:
    names, rank, world, port, out = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
        Path(sys.argv[5])
    from megatron.core import parallel_state

    os.environ["LOCAL_RANK"] = str(rank)  # one GPU per rank where there are GPUs
    results: dict = {}
    try:
        for name in names:
            run, tp, pp, *ep = SCENARIOS[name]
            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()  # the process group stays; the next TP x PP is set up on it
            parallel.initialize(rank, world, master_addr="127.0.0.1", master_port=port,
                                tensor_parallel_size=tp or world, pipeline_parallel_size=pp,
                                expert_parallel_size=ep[0] if ep else 1, seed=SEED, timeout_s=300)
            (out / name).mkdir(exist_ok=True)
            results[name] = {}
            run(rank, out / name, results[name])
    except Exception:
        results["error"] = traceback.format_exc()
        (out / f"error{rank}.txt").write_text(results["error"])
        raise
    finally:
        if rank == 0:
            # what this CPU run loaded of megatron-core: the modules whose CUDA call sites test_megatron_cpu audits
            results["megatron_modules"] = sorted(m for m in sys.modules if m.startswith("megatron.core"))
            (out / "result.json").write_text(json.dumps(results, default=float))
    parallel.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
