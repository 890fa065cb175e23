"""A path holding '=' on the command line (docs/training.md, "Checkpoints and resume": every sweep job's save dir is
`checkpoints/<exp>/algorithm=rloo-seed1`, on purpose). Hydra's override grammar refuses `train.resume=<that path>`
unquoted; relax-train, its dry run, its sweeps, relax-submit and relax-serve say so in one line that gives the form
that works, the user's own value quoted for Hydra inside the shell's quotes (`relax.cli.config_check._quoting_hint`),
and that form then works: checked with Hydra's own parser, and with the real commands (a dry run that finds the
checkpoint, a server that answers from the model directory)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException

from relax.cli.config_check import hydra_error_message

HINT = " must be quoted for Hydra: "
TIMEOUT = 300


def _refusal(override: str, *, sweep: bool = False) -> str:
    """What relax says of `override`, refused by Hydra's own parser."""
    with pytest.raises(OverrideParseException) as exc:
        OverridesParser.create().parse_overrides([override])
    return hydra_error_message(exc.value, sweep=sweep)


def _given(message: str) -> list[str]:
    """The command-line words the message's hint gives, as the shell splits them."""
    assert HINT in message, message
    return shlex.split(message.split(HINT, 1)[1])


@pytest.mark.parametrize("value, culprit", [
    ("checkpoints/x/algorithm=rloo-seed1/step_000016", "="),
    ("/data/run#3/hf", "#"),
    ("exp/it's=here", "'"),  # a quote in it: quoted with the other quote, the shell's quoting escapes it
    ("hf/a=b$HOME", "="),  # a character the shell expands inside double quotes: single-quoted for the shell
])
def test_the_hint_gives_a_form_hydra_reads_as_the_same_value(value, culprit):
    override = f"train.resume={value}"
    message = _refusal(override)
    assert "\n" not in message and message.startswith(f"cannot parse override {override!r}: ")
    assert f"a value holding {culprit!r}{HINT}" in message
    (word,) = _given(message)  # one shell word
    parsed = OverridesParser.create().parse_override(word)
    assert (parsed.key_or_group, parsed.value()) == ("train.resume", value)


def test_in_a_sweep_each_choice_is_quoted_and_stays_a_choice():
    a, b = "ck/algorithm=rloo-seed1/step_2", "ck/algorithm=grpo-seed1/step_2"
    message = _refusal(f"train.resume={a},{b}", sweep=True)
    (word,) = _given(message)
    assert message.count("\n") == 0 and "each value holding '='" in message
    parsed = OverridesParser.create().parse_override(word)
    assert parsed.is_sweep_override() and [q.text for q in parsed.value().list] == [a, b]
    # a run's value with a comma is one value
    (word,) = _given(_refusal(f"train.resume={a},{b}"))
    assert OverridesParser.create().parse_override(word).value() == f"{a},{b}"


@pytest.mark.parametrize("override", ["train.eval_pass_k=[1,4", "seed=choice(1,2", "train.resume=${oc.env:X"])
def test_control_a_value_meant_as_the_grammars_own_form_gets_no_quoting_hint(override):
    """A list, a function or an interpolation that does not parse: quoting it whole would make it a string, which is
    not what was meant, so Hydra's own words and its pointer to the grammar stay."""
    message = _refusal(override)
    assert HINT not in message and "override_grammar" in message


def _checkpoint(root: Path, name: str) -> Path:
    """A committed checkpoint (as a run commits it: `Checkpoints.commit`) of the default config, in the save dir
    `root/checkpoints/x/<name>`."""
    from relax.config import load_config
    from relax.runner import checkpoint

    cfg = load_config(["tracking.enabled=false", f"train.save_dir='{root / 'checkpoints' / 'x' / name}'"])
    with checkpoint.Checkpoints(cfg) as ckpts:
        staging = ckpts.staging(2)
        (staging / "policy").mkdir()
        (staging / "policy" / "weights.json").write_text("{}")  # the manifest the resume's checks read
        return ckpts.commit(staging, 2, {"sampler": {}})


def _run(cwd: Path, module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=TIMEOUT)


