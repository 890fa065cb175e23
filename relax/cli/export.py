"""`relax-export CHECKPOINT OUT_DIR`: a checkpoint's policy as a Hugging Face model directory.

    relax-export checkpoints/relax/grpo-seed1 hf/grpo-seed1            # the latest checkpoint of a save dir
    relax-export checkpoints/relax/grpo-seed1/step_000040 out --force  # one checkpoint, replacing out/
    relax-export CKPT OUT --model-path /models/Qwen3-0.6B              # where the run's base model is here

CHECKPOINT is a committed checkpoint (`step_NNNNNN/`) or a save dir (its latest checkpoint, as `train.resume=auto`
finds it). It is checked before anything is read (`relax.runner.checkpoint.verify`: every file's size and SHA-256
against state.json); an unfinished (`.tmp-`) or changed checkpoint is refused. OUT_DIR must be empty or absent
(`--force` replaces its contents, but never a checkpoint or a save dir that it is or holds); the export is written
next to it first and renamed into place, so a failed export leaves no half-written directory. How:
`relax.runner.export` (which `train.save_hf=true` runs on a run's final checkpoint); what it writes:
`relax.train.export`. The run's tokenizer comes from where the run's model was (`model.path`); `--model-path` names
where that model is on this machine (refused for a model.source=config run, which has no model file). Those files
are checked against what the checkpoint records of the run's model (`relax.runner.model_record`: architectures,
vocab_size, tokenizer and chat template digests): another model is refused naming the field; a checkpoint without
the record is exported with a note that the check could not be made. A LoRA run's adapters are a PEFT directory
whose adapter_config.json names the base where it is on this machine (a .gguf file: transformers loads it with
`gguf_file=`); for a model.source=config run, whose base exists nowhere else, the base is written beside them in
OUT_DIR/base/ (with the tokenizer, template, processor and generation config, so that it can be moved alone) and
adapter_config.json names it. The summary says how to load what was written, and how the run built its prompts where
the exported chat template alone would build others (data.system_prompt, data.apply_chat_template=false;
relax_export.json records both).

Exit 0 when written, 2 when the checkpoint or the arguments are refused (one message, nothing written), 1 when a
write fails (disk full, unwritable).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, NoReturn, Optional

from relax.runner.export import BASE_DIR, ExportRefused, ExportResult, export_checkpoint
from relax.train.export import EXPORT_FILE

OK_EXIT, WRITE_EXIT, USAGE_EXIT = 0, 1, 2


def summary(result: ExportResult) -> str:
    """What `relax-export` prints."""
    e = result.exported
    stops = ", ".join(f"{tok} ({i})" for i, tok in e.stop_tokens)
    top_k = e.sampling["top_k"] or "off"
    run = f", run {result.run_id}" if result.run_id else ""
    rows = [
        ("weights", f"{e.weights_from}, {e.num_parameters:,} parameters, {e.dtype}"),
        ("sampling", f"temperature {e.sampling['temperature']}, top_p {e.sampling['top_p']}, top_k {top_k}"),
        ("stops on", stops),
        ("files", ", ".join(e.files)),
    ]
    if result.model_check is not None:  # the model files the tokenizer and template came from (hf, gguf)
        rows.append(("model", "the run's (its record in the checkpoint: tokenizer, chat template, architectures, "
                     "vocab_size)" if result.model_check == "checked" else result.model_check))
    rows += [("prompts", note) for note in prompt_notes(result.prompts)]
    lines = [f"Exported {result.checkpoint} (step {result.step}, {result.algorithm}{run}) to {result.out_dir}"]
    lines += [f"  {k:<9} {v}" for k, v in rows]
    # a vision-language model is no causal LM to transformers' Auto classes
    cls = "AutoModelForImageTextToText" if "processor_config.json" in e.files else "AutoModelForCausalLM"
    out = result.out_dir
    if "PEFT" in e.weights_from and f"{BASE_DIR}/config.json" in e.files:  # adapters and the base built from config
        base = out / BASE_DIR
        lines.append(f"  {'base':<9} {base}/: the model the adapters go on (built from config, nowhere else), with "
                     "the tokenizer, chat template and generation config")
        lines.append(f'Load it with peft: AutoPeftModelForCausalLM.from_pretrained("{out}"), or, once moved, '
                     f'PeftModel.from_pretrained({cls}.from_pretrained("{base}"), "{out}") '
                     f"(relax-export --merge writes the merged model); {EXPORT_FILE} records where it came from.")
    elif "PEFT" in e.weights_from:  # a LoRA run's adapters: they load on top of the run's base model
        base_model = _base_model(out)
        if "gguf" in base_model:  # transformers de-quantizes the .gguf; PEFT's Auto class cannot load a file
            lines.append(f"  {'base':<9} {base_model['gguf']}: the model the adapters go on (de-quantized by "
                         "transformers as the run did)")
            lines.append(f'Load it with peft: PeftModel.from_pretrained({base_model["load"]}, "{out}") '
                         f"(relax-export --merge writes the merged model); {EXPORT_FILE} records where it came "
                         "from.")
        else:
            where = base_model.get("path", "<the base model>")
            lines.append(f"  {'base':<9} {where}: the model the adapters go on")
            lines.append(f'Load it with peft: AutoPeftModelForCausalLM.from_pretrained("{out}"), or '
                         f'PeftModel.from_pretrained({cls}.from_pretrained("{where}"), "{out}") '
                         f"(relax-export --merge writes the merged model); {EXPORT_FILE} records where it came from.")
    elif "processor_config.json" in e.files:  # a vision-language model with its processor
        lines.append(f'Load it with transformers: AutoModelForImageTextToText.from_pretrained("{result.out_dir}") '
                     f'and AutoProcessor.from_pretrained("{result.out_dir}") (its video processor needs torchvision); '
                     f"{EXPORT_FILE} records where it came from.")
    else:
        lines.append(f'Load it with transformers: AutoModelForCausalLM.from_pretrained("{result.out_dir}"); '
                     f"{EXPORT_FILE} records where it came from.")
    return "\n".join(lines)


def prompt_notes(prompts: dict[str, Any]) -> list[str]:
    """How the run built its prompts where the exported chat template alone builds others (data.apply_chat_template,
    data.system_prompt): what a user of the export must do to prompt the policy as it was trained."""
    notes = []
    if prompts.get("apply_chat_template") is False:
        notes.append("the run gave the model its prompts as plain text (data.apply_chat_template=false), not through "
                     "chat_template.jinja: prompt it with plain text too")
    system = prompts.get("system_prompt")
    if system:
        shown = system if len(system) <= 60 else system[:57] + "..."
        notes.append(f"the run put data.system_prompt ({shown!r}) before every prompt as a system message, which "
                     f"chat_template.jinja does not add: send it as the first message; {EXPORT_FILE} holds it")
    return notes


def _base_model(out: Path) -> dict[str, Any]:
    """relax_export.json's `base_model` ({} when it has none)."""
    try:
        record = json.loads((out / EXPORT_FILE).read_text())
    except (OSError, ValueError):
        return {}
    base = record.get("base_model") if isinstance(record, dict) else None
    return base if isinstance(base, dict) else {}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage dump
        _fail(f"{message} (see relax-export --help)", USAGE_EXIT)


