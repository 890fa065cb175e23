"""Every rule a resolved `RelaxConfig` must satisfy, checked before Ray or any model starts.

Generic rules live here and read the algorithm's capability flags; rules that belong to one
algorithm come from its registry entry (`Algorithm.check`). All violations are collected, never
just the first, so a user fixes a config in one go.
"""

from __future__ import annotations

import dataclasses

from relax import algorithms
from relax.algorithms.base import Range, Violation, choices_of, range_of
from relax.config.core_rules import role_cores_violations
from relax.config.credentials import REWARD_KEY_INSTEAD, credentials_problem, query_problem
from relax.config.derive import adapter_conflicts, agentic, data_parallel_size, needs_reference
from relax.config.evaluation import EVAL_SET_NAME, default_eval_set_name, eval_set_problem, evaluates
from relax.config.megatron_rules import (
    NOT_BUILT,
    megatron_violations,
    micro_batch_tokens_violation,
    pack_sequences_violation,
    sequence_parallel_violation,
)
from relax.config.moe_rules import moe_violations
from relax.config.reward_list_rules import reward_list_violations
from relax.config.reward_model_rules import needs_own_gpu, reward_model_violations
from relax.config.reward_service_rules import reward_service_violations
from relax.config.sandbox_rules import sandbox_violations
from relax.config.schema import TOOL_PARSERS, RelaxConfig, TrainConfig
from relax.config.vision_rules import VISION_ARCHS, vision_violations
from relax.sandbox_limits import PYTHON_TOOL, PYTHON_TOOL_MARGIN_S, python_tool_limits

# fields whose rules read this process's environment (a key's variable is set): true of the process that runs, not
# of one that checks a config for another machine (relax-submit)
ENVIRONMENT_FIELDS = frozenset({"reward_model.api_key_env", "data.reward_service.api_key_env"})


class ConfigError(Exception):
    """A config that breaks one or more rules; `str()` lists them all."""

    def __init__(self, violations: list[Violation], algorithm: str | None = None,
                 config: RelaxConfig | None = None):
        self.violations = violations
        self.algorithm = algorithm
        # the resolved config the violations are of (`check`'s), so that a caller that exempts some rules
        # (relax-submit: `ENVIRONMENT_FIELDS`) can still check the rest of it; None where none was built
        self.config = config
        super().__init__(format_violations(violations))


def format_violations(violations: list[Violation]) -> str:
    return "\n".join(f"  - {v.message}" for v in violations)


class _Rules:
    """Collects violations; `require(ok, fields, message)` reads like the rule it states."""

    def __init__(self) -> None:
        self.found: list[Violation] = []

    def require(self, ok: bool, fields: str | tuple[str, ...], message: str) -> None:
        if not ok:
            self.found.append(Violation((fields,) if isinstance(fields, str) else tuple(fields), message))

    def add(self, violation: Violation | None) -> None:
        """A rule stated elsewhere (`relax.config.megatron_rules`) that returns its violation or None."""
        if violation is not None:
            self.found.append(violation)

    def choice(self, key: str, value: object, options: tuple[str, ...]) -> None:
        self.require(value in options, key, f"{key}={value!r} must be one of {', '.join(options)}")

    def within(self, key: str, value: object, allowed: Range) -> None:
        self.require(allowed.admits(value), key, allowed.message(key, value))

    def positive(self, key: str, value: float | int | None) -> None:
        self.within(key, value, _POSITIVE)


_POSITIVE = Range(0, lo_open=True, finite=True)  # as the schema's `positive` fields: +inf is no setting


def _choices(cfg: RelaxConfig, r: _Rules) -> None:
    """Every field of a section that the schema declares with `choice` holds one of its options (rollout.sglang's
    are checked with that section, where it is used: `_sglang`)."""
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(value):
            continue
        for f in dataclasses.fields(value):
            options = choices_of(type(value), f.name)
            if options is not None:
                r.choice(f"{section.name}.{f.name}", getattr(value, f.name), options)


def _ranges(cfg: RelaxConfig, r: _Rules) -> None:
    """Every field that the schema declares with a range (`positive`, `non_negative`, `in_range`, `finite`) holds a
    value in it: seed, then section by section (rollout.sglang's are checked with that section, where it is used:
    `_sglang`)."""
    _declared_ranges(cfg, "", r)
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        if dataclasses.is_dataclass(value):
            _declared_ranges(value, f"{section.name}.", r)


def _declared_ranges(section: object, prefix: str, r: _Rules) -> None:
    """The range rule of each field of `section` (a config dataclass) that declares one, keys `<prefix><field>`."""
    for f in dataclasses.fields(section):
        allowed = range_of(type(section), f.name)
        if allowed is None or not allowed.applies(section):
            continue
        r.within(f"{prefix}{f.name}", getattr(section, f.name), allowed)


def _combinations(cfg: RelaxConfig, r: _Rules) -> None:
    """Rules between a field and another that its range alone does not state."""
    a, t, c, m = cfg.algorithm, cfg.train, cfg.cluster, cfg.model
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
    r.add(micro_batch_tokens_violation(t.backend, t.max_tokens_per_micro_batch))
    r.add(pack_sequences_violation(t.backend, t.pack_sequences, t.layer_spec))
    r.require(not t.use_dynamic_global_batch_size or (t.num_steps_per_rollout or 1) > 1,
              ("train.use_dynamic_global_batch_size", "train.num_steps_per_rollout"),
              "train.use_dynamic_global_batch_size=true has no effect with one optimizer step per rollout "
              "(train.num_steps_per_rollout=1): the step takes the whole rollout either way")
    r.require(t.save or t.save_failures == "stop", ("train.save_failures", "train.save"),
              f"train.save_failures={t.save_failures} has no effect with train.save=false")
    r.require(t.save or t.save_on_preempt, ("train.save_on_preempt", "train.save"),
              "train.save_on_preempt=false has no effect with train.save=false (no checkpoint is written)")
    r.require(c.heartbeat_timeout_s is not None, "cluster.heartbeat_timeout_s",
              "cluster.heartbeat_timeout_s=null would let the driver wait on a hung role forever; set a number of "
              "seconds (a very large one, such as 86400, all but turns the watchdog off and keeps every wait bounded)")
    if m.source == "config":
        r.require(
            m.num_key_value_heads > 0 and m.num_attention_heads % m.num_key_value_heads == 0,
            ("model.num_attention_heads", "model.num_key_value_heads"),
            f"model.num_attention_heads={m.num_attention_heads} must be a multiple of "
            f"model.num_key_value_heads={m.num_key_value_heads}",
        )
        r.require(m.head_dim % 2 == 0, "model.head_dim",
                  f"model.head_dim={m.head_dim} must be even: rotary embeddings rotate pairs of dimensions")


def _batches(cfg: RelaxConfig, algo: algorithms.Algorithm, r: _Rules, given: RelaxConfig | None = None) -> None:
    """The rollout's samples split into global batches, and those into micro-batches. `given`: the config before
    `derive.resolve` (None: not known), which tells a train.global_batch_size the user set from a derived one."""
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
    if t.global_batch_size % (t.micro_batch_size * dp) != 0:
        r.require(False, ("train.global_batch_size", "train.micro_batch_size"),
                  _indivisible(t, ro.rollout_batch_size, ro.n_samples_per_prompt, dp,
                               None if given is None else given.train))


