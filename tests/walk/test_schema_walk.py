"""Every option either changes what runs or is rejected before start: a walk over every config field.

For each field of the schema (`RelaxConfig` and its sections) and of every algorithm's config class, the walk
sets one non-default value and asserts that either validation rejects the config, or a short run of the real
training loop records something different from the same run with the default: its service-graph plan, its
metrics, its checkpoint files and saved model config, its MLflow run, its output. A field added to the schema
is walked automatically; one that is accepted and ignored fails here.

The runs use the real loop, roles and backends in this process (tests/inprocess_ray.py, the transport only is
replaced; see tests/runner for the same loop on a real Ray). Runs are deterministic, so "different" is exact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from inprocess_ray import inprocess_ray

from relax import algorithms
from relax.config import ConfigError, load_config
from relax.config.schema import RelaxConfig

# its runs share module-scoped baselines (the default run of each algorithm and context): one xdist worker runs
# them in a row, so that each baseline runs once, not once per worker
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("walk")]

# A short, fast run of the default experiment: every section at work (rollout, rewards, advantages, two optimizer
# steps per rollout so that off-policy terms bind, checkpoints, MLflow), two rollouts.
BASE = [
    "train.num_rollout=2",
    "rollout.rollout_batch_size=2",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_response_len=4",
    "train.micro_batch_size=4",
    "train.lr=0.02",
    "data.num_prompts=32",
    "train.save_interval=2",
    "model.dtype=float32",  # bf16 kernels on tiny shapes are slower than fp32 on CPUs
    "cluster.cpus_per_node=1",  # one torch thread: the tiny model gains nothing from more
    # reward calls in this process: a limit runs them in worker processes, fresh interpreters that each run starts
    # anew (most of a short run's CPU); data.reward_timeout_s's own case walks it to a limit
    "data.reward_timeout_s=null",
]
# Algorithms that allow it get two optimizer steps per rollout, so that clipping and ratios bind.
MULTI_STEP = ["train.num_steps_per_rollout=2"]

# Values for fields where "default + a little" would not bind: limits, bounds and thresholds show their effect
# only where they are reached, so the walk sets them where they are.
VALUES: dict[str, Any] = {
    "rollout.max_prompt_len": 10,  # the digits prompts are 11 tokens: all are dropped, the run says so at start
    "train.clip_grad": 0.001,
    "train.mismatch_gate": "stop",  # on: the old log-probs recomputed, the mismatch and the gate's streak logged
    "train.mismatch_gate_metric": "logp_abs_diff",
    "algorithm.eps_clip": 0.01,
    "algorithm.eps_clip_high": 0.01,
    # dual clip: the second optimizer step of a rollout (MULTI_STEP) moves some ratios of tokens with A < 0 above 1.1,
    # whose loss it caps (train/pg_clipfrac_lower ~0.07), which changes the next step's weights
    "algorithm.dual_clip_c": 1.1,
    "algorithm.kl2_budget": 1e-6,
    "algorithm.miniclip_low": 0.9,
    "algorithm.miniclip_high": 0.001,
    "algorithm.value_clip": 1e-4,
    "algorithm.tis_clip": 0.5,
    "algorithm.tis_level": "sequence",
    "algorithm.rollout_mask": "token",
    # with rollout_mask=token: the engine's and the trainer's fp32 log-probs differ by rounding only, so a bound at 1
    # masks the tokens on one side of it
    "algorithm.rollout_mask_low": 1.0,
    "algorithm.rollout_mask_high": 1.0,
    # responses of unequal length: each one's token sum over the responses differs from its token mean's
    "algorithm.loss_agg_mode": "seq-mean-token-sum",
    "algorithm.loss_scale_factor": 8.0,  # walked from 4 (CONTEXT): the loss halves
    "data.openai_agent": "gateway_agents:three_turns",  # needs rollout=sglang: rejected (its runs: tests/openai)
    "algorithm.kl_coef": 0.5,
    "model.dtype": "bfloat16",
    "model.name": "tiny-walk",
    "model.arch": "llama",
    "model.source": "hf",  # from $MODEL_DIR/<name>, which the walk does not provide: the run says so at start
    "model.path": "some/model",
    "model.base_path": "some/base",  # with model.source=config: rejected (its runs: tests/models/test_peft_adapter.py)
    # not there: the run says so at start (its runs: tests/models/test_lora_continue.py)
    "model.lora_adapter_path": "some/adapter",
    "model.tokenizer": "some/tokenizer",  # not there: the run says so at start (its effect: tests/data)
    "model.chat_template": "some/template.jinja",  # not there: the run says so at start (its effect: tests/data)
    "cluster.cpus_per_node": 2,
    "cluster.role_cores": {"rollout": "0", "actor": "1"},
    "data.prompt_key": "question",
    "data.label_key": "answer",
    "algorithm.kl_loss_type": ("k2", "k1"),  # the first that differs from the algorithm's default
    "algorithm.kl_loss_coef": 0.3,
    "algorithm.critic_lr": 0.01,
    "model.max_position_embeddings": 1024,
    "cluster.name": "walk",
    "cluster.address": "auto",
    "data.name": "walk",
    "data.task": "arithmetic",
    "data.reward": "arithmetic",
    "data.reward_weights": "[2.0]",  # with one data.reward: rejected (weights are for a list)
    "data.prompt_overflow": "error",
    "data.reward_error": "raise",
    "data.reward_timeout_s": 1e-7,  # no call returns within 0.1 us: every call fails, every group is left out
    "data.system_prompt": "Answer with one digit.",
    "data.path": "prompts.jsonl",
    "data.eval_path": "prompts.jsonl",
    "data.eval_sets": {"extra": "prompts.jsonl"},
    "rollout.eval_top_p": 0.5,
    "rollout.max_episode_tokens": 40,  # single-turn data: rejected (the episode options: tests/agents)
    "data.env": "guess_number",
    "data.tools": "[calculator]",
    # a module that cannot be imported is refused; one that can changes a run only through what it registers and the
    # config then selects (tests/cli/test_plugins.py runs a plugin's algorithm)
    "plugins": "[relax_walk_no_such_plugin]",
    "data.tool_parser": "qwen3_coder",  # the tiny model's ChatML template: auto is hermes
    "data.agent": "tests.agents.echo_agent:Echo",
    "data.turn_rewards": "per_turn",
    "train.eval_pass_k": "[1]",  # the default with 2 eval samples per prompt (EVAL_CONTEXT) is [1, 2]
    "train.eval_correct_threshold": 0.25,  # the untrained model rarely earns the full reward of 1
    "train.eval_save_samples": True,  # a training run's default: no eval samples written
    "train.lr_schedule": "cosine",
    "train.save_dir": "elsewhere",
    "train.resume": "auto",
    "train.ref_load": "ref_model",
    "tracking.uri": "sqlite:///other.db",
    "tracking.experiment": "walk",
    "tracking.run_name": "walk-run",
    "tracking.arm": "walk-arm",
    "tracking.sweep_id": "walk-sweep",
    "tracking.parent_run_id": "0123456789abcdef",
    "tracking.system_metrics_interval_s": 0.05,  # samples within the probe's half second (the default: at the end only)
    "train.keep_checkpoints": 1,
    "train.save_interval": 1,  # every step, where the base saves every second one
    "train.warmup_steps": 2,  # a warmup of 1 step is no warmup: the first step's factor is (0 + 1) / 1
    "train.backend": "megatron",
    "train.mode": "fully_async",
    "train.max_staleness": 1,  # derived (None); 1 in sync is rejected: sync is on-policy
    # derived (None: on in the asynchronous modes); true in sync is rejected. Its effect, loads that swap weights
    # copied beside generation, is on time only: tests/runner/test_rollout_stream.py, tests/backends/test_rollout_*
    "rollout.stage_weights": True,
    "train.layer_spec": "local",  # megatron's layers: rejected on the torch backend (tests/megatron: both specs)
    "rollout.backend": "sglang",
    # rollout.sglang.* act with rollout=sglang only (rejected here; their effects: tests/sglang/test_options.py)
    "rollout.sglang.server": "embedded",
    "rollout.sglang.urls": "[http://127.0.0.1:30000]",
    "rollout.sglang.host": "0.0.0.0",
    "rollout.sglang.router_policy": "round_robin",
    "rollout.sglang.weight_sync": "distributed",
    "rollout.sglang.extra_args": "[--mem-fraction-static,0.5]",
    "train.calculate_per_token_loss": True,  # grpo's default is false
    "train.global_batch_size": 8,
    "train.max_tokens_per_micro_batch": 10,  # two of the probe's rows of 5 tokens, where micro_batch_size allows 4
    "train.num_steps_per_rollout": 1,
    "train.adam_beta1": 0.5,
    "train.adam_beta2": 0.9,
    "train.max_skipped_steps": 1,
    "data.max_failed_reward_steps": 1,
    "train.save_failures": "continue",
    "rollout.over_sampling_batch_size": 3,  # derived (None: rollout_batch_size when filtering)
    "rollout.max_filter_rounds": 1,  # one round: groups without a signal fill the batch instead of another round
    # the teacher's fields, walked with distillation (TEACHER_BASE): another directory (missing: the run says so at
    # start), a GGUF teacher (SmolLM2's, whose tokenizer is not the tiny model's: rejected at start)
    "teacher.name": "walk-teacher",
    "teacher.source": "gguf",
    "teacher.path": "other_teacher",
    # teacher_model is a full model directory, no PEFT adapters: the run says so at start (its runs:
    # tests/models/test_peft_adapter.py)
    "teacher.base_path": "teacher_model",
    "teacher.dtype": "bfloat16",
    "teacher.backend": "megatron",  # not in this build: rejected
    # the reward model's fields: without one (reward_model=none, the base) each is rejected; its runs: tests/rewards
    "reward_model.kind": "classifier",  # without reward_model.path: rejected
    "reward_model.path": "some/reward_model",
    "reward_model.base_path": "some/base",
    "reward_model.dtype": "bfloat16",
    "reward_model.colocate": True,
    "reward_model.template": "rate it",
    "reward_model.parser": "score_tag",
    "reward_model.engine": "openai",
    "reward_model.url": "http://127.0.0.1:9/v1",
    "reward_model.api_key_env": "WALK_KEY",
    "reward_model.model": "walk-judge",
    # the vision fields: on the text-only tiny model each is rejected naming the field; their runs: tests/models
    "model.freeze_vision_tower": True,
    "data.image_key": "pictures",
    # a remote reward service's fields: without data.reward=http(s)://... each is rejected; its runs: tests/rewards
    "data.reward_service.api_key_env": "WALK_KEY",
    # the sandbox's limits (data.sandbox.*): without a code_tests reward or the python tool each is rejected, as is
    # data.reward_workers with the base's reward calls in the driver; their runs: tests/rewards/test_sandbox_options.py
    "data.sandbox.wall_s": 20.0,
    "data.sandbox.cpu_s": 2,
    "data.reward_workers": 2,
    "data.reward_memory_mb": 256,  # as data.reward_workers: rejected with the base's calls in the driver; its runs:
    # tests/rewards/test_reward_memory_limit.py
    "model.lora_target_modules": "[q_proj,v_proj]",
    "model.lora_dropout": 0.5,
    "rollout.lora_sync": "adapter",
    "algorithm.teacher_adv_clip": 0.05,
}
# Evaluation after each step, with sampling: what evaluation's own fields act on.
EVAL_CONTEXT = ["train.eval_interval=1", "data.num_eval_prompts=4", "rollout.eval_n_samples_per_prompt=2",
                "rollout.eval_temperature=1.0"]
# Settings a field acts together with (documented with the field); the walk runs both the default and the
# changed value in this context. A field that only acts in a context is rejected outside it by validation.
CONTEXT: dict[str, list[str]] = {
    **{key: EVAL_CONTEXT for key in ("data.eval_sets", "rollout.eval_top_p", "train.eval_pass_k",
                                     "train.eval_correct_threshold", "train.eval_save_samples")},
    "data.prompt_overflow": ["rollout.max_prompt_len=10"],
    "data.reward_error": ["data.reward=walk_reward:reward"],
    "data.max_failed_reward_steps": ["data.reward=walk_reward:always_fails"],  # the default 3: the 2 steps run
    "train.min_lr_ratio": ["train.lr_schedule=cosine"],
    "train.max_skipped_steps": ["train.lr=1e30"],  # the first update blows the weights up; later gradients are NaN
    "train.keep_checkpoints": ["train.save_interval=1"],
    "algorithm.tis_clip": ["algorithm.use_tis=true"],
    "algorithm.tis_level": ["algorithm.use_tis=true"],
    "algorithm.rollout_mask_low": ["algorithm.rollout_mask=token"],
    "algorithm.rollout_mask_high": ["algorithm.rollout_mask=token"],
    "algorithm.loss_scale_factor": ["algorithm.loss_agg_mode=seq-mean-token-sum-norm", "algorithm.loss_scale_factor=4"],
    "algorithm.kl_loss_coef": ["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.1"],
    "algorithm.kl_loss_type": ["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.1"],
    # LoRA's settings act with adapters (model.lora_rank > 0); rollout.lora_sync=adapter: the engine adds B A itself,
    # which rounds differently from the merged weights (the bytes sent, perf/sync_bytes, are not walked)
    **{key: ["model.lora_rank=2"] for key in ("model.lora_alpha", "model.lora_dropout", "model.lora_target_modules",
                                              "rollout.lora_sync")},
    "data.overlong_penalty_factor": ["data.overlong_buffer_len=2"],  # the factor scales a penalty that is on
    # the parser reads the calls of the built-in tool loop (and of the OpenAI gateway, relax-serve: tests/agents)
    # the digits prompts list the calculator's schema (about 300 tiny-tokenizer tokens)
    "data.tool_parser": ["data.tools=[calculator]", "rollout.max_turns=2", "data.tool_timeout_s=null",
                         "rollout.max_prompt_len=400"],
    # steps by tokens differ from steps by rows where responses differ in length: long enough for some to stop early
    "train.use_dynamic_global_batch_size": ["rollout.max_response_len=24"],
    # the MLflow model of the directory train.save_hf exports at the end of the run (its tag relax.model_uri; the
    # export itself, <save_dir>/hf, shows in the files of train.save_hf=true without a context)
    "tracking.log_model": ["train.save_hf=true"],
    "rollout.over_sampling_batch_size": ["rollout.filter_groups=true"],
    # groups with a failed reward call carry no signal: most groups here, so rounds run to the limit
    "rollout.max_filter_rounds": ["rollout.filter_groups=true", "data.reward=walk_reward:reward"],
}
# Fields whose effect is on resources, not on a run's records; each with the probe that observes it.
PROBES = {
    "model.gradient_checkpointing": "probe_gradient_checkpointing",
    # megatron: the actor becomes Megatron ranks (the plan); its training is checked against the torch backend's
    # in tests/megatron (real processes: the walk's in-process transport cannot host a process group)
    "train.backend": "probe_actor_backend",
    # each role's process on cores of its own: what the plan starts each process with (its cores, a rollout process of
    # its own); the processes pinned, read from /proc: tests/runner/test_async_training.py (real processes)
    "cluster.role_cores": "probe_role_cores",
    # the untrained tiny model never writes a tool call: the probe gives the tool loop one
    "data.tool_parser": "probe_tool_parser",
    "train.micro_batch_size": "probe_micro_batches",
    "train.max_tokens_per_micro_batch": "probe_micro_batches",
    "train.pack_sequences": "probe_tokens_computed",
    # they act when a checkpoint cannot be written or a signal comes (tests/faults/test_save_failures.py and
    # test_preemption.py fill a real actor's disk and signal real runs)
    "train.save_failures": "probe_save_failures",
    "train.save_on_preempt": "probe_save_on_preempt",
    # they act when a role dies or hangs (tests/faults/test_role_failures.py kills and stops real processes)
    "train.max_restarts": "probe_max_restarts",
    "cluster.heartbeat_timeout_s": "probe_heartbeat_timeout",
    "train.checkpoint_timeout_s": "probe_checkpoint_timeout",
    # they act on the MLflow run's system/ metrics, sampled in time (tests/tracking/test_mlflow_completeness.py)
    "tracking.system_metrics": "probe_system_metrics",
    "tracking.system_metrics_interval_s": "probe_system_metrics",
}


def leaf_fields(cls: type, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for f in dataclasses.fields(cls):
        if f.name == "algorithm":
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(default):
            out += leaf_fields(type(default), f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", default))
    return out


def algorithm_fields(name: str) -> list[tuple[str, Any]]:
    cls = algorithms.get(name).config_cls
    return [(f"algorithm.{f.name}", f.default) for f in dataclasses.fields(cls) if f.name != "name"]


def other_value(key: str, value: Any) -> Any:
    if key in VALUES:
        candidates = VALUES[key] if isinstance(VALUES[key], tuple) else (VALUES[key],)
        return next(c for c in candidates if c != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 if value else 0.05
    raise AssertionError(f"the walk has no non-default value for {key}={value!r}: add one to VALUES")


def base_value(key: str, base: list[str], default: Any) -> Any:
    """The field's value in the walk's base run: what the base overrides set it to (a count or a length the base
    keeps small, such as train.num_rollout=2), else its default. The walk changes that value, so that a changed run
    costs what the base run does (the schema's default of 60 rollouts + 1 would run 61)."""
    text = next((o.split("=", 1)[1] for o in base if o.startswith(f"{key}=")), None)
    if text == "null":
        return None
    if text is None or isinstance(default, bool) or not isinstance(default, int | float):
        return default
    return type(default)(float(text)) if isinstance(default, float) else int(text)


def override(key: str, value: Any) -> str:
    if isinstance(value, dict):  # Hydra adds keys to a dict field (empty by default) with "+"
        return f"+{key}={{{','.join(f'{k}:{v}' for k, v in value.items())}}}"
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return f"{key}={text}"


# An algorithm that distills runs with a teacher, an untrained tiny model that `setup` saves in the run's directory,
# in fp32 as the policy (teacher.dtype=auto is bf16 on a CPU with native bf16 matmul and fp32 on one without)
TEACHER_BASE = ["teacher.path=teacher_model", "teacher.dtype=float32"]


def base_for(algorithm: str) -> list[str]:
    extra = MULTI_STEP if algorithms.get(algorithm).supports_multi_step else []
    teacher = TEACHER_BASE if algorithms.get(algorithm).requires_teacher else []
    return [f"algorithm={algorithm}", *BASE, *extra, *teacher]


class Workspace:
    """A directory per run: the run's cwd, so that relative outputs (mlflow.db, checkpoints) land in it."""

    def __init__(self, root: Path):
        from mlflow.tracking import MlflowClient

        self.root, self.n = root, 0
        # An empty MLflow store, created once and copied into each run's directory: creating a sqlite store
        # runs every schema migration, seconds per run.
        self.store = root / "template.db"
        MlflowClient(f"sqlite:///{self.store}").search_experiments()

    def new(self) -> Path:
        self.n += 1
        path = self.root / f"run{self.n}"
        path.mkdir()
        shutil.copyfile(self.store, path / "mlflow.db")
        (path / "prompts.jsonl").write_text("".join(f'{{"prompt": "repeat {d}", "label": "{d}"}}\n' for d in range(8)))
        return path


def observe(overrides: list[str], cwd: Path) -> dict[str, Any] | str:
    """What a user can see of `relax-train <overrides>`: "rejected", or the records of a short run."""
    cfg = accepted(overrides)  # validation, or Hydra refusing the key or value
    if cfg is None:
        return "rejected"
    from relax.runner.errors import RunError
    from relax.runner.plan import build_plan
    from relax.runner.train import run

    plan_obj = build_plan(cfg)
    plan = plan_obj.render()
    if cfg.dry_run:
        return {"plan": plan, "dry_run": True}  # relax-train prints the plan and starts nothing (tests/cli)
    err = io.StringIO()
    old = Path.cwd()
    os.chdir(cwd)
    try:
        with inprocess_ray(), contextlib.redirect_stderr(err):
            result = run(cfg, plan_obj, output_dir=cwd / "out")
    except RunError as exc:
        return {"plan": plan, "error": str(exc).splitlines()[0]}
    finally:
        os.chdir(old)
    history = [(step, {k: v for k, v in m.items() if not k.startswith("perf/")}) for step, m in result.history]
    files = sorted(str(p.relative_to(cwd)) for p in cwd.rglob("*") if p.is_file() and "out" not in p.parts
                   and not p.name.endswith((".db-journal", ".lock")) and "mlruns" not in p.parts)
    configs = sorted((str(p.relative_to(cwd)), p.read_text()) for p in cwd.rglob("config.json"))
    # the evaluation samples written to the output directory (train.eval_save_samples): the rest of it is logs
    eval_samples = sorted(str(p.relative_to(cwd)) for p in (cwd / "out" / "eval").rglob("*.jsonl"))
    return {"plan": plan, "history": history, "files": files, "model_configs": configs, "eval_samples": eval_samples,
            "mlflow": mlflow_record(cfg, result.run_id, cwd), "progress": "step " in err.getvalue()}


GIT_TAG_PREFIXES = ("relax.git_", "relax.project_git_")


def mlflow_record(cfg: RelaxConfig, run_id: str | None, cwd: Path) -> Any:
    if run_id is None:
        return None
    from mlflow.tracking import MlflowClient

    uri = cfg.tracking.uri
    client = MlflowClient(uri if "://" not in uri or not uri.startswith("sqlite:///") or uri.startswith("sqlite:////")
                          else f"sqlite:///{cwd / uri.removeprefix('sqlite:///')}")
    run = client.get_run(run_id)
    # each run has its own directory: paths are recorded relative to it
    # (git tags describe the code, not the config: a commit during the walk must not make two runs differ)
    tags = {k: v.replace(str(cwd), "<cwd>") for k, v in run.data.tags.items()
            if (not k.startswith("mlflow.") or k == "mlflow.parentRunId") and not k.startswith(GIT_TAG_PREFIXES)}
    tags.pop("mlflow.runName", None)
    # MLflow names an unnamed run at random: only a chosen name is a record of the config
    name = run.info.run_name if run.info.run_name == cfg.tracking.run_name else "<generated>"
    return {"experiment": client.get_experiment(run.info.experiment_id).name, "run_name": name, "tags": tags}


# overrides -> the config (None: rejected), so that the walk composes each config once (a probe's, a base's)
_CONFIGS: dict[tuple[str, ...], RelaxConfig | None] = {}


def accepted(overrides: list[str]) -> RelaxConfig | None:
    """The config, or None when validation (or Hydra) rejects it."""
    key = tuple(overrides)
    if key not in _CONFIGS:
        try:
            _CONFIGS[key] = load_config(overrides)
        except (ConfigError, Exception) as exc:
            if isinstance(exc, ConfigError) or type(exc).__module__.startswith(("hydra", "omegaconf")):
                _CONFIGS[key] = None
            else:
                raise
    return _CONFIGS[key]


def config(overrides: list[str]) -> RelaxConfig:
    """The config of overrides the walk knows are valid (a ConfigError otherwise)."""
    cfg = accepted(overrides)
    if cfg is None:
        raise ConfigError(f"the walk's config is rejected: {overrides}")
    return cfg


def probe_actor_backend(overrides: list[str], cwd: Path) -> Any:
    from relax.runner.plan import build_plan

    plan = build_plan(config(overrides))
    return plan.role("actor").backend, plan.role("actor").why


def probe_role_cores(overrides: list[str], cwd: Path) -> Any:
    from relax.runner.plan import build_plan, ray_options

    plan = build_plan(config(overrides))
    return plan.rollout_in_actor, [ray_options(plan, r.role, i) for r in plan.roles for i in range(r.replicas)]


def probe_tool_parser(overrides: list[str], cwd: Path) -> Any:
    """What the run's tool loop answers to a Qwen3-Coder call (tests/agents/test_tool_parsers.py: every format)."""
    from relax.agents.episode import EpisodeMaker

    maker = EpisodeMaker.for_config(config(overrides))
    loop = maker.loops()
    loop.reset({})
    reply = loop.turn("<tool_call>\n<function=calculator>\n<parameter=expression>\n6 * 7\n</parameter>\n</function>"
                      "\n</tool_call>")
    maker.close()
    return reply.messages


def probe_gradient_checkpointing(overrides: list[str], cwd: Path) -> Any:
    from relax.train.torch_policy import TorchPolicy

    cfg = config(overrides)
    policy = TorchPolicy(cfg.model, cfg.train, vocab_size=40, pad_token_id=0, seed=cfg.seed)
    return policy.model.is_gradient_checkpointing


def probe_micro_batches(overrides: list[str], cwd: Path) -> Any:
    """Micro-batches bound memory: the actor role's forward passes of one train step (the loss itself is
    split-free), for 8 rows of 5 tokens each."""
    import torch

    from relax.batch import TrainBatch
    from relax.roles.workers import ModelInfo, PolicyWorker

    cfg = config(overrides)
    worker = PolicyWorker(cfg, ModelInfo(vocab_size=40, pad_token_id=0, eos_token_ids=(1,)))
    calls = []
    worker.policy.model.register_forward_hook(lambda *a: calls.append(1))
    n = 8
    batch = TrainBatch(prompt_ids=torch.full((n, 3), 5), prompt_mask=torch.ones(n, 3, dtype=torch.long),
                       response_ids=torch.full((n, 2), 6), response_mask=torch.ones(n, 2, dtype=torch.long),
                       rollout_logp=torch.zeros(n, 2), finish_reason=["stop"] * n, advantages=torch.ones(n, 2))
    worker.train_step(batch)
    return len(calls)


def probe_tokens_computed(overrides: list[str], cwd: Path) -> Any:
    """Packing computes the real tokens only: the tokens the actor role's model embeds in one train step, for 8
    rows of 3 prompt tokens and 1 to 8 response tokens."""
    import torch

    from relax.batch import TrainBatch
    from relax.roles.workers import ModelInfo, PolicyWorker

    cfg = config(overrides)
    worker = PolicyWorker(cfg, ModelInfo(vocab_size=40, pad_token_id=0, eos_token_ids=(1,)))
    tokens = []
    worker.policy.model.get_input_embeddings().register_forward_pre_hook(lambda m, a: tokens.append(a[0].numel()))
    n, T = 8, 8
    mask = (torch.arange(T)[None] < torch.arange(1, n + 1)[:, None]).long()
    batch = TrainBatch(prompt_ids=torch.full((n, 3), 5), prompt_mask=torch.ones(n, 3, dtype=torch.long),
                       response_ids=6 * mask, response_mask=mask, rollout_logp=torch.zeros(n, T),
                       finish_reason=["stop"] * n, advantages=mask.float())
    worker.train_step(batch)
    return sum(tokens)


def probe_max_restarts(overrides: list[str], cwd: Path) -> Any:
    """How many role failures in a row the run's restart policy answers with a restart before it stops."""
    from relax.runner.errors import RoleFailure, RunError
    from relax.runner.restarts import Restarts

    cfg = load_config(overrides + [f"train.save_dir={cwd / 'ckpt'}"])
    restarts = Restarts(cfg.train.max_restarts)
    with contextlib.redirect_stderr(io.StringIO()):
        for n in range(100):
            try:
                restarts.next(cfg, RoleFailure("actor", "died"))
            except RunError:
                return n
    return None


def probe_heartbeat_timeout(overrides: list[str], cwd: Path) -> Any:
    """Whether the driver's watchdog declares hung a role last heard from (and progressing) 400 s ago."""
    from relax.roles.heartbeat import RoleBeat
    from relax.runner.errors import RoleFailure
    from relax.runner.watchdog import Watchdog

    class Snapshot:
        @staticmethod
        def remote():
            return {"actor": RoleBeat(beat_age_s=400.0, progress_age_s=400.0, progress=1, pid=1)}

    board = type("Board", (), {"snapshot": Snapshot})()
    watch = Watchdog(board, config(overrides).cluster.heartbeat_timeout_s)
    with inprocess_ray():
        try:
            watch.check({"actor"}, waited_s=400.0)
        except RoleFailure as exc:
            return str(exc)
    return "alive"


def probe_checkpoint_timeout(overrides: list[str], cwd: Path) -> Any:
    """What the cluster's checkpoint save does when the actor's save never finishes: the driver's wait fails at
    the deadline (ray's wait answering nothing, each poll advancing a fake clock by 100 s)."""
    import sys
    import types
    from unittest import mock

    from relax.runner.cluster import Cluster
    from relax.runner.errors import RoleFailure
    from relax.runner.watchdog import Watchdog

    clock = [0.0]

    def wait(pending, num_returns, timeout):
        clock[0] += 100.0
        return [], pending

    never = types.SimpleNamespace(wait=wait, exceptions=types.SimpleNamespace())
    cluster = object.__new__(Cluster)
    cluster.cfg, cluster.critic, cluster.actor_process = config(overrides), None, "actor"
    cluster.watch = Watchdog(None, None)
    cluster.actor = types.SimpleNamespace(save=types.SimpleNamespace(remote=lambda path: object()))
    staging = types.SimpleNamespace(staging=lambda step: cwd / "staging")
    with mock.patch.dict(sys.modules, {"ray": never}), mock.patch("time.monotonic", lambda: clock[0]):
        try:
            cluster.save(staging, 1, {})
        except RoleFailure as exc:
            return f"{exc} after {clock[0]:g} s"
    return "saved"


def probe_save_failures(overrides: list[str], cwd: Path) -> Any:
    """What a checkpoint whose write fails with ENOSPC does to the run: stops it, or is counted and training goes on."""
    import errno

    from relax.runner.checkpoint import Checkpoints
    from relax.runner.errors import RunError
    from relax.runner.plan import build_plan
    from relax.runner.session import Session

    class FullDisk:
        def save(self, ckpts, step: int, state: dict, rollout=None) -> Path:
            raise OSError(errno.ENOSPC, "No space left on device", str(ckpts.staging_path(step)))

    cfg = load_config(overrides + ["tracking.enabled=false", f"train.save_dir={cwd / 'ckpt'}"])
    ckpts = Checkpoints(cfg, cwd)
    with contextlib.redirect_stderr(io.StringIO()), ckpts, \
            Session(cfg, build_plan(cfg), cwd / "out", checkpoints=ckpts) as session:
        try:
            session.save_checkpoint(FullDisk(), 1, {"sampler": {}})
        except RunError:
            return "stopped"
        return f"went on, {session.checkpoint_failures} checkpoint(s) not written"


def probe_save_on_preempt(overrides: list[str], cwd: Path) -> Any:
    """What the run's signal handler does with a SIGTERM: stop at once, or let the step finish with a checkpoint."""
    import signal
    import time

    from relax.runner.preempt import Preempted, Preemption

    with Preemption.from_config(config(overrides)) as preemption:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)  # the handler runs here at the latest
        except Preempted:
            return "stopped at once"
    return f"stop requested after the step ({signal.Signals(preemption.requested).name})"


