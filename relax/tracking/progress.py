"""What a person watching a training run sees in the terminal: one live progress line and a final summary.

Pure formatting plus writes to a stream: no MLflow, no training code, so every line is testable with a
fake clock. On a terminal the line is rewritten in place (`\\r`); in logs (not a TTY: Ray job logs,
CI, `| tee`) it becomes one line every `every_steps` steps or `every_s` seconds, so logs stay short.

The metric keys shown are parameters (`reward_key`, `step_time_key`) because metric names are defined
next to the code that computes them (rollout, runner), which this layer may not import.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional, TextIO

from relax.metrics import RAW_REWARD, STEP_TIME

DEFAULT_REWARD_KEY = RAW_REWARD
DEFAULT_STEP_TIME_KEY = STEP_TIME
# the reward of a step whose every group was left out: it has none (its mean over no response is NaN)
LEFT_OUT = "- (every group left out)"


def step_name(index: int) -> str:
    """A step as user-facing messages name it, `step <index + 1>` for the loop's 0-based `index` (MLflow's step of its
    training metrics): 1-based, as the progress line shows the step once it is done (`step 3/6`) and its checkpoint is
    named (`step_000003`)."""
    return f"step {index + 1}"


def ranges_text(numbers: Iterable[int]) -> str:
    """Numbers as compact sorted text: "0..3, 5, 7..9" ("none" if empty)."""
    out: list[str] = []
    start = prev = None
    for s in sorted(set(numbers)):
        if prev is not None and s == prev + 1:
            prev = s
            continue
        if start is not None:
            out.append(f"{start}..{prev}" if prev != start else str(start))
        start = prev = s
    if start is not None:
        out.append(f"{start}..{prev}" if prev != start else str(start))
    return ", ".join(out) or "none"


def steps_name(indices: Iterable[int]) -> str:
    """Training steps of 0-based loop `indices` as `step_name` names them, then MLflow's numbering of the same steps
    (that of their metrics), for finding them there: "step 3 (MLflow step 2)", "steps 1..3, 5 (MLflow steps 0..2,
    4)"."""
    steps = sorted(set(indices))
    if not steps:
        return "no step"
    s = "s" if len(steps) > 1 else ""
    return f"step{s} {ranges_text(i + 1 for i in steps)} (MLflow step{s} {ranges_text(steps)})"


