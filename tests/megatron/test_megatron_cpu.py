"""The Megatron-core backend on CPU processes over gloo, against the torch backend and transformers.

One multi-process launch (tests/megatron/ranks.py, two rank processes; `shared_launch`) runs every scenario the
session's selected tests read, this module's and those of test_megatron_moe_aux_loss.py (`moe_aux`),
test_megatron_moe_load_and_z_loss.py (`moe_load_z`), tests/faults/test_megatron_nonfinite.py (`nonfinite`) and
tests/faults/test_checkpoint_safety.py (`checkpoint_refusal`; both in tests/megatron/fault_scenarios.py); each checks
many things:
- `tp2` (TP=2, DP=1, vocabulary padded 33 -> 34): logits vs transformers, the k/v-swap negative control,
  log-prob and post-finalize gradient parity, a 3-step train equal to TorchPolicy's, checkpoint resume, weight
  sync into the embedded rollout engine, HF export.
- `tp2sp` (TP=2 with sequence parallelism): log-prob, gradient and 3-step parity; norms unmarked as a control.
- `dp2` (TP=1, DP=2, distributed optimizer; then the plain optimizer with M2PO): exact logits at TP=1, 3-step
  GRPO and M2PO trains equal to TorchPolicy's (M2PO's step statistics all-gathered over data parallelism),
  resume with the distributed optimizer's per-rank state.
- `pp2` (PP=2, 1F1B schedule, tied embedding copied to the last stage): log-probs, a 3-step train equal to
  TorchPolicy's, weights gathered from both stages; the gather to the sending rank alone, in buckets, measured on
  both ranks (bytes received, the most CPU memory held).
- `bf16` (TP=1 x DP=2, the dense model and the MoE one with model.dtype=bfloat16: fp32 parameters under CPU bf16
  autocast, megatron-core's CUDA-decorated autograd Functions re-decorated for the CPU by cpu_compat): log-probs
  and a 3-step GRPO train against the torch backend in bf16, with both backends in fp32 as the scale of bf16's
  rounding; activation recompute equal to no recompute.
- `moe_ep1`, `moe_ep2` (a Qwen3-MoE on megatron-core's MoE layers, TP=1 x DP=2, experts on every rank or spread over
  two expert-parallel ranks; tests/megatron/moe_scenarios.py): log-prob, gradient and 3-step parity with the torch
  backend; at EP=2 also logits (two experts swapped as the control), resume, and routing replay through
  megatron-core's RouterReplay against the torch backend's replay (record-only as the control).
- `agg_dp2` (TP=1 x DP=2): algorithm.loss_agg_mode's response-level token sums (seq-mean-token-sum, and -norm over
  loss_scale_factor), 3 steps equal to the torch backend's, the Megatron trainer on one-row micro-batches split over
  two ranks, the torch one on three-row micro-batches (the loss against a loop by hand:
  tests/algorithms/test_loss_agg.py).

Tolerances (fp32): logits 1e-5 absolute at TP=2 and TP=1 (at TP=1 bitwise equal to transformers' eager attention
with MKL's default sgemm path on our CPUs, 1e-7 apart with another: fused against separate projections);
per-step losses, entropy and gradient norm 1e-4 relative: the two backends sum the same float terms in a
different order (vocab-parallel log-softmax, tensor-parallel matmul partial sums, data-parallel gradient sums),
observed differences are around 1e-7.

Tolerances (bf16 autocast): the backends round to bf16 (8 significant bits, a relative 2^-9 = 2e-3 per rounding) at
different places (Megatron's fused QKV and gate/up projections and its attention's baddbmm, against transformers'
separate projections and attention; the MoE router's logits), so they agree only as well as bf16 allows, not to the
bit.
- log-probs of the same weights: the largest Megatron-vs-torch difference at most 3x the torch backend's own
  bf16-vs-fp32 difference (observed ratios 1.2 dense, 1.8 MoE; both around 2e-3 nats), and the Megatron bf16 log-probs
  differ from its fp32 ones by more than 1e-4 (fp32 parity is 5e-7): the forward did run in bf16.
- step 0 (same weights, same batch): loss and gradient norm within 1e-2 relative, a few bf16 roundings (observed
  at most 2.1e-3, the MoE gradient norm).
- all 3 steps (Adam amplifies the first step's rounding differences into different weights): gradient norm within
  1e-1 relative, entropy 1e-3 relative, loss 5e-3 absolute, against a loss of magnitude 0.1 to 0.4 (observed at
  most 2.0e-2, 3e-5 and 7.2e-4; the torch backend's own bf16 run is up to 2.2e-2, 5e-5 and 1.4e-3 from its fp32 one:
  the gradient norm's distance is bf16's own, so its bound leaves room for another CPU's roundings; step 0's 1e-2,
  same weights and batch, is the bound that catches a wrong gradient).
- activation recompute in bf16 repeats the layers' forward under the same autocast: equal to no recompute, exactly.
"""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# its tests share module-scoped fixtures: one xdist worker runs them in a row
pytestmark = [pytest.mark.xdist_group("megatron_cpu"), pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                or importlib.util.find_spec("megatron.core") is None,
                                reason="megatron-core is not installed (pip install -e '.[megatron]')")]

