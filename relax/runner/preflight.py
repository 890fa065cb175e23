"""Every check a start runs before Ray, in one place: the real start (`Recipe.setup`) and `dry_run=true` both run
`preflight`, so that a dry run reports exactly what a start would refuse, and the two cannot drift apart.

The checks (`CHECKS`, in order; each names the checks whose result it reads, and is skipped when one of them failed):

- `model`: the model's files (`model.path`, or `$MODEL_DIR/<name>`): config.json and weights (hf), the GGUF magic
  (gguf); with `train.backend=megatron`, its architecture and parallel sizes.
- `tokenizer`: the policy's tokenizer loads.
- `teacher`: the distillation teacher's files and tokenizer, token for token the policy's (`check_teacher`).
- `data`: the training prompts and the eval sets (files, task, prompt lengths); with `data.tools` each prompt is
  rendered with the tools' schemas as relax-serve and the gateway render them (`tools_renderer`).
- `reward`: the reward function (`data.reward`) imports, takes (response, label), and (with a time limit) can be sent
  to a worker process.
- `reward_model`: the reward model's files (a sequence-classification head of one label and its tokenizer; a judge's
  model and tokenizer) and the judge's parser (`relax.runner.reward_model.check_reward_model`).
- `tool_parser`: a `data.tool_parser` other than `auto` is read by something of the run: the built-in tool loop
  (`data.tools`) or the gateway of an agent program (`data.openai_agent`); otherwise (single-turn data, `data.env` or
  `data.agent` without `data.tools`: an environment answers with its step, an agent loop of one's own reads its turns
  itself) it is refused, not ignored (`unread_tool_parser`). A rule of relax-train's, not of the config: relax-serve
  reads data.tool_parser on its own.
- `agent`: agentic data: the chat template renders observations (`relax.agents.render.check_template`), and the
  environment, tools and agent loop load; its line says which tool-call parser `data.tool_parser` gives and why
  (`relax.agents.render.parser_choice`), and an environment or agent loop with `rollout.max_turns=1` is warned of
  (each episode one model turn).
- `openai_agent`: the agent program (`data.openai_agent`) and the tool-call parser its gateway answers with; with
  `rollout.max_turns=1` it is warned of (one model call per session).
- `lora`: every `model.lora_target_modules` name is a linear layer of the model (its architecture, no weights); a
  `model.lora_adapter_path` is a plain LoRA adapter directory of this base (`relax.models.lora.check_adapter_dir`).
- `tracking`: a sqlite `tracking.uri`'s database can be opened for writing, or created in a directory that exists
  or can be created (`relax.tracking.mlflow_run.sqlite_store_problem`); a file store (a path or `file:`) is one the
  installed MLflow accepts (MLflow 3 refuses it unless MLFLOW_ALLOW_FILE_STORE=true: `file_store_problem`); the store
  itself is opened after Ray starts.
- `endpoints`: every address the run must reach that the user gave accepts a TCP connection within
  `ENDPOINT_TIMEOUT_S` (`relax.runner.endpoints`, with which a sweep checks each job too: the Ray cluster joined,
  `cluster.address` or RAY_ADDRESS; each `rollout.sglang.urls` server; an http(s) `tracking.uri`; a reward service,
  `data.reward=http(s)://...`; a judge's `reward_model.url`), all probed at once: a refused, unresolvable or silent
  address is named with its option here, instead of a start that waits on it (ray.init retries for ever; a server's
  health wait and MLflow's HTTP retries take minutes). Whether the service behind a port answers properly is left to
  the start's own bounded waits.
- `gpus`: a local Ray instance gets the GPUs the plan needs from this machine.
- `checkpoints`: the save directory is not in use by another run and can be created; the resume point
  (`train.resume`) exists, is intact and was written with a config this run may continue, on the model files and the
  prompt sets (the data check's, by their MLflow dataset digest and size) it recorded. With train.resume=auto the
  dry run's line says which checkpoint the run continues, or that there is none and it starts at step 1
  (`checkpoint.resume_note`, which the start prints too).

`tool_parser` reads the config alone (`Check.config_only`, `CONFIG_CHECKS`): relax-submit runs it before it submits
(`config_check_problem`), so that a job it would stop is refused on the submitting machine. The others read what only
the job's machine has (its MODEL_DIR and DATA_DIR, its packages, its addresses, GPUs and directories), and run there.

A dry run changes nothing: the checkpoint directory is probed, not locked, cleaned or created. A real start enters
the `Checkpoints` context (lock, clean-up, resume point) into the caller's exit stack instead, which runs the same
checks for real. Every problem is reported at once, each as the message the check raised.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from relax.agents.episode import EpisodeMaker
from relax.agents.parsers import get_parser
from relax.agents.render import check_template, observation_roles, parser_choice
from relax.agents.tools import get_tools
from relax.config.derive import agentic, teacher_model
from relax.config.evaluation import default_eval_set_name, evaluates
from relax.config.reward_model_rules import has_role
from relax.config.schema import DataConfig, ModelConfig, RelaxConfig
from relax.data.datasets import (
    DataError,
    PromptItem,
    PromptRenderer,
    PromptSampler,
    build_datasets,
    build_eval_sets,
    template_words,
)
from relax.data.tokenizer import check_model_files, load_tokenizer, resolve_model_path, stop_token_ids
from relax.models.gguf_cache import gguf_config
from relax.models.lora import check_adapter_dir, check_adapter_tokenizer, check_targets
from relax.models.moe import check_moe_checkpoint
from relax.models.peft_merge import CAUSAL_LM, CLASSIFIER, adapter_path, ensure_merged, merge_preview, plan_merge
from relax.rewards.calls import RewardSpecError
from relax.rewards.combined import RewardList, reward_of
from relax.rewards.registry import check_record_fields
from relax.rewards.remote import is_url
from relax.rewards.worker_pool import memory_limit_problem, pickled
from relax.roles.reward_model import judge_model_config
from relax.roles.workers import ModelInfo
from relax.runner import checkpoint
from relax.runner.cluster import local_gpu_problem
from relax.runner.endpoints import endpoint_targets, unreachable
from relax.runner.errors import RunError
from relax.runner.plan import Plan, build_plan
from relax.runner.reward_model import check_reward_model
from relax.runner.session import dataset_records
from relax.serve.openai.agents import load_agent
from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.protocol import APIError
from relax.tracking.db_store import database_engine, driver_problem
from relax.tracking.mlflow_run import (
    experiment_problem,
    file_store_problem,
    resolve_tracking_uri,
    sqlite_path,
    sqlite_store_problem,
)
from relax.train.megatron.model import arch_from_hf_config, check_parallel_sizes

# what a check raises for a user's mistake (anything else is a bug, and propagates)
USER_ERRORS = (DataError, FileNotFoundError, ValueError, ImportError, RunError)


@dataclass(frozen=True)
class Inputs:
    """What a run reads from the user's files, checked before any process starts (`preflight`)."""

    tokenizer: Any
    sampler: PromptSampler  # the training prompts, in the run's order
    eval_sets: dict[str, Sequence[PromptItem]]  # by name; none without evaluation
    reward_fn: Any  # None: data.reward=none (an agent program's own rewards)
    info: ModelInfo  # what the roles need of the tokenizer


