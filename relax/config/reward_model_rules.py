"""The rules of the `reward_model` section (`RewardModelConfig`), and what the planner reads of it.

Each kind reads its own fields; a field that the chosen kind (or engine) does not read is rejected rather than
ignored, and every problem is reported at once with the rest of the config's (`relax.config.validate`). What needs
the files or imports (the model's directory, a parser named by import path) is checked when the run prepares its
inputs, still before anything starts (`relax.runner.reward_model.check_reward_model`).
"""

from __future__ import annotations

import dataclasses
import os
import string
from urllib.parse import urlparse

from relax.algorithms.base import Violation
from relax.config.derive import template_reads
from relax.config.schema import RelaxConfig, RewardModelConfig
from relax.config.vision_rules import is_vision_model

# the fields a judge's template may name
TEMPLATE_FIELDS = ("prompt", "response", "label")
# the built-in score parsers (relax.rewards.judge.JUDGE_PARSERS), here for validation, which imports no layer above
JUDGE_PARSERS = ("number", "score_tag")
# fields each kind reads besides kind, weight, rule_weight and batch_size
_READS = {
    "classifier": {"path", "base_path", "dtype", "max_length", "colocate"},
    "judge": {"path", "base_path", "dtype", "max_length", "colocate", "template", "parser", "score_min", "score_max",
              "engine", "url", "api_key_env", "model", "max_new_tokens", "temperature", "timeout_s"},
}
_COMMON = {"kind", "weight", "rule_weight", "batch_size"}
_ENGINE_FIELDS = {"embedded": {"path", "base_path", "dtype", "max_length", "colocate"},
                  "openai": {"url", "api_key_env", "model", "timeout_s"}}


def is_gguf_file(path: str | None) -> bool:
    """Whether reward_model.path names a .gguf file, by its name alone (the ending `.gguf`, any case), so that every
    machine decides alike: the config is validated where it is submitted (relax-submit's machine, which may not have
    the path) as well as where it runs. Whether it exists and is one is checked before start where it runs
    (`relax.runner.reward_model.check_reward_model`: a directory so named is refused there as not an existing .gguf
    file). A judge loads it as model.source=gguf loads the policy, de-quantized; a classifier cannot (a GGUF file
    holds a causal LM, not a classification head)."""
    return bool(path) and os.path.splitext(str(path))[1].lower() == ".gguf"


def has_role(cfg: RelaxConfig) -> bool:
    """Whether the reward model is a role of the plan holding a model (a classifier, a judge on the embedded
    engine); a judge at a URL is called from the driver's scoring thread and holds nothing."""
    rm = cfg.reward_model
    return rm.kind == "classifier" or (rm.kind == "judge" and rm.engine == "embedded")


def on_actor_gpu(cfg: RelaxConfig) -> bool:
    """Whether the reward model's role shares the actor's device (reward_model.colocate, None: cluster.colocate)."""
    rm = cfg.reward_model
    return cfg.cluster.colocate if rm.colocate is None else bool(rm.colocate)


def needs_own_gpu(cfg: RelaxConfig) -> bool:
    """Whether the plan gives the reward model a GPU of its own."""
    c = cfg.cluster
    return has_role(cfg) and c.num_nodes * c.gpus_per_node > 0 and not on_actor_gpu(cfg)


def _changed(rm: RewardModelConfig, key: str) -> bool:
    return getattr(rm, key) != getattr(RewardModelConfig(), key)


