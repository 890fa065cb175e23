"""`train.backend=megatron` through the real loop: Ray, the embedded rollout engine, MLflow, checkpoints.

One asynchronous run at tensor parallelism 2 (stale samples: every rank computes old log-probs under the weights
of their version) against the torch backend on the same config: the same start gives the same first step. The run
is agentic (data=guess_number: episodes whose observations the ranks attend to and do not train); single-turn parity
is checked rank by rank in test_megatron_cpu.py.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                 or importlib.util.find_spec("megatron.core") is None,
                                 reason="megatron-core is not installed (pip install -e '.[megatron]')")]

FIRST_STEP = ["train/pg_loss", "train/grad_norm", "train/entropy", "train/loss", "rollout/raw_reward",
              "rollout/turns_mean", "rollout/obs_token_frac"]
COMMON = ["rollout/raw_reward", "rollout/response_len", "train/loss", "train/grad_norm", "train/lr", "train/entropy",
          "rollout/staleness_mean", "rollout/train_rollout_logp_abs_diff", "perf/step_time", "perf/actor_compute_time"]


def overrides(tmp_path, name: str, *extra: str) -> list[str]:
    return ["model.dtype=float32", "train.num_rollout=3", "rollout.rollout_batch_size=4",
            "rollout.n_samples_per_prompt=4", "train.micro_batch_size=8", "train.mode=fully_async",
            "train.max_staleness=1", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "tracking.progress=false",
            "data=guess_number", "rollout.max_turns=3", "rollout.max_episode_tokens=40",
            f"train.save_dir={tmp_path}/{name}", *extra]


def test_megatron_tp2_sequence_parallel_trains_through_ray_like_the_torch_backend(tmp_path, ray_local, fresh_store):
    import torch
    from inprocess_ray import inprocess_ray
    from transformers import AutoModelForCausalLM

    from relax.config import load_config
    from relax.runner.train import run

    fresh_store(tmp_path)
    mega = run(load_config(overrides(tmp_path, "mega", "train.backend=megatron", "train.tensor_parallel_size=2",
                                     "train.sequence_parallel=true", "train.save_hf=true")), output_dir=tmp_path / "a")
    with inprocess_ray():  # the torch backend's first step, for comparison: its roles in this process
        ref = run(load_config(overrides(tmp_path, "torch", "train.num_rollout=1")), output_dir=tmp_path / "b")
    assert [s for s, _ in mega.history] == [0, 1, 2]
    for _, m in mega.history:
        assert not [k for k in COMMON if k not in m]
    assert max(m["rollout/staleness_max"] for _, m in mega.history) == 1  # stale batches were trained
    first, expected = mega.history[0][1], ref.history[0][1]
    for key in FIRST_STEP:  # the same initial weights and the same first batch
        assert first[key] == pytest.approx(expected[key], rel=1e-3, abs=1e-6), key

    hf = tmp_path / "mega" / "step_000003" / "hf"
    model = AutoModelForCausalLM.from_pretrained(str(hf), local_files_only=True)
    state = json.loads((tmp_path / "mega" / "step_000003" / "policy" / "trainer_state.json").read_text())
    assert state["layer_spec"] == "local"  # train.layer_spec=auto on a CPU
    ids = torch.tensor([[3, 4, 5, 6]])
    assert torch.isfinite(model(ids).logits).all()
    # at the end of the run (train.save_hf=true) the final checkpoint's hf/ is exported to <save_dir>/hf as it is
    export = tmp_path / "mega" / "hf"
    assert json.loads((export / "relax_export.json").read_text())["weights_from"] == "hf/"
    exported = AutoModelForCausalLM.from_pretrained(str(export), local_files_only=True).state_dict()
    assert all(torch.equal(exported[name], tensor) for name, tensor in model.state_dict().items())


def test_megatron_trains_tiny_moe_with_routing_replay(tmp_path, ray_local, fresh_store):
    """model=tiny_moe on train.backend=megatron through the real loop with routing replay, with PPO (a critic role
    beside the Megatron actor: the suite's run of test_megatron_moe_algorithms.py, whose other algorithms are the
    matrix's; GRPO on Megatron through Ray is the TP=2 test's), in bf16 (what
    model.dtype=auto is on a CPU with native bf16: the Megatron trainer under CPU bf16 autocast, which stopped at the
    first optimizer step before cpu_compat decorated megatron-core's autograd Functions for it): the engine's routes
    reach the Megatron trainer (its router agreement, reported only where routes arrived, is 1 on every step), the
    load-balancing loss, the router z-loss and the expert load are logged, and the HF export at the end is a
    Qwen3-MoE with every expert (the parity itself, fp32 and bf16: test_megatron_cpu.py,
    test_megatron_moe_aux_loss.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    from relax.config import load_config
    from relax.runner.train import run

    fresh_store(tmp_path)
    result = run(load_config(["algorithm=ppo", "model=tiny_moe", "train.backend=megatron",
                              "rollout.routing_replay=true", "model.dtype=bfloat16", "train.num_rollout=2",
                              "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4",
                              "rollout.max_response_len=8",
                              "train.micro_batch_size=4", "data.num_prompts=16", "train.save_hf=true",
                              "train.moe_z_loss_coef=0.001", "train.moe_aux_loss_coef=0.01",
                              f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "tracking.progress=false",
                              f"train.save_dir={tmp_path}/moe"]), output_dir=tmp_path / "out")
    assert result.series("rollout/router_agreement") == [1.0, 1.0]
    assert all(torch.isfinite(torch.tensor(result.series("train/loss"))))
    assert len(result.series("train/moe_z_loss")) == 2
    # E / k * sum_e f_e P_e <= E / k: each f_e <= 1 (a token picks an expert once) and the P_e sum to 1
    aux = result.series("train/moe_aux_loss")
    assert len(aux) == 2 and all(0 < v <= 4 / 2 for v in aux), aux
    assert all(1.0 <= v <= 4 / 2 for v in result.series("train/moe_expert_load_max_over_mean/layer_0"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "moe" / "hf"), local_files_only=True)
    assert model.config.model_type == "qwen3_moe"
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4