@dataclass
class Preflight:
    """The outcome of the checks of one config: each check's status (`status`: "ok", "n/a", "skipped" or
    "failed"), the problems by check (`problems`), and what the checks read (the tokenizer, the datasets, ...)."""

    cfg: RelaxConfig
    plan: Plan
    stack: Optional[contextlib.ExitStack]  # a real start's (the checkpoint directory is locked into it); None: dry
    status: dict[str, str] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # what a passed check found, said instead of what it checks
    tokenizer: Any = None
    train_set: Any = None
    eval_sets: dict = field(default_factory=dict)
    reward_fn: Any = None
    info: Optional[ModelInfo] = None
    checkpoints: Optional[checkpoint.Checkpoints] = None
    hash_checkpoints: bool = True  # False: a probed resume point's files are checked by size (`checkpoint.verify`)
    # True: a PEFT adapter directory is merged into its base (written once); False (a dry run, a sweep's precheck):
    # the merge is checked and a stand-in of its config and tokenizer read instead (`adapter_merge`)
    merge: bool = True
    previews: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def ok(self) -> bool:
        return not self.problems

    def error(self) -> RunError:
        """Every problem as one RunError (one problem: its message alone)."""
        texts = list(dict.fromkeys(self.problems.values()))  # a cause two checks share is said once
        return RunError(texts[0] if len(texts) == 1 else  # listed as validation lists a config's problems
                        f"{len(texts)} problems:\n" + "\n".join(f"  - {t}" for t in texts))

    def inputs(self) -> Inputs:
        """The checked inputs (call once `ok`)."""
        cfg = self.cfg
        sampler = PromptSampler(self.train_set, cfg.rollout.rollout_batch_size, seed=cfg.seed,
                                shuffle=cfg.data.shuffle)
        return Inputs(self.tokenizer, sampler, self.eval_sets, self.reward_fn, self.info)

    def render(self) -> str:
        """The dry run's table: each check, its status, and the problem of a failed one."""
        lines = ["Checks before Ray (what a start runs before any process starts):"]
        for check in CHECKS:
            status = self.status.get(check.name, "n/a")
            note = self.notes[check.name] if status in ("ok", "n/a") and check.name in self.notes else check.what
            if status == "failed":
                note = self.problems[check.name].splitlines()[0]
            elif status == "skipped":
                failed = [n for n in check.needs if self.status.get(n) in ("failed", "skipped")]
                note = f"not checked: needs {', '.join(failed)}"
            lines.append(f"  {status:<8} {check.name:<13} {note}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Check:
    """One pre-Ray check: `run(pre)` returns False when it does not apply to the config (n/a), and raises one of
    `USER_ERRORS` naming the problem."""

    name: str
    what: str  # what it checks, in a few words (the dry run's table)
    run: Callable[[Preflight], Optional[bool]]
    needs: tuple[str, ...] = ()
    # reads the config alone (no file, address, GPU or module of the run's machine): true wherever the config is
    # composed, so relax-submit runs it on the submitting machine too (`CONFIG_CHECKS`)
    config_only: bool = False


def _model(pre: Preflight) -> bool:
    cfg = pre.cfg
    if cfg.model.source == "config":
        return False
    adapters = adapter_path(cfg.model)
    if adapters is not None and cfg.model.lora_rank > 0 and cfg.train.num_rollout > 0:
        raise ValueError(f"model.lora_rank={cfg.model.lora_rank} with model.path={str(adapters)!r}, a PEFT adapter "
                         "directory: continuing to train these adapters is not in this build with model.path naming "
                         "them (model.path is their merged model, and new adapters on it would not be these). To "
                         f"continue training them, set model.lora_adapter_path={str(adapters)!r} and model.path to "
                         "their base model's directory; to train every parameter of the merged model, "
                         "model.lora_rank=0; for new adapters on it, save it merged (PEFT's merge_and_unload, then "
                         "save_pretrained) and set model.path to that directory")
    # a PEFT adapter directory: its base with the adapters merged, before any role loads it
    if (note := adapter_merge(pre, cfg.model, "model")) is not None:
        pre.notes["model"] = note
    path = resolve_model_path(cfg.model)
    if cfg.train.backend == "megatron":  # the architecture first: the most specific message
        _check_megatron_model(cfg, path)
    check_model_files(cfg.model)  # config.json and weights (hf), the GGUF magic (gguf)
    check_moe_checkpoint(cfg, path)  # MoE options need an MoE model (relax.models.moe)
    return True


def adapter_merge(pre: Preflight, model_cfg: Any, option: str, task: str = CAUSAL_LM) -> Optional[str]:
    """A PEFT adapter directory as `<option>.path`: merged into its base (a start, `pre.merge`), or (a dry run) the
    merge checked (`plan_merge`: the adapters and the base readable) and, where no up-to-date merge is there, a
    stand-in of the merged model's config and tokenizer read by the later checks (`merge_preview`, removed when the
    checks end), writing no weights. Returns the dry run's line on it (None: not an adapter directory, or a start).
    `<option>.base_path` with a model that is no adapter directory is refused (`plan_merge`)."""
    key = f"{option}.path"
    if adapter_path(model_cfg, key) is None:
        plan_merge(model_cfg, task, option, key)  # refuses a base_path given without adapters
        return None
    if pre.merge:
        ensure_merged(model_cfg, task, option, key)
        return None
    plan = plan_merge(model_cfg, task, option, key)
    if plan.fresh:
        return f"{option}.path is a PEFT adapter directory, merged into {plan.base} at {plan.out} (up to date)"
    pre.previews.enter_context(merge_preview(plan))
    return (f"{option}.path is a PEFT adapter directory: a start merges it into its base {plan.base}, once, "
            f"into {plan.out} (checked readable; the dry run wrote nothing)")


def _check_megatron_model(cfg: RelaxConfig, path: Path) -> None:
    """The architecture and parallel sizes of a model read from files, for the Megatron backend (raises ValueError
    naming what is unsupported)."""
    from transformers import AutoConfig

    if cfg.model.source == "gguf":
        config = gguf_config(path)
    else:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    check_parallel_sizes(arch_from_hf_config(config), tp=cfg.train.tensor_parallel_size,
                         pp=cfg.train.pipeline_parallel_size)


def _tokenizer(pre: Preflight) -> None:
    pre.tokenizer = tokenizer = load_tokenizer(pre.cfg.model)
    pre.info = ModelInfo(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_ids=stop_token_ids(pre.cfg.model, tokenizer))


def _teacher(pre: Preflight) -> bool:
    teacher = teacher_model(pre.cfg)
    if teacher is None:
        return False
    note = check_teacher(pre, teacher)
    if note is not None:
        pre.notes["teacher"] = note
    return True


def check_teacher(pre: Preflight, teacher: ModelConfig) -> Optional[str]:
    """The teacher's files, and its tokenizer: the policy's (`pre.tokenizer`, of `pre.cfg.model`), token for token
    (distillation compares the two models' log-probs of the same token ids); a PEFT adapter directory merged first,
    or its merge checked, as `pre` does (`adapter_merge`: a start merges, a dry run writes nothing). Raises ValueError
    naming both models. Returns the dry run's line on a merge."""
    model, tokenizer = pre.cfg.model, pre.tokenizer
    where = f"teacher.path={teacher.path}" if teacher.path else f"teacher={teacher.name} ({teacher.source})"
    try:
        note = adapter_merge(pre, teacher, "teacher")
        resolve_model_path(teacher, key="teacher.path")
        check_model_files(teacher, key="teacher.path")
        theirs = load_tokenizer(teacher, key="teacher.path")
    except (FileNotFoundError, ValueError) as exc:
        # the loaders name the path's option (key); their source is model.source's text: here it is the teacher's
        text = str(exc).replace("model.source", "teacher.source")
        raise ValueError(f"the teacher ({where}) cannot be loaded: {text}") from None
    ours = "model.path=" + model.path if model.path else f"model={model.name} ({model.source})"
    mine, other = tokenizer.get_vocab(), theirs.get_vocab()
    if mine != other:
        differ = sorted(set(mine.items()) ^ set(other.items()), key=lambda kv: kv[1])[:3]
        example = ", ".join(f"{tok!r}->{i}" for tok, i in differ)
        raise ValueError(f"the teacher's tokenizer ({where}: {len(other)} tokens) is not the policy's ({ours}: "
                         f"{len(mine)} tokens; first differences: {example}): distillation compares the two models' "
                         "log-probs of the same token ids, so the teacher must share the policy's tokenizer")
    return note


def tools_renderer(cfg: RelaxConfig, tokenizer: Any, eos_token_ids: Sequence[int]) -> Optional[PromptRenderer]:
    """How a run with `data.tools` renders its prompts: the chat template given the tools' schemas (a template with a
    place for tools lists them itself; for one without, Relax's tools prompt is added to the system message, unless
    that message already describes the tools), exactly as relax-serve and the gateway render the same messages and
    tools (`relax.serve.openai.chat.ChatFormat.render`, with data.tool_parser's format), so that the model is trained
    on the prompt it is served with. None without data.tools or without the chat template (the plain template)."""
    d = cfg.data
    if not d.tools or not d.apply_chat_template:
        return None
    schemas = [tool.schema for tool in get_tools(list(d.tools), d.sandbox).values()]
    fmt = ChatFormat(tokenizer, tuple(eos_token_ids), get_parser(d.tool_parser, tokenizer))

    def render(messages: list[dict]) -> str:
        try:
            return fmt.render(messages, schemas)
        except APIError as exc:  # the template refuses the conversation (its own raise_exception)
            raise ValueError(f"with data.tools, {str(exc).removeprefix('messages: ')}") from None

    return render


def template_name(cfg: RelaxConfig) -> Optional[str]:
    """`model.chat_template='<path>'` where the run sets it (the template the messages about it name, in place of the
    model's own), else None."""
    return template_words(cfg.model.chat_template) if cfg.model.chat_template else None


def _data(pre: Preflight) -> None:
    """The training prompts and eval sets load; a message about the chat template names model.chat_template's file
    where the run sets one (`build_datasets` writes it)."""
    cfg = pre.cfg
    render = tools_renderer(cfg, pre.tokenizer, pre.info.eos_token_ids if pre.info is not None else ())
    pre.train_set, default_eval = build_datasets(cfg, pre.tokenizer, render)
    if evaluates(cfg):
        pre.eval_sets = build_eval_sets(cfg, pre.tokenizer, default_eval, render)
        if not pre.eval_sets or (default_eval is None and default_eval_set_name(cfg.data) is not None):
            what = ("train.num_rollout=0 (an evaluation-only run)" if cfg.train.num_rollout == 0
                    else f"train.eval_interval={cfg.train.eval_interval}")
            raise DataError(f"{what}: data={cfg.data.name} has no eval prompts (data.eval_path, data.eval_sets, or a "
                            "test split for gsm8k)")


def _reward(pre: Preflight) -> bool:
    if pre.cfg.data.reward == "none":
        return False
    # imports, and can be called as fn(response, label); the code_tests rewards under data.sandbox's limits
    pre.reward_fn = reward_of(pre.cfg.data.reward, pre.cfg.data.sandbox)
    # the record fields its parameters ask for are in every record (the data sets loaded: the data check passed)
    sets = ([("the training data", pre.train_set)] if pre.train_set is not None else []) + \
        [(f"the eval set {name!r}", items) for name, items in (pre.eval_sets or {}).items()]
    entries = pre.reward_fn.fns if isinstance(pre.reward_fn, RewardList) else [pre.reward_fn]
    specs = pre.reward_fn.specs if isinstance(pre.reward_fn, RewardList) else [pre.cfg.data.reward]
    for spec, fn in zip(specs, entries, strict=True):
        for what, items in sets:
            check_record_fields(spec, fn, items, what)
    if pre.cfg.data.reward_timeout_s is not None and not is_url(pre.cfg.data.reward):
        pickled(pre.reward_fn)  # a limited call runs in a worker process, which it must reach
    problem = memory_limit_problem() if pre.cfg.data.reward_memory_mb is not None else None
    if problem is not None:  # refused here, not accepted and left unapplied
        raise RewardSpecError(problem)
    return True


def _reward_model(pre: Preflight) -> bool:
    if pre.cfg.reward_model.kind == "none":
        return False
    rm = pre.cfg.reward_model
    # a model of this machine's files (a judge at a URL holds none); a path that is no directory: check_reward_model's
    if has_role(pre.cfg) and rm.path and Path(rm.path).expanduser().is_dir():
        # a PEFT adapter directory: merged into its base (a classifier's: a sequence-classification model)
        note = adapter_merge(pre, judge_model_config(pre.cfg), "reward_model",
                             CLASSIFIER if rm.kind == "classifier" else CAUSAL_LM)
        if note is not None:
            pre.notes["reward_model"] = note
    check_reward_model(pre.cfg)  # a classifier's head and tokenizer, a judge's model and parser
    return True


def unread_tool_parser(cfg: RelaxConfig) -> Optional[str]:
    """The message for a `data.tool_parser` set (not its default, `auto`) where nothing of the run reads tool calls,
    None where something does or it is unset. Readers: the built-in tool loop (`data.tools`, with or without
    `data.env`: `relax.agents.episode.EpisodeMaker.for_config`) and the OpenAI gateway of an agent program
    (`data.openai_agent`: `relax.serve.openai.agents.AgentRollout`). An environment alone answers every turn with its
    step, and an agent loop of one's own (`data.agent`) is built with no parser; the relax-serve servers a run with
    rollout.sglang.server=embedded starts resolve it too, but the run only calls their /generate."""
    d = cfg.data
    if d.tool_parser == DataConfig().tool_parser or d.tools or d.openai_agent:
        return None
    if d.agent:
        what = f"data.agent={d.agent} is an agent loop of your own, which reads the model's turns itself"
    elif d.env:
        what = f"data.env={d.env} without data.tools answers every turn with its step and reads no tool call"
    else:
        what = "single-turn data (no data.env, data.tools, data.agent or data.openai_agent) reads no tool call"
    return (f"data.tool_parser={d.tool_parser} has no effect: {what}; only data.tools (the built-in tool loop) and "
            "data.openai_agent (its gateway) read tool calls with it. Set data.tools, or leave data.tool_parser "
            "unset")


def _tool_parser(pre: Preflight) -> bool:
    if pre.cfg.data.tool_parser == DataConfig().tool_parser:
        return False
    if (problem := unread_tool_parser(pre.cfg)) is not None:
        raise ValueError(problem)
    return True


def _agent(pre: Preflight) -> bool:
    cfg = pre.cfg
    if not agentic(cfg):
        return False
    # observations render after a turn; the environment, tools or agent loop load here, so a bad name fails now
    name = template_name(cfg)
    if name is not None and name in pre.problems.get("data", ""):
        # the data check failed on the same file: one cause, one line (the observations are not tried)
        said = [f"chat template not checked ({name} failed the data check); env, tools, agent load"]
    else:
        check_template(pre.tokenizer, cfg.model.name, observation_roles(cfg.data), name)
        said = ["chat template renders observations; env, tools, agent load"]
    maker = EpisodeMaker.for_config(cfg)
    if maker is not None:
        maker.close()
    if cfg.data.tools:
        said.append(parser_choice(cfg.data.tool_parser, pre.tokenizer))
    loop = ("data.env", cfg.data.env) if cfg.data.env else ("data.agent", cfg.data.agent) if cfg.data.agent else None
    if loop is not None and cfg.rollout.max_turns == 1:
        # a one-turn environment is possible (it scores the answer and says done), so this is said, not refused
        said.append(_one_turn(*loop, "each episode is one model turn (its step's observation is never read; every "
                              "row ends max_turns unless done); set rollout.max_turns to the turns an episode needs",
                              "one turn per episode"))
    pre.notes["agent"] = "; ".join(said)
    return True


def _one_turn(option: str, value: str, why: str, short: str) -> str:
    """Warn on the console that `option=value` runs with rollout.max_turns=1 (`why`), and return the pre-start
    check line's words for it (`short`)."""
    print(f"relax-train: warning: {option}={value} with rollout.max_turns=1: {why}", file=sys.stderr, flush=True)
    return f"warning: {option} with rollout.max_turns=1 ({short})"


def _openai_agent(pre: Preflight) -> bool:
    if not pre.cfg.data.openai_agent:
        return False
    load_agent(pre.cfg.data.openai_agent)
    get_parser(pre.cfg.data.tool_parser, pre.tokenizer)
    said = ["data.openai_agent loads", parser_choice(pre.cfg.data.tool_parser, pre.tokenizer)]
    if pre.cfg.rollout.max_turns == 1:
        # an agent that makes one call works (a session's first call is answered), so this is said, not refused
        said.append(_one_turn("data.openai_agent", pre.cfg.data.openai_agent,
                              "a session allows one model call: an agent's second call is answered 400 (code "
                              "max_calls), its episode ends max_turns and trains on the first answer alone; set "
                              "rollout.max_turns to the calls the agent makes", "one model call per session"))
    pre.notes["openai_agent"] = "; ".join(said)
    return True


def _lora(pre: Preflight) -> bool:
    m = pre.cfg.model
    if m.lora_rank <= 0 and not m.lora_adapter_path:
        return False
    if m.lora_adapter_path:  # continuing to train a PEFT adapter: its files, PEFT type and base
        pre.notes["lora"] = check_adapter_dir(m, pre.info.vocab_size, pre.info.pad_token_id)
        check_adapter_tokenizer(m, pre.tokenizer)
    check_targets(m, pre.info.vocab_size, pre.info.pad_token_id)  # the architecture only
    return True


def _endpoints(pre: Preflight) -> bool:
    targets = endpoint_targets(pre.cfg)
    if not targets:
        return False
    problems = unreachable(targets)
    if problems:
        raise RunError(problems[0] if len(problems) == 1 else
                       f"{len(problems)} addresses cannot be reached: " + "; ".join(problems))
    return True


def _checkpoints(pre: Preflight) -> bool:
    # the last check: a start locks the directory (and sets earlier runs' checkpoints aside) only once every other
    # check passed; otherwise, and in a dry run, it is probed
    # the prompt sets read (the data check passed): the resume point's are checked against them, and every
    # checkpoint records them (`checkpoint.check_run_data`)
    data = None
    if pre.train_set is not None:
        data = [r.to_dict() for r in dataset_records(pre.cfg, pre.train_set, pre.eval_sets)]
    if pre.stack is None or pre.problems:
        applies = checkpoint.probe(pre.cfg, hashes=pre.hash_checkpoints, data=data)
        if (note := checkpoint.resume_note(pre.cfg)) is not None:
            pre.notes["checkpoints"] = note  # the dry run's line: where train.resume=auto starts
        return applies
    pre.checkpoints = pre.stack.enter_context(checkpoint.Checkpoints(pre.cfg, data=data))
    return True


def _tracking(pre: Preflight) -> bool:
    if not pre.cfg.tracking.enabled:
        return False
    uri = pre.cfg.tracking.uri
    if database_engine(uri) is not None:  # a database server: its driver here (the endpoints check probes the server)
        if (problem := driver_problem(uri)) is not None:
            raise RunError(problem)
        return True
    if sqlite_path(resolve_tracking_uri(uri)) is None:
        # a file store MLflow refuses (else it would stop the start once Ray is up); a server is the endpoints check's
        if (problem := file_store_problem(uri)) is not None:
            raise RunError(problem)
        server = [t for t in endpoint_targets(pre.cfg) if t.tracking_store and t.scheme in ("http", "https")]
        if not server or unreachable(server):  # an unreachable server: the endpoints check names it
            return False
    elif (problem := sqlite_store_problem(uri)) is not None:
        raise RunError(problem)
    # a deleted tracking.experiment, in a store there is (a sqlite database that exists, an MLflow server)
    if (problem := experiment_problem(uri, pre.cfg.tracking.experiment)) is not None:
        raise RunError(problem)
    return True


def _gpus(pre: Preflight) -> bool:
    if not pre.plan.total_gpus:
        return False
    # a Ray cluster joined (as `local_gpu_problem` reads it): its GPUs are its nodes', which only Ray sees
    joined = (f"cluster.address={pre.cfg.cluster.address}" if pre.cfg.cluster.address is not None else
              f"RAY_ADDRESS={os.environ['RAY_ADDRESS']}" if os.environ.get("RAY_ADDRESS") else None)
    if joined is not None:
        pre.notes["gpus"] = f"not checked: the run joins a Ray cluster ({joined}), whose GPUs are its nodes'"
        return False
    if (problem := local_gpu_problem(pre.cfg, pre.plan)) is not None:
        raise RunError(problem)
    return True


CHECKS: tuple[Check, ...] = (
    Check("model", "the model's files (model.path or $MODEL_DIR/<name>)", _model),
    Check("tokenizer", "the policy's tokenizer loads", _tokenizer, ("model",)),
    Check("teacher", "the teacher's files and tokenizer (the policy's)", _teacher, ("tokenizer",)),
    Check("data", "training prompts and eval sets", _data, ("tokenizer",)),
    Check("reward", "data.reward imports and takes (response, label)", _reward),
    Check("reward_model", "reward_model's files (a classifier's head, a judge's model) and parser", _reward_model),
    Check("tool_parser", "a data.tool_parser set is read (data.tools, data.openai_agent)", _tool_parser,
          config_only=True),
    Check("agent", "chat template renders observations; env, tools, agent load", _agent, ("tokenizer",)),
    Check("openai_agent", "data.openai_agent and its tool-call parser load", _openai_agent, ("tokenizer",)),
    Check("lora", "model.lora_target_modules are linear layers of the model", _lora, ("tokenizer",)),
    Check("tracking", "tracking.uri's sqlite store can be created and written, a database store's driver imports; "
          "no refused file store; tracking.experiment not deleted", _tracking),
    Check("endpoints", "cluster.address, rollout.sglang.urls, tracking.uri, ... accept connections", _endpoints),
    Check("gpus", "a local Ray instance gets the plan's GPUs", _gpus),
    Check("checkpoints", "save dir free and creatable; train.resume's checkpoint", _checkpoints),
)


INPUT_CHECKS = ("model", "tokenizer", "teacher", "data", "reward", "reward_model", "agent", "openai_agent", "lora")
# the checks that read the config alone (`Check.config_only`), which relax-submit runs before it submits
# (`config_check_problem`); every other reads what only the job's machine holds: the model, data and eval files and
# the tokenizer (paths under the cluster's MODEL_DIR and DATA_DIR), the reward, agent and tool modules (imported with
# the cluster's packages), the tracking store's directory, the addresses (reached from the cluster), the GPUs and the
# checkpoint directory
CONFIG_CHECKS = tuple(c.name for c in CHECKS if c.config_only)


def preflight(cfg: RelaxConfig, plan: Optional[Plan] = None, *, stack: Optional[contextlib.ExitStack] = None,
              only: Sequence[str] = (), hash_checkpoints: bool = True, merge: Optional[bool] = None) -> Preflight:
    """Run every check of `CHECKS` on `cfg` (or those named in `only`; a start and a dry run run them all): a dry
    run without `stack`; a real start locks the checkpoint directory into `stack`. `hash_checkpoints=False`: a probed
    resume point's files are checked by their size, not their SHA-256 (a sweep's precheck: each job hashes its own
    at its start). `merge`: whether a PEFT adapter directory is merged into its base (written) or its merge only
    checked (`adapter_merge`); None: merged by a start (with `stack`), checked by a dry run. Never raises for a
    user's mistake: see `Preflight.problems`."""
    pre = Preflight(cfg, plan or build_plan(cfg), stack, hash_checkpoints=hash_checkpoints,
                    merge=stack is not None if merge is None else merge)
    with pre.previews:  # a dry run's stand-ins of merges not written, removed once every check has read them
        _run_checks(pre, only)
    return pre


def _run_checks(pre: Preflight, only: Sequence[str]) -> None:
    for check in CHECKS:
        if only and check.name not in only:
            continue
        if any(pre.status.get(n) in ("failed", "skipped") for n in check.needs):
            pre.status[check.name] = "skipped"
            continue
        try:
            applies = check.run(pre)
        except USER_ERRORS as exc:
            pre.status[check.name], pre.problems[check.name] = "failed", str(exc)
            continue
        pre.status[check.name] = "n/a" if applies is False else "ok"


def config_check_problem(cfg: RelaxConfig) -> Optional[str]:
    """What a start of `cfg` would refuse before Ray that the config alone says (`CONFIG_CHECKS`), as the start says
    it (`Preflight.error`); None when nothing. Reads no file: relax-submit runs it on the submitting machine."""
    if not CONFIG_CHECKS:
        return None
    pre = preflight(cfg, only=CONFIG_CHECKS, merge=False)
    return None if pre.ok else str(pre.error())


def prepare(cfg: RelaxConfig) -> Inputs:
    """The user's inputs of `cfg` checked and read (the `INPUT_CHECKS` of `preflight`: model, tokenizer, data,
    reward, ...), or RunError naming every problem; for tools and tests that need them without a start."""
    pre = preflight(cfg, only=INPUT_CHECKS, merge=True)  # its callers go on to load the models
    if not pre.ok:
        raise pre.error()
    return pre.inputs()