RANKS = Path(__file__).with_name("ranks.py")
REL = 1e-4
LAUNCH_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PORT_TAKEN = ("Address already in use", "EADDRINUSE", "address already in use")


def launch(scenarios: str, world: int, out: Path) -> dict:
    """Run `world` rank processes of `scenarios` (comma-separated, one after the other in the same processes); rank
    0's results, one entry per scenario. A rank that fails stops the others at once (they
    would wait for it until the timeout); a rendezvous port taken by another process between picking it and binding
    it is picked again."""
    for attempt in range(3):
        port = _free_port()
        logs = [out / f"rank{r}-{attempt}.log" for r in range(world)]
        procs = []
        for r in range(world):
            with open(logs[r], "w") as log:  # a file, not a pipe: a chatty rank never blocks on a full pipe
                procs.append(subprocess.Popen([sys.executable, str(RANKS), scenarios, str(r), str(world), str(port),
                                               str(out)], stdout=log, stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        try:
            while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
                assert time.monotonic() < deadline, f"{scenarios} did not finish within {LAUNCH_TIMEOUT_S} s"
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        texts = [log.read_text(errors="replace") for log in logs]
        if any(p.returncode for p in procs) and any(m in t for t in texts for m in PORT_TAKEN) and attempt < 2:
            continue
        break
    result = json.loads((out / "result.json").read_text()) if (out / "result.json").is_file() else {}
    if any(p.returncode for p in procs) or "error" in result:
        tail = "\n".join(f"--- rank {r} ---\n{text[-3000:]}" for r, text in enumerate(texts))
        pytest.fail(f"{scenarios} failed:\n{result.get('error', '')}\n{tail}")
    return result


# The scenarios each fixture reads, in the launch's order: the fixtures' own scenarios first, bf16 last (cpu_compat's
# re-decoration of megatron-core's autograd Functions for CPU autocast stays in the process after it).
FIXTURE_SCENARIOS = {"launched": ("tp2", "tp2sp", "dp2", "pp2", "moe_ep1", "moe_ep2", "agg_dp2"),
                     "aux": ("moe_aux",), "load_z": ("moe_load_z",),
                     "megatron_nonfinite": ("nonfinite",),  # tests/faults/test_megatron_nonfinite.py
                     "megatron_checkpoints": ("checkpoint_refusal",),  # tests/faults/test_checkpoint_safety.py
                     "bf16": ("bf16",)}
_SHARED: dict = {}


def shared_launch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Rank 0's results of one launch of every scenario that the session's selected tests read (through the fixtures
    of FIXTURE_SCENARIOS), started by the first fixture that asks: each launch's rank processes import megatron-core,
    torch and transformers anew, several seconds of CPU each. The tests that read it are one xdist group
    (`megatron_cpu`), so one worker runs them all and launches once."""
    if "result" not in _SHARED:
        used = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
        if torch.cuda.is_available():
            used.discard("bf16")  # the CPU autocast path only (the bf16 fixture skips)
        scenarios = [s for fixture, names in FIXTURE_SCENARIOS.items() if fixture in used for s in names]
        _SHARED["result"] = launch(",".join(scenarios), 2, tmp_path_factory.mktemp("megatron"))
    return _SHARED["result"]


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory) -> dict:
    """The TP=2 (without and with sequence parallelism), DP=2 (TP=1), PP=2, MoE and loss-aggregation scenarios' results
    (with the other scenarios of the shared launch)."""
    return shared_launch(request, tmp_path_factory)


@pytest.fixture(scope="module")
def tp2(launched) -> dict:
    return launched["tp2"]


@pytest.fixture(scope="module")
def dp2(launched) -> dict:
    return launched["dp2"]


def assert_same_steps(rows: list[dict], keys: tuple[str, ...]) -> None:
    for i, row in enumerate(rows):
        for k in keys:
            m, t = row["megatron"][k], row["torch"][k]
            assert m == pytest.approx(t, rel=REL, abs=1e-7), f"step {i} {k}: megatron {m} vs torch {t}"


STEP_KEYS = ("train/pg_loss", "train/grad_norm", "train/entropy", "train/loss", "train/pg_clipfrac",
             "train/ppo_kl", "train/lr")


# ---- TP=2 --------------------------------------------------------------------------------------------


def test_tp2_logits_match_transformers_and_negative_control_does_not(tp2):
    assert tp2["logits_max_diff"] < 1e-5
    assert tp2["negative_control_diff"] > 0.1  # k and v swapped: a conversion bug of that kind is visible


def test_tp2_logprobs_and_finalized_gradients_match_torch(tp2):
    assert tp2["logprob_max_diff"] < 1e-5
    assert tp2["grad_keys_missing"] == []
    # q/k-norm gradients are partial per TP rank until finalize_model_grads reduces them: checked here too
    worst = max(tp2["grad_rel_diff"].items(), key=lambda kv: kv[1])
    assert worst[1] < REL, worst


def test_tp2_three_steps_equal_torch_backend(tp2):
    assert len(tp2["train"]) == 3
    assert_same_steps(tp2["train"], STEP_KEYS)
    first = tp2["train"][0]
    assert first["megatron"]["rollout/train_rollout_logp_abs_diff"] == pytest.approx(
        first["torch"]["rollout/train_rollout_logp_abs_diff"], rel=REL)


def test_tp2_checkpoint_resume_repeats_the_step(tp2):
    assert tp2["train_resume"]["again"] == pytest.approx(tp2["train_resume"]["first"], rel=1e-6)
    assert tp2["train_resume_weight_diff"] == 0.0


def test_tp2_weight_sync_gives_the_rollout_engine_the_trainers_logprobs(tp2):
    assert tp2["rollout_vs_trainer_logp_max_diff"] < 1e-5


def test_tp2_hf_export_round_trip(tp2):
    assert tp2["export_tied"] is True
    assert tp2["export_weight_max_diff"] == 0.0
    assert tp2["export_logits_max_diff"] < 1e-5


# ---- TP=2 with sequence parallelism -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tp2sp(launched) -> dict:
    return launched["tp2sp"]


def test_tp2_sequence_parallel_logprobs_gradients_and_steps_equal_torch(tp2sp):
    """train.sequence_parallel: the same numbers as the torch backend (norm gradients summed over the ranks that
    each saw half of the sequence), rows of odd length padded to a multiple of TP."""
    assert tp2sp["sequence_parallel"] is True
    assert all(n % 2 == 0 for n in tp2sp["lengths"]), tp2sp["lengths"]
    assert tp2sp["logprob_max_diff"] < 1e-5
    worst = max(tp2sp["grad_rel_diff"].items(), key=lambda kv: kv[1])
    assert worst[1] < REL, worst
    assert_same_steps(tp2sp["train"], STEP_KEYS)


def test_tp2_sequence_parallel_norms_unmarked_give_partial_gradients(tp2sp):
    """Negative control: without their `sequence_parallel` mark the norms' gradients are not summed over the
    tensor-parallel ranks, and differ from the torch backend's; the other weights' do not."""
    diffs = tp2sp["unmarked_grad_rel_diff"]
    norms = {n: d for n, d in diffs.items() if "layernorm" in n or n == "model.norm.weight"}
    assert len(norms) == 5 and min(norms.values()) > 0.05, norms
    assert max(d for n, d in diffs.items() if n not in norms) < 1e-3


# ---- TP=1 x DP=2 ------------------------------------------------------------------------------------


def test_tp1_logits_equal_transformers(dp2):
    # Not bitwise: Megatron multiplies by the fused QKV and gate-up weights, transformers by each part; with MKL's
    # default sgemm path on both of our CPUs the bits agree, with another (MKL_CBWR=COMPATIBLE) they differ by 1e-7.
    # A wrong architecture detail (norm, rotary, bias, tied head) moves logits by 1e-2 or more: the control below.
    assert dp2["logits_max_diff"] < 1e-5
    assert dp2["negative_control_diff"] > 0.1


def test_dp2_distributed_optimizer_three_steps_equal_torch_backend(dp2):
    assert_same_steps(dp2["train"], STEP_KEYS)
    assert dp2["train"][0]["megatron"]["rollout/train_rollout_ratio_max"] == pytest.approx(
        dp2["train"][0]["torch"]["rollout/train_rollout_ratio_max"], rel=REL)


def test_dp2_m2po_step_statistics_over_data_parallel_ranks(dp2):
    assert_same_steps(dp2["m2po"], STEP_KEYS + ("train/ppo_kl_m2_before", "train/ppo_kl_m2_after"))


def test_dp2_activation_recompute_trains_as_hf_gradient_checkpointing_and_keeps_fewer_activations(dp2):
    """model.gradient_checkpointing=true on Megatron (full recompute, a layer per checkpoint): the same steps as the
    torch backend with Hugging Face's gradient checkpointing, while the backward keeps far fewer tensors."""
    assert_same_steps(dp2["recompute"], STEP_KEYS)
    assert dp2["recompute_saved_bytes"] < 0.5 * dp2["saved_bytes"], (dp2["recompute_saved_bytes"], dp2["saved_bytes"])


def test_dp2_distributed_optimizer_resume(dp2):
    assert dp2["train_resume"]["again"] == pytest.approx(dp2["train_resume"]["first"], rel=1e-6)
    assert dp2["train_resume_weight_diff"] == 0.0


# ---- PP=2 -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pp2(launched) -> dict:
    return launched["pp2"]


@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_dp2_loss_agg_token_sum_modes_step_as_the_torch_backend(launched, mode):
    rows = launched["agg_dp2"][mode]
    assert_same_steps(rows, STEP_KEYS)
    assert rows[0]["torch"]["train/grad_norm"] > 0


def test_dp2_loss_agg_norm_divides_the_first_step_by_the_scale_factor(launched):
    """Same weights and batch at step 0: -norm's loss is the plain token sum's / loss_scale_factor (5)."""
    agg = launched["agg_dp2"]
    plain, norm = agg["seq-mean-token-sum"][0]["megatron"], agg["seq-mean-token-sum-norm"][0]["megatron"]
    assert norm["train/pg_loss"] == pytest.approx(plain["train/pg_loss"] / 5.0, rel=1e-5)


def test_pp2_logprobs_train_and_weight_gather(pp2):
    assert pp2["logprob_max_diff"] < 1e-5
    assert_same_steps(pp2["train"], STEP_KEYS)
    assert pp2["weight_keys_missing"] == []
    # after 3 Adam steps at lr 1e-2 (Adam's normalisation magnifies float-rounding differences of tiny gradients)
    assert pp2["weight_max_diff"] < 1e-3


def test_pp2_weights_gather_to_the_sending_rank_only_in_buckets(pp2):
    """The sender (global rank 0) gets exactly the HF model's weights, the later stage's tensors in buckets of at most
    a tensor's size; the other stage receives nothing and holds no more than a bucket and one parameter's conversion
    (its fused tensor and the parts split from it) beyond its shard, far less than the first stage's tensors that an
    all-gather to every stage would leave on it."""
    sender, other = pp2["gather"]["0"], pp2["gather"]["1"]
    assert sender["keys_differ"] == [] and sender["max_diff"] == 0.0
    assert sender["received_bytes"] == sender["model_bytes"] - sender["first_stage_bytes"]  # the later stage, once
    assert other["keys"] == 0 and other["received_bytes"] == 0
    assert other["peak_bytes"] <= other["bucket_bytes"] + 2 * other["largest_param_bytes"], other
    assert other["bucket_bytes"] + 2 * other["largest_param_bytes"] < sender["first_stage_bytes"] / 3  # it can fail


# ---- mixture of experts: TP=1 x DP=2, EP=1 and EP=2 ---------------------------------------------------


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_logprobs_gradients_and_steps_equal_torch_backend(launched, ep):
    """model.arch=qwen3_moe on megatron-core's MoE layers (router, SequentialMLP experts, all-to-all dispatcher over
    gloo): the torch backend's log-probs, finalized gradients of every HF tensor (router, stacked experts) and three
    training steps, with every expert on each rank (EP=1) or two on each (EP=2)."""
    moe = launched[f"moe_ep{ep}"]
    assert (moe["ep"], moe["local_experts"]) == (ep, 4 // ep)
    assert moe["logprob_max_diff"] < 1e-5
    assert moe["grad_keys_missing"] == []
    worst = max(moe["grad_rel_diff"].items(), key=lambda kv: kv[1])
    assert worst[1] < REL, worst
    assert any("experts.gate_up_proj" in n for n in moe["grad_rel_diff"])
    assert_same_steps(moe["train"], STEP_KEYS)
    assert moe["weight_keys_differ"] == [] and moe["weight_max_diff"] < 1e-3  # the gathered experts, after 3 steps


def test_moe_every_algorithm_steps_as_the_torch_backend(launched):
    """Each registered algorithm's loss (its default config), one step after another on the same MoE weights: the
    Megatron MoE policy's loss, gradient norm and entropy equal the torch backend's (the loop runs them end to end:
    test_megatron_moe_algorithms.py)."""
    from relax import algorithms

    rows = launched["moe_ep1"]["algorithms"]
    assert sorted(rows) == sorted(algorithms.names())
    for name, row in rows.items():
        m, t = row["megatron"], row["torch"]
        for key in ("train/loss", "train/grad_norm", "train/entropy"):
            assert m[key] == pytest.approx(t[key], rel=REL, abs=1e-7), (name, key, m[key], t[key])
        assert m["train/grad_norm"] > 0.0, name


def test_moe_ep2_logits_resume_and_negative_control(launched):
    moe = launched["moe_ep2"]
    assert moe["logits_max_diff"] < 1e-5
    assert moe["negative_control_diff"] > 1e-3  # experts 0 and 1 swapped: visible
    assert moe["train_resume"]["again"] == pytest.approx(moe["train_resume"]["first"], rel=1e-6)
    assert moe["train_resume_weight_diff"] == 0.0


def test_moe_ep2_routing_replay_through_megatron_router_replay(launched):
    """rollout.routing_replay on Megatron: each router's routing map is the engine's routes on every recorded token
    and layer although the engine's routers disagree with the trainer's, the log-probs and a training step equal the
    torch backend's replay, agreement 1; record-only (the control) routes 16% of token-layers otherwise and its
    log-probs differ from the replayed ones."""
    moe = launched["moe_ep2"]
    assert moe["replay_tokens_compared"] > 100 and moe["replay_tokens_routed_otherwise"] == 0
    assert moe["replay_logprob_vs_torch_replay"] < 1e-5
    assert moe["record_tokens_compared"] == moe["replay_tokens_compared"]
    assert moe["record_tokens_routed_otherwise"] > 0.05 * moe["record_tokens_compared"]
    assert moe["record_logprob_vs_torch_replay"] > 1e-3
    assert moe["replay_logprob_vs_engine"] < moe["record_logprob_vs_engine"] / 5
    replay, record, torch_replay = moe["replay_step"], moe["record_step"], moe["torch_replay_step"]
    assert replay["rollout/router_agreement"] == 1.0 and record["rollout/router_agreement"] < 0.95
    assert record["rollout/router_own_agreement"] < 0.95 and replay["rollout/router_own_agreement"] < 0.95
    for key in ("train/loss", "train/grad_norm", "rollout/router_agreement", "rollout/router_own_agreement"):
        assert replay[key] == pytest.approx(torch_replay[key], rel=REL), key


# ---- bf16 autocast (CPU) -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16(request, tmp_path_factory) -> dict:
    """The bf16 scenario, last in the shared launch. It checks the CPU's autocast path (cpu_compat); on GPUs the
    Megatron actor trains bf16 parameters without autocast, checked by tests/gpu."""
    if torch.cuda.is_available():
        pytest.skip("the CPU autocast path: with CUDA cpu_compat changes nothing and the actor keeps bf16 parameters")
    return shared_launch(request, tmp_path_factory)["bf16"]


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_bf16_autocast_log_probs_and_steps_agree_with_the_torch_backends_bf16(bf16, arch):
    """model.dtype=bfloat16 on the Megatron backend on a CPU: it trains (before cpu_compat re-decorated megatron-core's
    autograd Functions for CPU autocast, the first backward failed with "expected m1 and m2 to have the same dtype")
    and agrees with the torch backend in bf16 as closely as bf16 allows (tolerances: module docstring)."""
    res = bf16[arch]
    assert "failed" not in res, res.get("failed")
    assert res["autocast"] == [True, "torch.bfloat16", "torch.float32"]
    logp = res["logp_diff"]
    assert logp["megatron-torch"] <= 3 * logp["torch-torch_fp32"], logp
    assert logp["megatron-megatron_fp32"] > 1e-4, logp  # autocast was on
    assert logp["megatron_recompute-megatron"] == 0.0, logp
    steps = res["steps"]
    assert steps["megatron_recompute"] == steps["megatron"]
    for i, (m, t) in enumerate(zip(steps["megatron"], steps["torch"], strict=True)):
        loss = dict(rel=1e-2, abs=0) if i == 0 else dict(rel=0, abs=5e-3)
        assert m["train/loss"] == pytest.approx(t["train/loss"], **loss), i
        assert m["train/grad_norm"] == pytest.approx(t["train/grad_norm"], rel=1e-2 if i == 0 else 1e-1), i
        assert m["train/entropy"] == pytest.approx(t["train/entropy"], rel=1e-3), i
        assert m["train/lr"] == t["train/lr"]


def test_bf16_fp32_runs_use_no_autocast(bf16):
    """The fp32 policies beside the bf16 ones train without autocast: their steps equal the torch backend's fp32
    steps to the fp32 tolerance (the autocast re-decoration does nothing with autocast off)."""
    for arch in ("dense", "moe"):
        assert "failed" not in bf16[arch], bf16[arch].get("failed")
        rows = [{"megatron": m, "torch": t} for m, t in zip(bf16[arch]["steps"]["megatron_fp32"],
                                                          bf16[arch]["steps"]["torch_fp32"], strict=True)]
        assert_same_steps(rows, STEP_KEYS)


# ---- single process ---------------------------------------------------------------------------------


def cuda_sites(module: str) -> int:
    """Lines of `module`'s installed source matching cpu_compat.CUDA_PATTERN."""
    from relax.train.megatron import cpu_compat
    source = Path(importlib.util.find_spec(module).origin).read_text()
    return sum(1 for line in source.splitlines() if cpu_compat.CUDA_PATTERN.search(line))


def test_cpu_redirect_call_sites_match_installed_megatron_core():
    """An upgrade of megatron-core that adds, removes or moves a CUDA-only call site in a redirected module
    fails here: re-audit cpu_compat (and the modules it lists) before trusting CPU runs again."""
    from relax.train.megatron import cpu_compat
    assert {module: cuda_sites(module) for module in cpu_compat.REDIRECTED_MODULES} == cpu_compat.CALL_SITES
    import megatron.core

    assert megatron.core.__version__ == "0.16.1", "cpu_compat was audited against megatron-core 0.16.1"
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert re.search(r'megatron = \["megatron-core==0\.16\.1"\]', pyproject)


def test_every_megatron_module_the_cpu_runs_load_is_audited_for_cuda_call_sites(launched):
    """Every megatron.core module loaded by the TP=2, DP=2 and PP=2 runs (rank 0's sys.modules) has its CUDA call
    sites either redirected (cpu_compat.CALL_SITES) or audited as off the CPU path (UNREDIRECTED_SITES), with the
    count the audit saw; a module with sites in neither fails, so a new site anywhere on the path is noticed."""
    from relax.train.megatron import cpu_compat
    loaded = set(launched["megatron_modules"])
    assert set(cpu_compat.CALL_SITES) <= loaded, "a redirected module is no longer loaded: drop it from CALL_SITES"
    sources = [m for m in loaded if (importlib.util.find_spec(m).origin or "").endswith(".py")]
    found = {m: n for m in sources if (n := cuda_sites(m))}
    assert found == {**cpu_compat.CALL_SITES, **cpu_compat.UNREDIRECTED_SITES}


def test_every_autograd_function_the_cpu_runs_load_is_audited_for_autocast(launched):
    """Every torch.autograd.Function of every megatron.core module the CPU runs load is either given the CPU
    autocast state in its backward (cpu_compat.AUTOCAST_FUNCTIONS) or audited as indifferent to it
    (AUTOCAST_NEUTRAL); every one megatron-core decorates with torch.amp.custom_fwd/custom_bwd itself is in
    AUTOCAST_FUNCTIONS. A new Function (or a new CUDA-decorated one) in a future megatron-core fails here instead of
    failing a bf16 run on a CPU."""
    from relax.train.megatron import cpu_compat
    functions = {m: cpu_compat.autograd_functions(importlib.import_module(m)) for m in launched["megatron_modules"]}
    found = {(m, name) for m, classes in functions.items() for name in classes}
    listed = {(m, name) for table in (cpu_compat.AUTOCAST_FUNCTIONS, cpu_compat.AUTOCAST_NEUTRAL)
              for m, names in table.items() for name in names}
    assert found == listed
    rewrapped = {(m, name) for m, names in cpu_compat.AUTOCAST_FUNCTIONS.items() for name in names}
    decorated = {(m, name) for m, classes in functions.items() for name, cls in classes.items()
                 if cpu_compat.amp_device(cls.forward) or cpu_compat.amp_device(cls.backward)}
    assert decorated <= rewrapped


def test_cpu_autocast_redecoration_runs_the_backward_under_the_forwards_autocast():
    """After cpu_compat.enable() (a process without CUDA), each Function of AUTOCAST_FUNCTIONS is decorated for the
    CPU: a bf16-autocast forward of the column-parallel linear's Function with an fp32 weight has a backward (run
    outside autocast, as megatron-core's schedules run it) that computes; the undecorated one fails as it did."""
    from relax.train.megatron import cpu_compat
    if not cpu_compat.needed():
        pytest.skip("CUDA is available: cpu_compat changes nothing")
    from megatron.core.tensor_parallel import layers
    cpu_compat.enable()
    for module, names in cpu_compat.AUTOCAST_FUNCTIONS.items():
        for name in names:
            cls = getattr(importlib.import_module(module), name)
            assert (cpu_compat.amp_device(cls.forward), cpu_compat.amp_device(cls.backward)) == ("cpu", "cpu"), name
    fn = layers.LinearWithGradAccumulationAndAsyncCommunication
    weight = torch.randn(4, 8, requires_grad=True)
    x = torch.randn(3, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fn.apply(x, weight, None, False, False, False, None, 0, None)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    with torch.no_grad():
        want = torch.ones(3, 4, dtype=torch.bfloat16).matmul(weight.bfloat16()).float()
    assert torch.equal(x.grad, want)


def _tiny_hf(arch: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=33, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=48, max_position_embeddings=64)
    torch.manual_seed(0)
    if arch == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=8, tie_word_embeddings=True, **common))
    return LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common))  # SmolLM2-135M's layout


