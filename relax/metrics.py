"""Every metric name Relax logs, defined once.

Imported by the algorithms, backends, roles, runner, tracking, `relax-compare` and the sweep launcher,
so a name cannot drift between the code that computes a value and the code that reads it. Pure
constants: this module imports nothing and sits below every layer.

Prefixes: `rollout/` (the generated batch and its rewards), `train/` (the actor's optimizer step),
`critic/` (PPO's value model), `eval/` (evaluation prompts), `perf/` (times and throughput), `system/`
(MLflow's system metrics: CPU, memory, disk, network, GPU).
"""

# ---- rollout: the generated batch and its rewards
RAW_REWARD = "rollout/raw_reward"  # mean reward of the scored responses
RESPONSE_LEN = "rollout/response_len"
TRUNCATED_FRAC = "rollout/truncated_frac"  # responses that hit max_response_len
REWARD_ERRORS = "rollout/reward_errors"  # reward calls that raised or returned a non-finite value
REWARD_DROPPED_FRAC = "rollout/reward_dropped_frac"  # share of responses left out of the loss (reward errors)
# reward calls stopped at their time limit (also reward errors): data.reward past data.reward_timeout_s, a reward
# service's items whose request's last try got no answer within data.reward_service.timeout_s (or whose batch passed
# its bound), a judge past reward_model.timeout_s (every try), an episode's step or turn past data.env_timeout_s
REWARD_TIMEOUTS = "rollout/reward_timeouts"
# the code_tests rewards: their sandbox runs stopped at the sandbox's wall-clock or CPU limit / sandbox runs (logged
# when the step's reward calls ran code; a time-out fails the code's tests, it is not a reward error)
SANDBOX_TIMEOUT_FRAC = "rollout/sandbox_timeout_frac"
# reward_model=classifier|judge: the mean score of the responses it scored (before reward_model.weight), seconds the
# step's batch took in it (in the scoring thread, beside generation), and a judge's answers without a readable score
# (reward_model.parser) / responses judged (their groups are left out, counted in reward_errors too)
REWARD_MODEL_SCORE_MEAN = "rollout/reward_model_score_mean"
REWARD_MODEL_TIME = "perf/reward_model_time"
JUDGE_PARSE_FAIL_FRAC = "rollout/judge_parse_fail_frac"
# What a reward is made of, each the mean over the step's responses whose reward calls all succeeded (those
# rollout/raw_reward averages, less the others of a group left out) that have the value: a list data.reward's
# components before their weights, rollout/reward/<name>_mean (name: the built-in's name, the function's attribute;
# relax.config.reward_list_rules.component_names; their weighted sum is rollout/raw_reward without a reward model); a
# reward function's dict return's other numeric keys, rollout/reward/<key>_mean (a list's: <name>/<key>); with
# reward_model=classifier|judge, the rule reward before the model's score is added (data.reward's, an episode's turn
# rewards)
REWARD_PARTS_PREFIX = "rollout/reward/"
RULE_REWARD_MEAN = "rollout/rule_reward_mean"


def reward_mean(name: str) -> str:
    """The logged name of the mean of a reward's part `name` (a component's name, a dict return's key)."""
    return f"{REWARD_PARTS_PREFIX}{name}_mean"


