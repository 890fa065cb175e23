"""What an algorithm is: a config dataclass, two math hooks, capability flags and its own checks.

Each algorithm module (`relax/algorithms/<name>.py`) builds one `Algorithm` and calls `register`.
Generic code (config validation, the runner, the trainers) reads only this interface, so adding an
algorithm never touches it. This module names torch's types only (`import relax.config` loads no torch).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch


def choice(default: Optional[str], options: tuple[str, ...]) -> Any:
    """A config field whose value must be one of `options` (or None where that is the default): the schema states
    them, validation checks every such field (`relax.config.validate`) and names the options."""
    return field(default=default, metadata={"choices": options})


def choices_of(cls: type, name: str) -> Optional[tuple[str, ...]]:
    """The options of field `name` of config class `cls`, declared by `choice` on it or on a base class (a subclass
    may change the default alone)."""
    return _declared(cls, name, "choices")


def _declared(cls: type, name: str, key: str) -> Any:
    """Metadata `key` of field `name`, from `cls` or the nearest base class that declares it (None: undeclared)."""
    for klass in cls.__mro__:
        for f in getattr(klass, "__dataclass_fields__", {}).values():
            if f.name == name and key in f.metadata:
                return f.metadata[key]
    return None


@dataclass(frozen=True)
class Range:
    """The values a numeric config field may hold, declared on the field (`positive`, `non_negative`, `in_range`,
    `finite`) and checked for every field that has one by validation (`relax.config.validate`), which reports
    `<key>=<value> <says>`."""

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False  # lo itself is outside the range
    hi_open: bool = False
    also: tuple[float, ...] = ()  # values accepted besides the interval (a sentinel such as top_k=-1)
    finite: bool = False  # nan and +-inf are outside the range even without bounds
    optional: bool = False  # None passes (it means "derived" or "off", or another rule judges it)
    # (field, value): checked only while another field of the same section holds that value, or one of them when
    # value is a tuple (the architecture fields act only for model.source=config)
    when: Optional[tuple[str, Any]] = None
    says: str = ""  # the message's predicate; "" states the bounds ("must be > 0", "must be in [0, 1)")

    def applies(self, section: object) -> bool:
        """Whether the rule holds for `section` (the config dataclass that has the field): `when` (see above)."""
        if self.when is None:
            return True
        key, wanted = self.when
        return getattr(section, key) in (wanted if isinstance(wanted, tuple) else (wanted,))

    def admits(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if value in self.also:
            return True
        if self.finite and not math.isfinite(value):
            return False
        if self.lo is not None and not (value > self.lo if self.lo_open else value >= self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    def message(self, key: str, value: Any) -> str:
        # "a finite number" only where that is what the value lacks: `kl_coef=-0.1 must be >= 0` stays short
        finite_word = self.finite and isinstance(value, (int, float)) and not math.isfinite(value)
        return f"{key}={value} {self.says or self._bounds(finite_word)}"

    def _bounds(self, finite_word: bool = False) -> str:
        must = "must be a finite number" if finite_word else "must be"
        if self.lo is None and self.hi is None:
            return "must be a finite number"
        if self.hi is None:
            return f"{must} {'>' if self.lo_open else '>='} {self.lo}"
        if self.lo is None:
            return f"{must} {'<' if self.hi_open else '<='} {self.hi}"
        return f"{must} in {'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"


def in_range(default: Any, lo: Optional[float] = None, hi: Optional[float] = None, *, lo_open: bool = False,
             hi_open: bool = False, also: tuple[float, ...] = (), finite: bool = False, optional: bool = False,
             when: Optional[tuple[str, Any]] = None, says: str = "") -> Any:
    """A numeric config field whose value must lie between `lo` and `hi` (inclusive unless `lo_open` / `hi_open`;
    None: unbounded on that side); the other options are `Range`'s. Validation checks every such field."""
    return field(default=default, metadata={"range": Range(lo, hi, lo_open, hi_open, also, finite, optional, when,
                                                           says)})