def test_moe_converter_round_trip_per_expert_parallel_rank_and_per_expert_files(tmp_path):
    """Qwen3-MoE: each expert-parallel rank converts its experts (global indices), and their union converts back to
    the HF state dict; a checkpoint written by transformers (one tensor per expert) reads as the stacked tensors."""
    from relax.config.schema import ModelConfig
    from relax.models.hf import build_model
    from relax.train.megatron import convert
    from relax.train.megatron.model import arch_from_hf_config, check_parallel_sizes
    from relax.train.megatron.policy import _hf_getter

    model = build_model(ModelConfig(arch="qwen3_moe", num_layers=2), 33, 0, seed=0, dtype=torch.float32)
    spec = arch_from_hf_config(model.config)
    assert (spec.num_experts, spec.moe_top_k, spec.norm_topk_prob, spec.qk_norm) == (4, 2, True, True)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    parts = [convert.hf_to_megatron(spec, state.__getitem__, experts=range(2 * r, 2 * r + 2)) for r in range(2)]
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in parts[1]
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" not in parts[0]
    assert convert.local_to_global("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", 1, 2) == \
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    back = convert.megatron_to_hf(spec, [{**parts[0], **parts[1]}])
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], v) for k, v in state.items())
    model.save_pretrained(tmp_path)  # transformers writes mlp.experts.{e}.gate_proj/up_proj/down_proj
    get = _hf_getter(tmp_path)
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"):
        assert torch.equal(get(name), state[name])
    with pytest.raises(ValueError, match="expert_parallel_size=3 must divide num_experts=4"):
        check_parallel_sizes(spec, tp=1, pp=1, ep=3)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_converter_round_trip_per_tensor_parallel_rank(arch):
    from relax.train.megatron import convert
    from relax.train.megatron.model import arch_from_hf_config

    model = _tiny_hf(arch)
    spec = arch_from_hf_config(model.config)
    state = dict(model.state_dict())
    if spec.tie_word_embeddings:
        state.pop("lm_head.weight")
    for tp in (1, 2):
        shards = [convert.hf_to_megatron(spec, state.__getitem__, tp_rank=r, tp_size=tp) for r in range(tp)]
        assert shards[0]["embedding.word_embeddings.weight"].shape[0] == spec.padded_vocab_size(tp) // tp
        back = convert.megatron_to_hf(spec, shards)
        assert sorted(back) == sorted(state)
        for k, v in state.items():
            assert torch.equal(back[k], v), (tp, k)
    assert ("output_layer.weight" in shards[0]) == (not spec.tie_word_embeddings)
    assert ("decoder.layers.0.self_attention.q_layernorm.weight" in shards[0]) == (arch == "qwen3")