# DAPO's overlong penalty (data.overlong_buffer_len > 0), over the responses rollout/raw_reward averages: the mean
# reward trained on is raw_reward + overlong_penalty
OVERLONG_PENALTY = "rollout/overlong_penalty"  # mean penalty (<= 0)
OVERLONG_PENALIZED_FRAC = "rollout/overlong_penalized_frac"  # share of responses with a penalty
# algorithm.mask_truncated: share of the rollout's responses that ended by length and were left out of the loss
# (those of groups left out for a reward error count in reward_dropped_frac instead)
TRUNCATED_MASKED_FRAC = "rollout/truncated_masked_frac"
# Dynamic sampling (rollout.filter_groups): how the step's batch was built from its generation rounds
FILTERED_GROUP_FRAC = "rollout/filtered_group_frac"  # groups generated without a learning signal / groups generated
FILTER_ROUNDS = "rollout/filter_rounds"  # generation rounds of the batch
FILTER_FILLED_GROUPS = "rollout/filter_filled_groups"  # groups without a signal trained (max_filter_rounds reached)
# the extra generation cost: samples generated over the rounds / samples in the batch (1: nothing generated in vain)
FILTER_GENERATED_RATIO = "rollout/filter_generated_ratio"
# mean task reward over every response generated for the step (rollout/raw_reward is over the batch trained, which
# dynamic sampling tilts towards prompts with mixed outcomes): the policy's reward on the data as drawn
GENERATED_REWARD = "rollout/generated_reward"
# train/inference mismatch: |old-policy log-prob recomputed by the trainer - rollout log-prob| over the valid tokens
# no grammar constrained (`Samples.constrained`: their rollout log-prob is the model's own), and its max ratio
TRAIN_ROLLOUT_LOGP_ABS_DIFF = "rollout/train_rollout_logp_abs_diff"
TRAIN_ROLLOUT_RATIO_MAX = "rollout/train_rollout_ratio_max"  # max exp(trainer logp - rollout logp)
# the same mean over the valid tokens a grammar constrained (constrained decoding through the OpenAI gateway: strict
# tools, forced calls, response_format), whose rollout log-prob is of the grammar's masked distribution, so it is
# larger by the log of the probability the grammar left; their share (both logged only in a step with such tokens)
TRAIN_ROLLOUT_LOGP_ABS_DIFF_CONSTRAINED = "rollout/train_rollout_logp_abs_diff_constrained"
CONSTRAINED_TOKEN_FRAC = "rollout/constrained_token_frac"  # constrained tokens / valid tokens
# The rollout/trainer mismatch and what the rollout correction does with it (relax.algorithms.rollout_correction):
# k1 and k3 estimates of KL(rollout || trainer) per token, log-ppl(trainer) - log-ppl(rollout) per response, token
# ratio quantiles, the share truncated by importance sampling and the shares masked by rejection
MISMATCH_K1 = "rollout/mismatch_k1"
MISMATCH_K3 = "rollout/mismatch_k3"
MISMATCH_LOG_PPL_DIFF = "rollout/mismatch_log_ppl_diff"
MISMATCH_RATIO_QUANTILES = ("rollout/mismatch_ratio_p05", "rollout/mismatch_ratio_p50", "rollout/mismatch_ratio_p95")
TIS_TRUNCATED_FRAC = "rollout/tis_truncated_frac"
RS_MASKED_TOKEN_FRAC = "rollout/rs_masked_token_frac"
RS_MASKED_SEQ_FRAC = "rollout/rs_masked_seq_frac"
SAMPLING_DROPPED_MASS = "rollout/sampling_dropped_mass"  # probability mass top-k/top-p removed per drawn token
# Staleness of a response: the trainer's version at its step minus the version of the response's oldest token.
STALENESS_MEAN = "rollout/staleness_mean"  # over the batch's responses
STALENESS_MAX = "rollout/staleness_max"
STALENESS_HIST = "rollout/staleness_hist/"  # + s for s in 0..train.max_staleness: share of responses with staleness s
PARTIAL_FRAC = "rollout/partial_frac"  # share of responses whose tokens come from more than one weight version
# tokens generated before an interruption (partial rollout): older than their response's last version
ABORTED_TOKENS = "rollout/aborted_tokens"
# Agentic episodes (relax.agents): means over the batch's episodes
TURNS_MEAN = "rollout/turns_mean"  # model turns per episode
TOOL_CALLS_MEAN = "rollout/tool_calls_mean"  # tool calls per episode (malformed ones included)
TOOL_ERROR_FRAC = "rollout/tool_error_frac"  # failed tool calls / tool calls (0 without calls)
OBS_TOKEN_FRAC = "rollout/obs_token_frac"  # observation tokens / all response tokens
# Mixture-of-experts models (relax.train.routing), over the token-layers of a step's log-prob forwards with a route the
# engine recorded (rollout.routing_replay / record_routes): the share whose experts the trainer used equal the engine's
# (1 under replay), and the share whose experts the trainer's own router chooses do (what replay hides)
ROUTER_AGREEMENT = "rollout/router_agreement"
ROUTER_OWN_AGREEMENT = "rollout/router_own_agreement"
MOE_AUX_LOSS = "train/moe_aux_loss"  # the load-balancing loss (train.moe_aux_loss_coef > 0), mean over MoE layers
# the router z-loss (ST-MoE's): logsumexp(router logits)^2, mean over the MoE layers and the step's tokens routed
# (prompt and response tokens, padding excluded); train.moe_z_loss_coef times it is part of train/loss
MOE_Z_LOSS = "train/moe_z_loss"
# Expert load of a training step (every MoE model, both backends): each layer's tokens routed to each expert (the top-k
# experts used in the forward, replayed or not, over the step's prompt and response tokens, padding excluded), summed
# over micro-batches and data-parallel ranks before any ratio. max_over_mean: the largest expert's load / the mean
# expert load, in the worst layer (max over layers; 1: balanced, num_experts / top-k: every token to the same experts);
# min_over_mean: the smallest expert's load / the mean, in the worst layer (min over layers; 0: an expert got no token);
# cv: the coefficient of variation (population std / mean) of the experts' loads, mean over layers
MOE_LOAD_MAX_OVER_MEAN = "train/moe_expert_load_max_over_mean"
MOE_LOAD_MIN_OVER_MEAN = "train/moe_expert_load_min_over_mean"
MOE_LOAD_CV = "train/moe_expert_load_cv"
# Auxiliary-loss-free load balancing (train.moe_expert_bias_update_rate > 0): the routers' selection bias
# (e_score_correction_bias) after the step's update, largest and smallest over MoE layers and experts; a rollout of
# several optimizer steps logs the bias after its last update (relax.runner.optimizer_steps.LAST), not a mean
MOE_EXPERT_BIAS_MAX = "train/moe_expert_bias_max"
MOE_EXPERT_BIAS_MIN = "train/moe_expert_bias_min"