def positive(default: Any, **options: Any) -> Any:
    """A numeric config field that must be a finite number > 0 (`in_range`'s options; `finite=False` admits +inf).

    Finite by default, decided here once for every such field: nan already fails `> 0`, and +inf passed it although
    no field reads it as a setting (a timeout of inf overflows the socket's, an lr or a coefficient of inf makes the
    loss NaN, a temperature of inf turns the -inf of masked logits into NaN). A field whose inf is a meaningful
    setting says so with `finite=False` and documents it."""
    return in_range(default, 0, lo_open=True, **{"finite": True, **options})


def non_negative(default: Any, **options: Any) -> Any:
    """A numeric config field that must be a finite number >= 0 (`in_range`'s options; finite as `positive`)."""
    return in_range(default, 0, **{"finite": True, **options})


def finite(default: Any, **options: Any) -> Any:
    """A float config field that must be a finite number (`in_range`'s options)."""
    return in_range(default, finite=True, **options)


def range_of(cls: type, name: str) -> Optional[Range]:
    """The `Range` of field `name` of config class `cls`, declared on it or on a base class (a subclass may change
    the default alone)."""
    return _declared(cls, name, "range")


# verl's loss_agg_mode values: every token of the step weighs the same; each response weighs the same (its token
# mean); each response's token sum, over the responses; the same over a constant (loss_scale_factor)
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def loss_agg_mode(cfg: Any, per_token: bool) -> str:
    """The aggregation a step's loss uses: `cfg.loss_agg_mode`, else (auto, or a config without the field) the one
    `per_token` (train.calculate_per_token_loss) names."""
    mode = getattr(cfg, "loss_agg_mode", "auto")
    if mode != "auto":
        return mode
    return "token-mean" if per_token else "seq-mean-token-mean"