def test_unsupported_architecture_is_named():
    from transformers import MistralConfig

    from relax.train.megatron.model import arch_from_hf_config, check_parallel_sizes

    with pytest.raises(ValueError, match="'mistral'"):
        arch_from_hf_config(MistralConfig())
    spec = arch_from_hf_config(_tiny_hf("qwen3").config)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide"):
        check_parallel_sizes(spec, tp=4, pp=1)
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 must divide"):
        check_parallel_sizes(spec, tp=1, pp=3)


def test_transformer_engine_names_are_the_local_specs_names():
    """A Transformer Engine model's fused norm weights convert as the local spec's norms: the pairs megatron-core
    itself maps between the two specs (the local spec's `sharded_state_dict_keys_map`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from relax.train.megatron import convert
    pairs = get_gpt_layer_local_spec(qk_layernorm=True).submodules.sharded_state_dict_keys_map
    assert len(pairs) == 2
    for local, te in pairs.items():
        assert convert.local_to_global(f"decoder.layers.1.{te}weight", 2) == f"decoder.layers.3.{local}weight"
    assert convert.local_to_global("decoder.layers.0.self_attention.linear_qkv.weight", 1) == \
        "decoder.layers.1.self_attention.linear_qkv.weight"


def test_layer_spec_resolution():
    from relax.train.megatron import model
    cpu = torch.device("cpu")
    assert model.resolve_layer_spec("auto", cpu) == "local"
    assert model.resolve_layer_spec("local", cpu) == "local"
    with pytest.raises(ValueError, match="layer_spec=transformer_engine: this rank runs on cpu"):
        model.resolve_layer_spec("transformer_engine", cpu)


def test_a_packed_micro_batch_delimits_each_sequence_for_thd_attention():
    """train.pack_sequences on Megatron (Transformer Engine's THD attention, run in tests/gpu): the layout alone,
    against the padded layout of the same rows: each sequence between two cu_seqlens with positions from 0, the
    packed row padded to a multiple of TP as a sequence of its own, and each response token predicted at a position
    whose next token is that response token."""
    from relax.train.megatron.policy import left_aligned, packed_micro_batch

    spec = importlib.util.spec_from_file_location("backends_conftest", Path(__file__).parents[1] / "backends"
                                                  / "conftest.py")
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    samples = helpers.random_samples(5, 6, 4, seed=2, vocab=33)
    rows = torch.tensor([4, 1, 2])
    mb = packed_micro_batch(samples, rows, pad_token_id=0, multiple=5)  # 24 tokens: one of padding
    cu = mb.packed_seq_params.cu_seqlens_q.tolist()
    assert mb.packed_seq_params.qkv_format == "thd" and cu[0] == 0 and cu[-1] == mb.tokens.shape[1]
    assert mb.tokens.shape == (1, cu[-1]) and cu[-1] == 25
    sub = samples.select(rows)
    lengths = (sub.prompt_mask.sum(-1) + sub.present().bool().long().sum(-1)).tolist()
    assert [b - a for a, b in zip(cu, cu[1:], strict=False)][:3] == lengths
    assert sum(lengths) == 24 and len(cu) == 5  # the padding is a sequence of its own
    for a, b in zip(cu, cu[1:], strict=False):
        assert mb.positions[0, a:b].tolist() == list(range(b - a))
    tokens, cols, targets, t = left_aligned(sub, 0)
    assert mb.t == t
    valid = mb.packed.valid
    assert torch.equal(mb.targets[0], targets[valid])
    assert torch.equal(mb.tokens[0, mb.gather_cols[0] + 1], mb.targets[0])  # what each position predicts
    assert torch.equal(mb.tokens[0, mb.gather_cols[0]], tokens.gather(1, cols)[valid])  # from the same context token
