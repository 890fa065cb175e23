"""Each target row's verdict, and the suite's comparison with the report it replaces.

Every section records its headline numbers (`Headlines.add`); the report embeds them as one machine-readable
comment, and the next run of the suite reads that comment from the report it is about to overwrite and flags
every headline that got worse by more than `TOLERANCE`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

TOLERANCE = 0.15  # a change within this fraction is within the noise of repeated runs on a shared 2-core machine
MARK = "bench-headlines"
# Round 1's actor peak (MiB) for the memory target: bench/train_memory.py with the memory section's arguments
# (SmolLM2-135M fp32, 16 x (32 + 96) tokens, micro-batch 8) and MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD, run on the
# trainer of commit 7315782, before the chunked log-probs of round 2. (With glibc's default thresholds the same
# trainer peaked at 5054-5330 MiB: freed memory its arenas keep.)
ROUND1_PEAK_MIB = {"float32": 4264.0}
MMAP_THRESHOLD = "65536"


def verdict(ok: bool | None, need: str = "") -> str:
    """The verdict cell of a row: met, not met (with what the target needs), or no target for this row."""
    if ok is None:
        return "no target"
    return "**met**" if ok else f"**not met** (needs {need})"


@dataclass
class Headlines:
    """Headline numbers by key: (median, whether higher is better)."""

    values: dict[str, tuple[float, bool]] = field(default_factory=dict)

    def add(self, key: str, value: float, higher_is_better: bool) -> None:
        if math.isfinite(value):
            self.values[key] = (float(value), higher_is_better)

    def embed(self) -> str:
        """The numbers as one HTML comment (invisible in rendered markdown), read back by `previous`."""
        return f"<!-- {MARK} {json.dumps(self.values, sort_keys=True)} -->"


def previous(report_text: str) -> Headlines | None:
    """The headlines embedded in an earlier report, or None (no report, or one written before they existed)."""
    m = re.search(rf"<!-- {MARK} (\{{.*?\}}) -->", report_text)
    if m is None:
        return None
    return Headlines({k: (float(v), bool(h)) for k, (v, h) in json.loads(m.group(1)).items()})


def comparison(before: Headlines | None, now: Headlines, tolerance: float = TOLERANCE) -> list[str]:
    """Markdown: every headline of both reports, its change, and a regression flag beyond `tolerance`."""
    if before is None:
        return ["The report this run replaced carries no machine-readable headline numbers (it was written before "
                "the suite recorded them): nothing to compare against. The next run compares against this one."]
    lines = ["| headline | previous | now | change | flag |", "|---|---|---|---|---|"]
    flagged = 0
    for key in sorted(set(before.values) & set(now.values)):
        (old, higher), (new, _) = before.values[key], now.values[key]
        change = (new - old) / abs(old) if old else 0.0
        worse = -change if higher else change
        flag = ""
        if worse > tolerance:
            flag, flagged = "**regression**", flagged + 1
        elif -worse > tolerance:
            flag = "better"
        lines.append(f"| {key} | {old:.4g} | {new:.4g} | {change:+.0%} | {flag} |")
    missing = sorted(set(before.values) - set(now.values))
    summary = (f"{flagged} regression(s) beyond {tolerance:.0%}" if flagged
               else f"no headline got worse by more than {tolerance:.0%}")
    out = [f"Against the report this run replaced: {summary}.", "", *lines]
    if missing:
        out += ["", f"Not measured in this run: {', '.join(missing)}."]
    return out