@dataclass(frozen=True)
class AlgorithmConfig:
    """Settings shared by every algorithm; subclasses add their own and set `name`.

    `eps_clip_high=None` means "same as eps_clip". Keys here exist for every algorithm; a key
    that only one algorithm understands belongs on that algorithm's subclass, so that Hydra
    rejects it for the others.
    """

    name: str = "grpo"
    # (0, 1): the ratio's lower bound 1 - eps_clip must be positive, else the lower clip never binds (ratio > 0) and
    # a token with A < 0 is unclipped. An algorithm may widen this on its config (CISPO admits 1: no lower clip).
    eps_clip: float = in_range(
        0.2, 0, 1, lo_open=True, hi_open=True,
        says="must be in (0, 1): it must be a finite number, the ratio is clipped to [1 - eps_clip, "
        "1 + eps_clip_high], and at eps_clip >= 1 the lower bound is <= 0, below every ratio, so the lower clip "
        "never applies")
    # may exceed 1 (clip-higher: DAPO uses 0.28, CISPO often 10): it bounds the ratio from above only
    eps_clip_high: Optional[float] = positive(None, optional=True)
    # Dual-clip PPO (Ye et al. 2020; verl's clip_ratio_c, slime's --eps-clip-c), null: off. The PPO-Clip loss of a
    # token with A < 0 is capped at dual_clip_c * |A| (its gradient is 0 there), so that a token whose ratio ran far
    # above the clip range (up to e^20, the log-ratio clamp) adds at most dual_clip_c * |A|; A >= 0 is unchanged.
    # Read by the PPO-Clip losses (grpo, ppo, gspo with its sequence ratio, m2po, opd, both reinforce_pp); rloo, cispo
    # and sapo reject it (`Algorithm.ignores`). Logs train/pg_clipfrac_lower. docs/algorithms.md, "Dual clip".
    dual_clip_c: Optional[float] = in_range(
        None, 1, lo_open=True, finite=True, optional=True,
        says="must be a finite number > 1 (null: off): it caps the loss of a token with a negative advantage A at "
        "dual_clip_c * |A|, and a cap of 1 or less would also cut tokens whose ratio has not moved above 1, the "
        "on-policy ones inside the clip range")
    use_kl_loss: bool = False
    kl_loss_coef: float = non_negative(0.0)
    kl_loss_type: str = choice("k3", ("k1", "k2", "k3"))
    kl_coef: float = non_negative(0.0)
    # Rollout correction (relax.algorithms.rollout_correction, docs/algorithms.md): truncated importance sampling
    # at the token, sequence or geometric-mean level, and rejection of tokens or responses whose ratio is outside
    # [rollout_mask_low, rollout_mask_high] at the same levels (none: off)
    use_tis: bool = False
    tis_clip: float = in_range(2.0, 1, finite=True, says="must be a finite number >= 1: it caps the importance weight "
                               "min(ratio, tis_clip) from above, and a cap below 1 would scale down every token on "
                               "which the rollout engine and the trainer agree (ratio 1), a smaller loss rather than "
                               "a truncation")
    tis_level: str = choice("token", ("token", "sequence", "geometric"))
    rollout_mask: str = choice("none", ("none", "token", "sequence", "geometric"))
    rollout_mask_low: float = 0.5
    rollout_mask_high: float = 2.0
    use_rollout_logprobs: bool = False
    normalize_advantages: bool = False
    normalize_rewards: bool = True
    std_normalization: bool = True
    entropy_coef: float = non_negative(0.0)
    # Responses that ended by length (finish_reason "length") get a zero loss mask: no loss, token statistic or
    # denominator sees them, while their reward still counts in their group's baseline. Applied by the runner's mask
    # step (relax.runner.train.train_batch), so every algorithm has it.
    mask_truncated: bool = False
    # How the policy loss (with its KL loss and entropy terms, and PPO's critic loss) sums its tokens, by verl's
    # names (actor.loss_agg_mode); auto: train.calculate_per_token_loss decides (true: token-mean, false:
    # seq-mean-token-mean). Set, it must agree with train.calculate_per_token_loss (token-mean with true, the
    # seq-mean-* modes with false), which decides the step's denominator: its valid tokens or its responses.
    # seq-mean-token-sum: each response's token sum, averaged over the step's responses; seq-mean-token-sum-norm: the
    # same divided by loss_scale_factor. docs/algorithms.md, "Reduction".
    loss_agg_mode: str = choice("auto", ("auto", *LOSS_AGG_MODES))
    # seq-mean-token-sum-norm's constant divisor (verl's loss_scale_factor; Dr. GRPO divides by the generation
    # budget, e.g. rollout.max_response_len); needed by that mode and only read by it.
    loss_scale_factor: Optional[float] = positive(None, optional=True)

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high


@dataclass(frozen=True)
class Violation:
    """One broken rule: the dotted config keys involved and a message with values and reason."""

    fields: tuple[str, ...]
    message: str


@dataclass
class AdvantageInputs:
    """What the advantages step has for a whole global batch (responses of a group consecutive)."""

    # [N] scalar reward per response; [N, T] a reward on tokens (an episode's per-turn rewards, each on its turn's
    # last token) for algorithms with `Algorithm.token_rewards`
    rewards: torch.Tensor
    mask: torch.Tensor  # [N, T] 1 on response tokens that count
    group_size: int
    old_logp: Optional[torch.Tensor] = None  # [N, T]
    ref_logp: Optional[torch.Tensor] = None  # [N, T]
    values: Optional[torch.Tensor] = None  # [N, T] critic values (PPO)
    teacher_logp: Optional[torch.Tensor] = None  # [N, T] the teacher's log-probs (algorithms with requires_teacher)
    # [N] bool: the response ended with a stop token, which `mask` counts as its last token (None: unknown)
    stopped: Optional[torch.Tensor] = None
    # [N] tokens of each response (the stop token included), also of one whose tokens `mask` leaves out of the loss
    # (algorithm.mask_truncated); None: the mask's counts
    lengths: Optional[torch.Tensor] = None