def _indivisible(t: TrainConfig, prompts: int, n: int, dp: int, given: TrainConfig | None = None) -> str:
    """Why train.global_batch_size does not split into micro-batches, and each fix. `given`: train before
    `derive.resolve`, whose None fields were derived: a global batch size left unset is the rollout's samples /
    train.num_steps_per_rollout, and the message says what it comes from rather than only naming a value the user
    never set; one the user set is named as set. Each fix named loads. Without `given` (a caller that resolved the
    config itself), a value equal to the rollout's samples / steps may be either: the message says so."""
    gbs, unit, samples = t.global_batch_size, t.micro_batch_size * dp, prompts * n
    dp_text = f"train.micro_batch_size * data-parallel size ({t.micro_batch_size}*{dp}={unit})" if dp > 1 else \
        f"train.micro_batch_size={t.micro_batch_size}"
    if gbs % dp == 0:
        fit = max(d for d in range(1, t.micro_batch_size) if (gbs // dp) % d == 0)
        lower = f"lower train.micro_batch_size (train.micro_batch_size={fit} fits)"
    else:
        lower = f"no train.micro_batch_size splits {gbs} over {dp} data-parallel replicas"
    # the global batch sizes that micro-batches split and that split the rollout into whole steps
    fitting = [g for g in range(unit, samples + 1, unit) if samples % g == 0]
    # (without `given`: a value unlike the rollout's samples / steps cannot be derived, so it was set)
    gbs_set = given.global_batch_size is not None if given is not None else gbs * t.num_steps_per_rollout != samples
    steps_set = None if given is None else given.num_steps_per_rollout is not None
    if gbs_set:  # the user's own value: the fix is theirs to change
        if steps_set is False and fitting:  # train.num_steps_per_rollout (unset) follows it: samples / global batch
            to = f"a multiple of {unit} that divides the rollout's {samples} samples ({_or(fitting)}; " \
                 "train.num_steps_per_rollout follows)"
        elif steps_set is False:
            to = f"a multiple of {unit} (none divides the rollout's {samples} samples: raise " \
                 "rollout.rollout_batch_size or rollout.n_samples_per_prompt too)"
        elif steps_set and fitting:  # both set: they multiply to the rollout's samples
            to = f"a multiple of {unit} and train.num_steps_per_rollout to match (global batch x steps = the " \
                 f"rollout's {samples} samples: {_or([f'{g}x{samples // g}' for g in fitting])})"
        else:
            to = f"a multiple of {unit}"
        return f"train.global_batch_size={gbs} must be divisible by {dp_text}: {lower}, or set " \
            f"train.global_batch_size to {to}"
    steps = f" / train.num_steps_per_rollout={t.num_steps_per_rollout}" if t.num_steps_per_rollout > 1 else ""
    if given is None:  # equal to the rollout's samples / steps: set so, or derived; which fix fits depends on which
        return (f"train.global_batch_size={gbs} (set, or derived when unset: rollout.rollout_batch_size={prompts} x "
                f"rollout.n_samples_per_prompt={n}{steps}) must be divisible by {dp_text}: {lower}, or make a "
                f"global batch a multiple of {unit} samples (train.global_batch_size, train.num_steps_per_rollout "
                "or the rollout's size)")
    fixes = [lower, f"raise rollout.rollout_batch_size or rollout.n_samples_per_prompt so that "
                    f"{'each step' if steps else 'a rollout'} holds a multiple of {unit} samples"]
    if fitting:  # (steps set: unset they are 1, the global batch the whole rollout, and nothing smaller fits)
        fixes.append(f"set train.num_steps_per_rollout to {_or([samples // g for g in fitting])} (a global batch "
                     f"of {_or(fitting)})")
    return (f"train.global_batch_size={gbs} (unset, it is the samples of a rollout: rollout.rollout_batch_size="
            f"{prompts} x rollout.n_samples_per_prompt={n}{steps}) must be divisible by {dp_text}: "
            f"{', or '.join(fixes)}")


def _or(values: list) -> str:
    """A few of `values` for a message ("2 or 6", "2, 4 or 8", at most 4 of them, the smallest)."""
    shown = [str(v) for v in values[:4]]
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"


def _resources(cfg: RelaxConfig, algo: algorithms.Algorithm, r: _Rules) -> None:
    """GPU counts the runner can place (the rule is in `relax.runner.plan`): every process of a role uses at
    most one device; colocated roles share the actor's one GPU; apart, each GPU of a role holds the same
    number of its processes."""
    c, t, ro = cfg.cluster, cfg.train, cfg.rollout
    total = c.num_nodes * c.gpus_per_node
    needed = c.actor_gpus if c.colocate else c.actor_gpus + c.rollout_gpus
    apart = "" if c.colocate else f" + cluster.rollout_gpus={c.rollout_gpus}"
    if not c.colocate and algo.requires_teacher:  # apart, the teacher has a GPU of its own (relax.runner.plan)
        needed += 1
        apart += " + 1 for the teacher"
    if needs_own_gpu(cfg):  # reward_model.colocate=false (or cluster.colocate=false): a GPU of its own
        needed += 1
        apart += " + 1 for the reward model"
    r.require(
        needed <= total,
        ("cluster.actor_gpus", "cluster.num_nodes", "cluster.gpus_per_node")
        + (() if c.colocate else ("cluster.rollout_gpus",)),
        f"the roles need {needed} GPU(s): cluster.actor_gpus={c.actor_gpus}{apart}, but the cluster has "
        f"cluster.num_nodes * cluster.gpus_per_node = {c.num_nodes}*{c.gpus_per_node} = {total}",
    )
    r.require(c.num_nodes == 1 or c.address is not None, ("cluster.num_nodes", "cluster.address"),
              f"cluster.num_nodes={c.num_nodes} needs cluster.address (an existing Ray cluster, see launch/README.md): "
              "without it relax-train starts a local Ray instance on this one machine")
    r.require(c.colocate or total > 0, ("cluster.colocate", "cluster.gpus_per_node"),
              "cluster.colocate=false has no effect without GPUs (cluster.gpus_per_node=0): on a CPU cluster every "
              "role takes turns on all cores")
    if c.colocate:
        r.require(c.rollout_gpus == 0, ("cluster.rollout_gpus", "cluster.colocate"),
                  f"cluster.rollout_gpus={c.rollout_gpus} has no effect with cluster.colocate=true: the rollout "
                  "replicas share the actor's GPU; set cluster.colocate=false to give them GPUs of their own")
    if total > 0:
        r.require(c.actor_gpus > 0, "cluster.actor_gpus", "cluster.actor_gpus=0 on a GPU cluster: the actor has no GPU")
        if not c.colocate:
            r.require(c.rollout_gpus > 0, "cluster.rollout_gpus",
                      "cluster.rollout_gpus=0 with cluster.colocate=false: the rollout role has no GPU")
            r.require(c.rollout_gpus <= 0 or ro.num_replicas % c.rollout_gpus == 0 or c.rollout_gpus_per_engine > 1,
                      ("rollout.num_replicas", "cluster.rollout_gpus"),
                      f"rollout.num_replicas={ro.num_replicas} must be a multiple of cluster.rollout_gpus="
                      f"{c.rollout_gpus}: a rollout engine runs on one GPU (or a share of one) and every rollout "
                      "GPU holds the same number of engines")
    if t.backend == "torch":
        r.require(c.actor_gpus <= 1, ("train.backend", "cluster.actor_gpus"),
                  f"train.backend=torch trains on one device but cluster.actor_gpus={c.actor_gpus}; "
                  "use train.backend=megatron for several GPUs")
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(t, key)
            r.require(value == 1, f"train.{key}",
                      f"train.{key}={value} needs train.backend=megatron (the torch backend has no model parallelism)")
        r.require(t.context_parallel_size == 1, "train.context_parallel_size",
                  f"train.context_parallel_size={t.context_parallel_size} {NOT_BUILT}: neither backend has context "
                  "parallelism (megatron-core's needs Transformer Engine's attention)")
        r.add(sequence_parallel_violation(t.backend, t.sequence_parallel, t.tensor_parallel_size))
        r.require(t.layer_spec == "auto", "train.layer_spec",
                  f"train.layer_spec={t.layer_spec} chooses megatron-core's layers: it needs train.backend=megatron")
    elif t.backend == "megatron" and c.actor_gpus == 0:
        r.require(t.layer_spec != "transformer_engine", ("train.layer_spec", "cluster.actor_gpus"),
                  "train.layer_spec=transformer_engine needs GPUs (cluster.actor_gpus > 0): Transformer Engine's "
                  "modules run on CUDA only; layer_spec=local (or auto) runs on the CPU")
    elif t.backend == "megatron" and c.actor_gpus > 0:
        mp = t.tensor_parallel_size * t.pipeline_parallel_size * t.context_parallel_size
        r.require(c.actor_gpus % mp == 0, ("cluster.actor_gpus", "train.tensor_parallel_size"),
                  f"cluster.actor_gpus={c.actor_gpus} must be divisible by "
                  f"tensor*pipeline*context parallel size ({mp})")
    sg = ro.sglang
    if ro.backend == "sglang" and sg.server == "sglang" and sg.urls is None:
        r.require(total > 0, ("rollout.sglang.server", "cluster.gpus_per_node"),
                  "rollout.sglang.server=sglang launches SGLang servers, which need GPUs; this cluster has none: use "
                  "rollout.sglang.server=embedded (Relax's engine behind SGLang's protocol, runs on CPU), servers "
                  "already running (rollout.sglang.urls) or a GPU cluster option such as cluster=1xgpu")
    tp = c.rollout_gpus_per_engine
    if tp != 1:
        launches_sglang = ro.backend == "sglang" and sg.server == "sglang" and sg.urls is None
        r.require(launches_sglang, "cluster.rollout_gpus_per_engine",
                  f"cluster.rollout_gpus_per_engine={tp} sets the tensor parallelism of launched SGLang servers "
                  "(rollout=sglang with rollout.sglang.server=sglang); the embedded engine runs on one device")
        if launches_sglang:
            r.require(not c.colocate, ("cluster.rollout_gpus_per_engine", "cluster.colocate"),
                      f"cluster.rollout_gpus_per_engine={tp} with cluster.colocate=true {NOT_BUILT}: a colocated "
                      "engine shares one actor GPU; use cluster.colocate=false with cluster.rollout_gpus = "
                      "rollout.num_replicas * rollout_gpus_per_engine")
            r.require(c.colocate or c.rollout_gpus == ro.num_replicas * tp,
                      ("cluster.rollout_gpus", "cluster.rollout_gpus_per_engine", "rollout.num_replicas"),
                      f"cluster.rollout_gpus={c.rollout_gpus} must be rollout.num_replicas * "
                      f"cluster.rollout_gpus_per_engine = {ro.num_replicas}*{tp} (a tensor-parallel engine gets "
                      "GPUs of its own)")


def _sglang(cfg: RelaxConfig, r: _Rules) -> None:
    """rollout.sglang: its values, and its fields set where nothing reads them."""
    ro, c, sg = cfg.rollout, cfg.cluster, cfg.rollout.sglang
    if ro.backend != "sglang":
        for f in dataclasses.fields(sg):
            r.require(not _changed(sg, f.name), f"rollout.sglang.{f.name}",
                      f"rollout.sglang.{f.name}={getattr(sg, f.name)!r} has no effect: rollout.backend={ro.backend} "
                      "(use rollout=sglang)")
        return
    for key in ("server", "router_policy"):
        r.choice(f"rollout.sglang.{key}", getattr(sg, key), choices_of(type(sg), key))
    r.require(sg.router_policy != "power_of_two" or ro.num_replicas >= 2,
              ("rollout.sglang.router_policy", "rollout.num_replicas"),
              "rollout.sglang.router_policy=power_of_two picks the less loaded of two servers: it needs "
              "rollout.num_replicas >= 2 (sglang-router refuses to start otherwise)")
    if sg.weight_sync is not None:
        r.choice("rollout.sglang.weight_sync", sg.weight_sync, choices_of(type(sg), "weight_sync"))
    _declared_ranges(sg, "rollout.sglang.", r)
    if sg.urls is not None:
        r.require(len(sg.urls) > 0, "rollout.sglang.urls", "rollout.sglang.urls=[] names no server (leave it unset "
                  "to launch servers)")
        bad = [u for u in sg.urls if not (isinstance(u, str) and u.startswith(("http://", "https://")))]
        r.require(not bad, "rollout.sglang.urls", f"rollout.sglang.urls: {bad} are not http(s):// URLs")
        r.require(not sg.urls or ro.num_replicas == len(sg.urls), ("rollout.num_replicas", "rollout.sglang.urls"),
                  f"rollout.num_replicas={ro.num_replicas} but rollout.sglang.urls names {len(sg.urls)} server(s): "
                  f"set rollout.num_replicas={len(sg.urls)}")
        for key in ("server", "extra_args", "startup_timeout_s"):
            r.require(not _changed(sg, key), f"rollout.sglang.{key}",
                      f"rollout.sglang.{key}={getattr(sg, key)!r} has no effect: rollout.sglang.urls names servers "
                      "that are already running (nothing is launched)")
    elif sg.server == "embedded":
        r.require(sg.extra_args is None, "rollout.sglang.extra_args",
                  f"rollout.sglang.extra_args={sg.extra_args} has no effect: they are arguments of "
                  "sglang.launch_server (rollout.sglang.server=sglang)")
    else:
        r.require(cfg.model.source == "hf", ("rollout.sglang.server", "model.source"),
                  f"rollout.sglang.server=sglang loads the model from a Hugging Face directory (model.source=hf), "
                  f"not model.source={cfg.model.source}; use rollout.sglang.server=embedded for this model")
    r.require(sg.release_memory or (c.colocate and cfg.train.mode == "sync"), "rollout.sglang.release_memory",
              "rollout.sglang.release_memory=false has no effect: servers release their memory only when colocated "
              "with the actor in train.mode=sync")
    r.require(c.num_nodes == 1 or sg.host not in ("127.0.0.1", "localhost") or sg.urls is not None,
              ("rollout.sglang.host", "cluster.num_nodes"),
              f"rollout.sglang.host={sg.host} is loopback but cluster.num_nodes={c.num_nodes}: servers on other "
              "nodes could not be reached; set rollout.sglang.host=0.0.0.0")
    _weight_paths(cfg, r)


def _weight_paths(cfg: RelaxConfig, r: _Rules) -> None:
    """rollout.sglang.weight_sync where the plan's placement lets it work (relax.runner.plan._weight_senders)."""
    c, sg = cfg.cluster, cfg.rollout.sglang
    gpus = c.num_nodes * c.gpus_per_node > 0
    # on GPUs, colocated: each launched server gets CUDA IPC handles from the actor rank on its own GPU (any node)
    per_gpu = gpus and c.colocate and sg.urls is None
    r.require(sg.weight_sync != "tensor" or c.num_nodes == 1 or per_gpu,
              ("rollout.sglang.weight_sync", "cluster.num_nodes"),
              "rollout.sglang.weight_sync=tensor shares memory with servers on the trainer's node, but on "
              f"cluster.num_nodes={c.num_nodes} servers of other nodes cannot open it"
              + (" (servers given by rollout.sglang.urls get it from actor rank 0)" if gpus and c.colocate else "")
              + "; use rollout.sglang.weight_sync=distributed")
    r.require(sg.weight_sync != "tensor" or not gpus or c.colocate, ("rollout.sglang.weight_sync", "cluster.colocate"),
              "rollout.sglang.weight_sync=tensor with cluster.colocate=false: CUDA IPC handles open only in a process "
              "on the GPU that made them, and the servers run on GPUs of their own; use "
              "rollout.sglang.weight_sync=distributed (the default apart)")
    r.require(sg.weight_sync != "distributed" or not per_gpu, ("rollout.sglang.weight_sync", "cluster.colocate"),
              "rollout.sglang.weight_sync=distributed with cluster.colocate=true on GPUs puts rollout replica 0 and "
              "actor rank 0 on the same GPU in one NCCL group, which NCCL refuses; use rollout.sglang.weight_sync="
              "tensor (the default colocated: each server gets CUDA IPC handles from the actor rank on its GPU)")


def _modes(cfg: RelaxConfig, r: _Rules) -> None:
    """What each train.mode means for staleness, weight sync and partial rollout (docs/training.md)."""
    t, ro, c = cfg.train, cfg.rollout, cfg.cluster
    s = t.max_staleness
    if s is None or t.mode not in choices_of(type(t), "mode"):
        return
    if t.mode == "sync":
        r.require(s == 0, ("train.max_staleness", "train.mode"),
                  f"train.max_staleness={s} needs train.mode=fully_async: train.mode=sync trains on-policy (0)")
    if t.mode == "hybrid":
        r.require(s == 1, ("train.max_staleness", "train.mode"),
                  f"train.max_staleness={s}: train.mode=hybrid is one step off-policy by construction (1); "
                  "use train.mode=fully_async for another bound")
    if t.mode != "fully_async":
        r.require(t.weight_sync_interval == 1, ("train.weight_sync_interval", "train.mode"),
                  f"train.weight_sync_interval={t.weight_sync_interval} needs train.mode=fully_async: "
                  f"train.mode={t.mode} publishes the weights after every step")
    else:
        r.require(t.weight_sync_interval <= s + 1, ("train.weight_sync_interval", "train.max_staleness"),
                  f"train.weight_sync_interval={t.weight_sync_interval} must be <= train.max_staleness + 1 ({s + 1}): "
                  "with rarer weight updates the rollout could never generate within the staleness bound")
        gpus = c.num_nodes * c.gpus_per_node
        r.require(gpus == 0 or not c.colocate, ("train.mode", "cluster.colocate"),
                  "train.mode=fully_async runs the rollout continuously on GPUs of its own: set cluster.colocate=false "
                  "and cluster.rollout_gpus (or use train.mode=hybrid to share the actor's GPUs)")
    if t.mode == "hybrid":
        r.require(c.colocate, ("train.mode", "cluster.colocate"),
                  "train.mode=hybrid pipelines colocated roles (cluster.colocate=true); use train.mode=fully_async "
                  "for a rollout on GPUs of its own")
    if ro.stage_weights:
        r.require(t.mode != "sync", ("rollout.stage_weights", "train.mode"),
                  "rollout.stage_weights=true has nothing to overlap with train.mode=sync: the rollout waits for "
                  "each version's weights before it generates")
        r.require(ro.backend == "embedded", ("rollout.stage_weights", "rollout.backend"),
                  f"rollout.stage_weights=true {NOT_BUILT} with rollout.backend={ro.backend}: SGLang servers load "
                  "weights themselves (rollout.sglang.weight_sync)")
    if ro.partial_rollout:
        r.require(t.mode == "fully_async", ("rollout.partial_rollout", "train.mode"),
                  f"rollout.partial_rollout=true needs train.mode=fully_async (train.mode={t.mode} never updates "
                  "weights during a rollout)")
        r.require(t.mode != "fully_async" or s > 0, ("rollout.partial_rollout", "train.max_staleness"),
                  "rollout.partial_rollout=true has no effect with train.max_staleness=0: no weight update arrives "
                  "while a rollout batch generates")


def _flags(cfg: RelaxConfig, algo: algorithms.Algorithm, r: _Rules) -> None:
    """Rules that follow from the algorithm's capability flags."""
    a, ro, t = cfg.algorithm, cfg.rollout, cfg.train
    name = f"algorithm={algo.name}"
    if not algo.supports_async:
        r.require(t.mode == "sync", "train.mode",
                  f"{name}: train.mode={t.mode} is not supported: {algo.name} trains synchronously only "
                  "(it has no off-policy correction for stale rollouts)")
        r.require(t.mode != "sync" or not t.max_staleness, "train.max_staleness",
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
    r.require(not (a.rollout_mask != "none" and a.use_rollout_logprobs),
              ("algorithm.rollout_mask", "algorithm.use_rollout_logprobs"),
              f"algorithm.rollout_mask={a.rollout_mask} and algorithm.use_rollout_logprobs are mutually exclusive: "
              "the mask filters the rollout/trainer mismatch that use_rollout_logprobs assumes away")
    low, high = a.rollout_mask_low, a.rollout_mask_high
    r.require(0 < low < high, ("algorithm.rollout_mask_low", "algorithm.rollout_mask_high"),
              f"algorithm.rollout_mask_low={low} and rollout_mask_high={high} must satisfy 0 < low < high (bounds "
              "of the ratio exp(trainer logp - rollout logp) a kept token or response has)")
    r.require(low <= 1 <= high, ("algorithm.rollout_mask_low", "algorithm.rollout_mask_high"),
              f"[algorithm.rollout_mask_low, rollout_mask_high] = [{low}, {high}] must contain 1: a token on which "
              "the engine and the trainer agree would be masked")
    r.require(not (a.kl_coef != 0 and a.kl_loss_coef != 0), ("algorithm.kl_coef", "algorithm.kl_loss_coef"),
              f"algorithm.kl_coef={a.kl_coef} and algorithm.kl_loss_coef={a.kl_loss_coef} are both nonzero: "
              "use either reward-side KL or a KL loss, not both")


def _not_built(cfg: RelaxConfig, r: _Rules) -> None:
    """Options that are planned (context parallelism, a Megatron teacher) but have nothing behind them yet."""
    t, _ro, _c = cfg.train, cfg.rollout, cfg.cluster
    r.require(not t.dynamic_context_parallel, "train.dynamic_context_parallel",
              f"train.dynamic_context_parallel=true {NOT_BUILT}: it needs context parallelism, which "
              "train.backend=megatron does not have here (megatron-core's needs Transformer Engine's attention)")
    r.require(cfg.teacher.backend == "torch", "teacher.backend",
              f"teacher.backend={cfg.teacher.backend} {NOT_BUILT}: the teacher runs on the torch backend on one device "
              "(the actor's GPU when colocated, else one of its own); a teacher larger than one device would need "
              "Megatron's tensor parallelism, which the teacher role does not have")


def _ignored(cfg: RelaxConfig, algo: algorithms.Algorithm, r: _Rules) -> None:
    """Algorithm fields that would be accepted and then not read: rejected, never silently ignored."""
    a = cfg.algorithm
    defaults = type(a)()

    def changed(key: str) -> bool:
        return getattr(a, key) != getattr(defaults, key)

    for key, why in algo.ignores.items():
        r.require(not changed(key), f"algorithm.{key}",
                  f"algorithm={algo.name}: algorithm.{key}={getattr(a, key)} has no effect: {why}; "
                  f"leave it at {getattr(defaults, key)}")
    for key in ("tis_clip", "tis_level"):
        r.require(a.use_tis or not changed(key), (f"algorithm.{key}", "algorithm.use_tis"),
                  f"algorithm.{key}={getattr(a, key)} has no effect without algorithm.use_tis=true")
    for key in ("rollout_mask_low", "rollout_mask_high"):
        r.require(a.rollout_mask != "none" or not changed(key), (f"algorithm.{key}", "algorithm.rollout_mask"),
                  f"algorithm.{key}={getattr(a, key)} has no effect with algorithm.rollout_mask=none")
    r.require(a.use_kl_loss or not changed("kl_loss_type"), ("algorithm.kl_loss_type", "algorithm.use_kl_loss"),
              f"algorithm.kl_loss_type={a.kl_loss_type} has no effect without algorithm.use_kl_loss=true")
    # k1 is the estimator of REINFORCE++'s reward, never a loss: E_pi[grad (logp - ref_logp)] = E_pi[grad logp] = 0
    r.require(not (a.use_kl_loss and a.kl_loss_type == "k1"), ("algorithm.kl_loss_type", "algorithm.use_kl_loss"),
              "algorithm.kl_loss_type=k1 is not allowed with algorithm.use_kl_loss=true: as a loss, k1 = logp - "
              "ref_logp has zero expected gradient (the mean of grad logp over the policy's own samples is 0), so it "
              "adds only noise and no pull toward the reference; use k2 (its gradient is that of KL(pi||ref)) or k3 "
              "(the default, low-variance; its gradient is that of KL(ref||pi)); docs/algorithms.md, "
              "\"KL-loss estimators\"")
    if "std_normalization" not in algo.ignores:
        r.require(a.normalize_rewards or not changed("std_normalization"),
                  ("algorithm.std_normalization", "algorithm.normalize_rewards"),
                  f"algorithm.std_normalization={a.std_normalization} has no effect with "
                  "algorithm.normalize_rewards=false (the raw rewards are used)")


def _overlong(cfg: RelaxConfig, r: _Rules) -> None:
    """DAPO's overlong penalty (data.overlong_buffer_len, data.overlong_penalty_factor; docs/training.md)."""
    d, limit, name = cfg.data, cfg.rollout.max_response_len, "rollout.max_response_len"
    if agentic(cfg):  # an episode's model tokens count against the episode's budget
        limit, name = cfg.rollout.max_episode_tokens or limit, "rollout.max_episode_tokens"
    buffer, factor = d.overlong_buffer_len, d.overlong_penalty_factor
    r.require(0 <= buffer < max(limit, 1), ("data.overlong_buffer_len", name),
              f"data.overlong_buffer_len={buffer} must be in [0, {name}={limit}): the penalty starts {limit} - "
              "overlong_buffer_len tokens into a response, and some length must stay unpenalised (0: off)")
    r.require(buffer != 0 or not _changed(d, "overlong_penalty_factor"),
              ("data.overlong_penalty_factor", "data.overlong_buffer_len"),
              f"data.overlong_penalty_factor={factor} has no effect with data.overlong_buffer_len=0 (no overlong "
              "penalty); set data.overlong_buffer_len")


def _dynamic_sampling(cfg: RelaxConfig, algo: algorithms.Algorithm, r: _Rules, own_refused: set[str]) -> None:
    """DAPO's dynamic sampling (rollout.filter_groups, over_sampling_batch_size, max_filter_rounds; docs/training.md,
    "Dynamic sampling"). `own_refused`: the fields the algorithm's own rules refuse."""
    ro = cfg.rollout
    if not ro.filter_groups:
        for key in ("over_sampling_batch_size", "max_filter_rounds"):
            r.require(not _changed(ro, key), (f"rollout.{key}", "rollout.filter_groups"),
                      f"rollout.{key}={getattr(ro, key)} has no effect without rollout.filter_groups=true")
        return
    r.require(algo.group_relative, "rollout.filter_groups",
              f"algorithm={algo.name}: rollout.filter_groups=true is not supported: it drops groups whose rewards are "
              f"all equal because a group baseline gives them no advantage, but {algo.name}'s advantages do not come "
              "from a group baseline (such groups still carry a learning signal)")
    # Where the algorithm reads normalize_rewards (GRPO's hook and those built on it), false means raw rewards as
    # advantages: no group baseline, so an all-equal group has a signal too. REINFORCE++-baseline ignores the key
    # (its baseline is always the group mean; `_ignored` refuses a change) and RLOO refuses false with its own rule.
    raw_rewards = (algo.group_relative and "normalize_rewards" not in algo.ignores
                   and not cfg.algorithm.normalize_rewards
                   and "algorithm.normalize_rewards" not in own_refused)
    r.require(not raw_rewards, ("rollout.filter_groups", "algorithm.normalize_rewards"),
              f"algorithm={algo.name}: rollout.filter_groups=true is not supported with "
              "algorithm.normalize_rewards=false: it drops groups whose rewards are all equal because a group "
              f"baseline gives them no advantage, but with normalize_rewards=false {algo.name}'s advantages are the "
              "raw rewards, not relative to a group baseline (such groups still carry a learning signal); set "
              "algorithm.normalize_rewards=true or leave rollout.filter_groups off")
    over = ro.over_sampling_batch_size
    r.require(over is not None and over >= ro.rollout_batch_size,
              ("rollout.over_sampling_batch_size", "rollout.rollout_batch_size"),
              f"rollout.over_sampling_batch_size={over} must be >= rollout.rollout_batch_size={ro.rollout_batch_size}: "
              "each generation round draws that many prompts, and the first round must be able to fill the batch")


def _tracking(cfg: RelaxConfig, r: _Rules) -> None:
    """MLflow system metrics (tracking.system_metrics, tracking.system_metrics_interval_s; docs/experiments.md) and
    the final policy as an MLflow model (tracking.log_model; docs/training.md, "Exporting a checkpoint")."""
    tr = cfg.tracking
    if tr.log_model:
        r.require(tr.enabled, ("tracking.log_model", "tracking.enabled"),
                  "tracking.log_model=true has no effect with tracking.enabled=false: the model is logged into the "
                  "run's MLflow run")
        r.require(cfg.train.save_hf, ("tracking.log_model", "train.save_hf"),
                  "tracking.log_model=true logs the Hugging Face directory that train.save_hf=true exports at the end "
                  "of the run: set train.save_hf=true too")
        # refused before anything starts: the run would train, then fail at its end
        r.require(cfg.model.lora_rank <= 0, ("tracking.log_model", "model.lora_rank"),
                  f"tracking.log_model=true with model.lora_rank={cfg.model.lora_rank}: a LoRA run's train.save_hf "
                  "export is a PEFT adapter directory (no config.json), which MLflow's transformers flavor does not "
                  "log; leave tracking.log_model out, and after the run write the merged model with `relax-export "
                  "<save_dir> <dir> --merge` and log it into the run with `python -m relax.tracking.model <dir> "
                  "--run-id <run id> --uri <tracking.uri>`")
    if tr.enabled:
        scheme = tracking_uri_scheme(tr.uri)
        r.require(scheme in MLFLOW_SCHEMES, "tracking.uri",
                  f"tracking.uri={tr.uri!r}: MLflow has no store for the scheme {scheme + ':'!r}; use a directory "
                  "(a path or file:///...), a database (sqlite:///mlflow.db, postgresql://..., mysql://..., "
                  "mssql://...), a tracking server (http(s)://host:port) or databricks")
    interval = tr.system_metrics_interval_s
    r.require(tr.system_metrics or not _changed(tr, "system_metrics_interval_s"),
              ("tracking.system_metrics_interval_s", "tracking.system_metrics"),
              f"tracking.system_metrics_interval_s={interval} has no effect with tracking.system_metrics=false")


# the URI schemes of MLflow's tracking stores ('': a local path; mlflow.tracking._tracking_service.utils)
MLFLOW_SCHEMES = ("", "file", "sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks",
                  "databricks-uc", "uc")


def _url_credentials(cfg: RelaxConfig, r: _Rules) -> None:
    """No URL option holds a user or password: Relax records them (MLflow params and tags, the job's
    config.resolved.yaml, the checkpoint's config.yaml and state.json, Hydra's .hydra/); each secret has an
    environment variable, which the message names. An option that names an API's base (reward_model.url,
    rollout.sglang.urls) takes no query or fragment either (`?api_key=...`: `query_problem`)."""
    def url(key: str, value: object, instead: str, password_only: bool = False, base: str | None = None) -> bool:
        """`base`: the option names an API's base (`base`: its shape), which takes no query or fragment either
        (`query_problem`). True when the value was refused."""
        problem = credentials_problem(key, value, instead, password_only=password_only)
        if problem is None and base is not None:
            problem = query_problem(key, value, instead, base=base)
        r.require(problem is None, key, problem or "")
        return problem is not None

    url("data.reward", cfg.data.reward, REWARD_KEY_INSTEAD)
    url("reward_model.url", cfg.reward_model.url, "put the key in an environment variable named by "
        "reward_model.api_key_env (sent as a Bearer key)", base="http(s)://host:port/v1")
    for u in cfg.rollout.sglang.urls or ():
        # relax.runner.rollout_driver.sglang_engines.API_KEY_ENV (a test checks they agree); one message for the option
        if url("rollout.sglang.urls", u, "put the servers' key (their --api-key) in $RELAX_SGLANG_API_KEY",
               base="http(s)://host:port each"):
            break
    web = tracking_uri_scheme(cfg.tracking.uri) in ("http", "https")
    url("tracking.uri", cfg.tracking.uri,
        "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the environment"
        if web else "give the password to the database client from its environment (postgresql: PGPASSWORD or "
        "~/.pgpass)", password_only=not web)


def tracking_uri_scheme(uri: str) -> str:
    """The scheme that MLflow picks a store by: a database's without its driver (`postgresql+psycopg2` ->
    `postgresql`), none for a Windows drive letter, `databricks` for `databricks://profile`."""
    from urllib.parse import urlparse

    scheme = urlparse(uri).scheme.lower()
    if len(scheme) == 1:
        return ""
    return scheme.split("+", 1)[0]


def _changed(section: object, key: str) -> bool:
    """Whether a schema field differs from its dataclass default."""
    return getattr(section, key) != getattr(type(section)(), key)


def _unused_in_context(cfg: RelaxConfig, r: _Rules) -> None:
    """Schema fields that only act together with another setting: set without it, they are rejected."""
    m, d, t, ro = cfg.model, cfg.data, cfg.train, cfg.rollout

    def unused(section: object, prefix: str, keys: tuple[str, ...], when: bool, why: str) -> None:
        for key in keys:
            if when and _changed(section, key):
                r.require(False, f"{prefix}.{key}", f"{prefix}.{key}={getattr(section, key)!r} has no effect: {why}")

    unused(m, "model", ("arch", "hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads",
                        "head_dim", "intermediate_size", "max_position_embeddings"), m.source != "config",
           f"the architecture of model.source={m.source} comes from its files (these fields build source=config)")
    unused(m, "model", ("path",), m.source == "config", "model.source=config builds the model from its fields")
    unused(m, "model", ("base_path",), m.source != "hf", "it names the base model of a PEFT adapter directory "
           f"model.path (model.source=hf), and model.source={m.source} has none")
    unused(m, "model", ("tokenizer",), m.source != "config",
           f"a model of model.source={m.source} has its own tokenizer (model.tokenizer serves source=config)")
    r.choice("model.arch", m.arch, ("qwen3", "qwen3_moe") + VISION_ARCHS)
    if m.source == "config":
        need = ro.max_prompt_len + ro.max_response_len
        r.require(need <= m.max_position_embeddings, ("model.max_position_embeddings", "rollout.max_prompt_len"),
                  f"rollout.max_prompt_len + rollout.max_response_len ({need}) exceeds "
                  f"model.max_position_embeddings={m.max_position_embeddings}")
    synthetic = d.path is None and d.task not in ("gsm8k", "file")  # relax.data.tasks generates every other task
    unused(d, "data", ("num_prompts",), not synthetic, "it sizes the synthetic tasks (data.task=digits|arithmetic|"
           "guess_number|calculator without data.path)")
    # the keys name the fields of every prompt file read: data.path, data.eval_path and data.eval_sets (an entry's own
    # keys first); a built-in task without such files has none to name
    reads_files = d.path is not None or (evaluates(cfg) and (d.eval_path is not None or bool(d.eval_sets)))
    unused(d, "data", ("prompt_key", "label_key"), not reads_files,
           "it names the fields of the records of data.path, data.eval_path and data.eval_sets, and "
           f"data.task={d.task} reads none of them")
    r.require(d.path is None or d.task == "file", ("data.path", "data.task"),
              f"data.path is set but data.task={d.task}: prompts come from data.path only with data.task=file "
              "(data=jsonl)")
    r.require(t.ref_load is None or needs_reference(cfg) is not None, "train.ref_load",
              f"train.ref_load={t.ref_load} has no effect: no KL term needs a reference model "
              "(set algorithm.use_kl_loss=true with a kl_loss_coef, or an algorithm with reward-side KL)")
    no_eval = not evaluates(cfg)
    why_eval = "train.eval_interval=0 runs no evaluation"
    # train.num_rollout=0 (an evaluation-only run) trains nothing, so it writes no checkpoint
    unused(t, "train", ("save_interval", "keep_checkpoints", "save_hf"), t.num_rollout == 0,
           "train.num_rollout=0 (evaluation only) trains nothing and writes no checkpoint")
    unused(d, "data", ("eval_path", "eval_sets", "num_eval_prompts"), no_eval, why_eval)
    unused(d, "data", ("eval_path",), synthetic,
           f"data.task={d.task} generates its own eval prompts (data.num_eval_prompts)")
    unused(d, "data", ("system_prompt",), not d.apply_chat_template,
           "the system prompt is a message of the chat template (data.apply_chat_template=false)")
    if not no_eval:
        # an evaluation-only run is there to evaluate: it says so, whatever train.eval_interval holds
        field, what = (("train.num_rollout", "train.num_rollout=0 (an evaluation-only run)") if t.num_rollout == 0
                       else ("train.eval_interval", f"train.eval_interval={t.eval_interval}"))
        r.require(d.num_eval_prompts > 0, (field, "data.num_eval_prompts"),
                  f"{what} needs eval prompts, but data.num_eval_prompts=0")
        r.require(d.task != "file" or d.eval_path is not None or bool(d.eval_sets), (field, "data.eval_path"),
                  f"{what} needs eval prompts: set data.eval_path or data.eval_sets for data.task=file")
    unused(ro, "rollout", ("eval_n_samples_per_prompt", "eval_temperature", "eval_top_p"), no_eval, why_eval)
    unused(t, "train", ("eval_pass_k", "eval_correct_threshold", "eval_save_samples"), no_eval, why_eval)
    unused(ro, "rollout", ("partial_rollout_max_aborts", "mask_offpolicy_in_partial_rollout"), not ro.partial_rollout,
           "it acts on partial rollout (rollout.partial_rollout=true)")
    unused(t, "train", ("min_lr_ratio",), t.lr_schedule == "constant",
           "train.lr_schedule=constant never decays (use cosine or linear)")
    unused(t, "train", ("save_interval", "keep_checkpoints", "save_hf"), not t.save,
           "train.save=false writes no checkpoint")
    unused(t, "train", ("save_dir",), not t.save and t.resume is None,
           "train.save=false writes no checkpoint and train.resume is unset")


def _teacher(cfg: RelaxConfig, algo: algorithms.Algorithm, r: _Rules) -> None:
    """The teacher's options act only for an algorithm that distills (`requires_teacher`), which needs one. Its files
    and its tokenizer (the policy's) are checked before Ray starts (`relax.runner.train`)."""
    t = cfg.teacher
    if algo.requires_teacher:
        r.require(t.path is not None or t.name != "none" or t.source == "gguf", "teacher.path",
                  f"algorithm={algo.name} distills from a teacher: set teacher.path=<a Hugging Face directory of a "
                  "model with the policy's tokenizer, such as a relax-export of a Relax run> or choose "
                  "teacher=<option> (conf/teacher)")
        r.require(t.base_path is None or t.source == "hf", "teacher.base_path",
                  f"teacher.base_path={t.base_path!r} has no effect: it names the base model of a PEFT adapter "
                  f"directory teacher.path (teacher.source=hf), and teacher.source={t.source} has none")
        return
    for f in dataclasses.fields(t):
        r.require(not _changed(t, f.name), f"teacher.{f.name}",
                  f"teacher.{f.name}={getattr(t, f.name)!r} has no effect: algorithm={algo.name} uses no teacher "
                  "(on-policy distillation does: algorithm=opd)")


def _lora(cfg: RelaxConfig, r: _Rules) -> None:
    """LoRA's options (model.lora_*, rollout.lora_sync). That the target modules exist is checked against the model's
    architecture before Ray starts (`relax.models.lora.check_targets`), naming the layers it has."""
    m, ro = cfg.model, cfg.rollout
    if m.lora_adapter_path:
        _adapter(cfg, r)
    if m.lora_rank <= 0:
        if m.lora_adapter_path:  # its adapter_config.json unreadable: the lora check says why, before start
            return
        for key in ("lora_alpha", "lora_dropout", "lora_target_modules"):
            r.require(not _changed(m, key), (f"model.{key}", "model.lora_rank"),
                      f"model.{key}={getattr(m, key)} has no effect with model.lora_rank=0 (every parameter trains)")
        r.require(not _changed(ro, "lora_sync"), ("rollout.lora_sync", "model.lora_rank"),
                  f"rollout.lora_sync={ro.lora_sync} has no effect with model.lora_rank=0 (every weight is sent)")
        return
    r.positive("model.lora_alpha", m.lora_alpha)
    r.require(0 <= m.lora_dropout < 1, "model.lora_dropout", f"model.lora_dropout={m.lora_dropout} must be in [0, 1)")
    targets = list(m.lora_target_modules)
    r.require(bool(targets) and all(isinstance(t, str) and t for t in targets), "model.lora_target_modules",
              f"model.lora_target_modules={targets} must name linear layers (e.g. [q_proj,v_proj]) or be [all-linear]")
    r.require("all-linear" not in targets or targets == ["all-linear"], "model.lora_target_modules",
              f"model.lora_target_modules={targets}: all-linear stands alone (every linear layer but the output head)")
    r.require(cfg.train.backend == "torch" or bool(m.lora_adapter_path), ("model.lora_rank", "train.backend"),
              f"model.lora_rank={m.lora_rank} with train.backend={cfg.train.backend} {NOT_BUILT}: LoRA on "
              "megatron-core's tensor-parallel linear layers is not built; train.backend=torch trains the adapters "
              "(PEFT), on one device")
    local = ro.sglang.urls is None and cfg.cluster.num_nodes == 1
    r.require(ro.lora_sync == "merged" or ro.backend == "embedded" or local,
              ("rollout.lora_sync", "rollout.sglang.urls", "cluster.num_nodes"),
              f"rollout.lora_sync={ro.lora_sync} with rollout=sglang needs servers that read the driver's files: each "
              "update is an adapter directory the servers load (/load_lora_adapter), written on this node; servers "
              "of other nodes or given by rollout.sglang.urls cannot read it (use rollout.lora_sync=merged there)")


def _adapter(cfg: RelaxConfig, r: _Rules) -> None:
    """model.lora_adapter_path (continuing to train a PEFT adapter): its adapter_config.json gives model.lora_*
    (`derive.resolve`); an option set to another value is refused naming both, never ignored. The directory's files,
    its PEFT type and its base are checked before start (`relax.models.lora.check_adapter_dir`)."""
    m = cfg.model
    for key, value, own in adapter_conflicts(m):
        r.require(False, (f"model.{key}", "model.lora_adapter_path"),
                  f"model.{key}={value} with model.lora_adapter_path={m.lora_adapter_path!r}, whose "
                  f"adapter_config.json says {own}: the adapters are trained as they were saved; leave model.{key} "
                  "out (it takes the adapter's value)")
    r.require(cfg.train.backend == "torch", ("model.lora_adapter_path", "train.backend"),
              f"model.lora_adapter_path with train.backend={cfg.train.backend} {NOT_BUILT}: LoRA on megatron-core's "
              "tensor-parallel linear layers is not built; train.backend=torch continues training the adapters")


def _evaluation(cfg: RelaxConfig, r: _Rules) -> None:
    """Evaluation's sampling, its pass@k and its eval sets (docs/training.md, "Evaluation")."""
    ro, t, d = cfg.rollout, cfg.train, cfg.data
    r.require(ro.eval_top_p == 1 or ro.eval_temperature > 0, ("rollout.eval_top_p", "rollout.eval_temperature"),
              f"rollout.eval_top_p={ro.eval_top_p} has no effect with rollout.eval_temperature=0: greedy decoding "
              "takes the most likely token, which every nucleus holds")
    n = ro.eval_n_samples_per_prompt
    ks = t.eval_pass_k
    if ks is not None:
        r.require(len(ks) > 0, "train.eval_pass_k", "train.eval_pass_k=[] logs no pass@k (leave it unset for [1, n])")
        r.require(all(1 <= k <= n for k in ks), ("train.eval_pass_k", "rollout.eval_n_samples_per_prompt"),
                  f"train.eval_pass_k={list(ks)}: each k must be in 1..rollout.eval_n_samples_per_prompt={n} "
                  "(pass@k is estimated from the n responses to each prompt)")
        r.require(list(ks) == sorted(set(ks)), "train.eval_pass_k",
                  f"train.eval_pass_k={list(ks)} must be ascending without repeats")
    for name in d.eval_sets:
        r.require(EVAL_SET_NAME.fullmatch(name) is not None, "data.eval_sets",
                  f"data.eval_sets: the name {name!r} must be letters, digits, '_', '.', '-' (starting with a letter "
                  "or digit): it becomes the metric names eval/<name>/...")
        problem = eval_set_problem(name, d.eval_sets[name])
        r.require(problem is None, "data.eval_sets", problem or "")
    default = default_eval_set_name(d)
    if d.eval_path is not None and default is not None:
        r.require(EVAL_SET_NAME.fullmatch(default) is not None, "data.eval_path",
                  f"data.eval_path={d.eval_path}: the eval set is named after the file's stem, {default!r}, which "
                  "must be letters, digits, '_', '.', '-' (rename the file, or list it in data.eval_sets by name)")
    r.require(default not in d.eval_sets, ("data.eval_sets", "data.eval_path"),
              f"data.eval_sets.{default}: the name is taken by the default eval set "
              f"({f'data.eval_path={d.eval_path}' if d.eval_path is not None else f'data.task={d.task}'}): "
              "choose another name")


def _agents(cfg: RelaxConfig, r: _Rules) -> None:
    """Agentic rollouts (data.env / data.tools / data.agent, docs/agents.md): their limits, and nothing multi-turn
    asked of single-turn data or of a backend that does not run episodes."""
    ro, d = cfg.rollout, cfg.data
    episodes = agentic(cfg)
    r.require(not (d.agent and (d.env or d.tools)), ("data.agent", "data.env", "data.tools"),
              "data.agent decides every observation itself; it cannot be combined with data.env or data.tools")
    _openai_agent(cfg, r)
    r.require(d.tool_parser in TOOL_PARSERS or ":" in d.tool_parser, "data.tool_parser",
              f"data.tool_parser={d.tool_parser!r}: unknown; expected one of {', '.join(TOOL_PARSERS)} or "
              "'package.module:function' (text -> relax.agents.parsers.ParsedMessage)")
    r.require(bool(d.tools) or not _changed(d, "tool_timeout_s"), ("data.tool_timeout_s", "data.tools"),
              f"data.tool_timeout_s={d.tool_timeout_s} limits tool calls, and no tools are set (data.tools)")
    # a turn that calls a tool is answered by the tool, never by data.env (and data.agent, data.openai_agent take no
    # data.tools): with one turn the call runs and the episode ends, its result shown to no one
    r.require(not d.tools or ro.max_turns >= 2, ("data.tools", "rollout.max_turns"),
              f"data.tools={list(d.tools)} with rollout.max_turns={ro.max_turns}: the model never reads a tool's "
              "result (the episode ends after the turn that calls it, and data.reward scores the call); set "
              "rollout.max_turns >= 2 (a turn to call, one to read the result and answer), or drop data.tools")
    wall, set_wall = python_tool_limits(d.sandbox)["wall_s"], d.sandbox.wall_s is not None  # (its range: sandbox_rules)
    r.require(PYTHON_TOOL not in d.tools or d.tool_timeout_s is None or not wall > 0
              or d.tool_timeout_s > wall + PYTHON_TOOL_MARGIN_S,
              ("data.tool_timeout_s", "data.sandbox.wall_s", "data.tools") if set_wall else
              ("data.tool_timeout_s", "data.tools"),
              f"data.tool_timeout_s={d.tool_timeout_s} must be more than {wall + PYTHON_TOOL_MARGIN_S:g} s, the python "
              f"tool's sandbox wall-clock limit ({wall:g} s{', data.sandbox.wall_s' if set_wall else ''}) plus a "
              f"{PYTHON_TOOL_MARGIN_S:g} s margin: the sandbox stops a runaway program with an error the model reads; "
              "a call stopped first by data.tool_timeout_s kills and respawns its worker")
    r.require(bool(d.env or d.agent) or not _changed(d, "env_timeout_s"), ("data.env_timeout_s", "data.env"),
              f"data.env_timeout_s={d.env_timeout_s} limits an environment's steps or an agent loop's turns, and "
              "neither is set (data.env, data.agent)")
    hb = cfg.cluster.heartbeat_timeout_s
    r.require(not (d.env or d.agent) or d.env_timeout_s is None or hb is None or d.env_timeout_s < hb,
              ("data.env_timeout_s", "cluster.heartbeat_timeout_s"),
              f"data.env_timeout_s={d.env_timeout_s} must be below cluster.heartbeat_timeout_s={hb}: a step that "
              "hangs would otherwise read as a hung rollout process, restarted, instead of ending its episode")
    r.require(bool(d.tools or d.agent) or not _changed(ro, "max_tool_errors"),
              ("rollout.max_tool_errors", "data.tools"),
              f"rollout.max_tool_errors={ro.max_tool_errors} counts failed tool calls, and nothing calls tools "
              "(data.tools, or an agent loop: data.agent)")
    if not episodes:
        r.require(ro.max_turns == 1, ("rollout.max_turns", "data.env"),
                  f"rollout.max_turns={ro.max_turns} needs an environment, tools or an agent loop (data.env, "
                  "data.tools, data.agent) to answer the model between turns")
        r.require(ro.max_episode_tokens in (None, ro.max_response_len), ("rollout.max_episode_tokens", "data.env"),
                  "rollout.max_episode_tokens limits agentic episodes (data.env, data.tools, data.agent); a "
                  "single-turn response is limited by rollout.max_response_len")
        r.require(d.reward != "none" or cfg.reward_model.kind != "none", "data.reward",
                  "data.reward=none: single-turn responses need a reward function or a reward model (none is for "
                  "an environment or agent loop that gives the rewards, or reward_model=classifier|judge)")
        r.require(d.turn_rewards == "episode", ("data.turn_rewards", "data.env"),
                  "data.turn_rewards=per_turn places the rewards of an episode's turns; single-turn responses have "
                  "one (data.env, data.tools, data.agent make episodes)")
        return
    if d.turn_rewards == "per_turn":
        algo = algorithms.get(cfg.algorithm.name)
        r.require(algo.token_rewards, ("data.turn_rewards", "algorithm.name"),
                  f"data.turn_rewards=per_turn needs an algorithm whose advantages take rewards on tokens (ppo, "
                  f"reinforce_pp); {algo.name}'s advantages compare one reward per episode (its group baseline): use "
                  "data.turn_rewards=episode")
        r.require(not ro.mask_offpolicy_in_partial_rollout,
                  ("data.turn_rewards", "rollout.mask_offpolicy_in_partial_rollout"),
                  "data.turn_rewards=per_turn with rollout.mask_offpolicy_in_partial_rollout: a turn's reward on a "
                  "token left out of the loss would be lost")
    if ro.max_episode_tokens is not None:
        r.require(ro.max_episode_tokens >= ro.max_response_len, ("rollout.max_episode_tokens",
                                                                 "rollout.max_response_len"),
                  f"rollout.max_episode_tokens={ro.max_episode_tokens} must be >= rollout.max_response_len="
                  f"{ro.max_response_len} (one turn)")
    r.require(d.reward != "none" or bool(d.env or d.agent or d.openai_agent), "data.reward",
              "data.reward=none with tools only: nothing would reward the episodes (set data.reward, or data.env)")


def _openai_agent(cfg: RelaxConfig, r: _Rules) -> None:
    """data.openai_agent: an agent program behind the training gateway (relax.serve.openai.agents)."""
    d, ro = cfg.data, cfg.rollout
    if not d.openai_agent:
        r.require(not (_changed(d, "agent_timeout_s") or _changed(d, "agent_workers")),
                  ("data.agent_timeout_s", "data.agent_workers", "data.openai_agent"),
                  "data.agent_timeout_s and data.agent_workers limit and run agent programs; data.openai_agent is "
                  "not set")
        return
    r.require(not (d.env or d.tools or d.agent), ("data.openai_agent", "data.env", "data.tools", "data.agent"),
              "data.openai_agent runs the whole episode itself (its tools included); it cannot be combined with "
              "data.env, data.tools or data.agent")
    r.require(ro.backend == "sglang", ("data.openai_agent", "rollout.backend"),
              "data.openai_agent serves the agent through an OpenAI gateway in front of SGLang servers: use "
              "rollout=sglang (on a CPU: rollout=sglang rollout.sglang.server=embedded)")


def validate(cfg: RelaxConfig, given: RelaxConfig | None = None) -> list[Violation]:
    """All violations of `cfg` (resolved), generic ones first, then the algorithm's own. `given`: `cfg` before
    `derive.resolve` where the caller has it (which values the user set, which were derived: the messages say)."""
    r = _Rules()
    try:
        algo = algorithms.get(cfg.algorithm.name)
    except KeyError as exc:
        return [Violation(("algorithm.name",), str(exc.args[0]))]
    own = algo.check(cfg)  # the algorithm's own rules, reported last
    _choices(cfg, r)
    _ranges(cfg, r)
    _combinations(cfg, r)
    _batches(cfg, algo, r, given)
    _resources(cfg, algo, r)
    _modes(cfg, r)
    _flags(cfg, algo, r)
    _ignored(cfg, algo, r)
    _unused_in_context(cfg, r)
    _teacher(cfg, algo, r)
    _lora(cfg, r)
    _evaluation(cfg, r)
    _overlong(cfg, r)
    _dynamic_sampling(cfg, algo, r, {f for v in own for f in v.fields})
    _tracking(cfg, r)
    _url_credentials(cfg, r)
    _sglang(cfg, r)
    _not_built(cfg, r)
    _agents(cfg, r)
    r.found.extend(reward_service_violations(cfg))
    r.found.extend(sandbox_violations(cfg))
    r.found.extend(reward_list_violations(cfg))
    r.found.extend(moe_violations(cfg))
    r.found.extend(megatron_violations(cfg))
    r.found.extend(vision_violations(cfg))
    r.found.extend(reward_model_violations(cfg))
    r.found.extend(role_cores_violations(cfg))
    for v in own:
        prefix = f"algorithm={algo.name}: "
        r.found.append(v if v.message.startswith(prefix) else Violation(v.fields, prefix + v.message))
    return r.found


def check(cfg: RelaxConfig, given: RelaxConfig | None = None) -> RelaxConfig:
    """Raise ConfigError with every violation, else return cfg. `given`: as for `validate`."""
    found = validate(cfg, given)
    if found:
        raise ConfigError(found, cfg.algorithm.name, config=cfg)
    return cfg