def _fail(message: str, code: int) -> NoReturn:
    print(f"relax-export: error: {message}", file=sys.stderr)
    sys.exit(code)


def _quiet() -> None:
    """Only the summary on stdout and one line on stderr for an error: without transformers' deprecation warnings
    (FutureWarning), log lines and progress bars (loading and writing weights)."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    warnings.filterwarnings("ignore", category=FutureWarning)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    disable_progress_bars()


def main(argv: Optional[list[str]] = None) -> None:
    """Parse the command line, export, print what was written; errors are one line on stderr."""
    parser = _Parser(prog="relax-export", description="Write a checkpoint's policy as a Hugging Face model "
                     "directory (safetensors, config, tokenizer, chat template, generation config). A LoRA run's "
                     "checkpoint is written as a PEFT adapter directory (adapter_config.json, "
                     "adapter_model.safetensors, tokenizer, chat template, generation config; no config.json: the "
                     "adapters load on the run's base model, written to OUT_DIR/base/ for a model.source=config "
                     "run), or with --merge as a whole model.")
    parser.add_argument("checkpoint", help="a checkpoint directory (step_NNNNNN/) or a save dir (its latest)")
    parser.add_argument("out_dir", help="the directory to write (must be empty or absent unless --force)")
    parser.add_argument("--force", action="store_true", help="replace the contents of a non-empty OUT_DIR (never a "
                        "checkpoint or a run's save dir: refused)")
    parser.add_argument("--model-path", default=None,
                        help="where the run's model.path (HF directory or .gguf file) is on this machine "
                             "(model.source=hf or gguf; refused for a model.source=config run)")
    parser.add_argument("--merge", action="store_true",
                        help="a LoRA run's checkpoint: write the base model with the adapters merged (default: a PEFT "
                             "adapter directory)")
    args = parser.parse_args(argv)
    _quiet()
    try:
        result = export_checkpoint(args.checkpoint, args.out_dir, force=args.force, model_path=args.model_path,
                                   merge=args.merge)
    except ExportRefused as e:
        _fail(str(e), USAGE_EXIT)
    except OSError as e:
        _fail(f"writing {args.out_dir} failed, nothing was exported: {e}", WRITE_EXIT)
    try:
        print(summary(result), flush=True)
    except BrokenPipeError:  # `relax-export ... | head`: the export is written (exit 0), its reader gone
        # stdout pointed at /dev/null, so that Python's flush at exit does not fail on the closed pipe again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    main()