def moe_layer_load(layer: int) -> str:
    """The logged name of the max_over_mean expert load of MoE layer `layer` (0-based, counting MoE layers only: the
    decoder layer's index when every layer is MoE)."""
    return f"{MOE_LOAD_MAX_OVER_MEAN}/layer_{layer}"


# the parity gate (train.mismatch_gate): rollouts in a row past its bound, rollouts it skipped, 1.0 on a rollout
# without a reading of its metric (logp_abs_diff: no free token; the count is then left as it was)
MISMATCH_GATE_STREAK = "train/mismatch_gate_streak"
MISMATCH_GATE_SKIPPED = "train/mismatch_gate_skipped"
MISMATCH_GATE_UNMEASURED = "train/mismatch_gate_unmeasured"
EPISODE_LEN = "rollout/episode_len"  # response tokens per episode, observations included
EPISODE_END = "rollout/episode_end/"  # + reason (relax.agents.protocol.END_REASONS): share of episodes ending so
ENV_TIME = "perf/env_time"  # seconds in environments and tools (summed over episodes; they run in the rollout)
# context tokens of earlier turns the embedded engine kept in its KV cache instead of computing them again, per
# episode (what an engine that re-prefills each turn would recompute)
KV_REUSED_TOKENS = "perf/kv_reused_tokens"
# Agent programs behind the OpenAI gateway (data.openai_agent), per episode: trajectory segments (a call that does not
# extend the conversation before it, as after a history edit, starts one), and calls whose sampling parameters the
# run's replaced (rollout.temperature, top_p, top_k)
GATEWAY_SEGMENTS = "rollout/gateway_segments_per_episode"
GATEWAY_SAMPLING_OVERRIDES = "rollout/gateway_sampling_overrides"
# per episode: tokens the engine sampled in the session, those in the loss masks of its rows (one per branch: side
# calls, parallel calls, choices not continued and segments left behind have their own), the rest (0: each sampled
# token is trained once), and the rows (branches) of a run
GATEWAY_SAMPLED_TOKENS = "rollout/gateway_sampled_tokens"
GATEWAY_TRAINED_TOKENS = "rollout/gateway_trained_tokens"
GATEWAY_UNTRAINED_TOKENS = "rollout/gateway_untrained_tokens"
GATEWAY_BRANCHES = "rollout/gateway_branches_per_run"
# Vision-language models (relax.rollout.vision): images per response, image tokens / all tokens of the batch (prompts
# and responses), seconds the engines' vision towers took (each prompt's images once)
IMAGES_PER_SAMPLE = "rollout/images_per_sample"
IMAGE_TOKEN_FRAC = "rollout/image_token_frac"
VISION_ENCODE_TIME = "perf/vision_encode_time"

