"""The sample ledger of a run: which samples each step trained, and the checks `relax-verify-run` makes on it.

Sample ids are unique over a run (`relax.runner.rollout_driver.stream.sample_ids`: prompt draw index * G + j). Each step
adds one entry: the ids of its rollout, split into those it trained and those it left out (groups with a failed
reward call), and, with dynamic sampling (`rollout.filter_groups`), the ids generated for the step but set aside (not
in its batch). An entry is one JSON line, its ids written as sorted ranges `[start, stop)` ("set_aside" only when
there are some):

    {"step":3,"trained":[[48,56],[60,64]],"left_out":[[56,60]]}
    {"step":4,"trained":[[64,72]],"left_out":[],"set_aside":[[72,80]]}

so that a step's line stays short however large its batch (its ids are one or a few runs of consecutive numbers).
A duplicate id inside a step is kept (as a second range over the same id), so that the checks still see it.

The ledger goes into every checkpoint (`ledger.jsonl`, listed in the checkpoint's manifest) and into the MLflow run
as an artifact of the same name (see `relax.runner.session.Session`); a resumed run continues the ledger of the
checkpoint it resumes, cut to the steps before it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax.runner.checkpoint import FILES
from relax.tracking.progress import step_name, steps_name

FILE = "ledger.jsonl"  # in each checkpoint, and the MLflow artifact
MAX_REPORTED = 10  # violations of one kind listed before "... and N more"

Ranges = tuple[tuple[int, int], ...]


class LedgerError(ValueError):
    """A ledger that cannot be read: names the source and the line."""


def to_ranges(ids: Iterable[int]) -> Ranges:
    """Sorted `[start, stop)` runs of consecutive ids; a repeated id starts a new run (duplicates are kept)."""
    out: list[list[int]] = []
    for i in sorted(int(x) for x in ids):
        if out and i == out[-1][1]:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return tuple((a, b) for a, b in out)


def count(ranges: Ranges) -> int:
    return sum(b - a for a, b in ranges)


@dataclass(frozen=True)
class Entry:
    """The samples of one step: trained, and left out of the loss (their group had a failed reward call); and those
    generated for it but set aside by dynamic sampling (not part of its batch, not counted in `size`)."""

    step: int
    trained: Ranges
    left_out: Ranges
    set_aside: Ranges = ()

    @property
    def size(self) -> int:
        """The samples of the step's batch."""
        return count(self.trained) + count(self.left_out)

    def to_json(self) -> str:
        obj = {"step": self.step, "trained": [list(r) for r in self.trained],
               "left_out": [list(r) for r in self.left_out]}
        if self.set_aside:
            obj["set_aside"] = [list(r) for r in self.set_aside]
        return json.dumps(obj, separators=(",", ":"))


def _ranges(value: Any, where: str, name: str) -> Ranges:
    if not isinstance(value, list):
        raise LedgerError(f"{where}: '{name}' is not a list of [start, stop) ranges")
    out = []
    for r in value:
        if (not isinstance(r, list) or len(r) != 2 or any(type(x) is not int for x in r) or not 0 <= r[0] < r[1]):
            raise LedgerError(f"{where}: '{name}' holds {r!r}, not a range [start, stop) of sample ids")
        out.append((r[0], r[1]))
    return tuple(out)


def _list(values: Any) -> list:
    return values.tolist() if hasattr(values, "tolist") else list(values)


def _ints(values: Any) -> list[int]:
    return [int(i) for i in _list(values)]


