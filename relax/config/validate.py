"""Every rule a resolved `RelaxConfig` must satisfy, checked before Ray or any model starts.

Generic rules live here and read the algorithm's capability flags; rules that belong to one
algorithm come from its registry entry (`Algorithm.check`). All violations are collected, never
just the first, so a user fixes a config in one go.
"""

from __future__ import annotations

from relax import algorithms
from relax.algorithms.base import Violation
from relax.config.schema import RelaxConfig

TRAIN_BACKENDS = ("torch", "megatron")
ROLLOUT_BACKENDS = ("embedded", "sglang")
MODES = ("sync", "fully_async", "hybrid")
MODEL_SOURCES = ("config", "hf", "gguf")
DTYPES = ("auto", "float32", "bfloat16")
LR_SCHEDULES = ("constant", "cosine", "linear")
KL_TYPES = ("k1", "k2", "k3")


class ConfigError(Exception):
    """A config that breaks one or more rules; `str()` lists them all."""

    def __init__(self, violations: list[Violation], algorithm: str | None = None):
        self.violations = violations
        self.algorithm = algorithm
        super().__init__(format_violations(violations))


def format_violations(violations: list[Violation]) -> str:
    return "\n".join(f"  - {v.message}" for v in violations)


def data_parallel_size(cfg: RelaxConfig) -> int:
    """Replicas of the actor's gradient: 1 for the torch backend (one device)."""
    if cfg.train.backend != "megatron":
        return 1
    model_parallel = cfg.train.tensor_parallel_size * cfg.train.pipeline_parallel_size * cfg.train.context_parallel_size
    return max(1, cfg.cluster.actor_gpus // max(1, model_parallel))


class _Rules:
    """Collects violations; `require(ok, fields, message)` reads like the rule it states."""

    def __init__(self) -> None:
        self.found: list[Violation] = []

    def require(self, ok: bool, fields: str | tuple[str, ...], message: str) -> None:
        if not ok:
            self.found.append(Violation((fields,) if isinstance(fields, str) else tuple(fields), message))

    def choice(self, key: str, value: object, options: tuple[str, ...]) -> None:
        self.require(value in options, key, f"{key}={value!r} must be one of {', '.join(options)}")

    def positive(self, key: str, value: float | int | None) -> None:
        self.require(value is not None and value > 0, key, f"{key}={value} must be > 0")

    def non_negative(self, key: str, value: float | int) -> None:
        self.require(value >= 0, key, f"{key}={value} must be >= 0")


def _ranges(cfg: RelaxConfig, r: _Rules) -> None:
    a, ro, t, c, m = cfg.algorithm, cfg.rollout, cfg.train, cfg.cluster, cfg.model
    r.positive("algorithm.eps_clip", a.eps_clip)
    if a.eps_clip_high is not None:
        r.positive("algorithm.eps_clip_high", a.eps_clip_high)
    for key in ("kl_loss_coef", "kl_coef", "entropy_coef"):
        r.non_negative(f"algorithm.{key}", getattr(a, key))
    r.positive("algorithm.tis_clip", a.tis_clip)
    r.choice("algorithm.kl_loss_type", a.kl_loss_type, KL_TYPES)
    r.require(
        not a.use_kl_loss or a.kl_loss_coef > 0,
        ("algorithm.use_kl_loss", "algorithm.kl_loss_coef"),
        f"algorithm.use_kl_loss=true needs algorithm.kl_loss_coef > 0 (got {a.kl_loss_coef})",
    )
    r.require(
        a.use_kl_loss or a.kl_loss_coef == 0,
        ("algorithm.kl_loss_coef", "algorithm.use_kl_loss"),
        f"algorithm.kl_loss_coef={a.kl_loss_coef} has no effect without algorithm.use_kl_loss=true",
    )
    for key in ("rollout_batch_size", "n_samples_per_prompt", "max_response_len", "max_prompt_len", "num_replicas"):
        r.positive(f"rollout.{key}", getattr(ro, key))
    r.positive("rollout.eval_n_samples_per_prompt", ro.eval_n_samples_per_prompt)
    r.require(ro.temperature > 0, "rollout.temperature", f"rollout.temperature={ro.temperature} must be > 0")
    r.non_negative("rollout.eval_temperature", ro.eval_temperature)
    r.require(0 < ro.top_p <= 1, "rollout.top_p", f"rollout.top_p={ro.top_p} must be in (0, 1]")
    r.require(ro.top_k == -1 or ro.top_k > 0, "rollout.top_k", f"rollout.top_k={ro.top_k} must be -1 (off) or > 0")
    r.choice("rollout.backend", ro.backend, ROLLOUT_BACKENDS)
    r.choice("train.backend", t.backend, TRAIN_BACKENDS)
    r.choice("train.mode", t.mode, MODES)
    r.choice("train.lr_schedule", t.lr_schedule, LR_SCHEDULES)
    for key in ("global_batch_size", "micro_batch_size", "num_steps_per_rollout", "num_rollout", "lr"):
        r.positive(f"train.{key}", getattr(t, key))
    for key in ("clip_grad", "weight_decay", "warmup_steps", "save_interval", "eval_interval", "max_staleness"):
        r.non_negative(f"train.{key}", getattr(t, key))
    r.require(0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio", f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
    if t.critic_lr is not None:
        r.positive("train.critic_lr", t.critic_lr)
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size"):
        r.positive(f"train.{key}", getattr(t, key))
    r.choice("model.source", m.source, MODEL_SOURCES)
    r.choice("model.dtype", m.dtype, DTYPES)
    if m.source == "config":
        for key in ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
            r.positive(f"model.{key}", getattr(m, key))
        r.require(
            m.num_key_value_heads > 0 and m.num_attention_heads % m.num_key_value_heads == 0,
            ("model.num_attention_heads", "model.num_key_value_heads"),
            f"model.num_attention_heads={m.num_attention_heads} must be a multiple of "
            f"model.num_key_value_heads={m.num_key_value_heads}",
        )
    for key in ("num_nodes",):
        r.positive(f"cluster.{key}", getattr(c, key))
    for key in ("gpus_per_node", "actor_gpus", "rollout_gpus"):
        r.non_negative(f"cluster.{key}", getattr(c, key))
    if c.cpus_per_node is not None:
        r.positive("cluster.cpus_per_node", c.cpus_per_node)
    r.require(cfg.seed >= 0, "seed", f"seed={cfg.seed} must be >= 0")


def _batches(cfg: RelaxConfig, algo: algorithms.Algorithm, r: _Rules) -> None:
    ro, t = cfg.rollout, cfg.train
    sizes = (t.global_batch_size, t.micro_batch_size, t.num_steps_per_rollout)
    if not all(isinstance(x, int) and x > 0 for x in sizes):
        return  # already reported by _ranges
    samples = ro.rollout_batch_size * ro.n_samples_per_prompt
    product = (f"rollout.rollout_batch_size * rollout.n_samples_per_prompt "
               f"({ro.rollout_batch_size}*{ro.n_samples_per_prompt}={samples})")
    if not algo.supports_multi_step:
        r.require(
            t.num_steps_per_rollout == 1,
            "train.num_steps_per_rollout",
            f"algorithm={algo.name}: train.num_steps_per_rollout={t.num_steps_per_rollout} must be 1: "
            f"{algo.name} performs exactly one optimizer update per rollout (reusing a rollout is not supported)",
        )
        r.require(
            samples == t.global_batch_size,
            ("rollout.rollout_batch_size", "rollout.n_samples_per_prompt", "train.global_batch_size"),
            f"algorithm={algo.name}: {product} must equal train.global_batch_size ({t.global_batch_size}): "
            f"{algo.name} performs exactly one optimizer update per rollout",
        )
    else:
        r.require(
            samples == t.global_batch_size * t.num_steps_per_rollout,
            ("rollout.rollout_batch_size", "rollout.n_samples_per_prompt", "train.global_batch_size",
             "train.num_steps_per_rollout"),
            f"{product} must equal train.global_batch_size * train.num_steps_per_rollout "
            f"({t.global_batch_size}*{t.num_steps_per_rollout}={t.global_batch_size * t.num_steps_per_rollout}): "
            "each rollout is split into num_steps_per_rollout global batches",
        )
    dp = data_parallel_size(cfg)
    r.require(
        t.global_batch_size % (t.micro_batch_size * dp) == 0,
        ("train.global_batch_size", "train.micro_batch_size"),
        f"train.global_batch_size={t.global_batch_size} must be divisible by "
        "train.micro_batch_size * data-parallel size "
        f"({t.micro_batch_size}*{dp}={t.micro_batch_size * dp})",
    )


def _resources(cfg: RelaxConfig, algo: algorithms.Algorithm, r: _Rules) -> None:
    c, t, ro = cfg.cluster, cfg.train, cfg.rollout
    total = c.num_nodes * c.gpus_per_node
    critic_gpus = (c.actor_gpus if c.critic_gpus is None else c.critic_gpus) if algo.requires_critic else 0
    needed = c.actor_gpus if c.colocate else c.actor_gpus + c.rollout_gpus + critic_gpus
    r.require(
        needed <= total,
        ("cluster.actor_gpus", "cluster.rollout_gpus", "cluster.num_nodes", "cluster.gpus_per_node"),
        f"the roles need {needed} GPUs (actor {c.actor_gpus}"
        + ("" if c.colocate else f" + rollout {c.rollout_gpus} + critic {critic_gpus}")
        + f") but the cluster has {c.num_nodes} node(s) * {c.gpus_per_node} GPUs = {total}",
    )
    if total > 0:
        r.require(c.actor_gpus > 0, "cluster.actor_gpus", "cluster.actor_gpus=0 on a GPU cluster: the actor has no GPU")
        if not c.colocate:
            r.require(c.rollout_gpus > 0, "cluster.rollout_gpus",
                      "cluster.rollout_gpus=0 with cluster.colocate=false: the rollout role has no GPU")
        if algo.requires_critic:
            r.require(critic_gpus > 0, "cluster.critic_gpus",
                      f"algorithm={algo.name} needs a critic but cluster.critic_gpus={c.critic_gpus} gives it no GPU")
    if t.backend == "torch":
        r.require(c.actor_gpus <= 1, ("train.backend", "cluster.actor_gpus"),
                  f"train.backend=torch trains on one device but cluster.actor_gpus={c.actor_gpus}; "
                  "use train.backend=megatron for several GPUs")
        for key in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size"):
            value = getattr(t, key)
            r.require(value == 1, f"train.{key}",
                      f"train.{key}={value} needs train.backend=megatron (the torch backend has no model parallelism)")
    elif t.backend == "megatron" and c.actor_gpus > 0:
        mp = t.tensor_parallel_size * t.pipeline_parallel_size * t.context_parallel_size
        r.require(c.actor_gpus % mp == 0, ("cluster.actor_gpus", "train.tensor_parallel_size"),
                  f"cluster.actor_gpus={c.actor_gpus} must be divisible by "
                  f"tensor*pipeline*context parallel size ({mp})")
    if ro.backend == "sglang":
        r.require(total > 0, "rollout.backend", "rollout.backend=sglang needs GPUs; this cluster has none "
                  "(use rollout=embedded or a GPU cluster option such as cluster=1xgpu)")


def _flags(cfg: RelaxConfig, algo: algorithms.Algorithm, r: _Rules) -> None:
    """Rules that follow from the algorithm's capability flags."""
    a, ro, t = cfg.algorithm, cfg.rollout, cfg.train
    name = f"algorithm={algo.name}"
    if not algo.supports_async:
        r.require(t.mode == "sync", "train.mode",
                  f"{name}: train.mode={t.mode} is not supported: {algo.name} trains synchronously only")
        r.require(t.max_staleness == 0, "train.max_staleness",
                  f"{name}: train.max_staleness={t.max_staleness} must be 0: {algo.name} has no off-policy correction "
                  "for stale rollouts")
        r.require(not ro.partial_rollout, "rollout.partial_rollout",
                  f"{name}: rollout.partial_rollout=true is not supported: {algo.name} trains synchronously only")
    if not algo.supports_context_parallel:
        r.require(t.context_parallel_size == 1, "train.context_parallel_size",
                  f"{name}: train.context_parallel_size={t.context_parallel_size} must be 1: {algo.name}'s statistics "
                  "are not computed across context-parallel shards")
        r.require(not t.dynamic_context_parallel, "train.dynamic_context_parallel",
                  f"{name}: train.dynamic_context_parallel=true is not supported by {algo.name}")
    if algo.group_relative:
        r.require(ro.n_samples_per_prompt >= 2, "rollout.n_samples_per_prompt",
                  f"{name}: rollout.n_samples_per_prompt={ro.n_samples_per_prompt} must be >= 2: {algo.name}'s "
                  "advantage compares the responses of a group")
    if algo.per_token_loss_required:
        r.require(t.calculate_per_token_loss == algo.per_token_loss, "train.calculate_per_token_loss",
                  f"{name}: train.calculate_per_token_loss={t.calculate_per_token_loss} must be "
                  f"{algo.per_token_loss} for {algo.name}")
    r.require(not (a.use_tis and a.use_rollout_logprobs), ("algorithm.use_tis", "algorithm.use_rollout_logprobs"),
              "algorithm.use_tis and algorithm.use_rollout_logprobs are mutually exclusive: TIS corrects the "
              "rollout/trainer mismatch that use_rollout_logprobs assumes away")
    r.require(not (a.kl_coef != 0 and a.kl_loss_coef != 0), ("algorithm.kl_coef", "algorithm.kl_loss_coef"),
              f"algorithm.kl_coef={a.kl_coef} and algorithm.kl_loss_coef={a.kl_loss_coef} are both nonzero: "
              "use either reward-side KL or a KL loss, not both")


def validate(cfg: RelaxConfig) -> list[Violation]:
    """All violations of `cfg` (resolved), generic ones first, then the algorithm's own."""
    r = _Rules()
    try:
        algo = algorithms.get(cfg.algorithm.name)
    except KeyError as exc:
        return [Violation(("algorithm.name",), str(exc.args[0]))]
    _ranges(cfg, r)
    _batches(cfg, algo, r)
    _resources(cfg, algo, r)
    _flags(cfg, algo, r)
    for v in algo.check(cfg):
        prefix = f"algorithm={algo.name}: "
        r.found.append(v if v.message.startswith(prefix) else Violation(v.fields, prefix + v.message))
    return r.found


def check(cfg: RelaxConfig) -> RelaxConfig:
    """Raise ConfigError with every violation, else return cfg."""
    found = validate(cfg)
    if found:
        raise ConfigError(found, cfg.algorithm.name)
    return cfg