def probe_system_metrics(overrides: list[str], cwd: Path) -> Any:
    """How many samples of MLflow's system metrics a run's MLflow record gets in half a second."""
    import time

    from mlflow.tracking import MlflowClient

    from relax.metrics import SYSTEM_PREFIX
    from relax.runner.plan import build_plan
    from relax.runner.session import Session

    cfg = load_config(overrides + [f"tracking.uri=sqlite:///{cwd / 'mlflow.db'}", "tracking.progress=false"])
    with contextlib.redirect_stderr(io.StringIO()), Session(cfg, build_plan(cfg), cwd / "out") as session:
        time.sleep(0.5)
    return len(MlflowClient(cfg.tracking.uri).get_metric_history(session.run_id,
                                                                 f"{SYSTEM_PREFIX}cpu_utilization_percentage"))


# Shared fields that one owner applies the same way for every algorithm (relax.algorithms.loss.compute_loss: the
# rollout correction, the KL loss, the entropy bonus; the runner: the old log-probs' source, the truncation mask):
# walked with grpo, and with each algorithm that declares it ignores one (which must then reject it). Fields whose
# effect depends on the algorithm (clipping, reward shaping, normalisation) are walked with every algorithm.
SHARED_LOSS_TERMS = {"use_tis", "tis_clip", "tis_level", "rollout_mask", "rollout_mask_low", "rollout_mask_high",
                     "use_kl_loss", "kl_loss_coef", "kl_loss_type", "entropy_coef", "mask_truncated",
                     "use_rollout_logprobs", "loss_agg_mode", "loss_scale_factor"}