def format_duration(seconds: Optional[float]) -> str:
    """`m:ss` below an hour, `h:mm:ss` above; "?" when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    total = max(0, int(round(seconds)))
    hours, rem = divmod(total, 3600)
    minutes, secs = divmod(rem, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_number(value: Any) -> str:
    """Four significant digits (0.4123, 12.5, 1.235e+04): rewards differ in scale between tasks."""
    if value is None:
        return "n/a"
    try:
        v = float(value)
    except (TypeError, ValueError):
        return str(value)
    return f"{v:.4g}"


def eta_seconds(step: int, total_steps: int, elapsed_s: float, start_step: int = 0) -> Optional[float]:
    """Remaining time at the average wall time per step so far: (total - step) * elapsed / (step - start).

    Wall time, not `perf/step_time`, so that evaluation and checkpointing between steps are counted.
    None before the first step completes.
    """
    done = step - start_step
    if done <= 0:
        return None
    return max(0, total_steps - step) * elapsed_s / done


def summary(
    final_reward: Optional[float],
    best_reward: Optional[float],
    run_id: Optional[str],
    ui_command: Optional[str],
    extra: Optional[Mapping[str, Any]] = None,
    *,
    title: str = "Relax run finished",
    rewards: bool = True,
) -> str:
    """The end-of-run block: final and best reward (unless `rewards=False`), the MLflow run id and how to open the
    MLflow UI.

    `extra` adds lines (e.g. {"steps": 60, "wall time": "4:12"}); numbers get `format_number`.
    """
    rows: list[tuple[str, str]] = []
    if rewards:  # False: a run that trained nothing has no reward to show
        rows += [("final reward", format_number(final_reward)), ("best reward", format_number(best_reward))]
    rows.append(("MLflow run", run_id if run_id else "(tracking disabled)"))
    if ui_command:
        rows.append(("open the UI", ui_command))
    for key, value in (extra or {}).items():
        text = format_number(value) if isinstance(value, float) else str(value)
        rows.append((str(key), text))
    width = max(len(k) for k, _ in rows)
    rule = "=" * max(60, len(title) + 4)
    lines = [rule, title, *(f"  {k.ljust(width)}  {v}" for k, v in rows), rule]
    return "\n".join(lines)


class Progress:
    """The live progress line of a training loop: step/total, reward, step time, elapsed, ETA.

    Call `update(step, metrics)` after each completed step (`step` counts completed steps, 1..total;
    `start_step` is where a resumed run began). Metrics missing from an update keep their last value.
    `enabled=False` (`tracking.progress=false`) hides the live line only: `update` prints nothing, while `write`'s
    messages and the closing `summary` are printed as plain lines. `started`: when the run began, on `clock`
    (default: now), if before this loop: `elapsed` counts from it, the eta from this loop's own pace.
    """

    def __init__(
        self,
        total_steps: int,
        enabled: bool = True,
        stream: Optional[TextIO] = None,
        *,
        start_step: int = 0,
        every_steps: int = 10,
        every_s: float = 10.0,
        reward_key: str = DEFAULT_REWARD_KEY,
        step_time_key: str = DEFAULT_STEP_TIME_KEY,
        clock: Callable[[], float] = time.monotonic,
        is_tty: Optional[bool] = None,
        started: Optional[float] = None,
    ) -> None:
        self.total_steps = total_steps
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.start_step = start_step
        self.every_steps = max(1, every_steps)
        self.every_s = every_s
        self.reward_key = reward_key
        self.step_time_key = step_time_key
        self.clock = clock
        if is_tty is None:
            isatty = getattr(self.stream, "isatty", None)
            is_tty = bool(isatty()) if callable(isatty) else False
        self.is_tty = is_tty
        self._t0 = clock()  # this loop's start (from start_step): the pace the eta extrapolates
        # `elapsed` counts from `started` (on `clock`), the run's start, when it began before this loop (a restart of
        # the service graph: the time lost to the failure is the run's, but not a cost of each step still to come)
        self._started = self._t0 if started is None else started
        self._last: dict[str, Any] = {}
        self._live_len = 0  # length of the line now shown in place (TTY), 0 when none
        self._live_line = ""
        self._last_print_step: Optional[int] = None
        self._last_print_time: Optional[float] = None

    def begin(self) -> None:
        """The loop's first step starts now: the eta extrapolates the pace from here, not from before the start-up (the
        roles, the engines, the first weights published), which is no cost of each step still to come."""
        self._t0 = self.clock()

    def format_line(self, step: int, metrics: Optional[Mapping[str, Any]] = None, now: Optional[float] = None, *,
                    left_out: bool = False) -> str:
        """The progress line for `step`, with `metrics` merged over the last seen values (no output). `left_out`: every
        group of the step was left out (its reward calls or episodes failed), so its reward has no value: the line
        says so (`reward - (every group left out)`) instead of showing `nan`, as the summary shows no reward then."""
        values = {**self._last, **(metrics or {})}
        now = self.clock() if now is None else now
        elapsed, pace = now - self._started, now - self._t0
        width = len(str(self.total_steps))
        pct = 100.0 * step / self.total_steps if self.total_steps > 0 else 100.0
        parts = [f"step {step:>{width}}/{self.total_steps} {pct:3.0f}%"]
        if left_out:
            parts.append(f"reward {LEFT_OUT}")
        elif self.reward_key in values:
            parts.append(f"reward {format_number(values[self.reward_key])}")
        if self.step_time_key in values:
            try:
                parts.append(f"step {float(values[self.step_time_key]):.2f}s")
            except (TypeError, ValueError):
                pass
        parts.append(f"elapsed {format_duration(elapsed)}")
        parts.append(f"eta {format_duration(eta_seconds(step, self.total_steps, pace, self.start_step))}")
        return " | ".join(parts)

    def update(self, step: int, metrics: Optional[Mapping[str, Any]] = None, *, left_out: bool = False) -> None:
        """Show progress after `step`: rewritten in place on a TTY, else printed every N steps or ~T seconds.
        `left_out`: every group of the step was left out (`format_line`)."""
        if not self.enabled:
            return
        now = self.clock()
        line = self.format_line(step, metrics, now, left_out=left_out)
        if metrics:
            self._last.update({k: v for k, v in metrics.items() if k in (self.reward_key, self.step_time_key)})
        if self.is_tty:
            self._draw(line)
            return
        due = (
            self._last_print_step is None
            or step - self._last_print_step >= self.every_steps
            or (self._last_print_time is not None and now - self._last_print_time >= self.every_s)
            or step >= self.total_steps
        )
        if due:
            self.stream.write(line + "\n")
            self.stream.flush()
            self._last_print_step = step
            self._last_print_time = now

    def _draw(self, line: str) -> None:
        pad = " " * max(0, self._live_len - len(line))  # erase the rest of a longer previous line
        self.stream.write("\r" + line + pad)
        self.stream.flush()
        self._live_len = len(line)
        self._live_line = line

    def write(self, message: str) -> None:
        """Print a message without garbling the live line (it is redrawn below the message); without the live line
        (`enabled=False`), as a plain line."""
        if self.enabled and self.is_tty and self._live_len:
            self.stream.write("\r" + message.ljust(self._live_len) + "\n")
            self._live_len = 0
            self._draw(self._live_line)
        else:
            self.stream.write(message + "\n")
            self.stream.flush()

    def close(self) -> None:
        """End the live line with a newline so later output starts on a fresh line. Idempotent."""
        if self.enabled and self.is_tty and self._live_len:
            self.stream.write("\n")
            self.stream.flush()
        self._live_len = 0

    def summary(
        self,
        final_reward: Optional[float],
        best_reward: Optional[float],
        run_id: Optional[str],
        ui_command: Optional[str],
        extra: Optional[Mapping[str, Any]] = None,
        *,
        title: str = "Relax run finished",
        rewards: bool = True,
    ) -> str:
        """Close the live line, print the end-of-run block and return it. The block is printed whether or not the live
        line is on (`tracking.progress` hides the live line only): it gives the run's outputs and MLflow run."""
        text = summary(final_reward, best_reward, run_id, ui_command, extra, title=title, rewards=rewards)
        self.close()
        self.stream.write(text + "\n")
        self.stream.flush()
        return text