class Ledger:
    """The entries of a run in the order they were added (a step added twice stays twice: the checks report it)."""

    def __init__(self, entries: Iterable[Entry] = ()):
        self.entries: list[Entry] = list(entries)

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, step: int, sample_ids: Any, kept: Any, set_aside: Any = None) -> Entry:
        """Record step `step`: `sample_ids` [N] (a LongTensor or ints) and `kept` [N] (bool: trained); `set_aside`:
        ids generated for the step and not in its batch (dynamic sampling; None: none)."""
        ids, keep = _ints(sample_ids), [bool(k) for k in _list(kept)]
        if len(ids) != len(keep):
            raise ValueError(f"step {step}: {len(ids)} sample ids but {len(keep)} kept flags")
        entry = Entry(int(step), to_ranges(i for i, k in zip(ids, keep, strict=True) if k),
                      to_ranges(i for i, k in zip(ids, keep, strict=True) if not k),
                      to_ranges(_ints(set_aside)) if set_aside is not None else ())
        self.entries.append(entry)
        return entry

    def truncate(self, step: int) -> Ledger:
        """Keep the entries of steps < `step` (a resume from the checkpoint of `step` recomputes the others)."""
        self.entries = [e for e in self.entries if e.step < step]
        return self

    def before(self, step: int) -> Ledger:
        """A new ledger with the entries of steps < `step`."""
        return Ledger(e for e in self.entries if e.step < step)

    @property
    def steps(self) -> list[int]:
        return [e.step for e in self.entries]

    def dumps(self) -> str:
        """JSONL: one line per entry, in order."""
        return "".join(e.to_json() + "\n" for e in self.entries)

    @classmethod
    def loads(cls, text: str, source: str = "ledger") -> Ledger:
        """Parse `dumps` output; LedgerError naming `source` and the line of anything else."""
        entries = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            where = f"{source}, line {n}"
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise LedgerError(f"{where}: not JSON ({exc})") from None
            if not isinstance(obj, dict) or type(obj.get("step")) is not int or obj["step"] < 0:
                raise LedgerError(f"{where}: not an entry (a JSON object with an integer 'step' >= 0)")
            entries.append(Entry(obj["step"], _ranges(obj.get("trained"), where, "trained"),
                                 _ranges(obj.get("left_out"), where, "left_out"),
                                 _ranges(obj.get("set_aside", []), where, "set_aside")))
        return cls(entries)

    def write(self, path: Path) -> None:
        path.write_text(self.dumps())

    @classmethod
    def read(cls, path: Path) -> Ledger:
        """The ledger in file `path`; LedgerError naming it if it cannot be read or parsed."""
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise LedgerError(f"{path} cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
        return cls.loads(text, str(path))


def read_checkpoint(path: Path, state: dict) -> Ledger | None:
    """The ledger of checkpoint `path` (`state`: its state.json), None if it has none (written before ledgers).

    The file must be the one committed: its size and SHA-256 as in the checkpoint's manifest (if it has one);
    LedgerError naming it otherwise (only this file is hashed, not the whole checkpoint)."""
    file = path / FILE
    files = state.get(FILES)
    if files is None:  # a checkpoint from before manifests: nothing to check the file against
        return Ledger.read(file) if file.exists() else None
    entry = files.get(FILE) if isinstance(files, dict) else None
    if entry is None:
        if file.exists():
            raise LedgerError(f"{file} is not part of checkpoint {path} as committed (not listed in its state.json)")
        return None
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise LedgerError(f"{file} cannot be read ({exc.strerror or exc})") from None
    if not isinstance(entry, dict) or len(data) != entry.get("size") \
            or hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        raise LedgerError(f"{file} was changed after checkpoint {path} was committed (its size or SHA-256 differs "
                          "from the one in its state.json)")
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise LedgerError(f"{file} is not text ({exc})") from None
    return Ledger.loads(text, str(file))


# ------------------------------------------------------------------------------------------------ checks


def _listed(problems: list[str], limit: int = MAX_REPORTED) -> list[str]:
    if len(problems) <= limit:
        return problems
    return problems[:limit] + [f"... and {len(problems) - limit} more like these"]


def _span(a: int, b: int) -> str:
    """Ids a..b-1 as text."""
    return f"sample id {a}" if b == a + 1 else f"sample ids {a}..{b - 1}"


def check_steps(steps: Sequence[int], n: int, what: str) -> list[str]:
    """Each of steps 0..n-1 exactly once in `steps`, and no other: the violations, naming `what` (e.g. "the ledger")."""
    problems = []
    seen: dict[int, int] = {}
    for s in steps:
        seen[s] = seen.get(s, 0) + 1
    twice = sorted(s for s, k in seen.items() if k > 1)
    if twice:
        problems.append(f"{what} has {steps_name(twice)} more than once")
    missing = [s for s in range(n) if s not in seen]
    if missing:
        problems.append(f"{what} is missing {steps_name(missing)} of its {n}")
    extra = sorted(s for s in seen if s >= n)
    if extra:
        problems.append(f"{what} has {steps_name(extra)} beyond the run's {n} steps")
    return problems


def check_samples(ledger: Ledger, per_step: int | None = None) -> list[str]:
    """No sample id in two places (two steps, or twice in one step, trained, left out or set aside), and each step
    with `per_step` samples in its batch (None: not checked). The violations, as text."""
    problems: list[str] = []
    if per_step is not None:
        for e in ledger.entries:
            if e.size != per_step:
                problems.append(f"{step_name(e.step)} has {e.size} samples ({count(e.trained)} trained, "
                                f"{count(e.left_out)} left out), expected {per_step}")
    spans = sorted((a, b, e.step, kind) for e in ledger.entries
                   for kind, ranges in (("trained", e.trained), ("left out", e.left_out), ("set aside", e.set_aside))
                   for a, b in ranges)
    overlaps: list[str] = []
    reach, owner = -1, None
    for a, b, step, kind in spans:
        if owner is not None and a < reach:
            both = "trained twice" if kind == owner[1] == "trained" else "used twice"
            overlaps.append(f"{_span(a, min(b, reach))} {both}: {owner[1]} at {step_name(owner[0])} and {kind} at "
                            f"{step_name(step)}")
        if b > reach:
            reach, owner = b, (step, kind)
    return _listed(problems) + _listed(overlaps)


def check_prefix(checkpoint: Ledger, checkpoint_step: int, run: Ledger) -> list[str]:
    """The ledger of the checkpoint of `checkpoint_step` covers steps 0..checkpoint_step-1 exactly and is, entry for
    entry, the start of the run's ledger (the MLflow artifact). The violations, as text."""
    problems = check_steps(checkpoint.steps, checkpoint_step, f"the ledger of the checkpoint of step {checkpoint_step}")
    head = run.before(checkpoint_step)
    mine = {e.step: e for e in checkpoint.entries}
    theirs = {e.step: e for e in head.entries}
    differ = sorted(s for s in mine if s in theirs and mine[s] != theirs[s])
    if differ:
        problems.append(f"{steps_name(differ)} differ between the checkpoint's ledger and the run's")
    absent = sorted(s for s in mine if s not in theirs)
    if absent:
        problems.append(f"{steps_name(absent)} of the checkpoint's ledger are not in the run's")
    return problems


def check_dropped(ledger: Ledger, dropped: dict[int, float], tolerance: float = 1e-6) -> list[str]:
    """Each step's left-out share in the ledger equals the share the run logged at that step (`dropped`: step ->
    `relax.metrics.REWARD_DROPPED_FRAC`): the ledger and the metrics describe the same rollouts. Steps missing on
    either side are not compared."""
    problems = []
    for e in ledger.entries:
        if e.step in dropped and e.size:
            share = count(e.left_out) / e.size
            if abs(share - dropped[e.step]) > tolerance:
                problems.append(f"{step_name(e.step)}: the ledger leaves out {count(e.left_out)} of {e.size} samples "
                                f"({share:.4g}) but the run logged a dropped share of {dropped[e.step]:.4g}")
    return _listed(problems)