@dataclass
class AdvantageOutput:
    advantages: torch.Tensor  # [N, T], zero on masked tokens
    returns: Optional[torch.Tensor] = None  # [N, T] critic targets (PPO)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class PolicyLossOutput:
    """Per-token policy loss before TIS, KL, entropy and reduction (applied by shared code).

    `metrics` hold means over valid tokens: of this micro-batch, or of the whole optimizer step when
    computed from the step statistics. `compute_loss` weights each by the micro-batch's share of the
    step's valid tokens, so that the micro-batches' values add up to the step's.
    """

    loss: torch.Tensor  # [B, T]
    clipped: Optional[torch.Tensor] = None  # [B, T] bool; None: the loss never clips
    # [B, T] bool: tokens whose loss the dual clip capped (algorithm.dual_clip_c; `compute_loss` logs their share as
    # train/pg_clipfrac_lower); None: no dual clip (off, or a loss that has none)
    dual_clipped: Optional[torch.Tensor] = None
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


StepStatistics = dict[str, float]
AdvantageFn = Callable[[Any, AdvantageInputs], AdvantageOutput]
# (config, logp, old_logp, advantages, mask) -> PolicyLossOutput; an algorithm with `step_statistics`
# also receives the keyword argument `stats` (the StepStatistics of the whole optimizer step).
PolicyLossFn = Callable[..., PolicyLossOutput]
# (config, logp, old_logp, advantages, mask) -> StepStatistics, over every valid token of the whole step
StepStatisticsFn = Callable[[Any, "torch.Tensor", "torch.Tensor", "torch.Tensor", "torch.Tensor"], StepStatistics]
CheckFn = Callable[[Any], list[Violation]]


def no_checks(cfg: Any) -> list[Violation]:
    return []


def no_critic_only_steps(cfg: Any) -> int:
    return 0


@dataclass(frozen=True)
class Algorithm:
    """A registry entry. `check` receives the whole resolved RelaxConfig (duck-typed).

    `step_statistics`, when set, computes what the policy loss needs from the whole optimizer step (every
    micro-batch and data-parallel rank) rather than from one micro-batch, e.g. M2PO's clip bounds. Its
    inputs are the detached `logp`, `old_logp`, `advantages` and `mask` of every valid token of the step
    (any shape; masked entries are ignored). A trainer then runs two passes (`needs_step_statistics`): a
    no-grad log-prob pass over all micro-batches that collects those tokens and calls `step_statistics`
    once, then the loss pass, which hands the result to `compute_loss` as `LossBatch.stats`. A
    data-parallel trainer all-gathers the collected tokens of every rank before the call, so that each
    rank computes the same statistics. `policy_loss` then receives them as the keyword argument `stats`.
    """

    name: str
    config_cls: type[AlgorithmConfig]
    compute_advantages: AdvantageFn
    policy_loss: PolicyLossFn
    summary: str  # one line: use it when ...
    requires_critic: bool = False
    requires_reference: bool = False  # besides the generic "a KL term needs a reference"
    # a frozen teacher scores every response token (AdvantageInputs.teacher_logp): on-policy distillation
    requires_teacher: bool = False
    # its advantages read the log-probs of the policy that sampled (AdvantageInputs.old_logp): the runner has the
    # actor compute them even for a batch that is exactly on-policy
    advantages_read_old_logp: bool = False
    supports_async: bool = True  # fully_async / hybrid modes, max_staleness > 0, partial rollout
    supports_context_parallel: bool = True
    supports_multi_step: bool = True  # train.num_steps_per_rollout > 1
    group_relative: bool = True  # needs rollout.n_samples_per_prompt >= 2
    step_statistics: Optional[StepStatisticsFn] = None
    # its advantages take rewards on tokens ([N, T] AdvantageInputs.rewards): an agentic episode's per-turn rewards
    # (data.turn_rewards=per_turn), discounted by the algorithm's own gamma over the model's tokens
    token_rewards: bool = False
    per_token_loss: bool = False  # value of train.calculate_per_token_loss when left unset
    per_token_loss_required: bool = False  # an explicit other value is an error
    metrics: tuple[str, ...] = ()  # metric names this algorithm adds
    # AlgorithmConfig fields this algorithm never reads -> why: validation rejects a value other than the config
    # class's default, so that a sweep over an ignored field cannot produce arms that differ only in their labels.
    ignores: dict[str, str] = field(default_factory=dict)
    check: CheckFn = no_checks
    # How many initial rollouts train only the critic (PPO's warm-up), read from the algorithm's config.
    critic_only_steps: Callable[[Any], int] = no_critic_only_steps

    def __post_init__(self) -> None:
        # the checks every algorithm shares (the loss aggregation's) run with its own, through `check`, which
        # validation calls; an entry made by dataclasses.replace wraps the algorithm's own check again, for itself
        own = getattr(self.check, "own_check", self.check)

        def check(cfg: Any) -> list[Violation]:
            return loss_agg_violations(cfg, self) + own(cfg)

        check.own_check = own  # type: ignore[attr-defined]
        object.__setattr__(self, "check", check)

    @property
    def needs_step_statistics(self) -> bool:
        """Whether a trainer must run the statistics pass over the whole step before the loss pass."""
        return self.step_statistics is not None