# RLOO's diagnostics of its training signal (see relax.algorithms.functional.rloo_diagnostics)
RLOO_BASELINE_MEAN = "rollout/rloo/baseline_mean"
RLOO_ADV_ABS_MEAN = "rollout/rloo/adv_abs_mean"
RLOO_NO_SIGNAL_FRAC = "rollout/rloo/no_signal_frac"
RLOO_EMPTY_RESPONSE_FRAC = "rollout/rloo/empty_response_frac"
RLOO_ZERO_ADV_GROUP_FRAC = "rollout/rloo/zero_adv_group_frac"
RLOO_DROPPED_GROUP_FRAC = "rollout/rloo/dropped_group_frac"
RLOO_METRICS = (
    RLOO_BASELINE_MEAN,
    RLOO_ADV_ABS_MEAN,
    RLOO_NO_SIGNAL_FRAC,
    RLOO_EMPTY_RESPONSE_FRAC,
    RLOO_ZERO_ADV_GROUP_FRAC,
    RLOO_DROPPED_GROUP_FRAC,
)

# On-policy distillation (algorithm=opd), over the valid response tokens of the step: the teacher's mean log-prob of
# the sampled tokens, the reverse KL from the policy that sampled to the teacher estimated per token as
# mean(logp_student - logp_teacher) (k1: the negative distillation advantage before clipping), and the share of tokens
# whose distillation advantage algorithm.teacher_adv_clip cut
TEACHER_LOGP_MEAN = "rollout/teacher_logp_mean"
TEACHER_KL = "train/teacher_kl"
TEACHER_ADV_CLIPFRAC = "train/teacher_adv_clipfrac"
OPD_METRICS = (TEACHER_LOGP_MEAN, TEACHER_KL, TEACHER_ADV_CLIPFRAC)

# ---- train: the actor's optimizer step (losses reduced as configured; diagnostics are shares/means of valid tokens)
PG_LOSS = "train/pg_loss"
PG_CLIPFRAC = "train/pg_clipfrac"
# algorithm.dual_clip_c only: share of valid tokens whose PPO-Clip loss the dual clip capped (A < 0, ratio > c; verl's
# name for the same share)
PG_CLIPFRAC_LOWER = "train/pg_clipfrac_lower"
PPO_KL = "train/ppo_kl"
KL_LOSS = "train/kl_loss"
ENTROPY = "train/entropy"
LOSS = "train/loss"
GRAD_NORM = "train/grad_norm"
LR = "train/lr"
CRITIC_ONLY = "train/critic_only"  # 1 on PPO's critic-only warm-up steps
M2_BEFORE = "train/ppo_kl_m2_before"
M2_AFTER = "train/ppo_kl_m2_after"
# Optimizer steps skipped because the loss or the gradient norm was not finite (weights, optimizer state and lr
# schedule left as they were): 0/1 from a trainer's step; the runner logs the count over the rollout's steps.
SKIPPED_STEPS = "train/skipped_steps"
# Logged with a skipped step only: parameter tensors whose gradient holds a NaN/inf (per shard on Megatron), and
# NaN/inf values at valid tokens of the step's batch (advantages, log-probs, returns, values): bad data or bad weights.
NONFINITE_GRAD_TENSORS = "train/nonfinite_grad_tensors"
NONFINITE_BATCH_VALUES = "train/nonfinite_batch_values"

# ---- critic (PPO)
VALUE_LOSS = "critic/value_loss"
VALUE_CLIPFRAC = "critic/value_clipfrac"
CRITIC_GRAD_NORM = "critic/grad_norm"
CRITIC_LR = "critic/lr"
CRITIC_SKIPPED_STEPS = "critic/skipped_steps"  # as train/skipped_steps, for the critic's optimizer
CRITIC_NONFINITE_GRAD_TENSORS = "critic/nonfinite_grad_tensors"