def cases() -> list[tuple[str, str, Any]]:
    # the teacher's fields with the algorithm that reads them (any other rejects them: tests/algorithms/test_opd.py)
    out = [("opd" if key.startswith("teacher.") else "grpo", key, value) for key, value in leaf_fields(RelaxConfig)]
    for name in algorithms.names():
        ignores = algorithms.get(name).ignores
        out += [(name, key, value) for key, value in algorithm_fields(name)
                if name == "grpo" or key.removeprefix("algorithm.") not in SHARED_LOSS_TERMS
                or key.removeprefix("algorithm.") in ignores]
    return out


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return Workspace(tmp_path_factory.mktemp("walk"))


@pytest.fixture(scope="module")
def baselines():
    return {}


def setup(key: str, cwd: Path, overrides: list[str]) -> None:
    """What a field needs to exist before the run: a checkpoint to resume, a reference model or a teacher to load."""
    if key == "train.resume":
        observe(overrides[:] + ["train.num_rollout=1", "train.save_interval=1"], cwd)
    if key == "train.ref_load":
        from relax.models.hf import build_model

        cfg = config(overrides)
        build_model(cfg.model, 40, 0, seed=99).save_pretrained(str(cwd / "ref_model"))
    if TEACHER_BASE[0] in overrides:
        from relax.data.tokenizer import load_tokenizer
        from relax.models.hf import build_model

        cfg = config(overrides)
        build_model(cfg.model, 40, 0, seed=98).save_pretrained(str(cwd / "teacher_model"))
        load_tokenizer(cfg.model).save_pretrained(str(cwd / "teacher_model"))


