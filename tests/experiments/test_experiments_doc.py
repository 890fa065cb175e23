"""docs/experiments.md keeps working as written: every `relax-train` command of its code blocks composes and validates
for every job of its sweep, every `relax-compare` command parses, the recipe scripts it runs exist, and the
`relax-compare` output it shows has the headers and verdicts the current version prints (the page's outputs rotted
once: they showed headers of an older version; docs/training.md's samples too, so its outputs are checked the same
way). Fast: configs only, nothing runs."""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import pytest

from relax.cli.compare import build_parser
from relax.config import ConfigError, load_config
from relax.tracking.compare import describe_final

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "experiments.md"
# the pages whose relax-compare outputs are checked, each with how many headers it shows at least
COMPARE_OUTPUTS = {"experiments.md": 10, "training.md": 9}


def _code_lines(doc: Path = DOC) -> list[str]:
    """The lines of the page's fenced code blocks, backslash continuations joined, a `$ ` prompt removed."""
    lines, inside, pending = [], False, ""
    for raw in doc.read_text().splitlines():
        line = raw.strip()
        if line.startswith("```"):
            inside = not inside
            continue
        if not inside:
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        lines.append(line[2:] if line.startswith("$ ") else line)
    return lines


def _commands(program: str) -> list[list[str]]:
    """The argument lists of `program` in the code blocks (after VAR=value prefixes; a trailing comment dropped)."""
    found = []
    for line in _code_lines():
        if not re.match(r"(?:[A-Z_]+=\S*\s+)*relax-(?:train|compare|submit)\s", line):
            continue  # output, or another program (the output quotes freely: not for shlex)
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]
        if words[:1] == ["relax-submit"] and program == "relax-train" and "--" in words:
            found.append(words[words.index("--") + 1:])  # the relax-train arguments it submits
        elif words[:1] == [program]:
            found.append(words[1:])
    return [list(c) for c in dict.fromkeys(map(tuple, found))]  # each once (sections 1 and 3 run the same sweep)


def _split_values(value: str) -> list[str]:
    """A sweep override's values: commas outside brackets separate them (`[1,8]` is one value)."""
    out, depth, current = [], 0, ""
    for ch in value:
        depth += 1 if ch in "[(" else -1 if ch in "])" else 0
        if ch == "," and depth == 0:
            out.append(current)
            current = ""
        else:
            current += ch
    return [*out, current]


def _jobs(args: list[str]) -> list[list[str]]:
    """The overrides of each job of `relax-train [-m] args`, without hydra.* and dry_run (not config fields), and of
    a swept seed only the first (no rule depends on the seed's value: fewer configs to compose)."""
    sweep = "-m" in args
    overrides = [a for a in args if a != "-m" and not a.startswith(("hydra.", "dry_run="))]
    choices = [[f"{k}={v}" for v in _split_values(val)][:1 if k == "seed" else None] if sweep and "," in val else [o]
               for o in overrides for k, _, val in [o.partition("=")]]
    return [list(job) for job in itertools.product(*choices)]


TRAIN = _commands("relax-train")
COMPARE = _commands("relax-compare")


def test_the_page_has_its_commands():
    assert len(TRAIN) >= 8 and len(COMPARE) >= 5, (TRAIN, COMPARE)


@pytest.mark.parametrize("args", TRAIN, ids=lambda a: " ".join(a)[:120])
def test_every_relax_train_command_composes_for_every_job(args):
    for job in _jobs(args):
        try:
            load_config(job)
        except ConfigError as exc:  # a Megatron recipe without megatron-core: rejected for that, not for the page
            assert "needs megatron-core, which is not installed" in str(exc), f"{job}: {exc}"


@pytest.mark.parametrize("args", COMPARE, ids=lambda a: " ".join(a)[:120])
def test_every_relax_compare_command_parses(args):
    build_parser().parse_args(args)  # an unknown option exits (SystemExit): the test fails naming the command


def test_the_recipe_scripts_it_runs_exist():
    scripts = {w for line in _code_lines() for w in line.split() if w.startswith("launch/recipes/")}
    assert scripts and all((ROOT / s).is_file() for s in scripts), scripts


def _steps(text: str, count: int | None = None) -> list[int]:
    """The steps `first..last` (or `a, b, c`) of a header: `count` of them where it says so, evenly spaced (a run's
    evaluations every train.eval_interval steps: 4..29 of six is 4, 9, ..., 29), else every step."""
    if ".." in text:
        first, last = map(int, text.split(".."))
        stride = (last - first) // (count - 1) if count and count > 1 else 1
        return list(range(first, last + 1, stride))
    return [int(s) for s in text.split(", ")]


@pytest.mark.parametrize("page", sorted(COMPARE_OUTPUTS))
def test_the_compare_output_shown_is_what_relax_compare_prints(page):
    lines = _code_lines(ROOT / "docs" / page)
    # any line that says how a final value is made, so that a header of an older wording is caught, not skipped
    headers = [line for line in lines if re.match(r"^[\w/]+: final value = ", line)]
    assert len(headers) >= COMPARE_OUTPUTS[page], headers
    for line in headers:
        metric, _, rest = line.partition(": ")
        # a training metric's steps as the progress line counts them, then MLflow's (which the runs logged)
        m = re.fullmatch(r"final value = .*\(steps? ([\d., ]+?)(?: \(MLflow steps? ([\d., ]+)\))?"
                         r"(?:, all there are)?; --(?:eval-)?last-k (\d+)\); mean and std over seeds", rest)
        assert m, f"not a header relax-compare prints: {line}"
        count = re.match(r"final value = mean of each run's last (\d+) ", rest)
        steps = _steps(m[2] or m[1], int(count[1]) if count else None)
        assert f"{metric}: {describe_final(metric, int(m[3]), [steps])}; mean and std over seeds" == line
    verdicts = [line for line in lines if line.startswith("verdict for ")]
    assert verdicts
    for line in verdicts:
        assert re.fullmatch(r"verdict for (\S+): (CI contains 0: no difference shown|CI above 0: \1 higher than \S+|"
                            r"CI below 0: \1 lower than \S+|no interval \(one pair\): no conclusion)", line), line