# ---- eval: eval/<set>/<metric> for each eval set (docs/training.md, "Evaluation"), from the n =
# rollout.eval_n_samples_per_prompt responses to each of its prompts. MLflow refuses "@" in a name: mean@n and
# pass@k are logged as mean_at_<n> and pass_at_<k>.
EVAL_PREFIX = "eval/"
EVAL_MEAN_AT = "mean_at_"  # + n: mean@n, the mean reward of a prompt's responses, averaged over the prompts
EVAL_PASS_AT = "pass_at_"  # + k (train.eval_pass_k): the unbiased pass@k estimate, averaged over the prompts
EVAL_RESPONSE_LEN = "response_len"  # mean response length in tokens
EVAL_TRUNCATED_FRAC = "truncated_frac"  # share of responses that hit rollout.max_response_len
EVAL_REWARD_ERRORS = "reward_errors"  # reward calls that failed (left out of mean@n and pass@k)
# The step of an eval/* value is the number of training steps in the weights it evaluated (relax.runner.session,
# `Session.log_evaluation`, decides it). A run records the convention in this tag (EVAL_STEP_WEIGHTS); runs made
# before it logged the evaluation after 0-based step s at step s (one less) and have no such tag.
EVAL_STEP_TAG = "relax.eval_step"
EVAL_STEP_WEIGHTS = "trained_steps"


def eval_metric(eval_set: str, metric: str) -> str:
    """The logged name of `metric` (EVAL_RESPONSE_LEN, f"{EVAL_PASS_AT}{k}", ...) of the eval set `eval_set`."""
    return f"{EVAL_PREFIX}{eval_set}/{metric}"


# ---- perf
STEP_TIME = "perf/step_time"
ROLLOUT_TIME = "perf/rollout_time"
TRAIN_TIME = "perf/train_time"
SYNC_TIME = "perf/weight_sync_time"
# bytes of the last weight update the engines received (each engine gets them once; tied weights counted once): the
# whole model, or with LoRA and rollout.lora_sync=adapter the adapters alone
SYNC_BYTES = "perf/sync_bytes"
TOKENS_PER_S = "perf/tokens_per_s"
ROLLOUT_ENGINE_TIME = "perf/rollout_engine_time"  # inside the rollout engine (the generation itself)
# Seconds inside the actor's train_step (forward, backward, optimizer), summed over a rollout's optimizer steps.
ACTOR_COMPUTE_TIME = "perf/actor_compute_time"
# Step time not spent in generation or in the actor's train_step: Ray calls, moving samples and weights,
# rewards, advantages, log-prob/value calls of other roles, evaluation.
OVERHEAD_TIME = "perf/overhead_time"
OVERHEAD_FRACTION = "perf/overhead_fraction"
# Asynchronous pipelining (every mode logs them; in sync each side waits for the other by design):
TRAIN_IDLE_FRAC = "perf/train_idle_frac"  # share of the step the loop waited for its rollout batch
ROLLOUT_IDLE_FRAC = "perf/rollout_idle_frac"  # share of the time since the last step the engines did not generate
BUFFER_SIZE = "perf/buffer_size"  # samples generated ahead, waiting for their step, when a step takes its batch

# ---- faults (docs/operations.md)
# rollout engines (SGLang servers or embedded replicas) replaced so far in this run (cumulative)
FAULT_RESTARTS_ROLLOUT = "fault/restarts/rollout"
FAULT_RESTARTS = "fault/restarts"  # service-graph restarts so far in this run (cumulative; train.max_restarts)
# checkpoints not written so far in the run (train.save_failures), logged at the steps whose checkpoint failed
FAULT_CHECKPOINT_FAILURES = "fault/checkpoint_failures"
ENGINE_RETRIES = "rollout/engine_retries"  # /generate requests sent again after a failure, in this step
WEIGHT_BUCKETS = "perf/weight_sync_buckets"  # buckets of the last weight update


def fault_restarts(role: str) -> str:
    """Service-graph restarts caused by `role` (actor, reference, critic, advantages) so far in this run."""
    return f"{FAULT_RESTARTS}/{role}"


# ---- system: MLflow's system metrics (tracking.system_metrics; relax.tracking.system_metrics), named by MLflow:
# system/cpu_utilization_percentage, system/system_memory_usage_megabytes, system/gpu_0_utilization_percentage, ...
# (docs/experiments.md lists them). Their step is the sample's index, not the training step.
SYSTEM_PREFIX = "system/"