def test_relax_train_names_the_quoted_form_and_its_dry_run_resumes_with_it(tmp_path):
    a = _checkpoint(tmp_path, "algorithm=rloo-seed1").relative_to(tmp_path)
    b = _checkpoint(tmp_path, "algorithm=grpo-seed1").relative_to(tmp_path)
    run = ["tracking.enabled=false", "train.num_rollout=0", "dry_run=true"]
    # a run, and a run of the checkpoint's own config (-cp/-cn, the path's '=' harmless there)
    for head in ([], ["-cp", str(a), "-cn", "config"]):
        done = _run(tmp_path, "relax.cli.train", *head, f"train.resume={a}", *run)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done
        assert done.stderr == (f"relax-train: error: cannot parse override 'train.resume={a}': mismatched input "
                               f"'=' expecting <EOF>; a value holding '='{HINT}\"train.resume='{a}'\"\n")
        again = _run(tmp_path, "relax.cli.train", *head, *_given(done.stderr), *run)
        assert again.returncode == 0, again
        assert "ok       checkpoints" in again.stdout and "dry run: config valid" in again.stdout
    # a sweep over both: each choice quoted, two jobs
    done = _run(tmp_path, "relax.cli.train", "-m", f"train.resume={a},{b}", *run)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done
    again = _run(tmp_path, "relax.cli.train", "-m", *_given(done.stderr), *run)
    assert again.returncode == 0, again
    assert f"== job 0: train.resume='{a}' " in again.stdout and f"== job 1: train.resume='{b}' " in again.stdout
    assert "sweep dry run: 2 jobs" in again.stdout
    # relax-submit checks the same way before it submits anything
    done = _run(tmp_path, "relax.cli.submit", "--address", "http://127.0.0.1:9", "--", f"train.resume={a}", *run[:2])
    assert done.returncode == 2, done
    assert done.stderr == (f"relax-submit: error: cannot parse override 'train.resume={a}': mismatched input '=' "
                           f"expecting <EOF>; a value holding '='{HINT}\"train.resume='{a}'\"\nNothing was "
                           "submitted.\n")


def test_relax_serve_names_the_quoted_form_and_serves_the_directory_with_it(tmp_path):
    from relax.config import load_config
    from relax.data.tokenizer import load_tokenizer
    from relax.models.hf import build_model

    model_dir = tmp_path / "exp" / "algorithm=grpo-seed2"
    tiny = load_config([])
    tokenizer = load_tokenizer(tiny.model)
    build_model(tiny.model, len(tokenizer), tokenizer.pad_token_id, seed=5).save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    path = model_dir.relative_to(tmp_path)
    args = ["--port", "0", "--threads", "1", "model.source=hf", "model.dtype=float32"]
    done = _run(tmp_path, "relax.cli.serve", *args, f"model.path={path}")
    assert (done.returncode, done.stdout) == (2, ""), done
    assert done.stderr == (f"relax-serve: error: cannot parse override 'model.path={path}': mismatched input '=' "
                           f"expecting <EOF>; a value holding '='{HINT}\"model.path='{path}'\"\n")
    proc = subprocess.Popen([sys.executable, "-m", "relax.cli.serve", *args, *_given(done.stderr)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        assert proc.stdout is not None
        for line in proc.stdout:  # until it listens (or ends: the loop ends, and the assert below names why)
            seen.append(line)
            if line.startswith("relax-serve: listening on "):
                break
        url = seen[-1].split("listening on ", 1)[1].split()[0] if seen else ""
        assert url.startswith("http://"), "".join(seen)
        with urllib.request.urlopen(f"{url}/v1/models", timeout=60) as answer:
            assert answer.status == 200 and json.load(answer)["data"]
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_the_resume_advice_relax_prints_is_pasteable():
    """The train.resume=<path> Relax prints for the user to paste (a checkpoint's advice, a set-aside run's note)
    parses as that path in Hydra's grammar, one word to the shell: quoted where a sweep job's directory holds '=', or
    a path holding a space, a $ or a quote."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from relax.config.store import override_text

    for path in ("checkpoints/relax/grpo-seed1/step_000002", "checkpoints/x/algorithm=rloo-seed1/step_000016",
                 "/data/my runs/grpo-seed1/step_000002", "/data/$HOME's/step_000002"):  # a space, $ and a quote
        text = override_text("train.resume", path)
        (arg,) = shlex.split(text)  # as the shell hands it to relax-train
        assert OverridesParser.create().parse_override(arg).value() == path, text
    assert override_text("train.resume", "checkpoints/relax/grpo-seed1") == "train.resume=checkpoints/relax/grpo-seed1"