def loss_agg_violations(cfg: Any, algorithm: Algorithm) -> list[Violation]:
    """`algorithm.loss_agg_mode` and `algorithm.loss_scale_factor` against `train.calculate_per_token_loss` (resolved:
    an unset one is the algorithm's default, `Algorithm.per_token_loss`) and the algorithm's required reduction."""
    a, t = cfg.algorithm, getattr(cfg, "train", None)  # a duck-typed config may hold the algorithm alone
    mode, factor = getattr(a, "loss_agg_mode", "auto"), getattr(a, "loss_scale_factor", None)
    found: list[Violation] = []
    if mode == "auto":
        if factor is not None:
            found.append(Violation(("algorithm.loss_scale_factor", "algorithm.loss_agg_mode"),
                                   f"algorithm.loss_scale_factor={factor} has no effect: only "
                                   "algorithm.loss_agg_mode=seq-mean-token-sum-norm divides by it; set that mode or "
                                   "remove it"))
        return found
    if mode not in LOSS_AGG_MODES:
        return found  # named by the generic choice check
    per_token = getattr(t, "calculate_per_token_loss", None)
    per_token = algorithm.per_token_loss if per_token is None else per_token
    wants = mode == "token-mean"
    required = "token-mean" if algorithm.per_token_loss else "seq-mean-token-mean"
    if algorithm.per_token_loss_required and mode != required:
        found.append(Violation(("algorithm.loss_agg_mode",),
                               f"algorithm.loss_agg_mode={mode} is not supported: {algorithm.name} needs "
                               f"{required} (train.calculate_per_token_loss="
                               f"{str(algorithm.per_token_loss).lower()}); leave algorithm.loss_agg_mode=auto"))
    elif per_token != wants:
        what = "the step's valid tokens" if wants else "the step's responses"
        default = f", {algorithm.name}'s default" if per_token == algorithm.per_token_loss else ""
        found.append(Violation(("algorithm.loss_agg_mode", "train.calculate_per_token_loss"),
                               f"algorithm.loss_agg_mode={mode} needs train.calculate_per_token_loss="
                               f"{str(wants).lower()} (its denominator is {what}), but it is "
                               f"{str(per_token).lower()}{default}: set train.calculate_per_token_loss="
                               f"{str(wants).lower()} too"))
    if mode == "seq-mean-token-sum-norm" and factor is None:
        budget = getattr(getattr(cfg, "rollout", None), "max_response_len", None)
        hint = f" (rollout.max_response_len={budget} here)" if budget is not None else ""
        found.append(Violation(("algorithm.loss_scale_factor",),
                               "algorithm.loss_agg_mode=seq-mean-token-sum-norm needs algorithm.loss_scale_factor: "
                               "the constant each response's token sum is divided by, Dr. GRPO's generation budget, "
                               f"e.g. the longest response allowed{hint}"))
    if mode != "seq-mean-token-sum-norm" and factor is not None:
        found.append(Violation(("algorithm.loss_scale_factor", "algorithm.loss_agg_mode"),
                               f"algorithm.loss_scale_factor={factor} has no effect with algorithm.loss_agg_mode={mode}"
                               ": only seq-mean-token-sum-norm divides by it"))
    return found


_REGISTRY: dict[str, Algorithm] = {}