def recorded_at_start(cfg: RelaxConfig) -> tuple[str, dict[str, str] | None]:
    """What of a run's records `observe` knows from the config alone: its plan (`observe` records exactly this
    render), and the run's standard tags (the session writes `standard_tags(cfg)` into the MLflow run when it opens
    it, and `mlflow_record` reads them back; tests/tracking: the tags a run gets). Two valid configs that differ here
    differ in their records whatever their runs do, so the walk compares them without running them."""
    from relax.runner.plan import build_plan
    from relax.tracking.params import standard_tags

    return build_plan(cfg).render(), standard_tags(cfg) if cfg.tracking.enabled else None


@pytest.mark.parametrize("algorithm,key,default", cases(), ids=lambda x: str(x))
def test_every_field_is_rejected_or_changes_the_run(algorithm, key, default, workspace, baselines):
    base = base_for(algorithm) + CONTEXT.get(key, [])
    value = other_value(key, base_value(key, base, default))
    changed_overrides = [o for o in base if not o.startswith(f"{key}=")] + [override(key, value)]
    if key in PROBES:
        probe = globals()[PROBES[key]]
        if accepted(changed_overrides) is None:
            return
        probe_key = (PROBES[key], tuple(base))  # the base's answer, once per probe and base
        if probe_key not in baselines:
            baselines[probe_key] = probe(base, workspace.new())
        assert baselines[probe_key] != probe(changed_overrides, workspace.new()), key
        return
    changed_cfg = accepted(changed_overrides)
    if changed_cfg is None:
        return
    base_cfg = accepted(base)
    assert base_cfg is not None, f"the walk's base config is invalid: {base}"
    if recorded_at_start(changed_cfg) != recorded_at_start(base_cfg):
        return  # their plans or their runs' tags differ: so do their records (`recorded_at_start`)
    changed_dir = workspace.new()
    setup(key, changed_dir, base)
    changed = observe(changed_overrides, changed_dir)
    if changed == "rejected":
        return
    cache_key = (algorithm, tuple(CONTEXT.get(key, [])), key in ("train.resume", "train.ref_load"))
    if cache_key not in baselines or key in ("train.resume", "train.ref_load"):
        base_dir = workspace.new()
        setup(key, base_dir, base)
        baselines[cache_key] = observe(base, base_dir)
    reference = baselines[cache_key]
    assert reference != "rejected", f"the walk's base config is invalid: {base}"
    assert changed != reference, f"{key}={value} (algorithm={algorithm}) was accepted and changed nothing observable"


def test_the_walk_sees_an_ignored_field(workspace, monkeypatch):
    """The negative control: were PPO's rejection of std_normalization (which its GAE never reads) removed, the
    runs with and without it would record exactly the same things, and the walk above would fail."""
    from relax.algorithms import base

    ppo = algorithms.get("ppo")
    monkeypatch.setitem(base._REGISTRY, "ppo", dataclasses.replace(ppo, ignores={}))
    monkeypatch.setattr(sys.modules[__name__], "_CONFIGS", {})  # the walk's configs were validated with the rule
    overrides = base_for("ppo")
    assert observe(overrides, workspace.new()) == observe(overrides + ["algorithm.std_normalization=false"],
                                                          workspace.new())