def template_problem(template: str) -> str | None:
    """Why `template` cannot be a judge's question (None: it can): it must be a Python format string naming
    {response} and no field beyond {prompt}, {response}, {label}."""
    try:
        fields = [(name, spec) for _, name, spec, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        return f"not a format string ({exc}; write a literal brace as {{{{ or }}}})"
    names = [name for name, _ in fields]
    # a field inside a format spec ({response:>{label}}) is filled from the sample's values as each call formats it,
    # where a value that is no spec fails the run: the spec is written as it is
    nested = [f"{{{name}:{spec}}}" for name, spec in fields if spec and "{" in spec]
    if nested:
        return f"nests a field in the format spec of {nested[0]}; write the spec without braces (e.g. {{response:>20}})"
    unknown = sorted({n for n in names if n not in TEMPLATE_FIELDS})
    if unknown:
        return (f"names {', '.join('{' + n + '}' for n in unknown)}; a template may name only "
                f"{', '.join('{' + n + '}' for n in TEMPLATE_FIELDS)}")
    if "response" not in names:
        return "has no {response} placeholder: the judge would never see the answer it scores"
    return None


def reward_model_violations(cfg: RelaxConfig) -> list[Violation]:
    """Every broken rule of `cfg.reward_model`."""
    rm, out = cfg.reward_model, []

    def require(ok: bool, fields: tuple[str, ...] | str, message: str) -> None:
        if not ok:
            out.append(Violation((fields,) if isinstance(fields, str) else tuple(fields), message))

    names = [f.name for f in dataclasses.fields(RewardModelConfig)]
    if rm.kind == "none":
        for key in names:
            require(key == "kind" or not _changed(rm, key), (f"reward_model.{key}", "reward_model.kind"),
                    f"reward_model.{key}={getattr(rm, key)!r} has no effect without a reward model "
                    "(reward_model=classifier or reward_model=judge)")
        return out
    reads = _COMMON | _READS.get(rm.kind, set())
    if rm.kind == "judge":
        reads -= _ENGINE_FIELDS["openai" if rm.engine == "embedded" else "embedded"]
    for key in names:
        if key not in reads:
            why = f"reward_model.kind={rm.kind}" if key not in _READS["judge"] or rm.kind != "judge" else \
                f"reward_model.engine={rm.engine}"
            require(not _changed(rm, key), (f"reward_model.{key}", "reward_model.kind"),
                    f"reward_model.{key}={getattr(rm, key)!r} has no effect with {why}")
    require(rm.weight != 0, "reward_model.weight",
            "reward_model.weight=0: the reward model's score would not count (reward_model=none turns it off)")
    if cfg.data.reward == "none":
        require(not _changed(rm, "rule_weight"), ("reward_model.rule_weight", "data.reward"),
                f"reward_model.rule_weight={rm.rule_weight} has no effect with data.reward=none (no rule reward)")
    if "path" in reads:
        require(rm.path is not None, "reward_model.path",
                f"reward_model.kind={rm.kind} needs reward_model.path=<a directory of the "
                f"{'sequence-classification model' if rm.kind == 'classifier' else 'judge model'} and its tokenizer"
                f"{'' if rm.kind == 'classifier' else ', or a .gguf file'}>")
    if rm.kind == "judge" and is_gguf_file(rm.path):
        require(rm.base_path is None, ("reward_model.base_path", "reward_model.path"),
                f"reward_model.base_path={rm.base_path!r} has no effect: it names the base model of a PEFT adapter "
                f"directory reward_model.path, and reward_model.path={rm.path} is a .gguf file (a whole model)")
    if rm.kind == "classifier":
        require(not is_gguf_file(rm.path), ("reward_model.path", "reward_model.kind"),
                f"reward_model=classifier: reward_model.path={rm.path} is a .gguf file, which holds a causal LM, not a "
                "sequence-classification model: a classifier is a Hugging Face directory (reward_model=judge can "
                "load a .gguf file)")
    if rm.colocate is not None and "colocate" in reads:
        c = cfg.cluster
        require(c.num_nodes * c.gpus_per_node > 0, ("reward_model.colocate", "cluster.gpus_per_node"),
                f"reward_model.colocate={rm.colocate} has no effect without GPUs: on a CPU cluster every role takes "
                "turns on all cores")
    if rm.kind == "judge":
        _judge(rm, require)
    _vision(cfg, require)
    return out


def _vision(cfg: RelaxConfig, require) -> None:
    """A reward model on its own role reads text only (its tokenizer's, or an embedded judge's question): beside a
    vision-language policy one that reads the prompt would score the responses without the prompts' images, as a
    text-only distillation teacher would (refused alike, `relax.config.vision_rules`). A judge at a URL
    (engine=openai) is sent the prompt's images where its template names {prompt}, as OpenAI `image_url` parts
    (`relax.runner.reward_model.JudgeScorer`), as a reward service is: allowed, the judge at the URL a
    vision-language model (one that is not answers each call 400: failed scores, warned of), with a plain {prompt}
    (a conversion or format spec cannot apply to images). A judge whose template leaves {prompt} out reads the
    response (and the label) alone, as it would with any policy: allowed."""
    m, rm = cfg.model, cfg.reward_model
    if not is_vision_model(m):  # (a source=hf directory not there to read: its own check reports it)
        return
    model = f"model={m.name} (model.arch={m.arch})" if m.source == "config" else f"model.path={m.path or m.name}"
    if rm.kind == "classifier":
        require(False, ("reward_model.kind", "model.arch"),
                f"reward_model=classifier (reward_model.path={rm.path}) reads text only: it would score the responses "
                f"without the prompts' images that {model} sees (a vision-language reward model is not built yet); "
                "use data.reward (a rule or a function of the response and the record), or reward_model=judge with a "
                "reward_model.template without {prompt} (a judge of the response alone)")
    elif rm.kind == "judge" and template_reads(rm.template, "prompt") and rm.engine != "openai":
        require(False, ("reward_model.template", "model.arch", "reward_model.engine"),
                f"reward_model.template names {{prompt}}, but the judge on reward_model.engine={rm.engine} reads text "
                f"only: it would judge the responses without the prompts' images that {model} sees; use a "
                "vision-language judge behind an OpenAI-compatible API (reward_model.engine=openai "
                "reward_model.url=...: it is sent each image as an image_url part), leave {prompt} out of "
                "reward_model.template (a judge of the response and the label alone), or use data.reward (a reward "
                "service or function gets the images as image_url parts)")
    elif rm.kind == "judge" and template_reads(rm.template, "prompt"):
        plain = all(not spec and not conv for _, name, spec, conv in string.Formatter().parse(rm.template or "")
                    if name == "prompt")
        require(plain, ("reward_model.template", "model.arch"),
                f"reward_model.template formats {{prompt}} (a conversion or format spec); beside {model} the judge "
                "is sent the prompt's images as image_url parts in its place, which cannot be formatted: write "
                "{prompt}")


def _judge(rm: RewardModelConfig, require) -> None:
    if rm.template is None:
        require(False, "reward_model.template",
                "reward_model.kind=judge needs reward_model.template: the question, with {response} (and "
                "optionally {prompt}, {label})")
    else:
        problem = template_problem(rm.template)
        require(problem is None, "reward_model.template", f"reward_model.template {problem}")
    require(rm.parser in JUDGE_PARSERS or ":" in rm.parser, "reward_model.parser",
            f"reward_model.parser={rm.parser!r}: unknown; expected one of {', '.join(JUDGE_PARSERS)} or "
            "'package.module:function' (text -> float, or None when it cannot be read)")
    require(rm.score_min < rm.score_max, ("reward_model.score_min", "reward_model.score_max"),
            f"reward_model.score_min={rm.score_min} must be < reward_model.score_max={rm.score_max}")
    if rm.engine != "openai":
        return
    url = urlparse(rm.url or "")
    require(url.scheme in ("http", "https") and bool(url.netloc), "reward_model.url",
            f"reward_model.engine=openai needs reward_model.url=http(s)://host:port/v1 (an OpenAI-compatible API), "
            f"got {rm.url!r}")
    if rm.api_key_env is not None:
        require(bool(os.environ.get(rm.api_key_env, "").strip()), "reward_model.api_key_env",
                f"reward_model.api_key_env={rm.api_key_env}: the environment variable {rm.api_key_env} is not set "
                "(or empty); the judge's key is read from it")