# hook -> the parameters Relax passes it, positionally and in this order (relax.algorithms.loss, the runner, the
# trainers, validation); policy_loss also gets `stats=` by keyword when the algorithm has step_statistics
HOOK_PARAMETERS = {
    "compute_advantages": ("cfg", "inputs"),
    "policy_loss": ("cfg", "logp", "old_logp", "advantages", "mask"),
    "step_statistics": ("cfg", "logp", "old_logp", "advantages", "mask"),
    "check": ("cfg",),
    "critic_only_steps": ("cfg",),
}


def check_hooks(algorithm: Algorithm) -> None:
    """Raise ValueError, naming the algorithm, the hook and the parameters it must accept, for a hook that cannot
    take the arguments Relax calls it with (a missing `mask`, a `stats` keyword absent with `step_statistics`): found
    at registration, where it would otherwise be a TypeError in a Ray role after the first rollout."""
    import inspect

    for hook_name, params in HOOK_PARAMETERS.items():
        hook = getattr(algorithm, hook_name)
        if hook_name == "check":
            hook = getattr(hook, "own_check", hook)  # the algorithm's own check, which __post_init__ wrapped
        if hook is None:
            if hook_name == "step_statistics":
                continue
            raise ValueError(f"algorithm {algorithm.name!r}: {hook_name} is None; it must be a function of "
                             f"({', '.join(params)})")
        keywords = {"stats": {}} if hook_name == "policy_loss" and algorithm.step_statistics is not None else {}
        wanted = ", ".join(params) + (", *, stats" if keywords else "")
        if not callable(hook):
            raise ValueError(f"algorithm {algorithm.name!r}: {hook_name} is {type(hook).__name__}, not a function of "
                             f"({wanted})")
        try:
            signature = inspect.signature(hook)
        except (TypeError, ValueError):  # a callable Python cannot introspect (a C function): trusted
            continue
        try:
            signature.bind(*params, **keywords)
        except TypeError as exc:
            why = (" (the algorithm has step_statistics, whose result policy_loss receives as stats=)"
                   if keywords else "")
            raise ValueError(f"algorithm {algorithm.name!r}: {hook_name} must accept ({wanted}){why}, as Relax calls "
                             f"it, but {getattr(hook, '__name__', hook_name)}{signature} cannot: {exc}") from None


def register(algorithm: Algorithm) -> Algorithm:
    if algorithm.name in _REGISTRY and _REGISTRY[algorithm.name] is not algorithm:
        raise ValueError(f"algorithm {algorithm.name!r} is already registered")
    if algorithm.config_cls.name != algorithm.name:
        raise ValueError(
            f"{algorithm.config_cls.__name__}.name is {algorithm.config_cls.name!r}, expected {algorithm.name!r}"
        )
    check_hooks(algorithm)
    _REGISTRY[algorithm.name] = algorithm
    return algorithm


def unregister(name: str) -> None:
    """For tests that register a temporary algorithm."""
    _REGISTRY.pop(name, None)


def get(name: str) -> Algorithm:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown algorithm {name!r}; known: {', '.join(names())} (one of your own package: name "
                       f"the module that registers it in plugins=[...])") from None


def names() -> list[str]:
    return sorted(_REGISTRY)


@dataclass
class LossBatch:
    """One micro-batch as the trainer hands it to `relax.algorithms.loss.compute_loss`."""

    logp: torch.Tensor  # [B, T] current policy, with grad
    old_logp: torch.Tensor  # [B, T] policy that produced the batch (recomputed by the trainer)
    advantages: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T]
    ref_logp: Optional[torch.Tensor] = None  # [B, T] when a KL loss needs it
    rollout_logp: Optional[torch.Tensor] = None  # [B, T] rollout engine's log-probs (TIS)
    entropy: Optional[torch.Tensor] = None  # [B, T] when entropy_coef > 0 (or to report it)
    # The algorithm's step_statistics over the whole optimizer step (None: computed from this batch alone,
    # i.e. this batch is the whole step). Only read by algorithms with `step_statistics`.
    stats: Optional[StepStatistics] = None
