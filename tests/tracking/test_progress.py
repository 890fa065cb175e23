from __future__ import annotations

import io

from relax.tracking.progress import Progress, eta_seconds, format_duration, format_number, summary


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(is_tty: bool, **kwargs: object) -> tuple[Progress, io.StringIO, FakeClock]:
    stream, clock = io.StringIO(), FakeClock()
    return Progress(60, True, stream, clock=clock, is_tty=is_tty, **kwargs), stream, clock  # type: ignore[arg-type]


def test_format_helpers() -> None:
    assert format_duration(0) == "0:00"
    assert format_duration(59.6) == "1:00"
    assert format_duration(144) == "2:24"
    assert format_duration(3725) == "1:02:05"
    assert format_duration(None) == "?"
    assert format_duration(float("inf")) == "?"
    assert format_number(0.41234) == "0.4123"
    assert format_number(12.5) == "12.5"
    assert format_number(None) == "n/a"


def test_eta_math() -> None:
    assert eta_seconds(0, 60, 5.0) is None  # no step done yet
    assert eta_seconds(12, 60, 36.0) == 144.0  # 48 steps left at 3 s per step
    assert eta_seconds(40, 60, 100.0, start_step=30) == 200.0  # resumed at 30: 10 s per step, 20 left
    assert eta_seconds(60, 60, 180.0) == 0.0


def test_line_contents() -> None:
    progress, _, clock = make(False)
    clock.t = 136.0  # 36 s after start, 12 of 60 steps done
    line = progress.format_line(12, {"rollout/raw_reward": 0.41234, "perf/step_time": 3.2109})
    assert line == "step 12/60  20% | reward 0.4123 | step 3.21s | elapsed 0:36 | eta 2:24"
    assert progress.format_line(1, {}) == "step  1/60   2% | elapsed 0:36 | eta 35:24"


def test_a_step_whose_every_group_was_left_out_shows_no_reward_but_why() -> None:
    """Its reward is NaN (a mean over no response): the line says why, not `reward nan`; the step time stays."""
    progress, stream, clock = make(False, every_steps=1)
    clock.t = 103.0
    progress.update(1, {"rollout/raw_reward": float("nan"), "perf/step_time": 3.0}, left_out=True)
    clock.t = 106.0
    progress.update(2, {"rollout/raw_reward": 0.5, "perf/step_time": 3.0})
    assert stream.getvalue().splitlines() == [
        "step  1/60   2% | reward - (every group left out) | step 3.00s | elapsed 0:03 | eta 2:57",
        "step  2/60   3% | reward 0.5 | step 3.00s | elapsed 0:06 | eta 2:54"]


def test_metrics_remembered_between_updates() -> None:
    progress, stream, clock = make(False, every_steps=1)
    clock.t = 103.0
    progress.update(1, {"rollout/raw_reward": 0.5, "perf/step_time": 3.0})
    clock.t = 106.0
    progress.update(2, {"train/loss": 1.0})
    assert stream.getvalue().splitlines()[-1] == "step  2/60   3% | reward 0.5 | step 3.00s | elapsed 0:06 | eta 2:54"


def test_non_tty_prints_every_n_steps_or_seconds() -> None:
    progress, stream, clock = make(False, every_steps=10, every_s=10.0)
    for step in range(1, 61):
        clock.t = 100.0 + step * 0.5  # 0.5 s steps: the step rule decides
        progress.update(step, {"rollout/raw_reward": step / 60})
    printed = [int(line.split()[1].split("/")[0]) for line in stream.getvalue().splitlines()]
    assert printed == [1, 11, 21, 31, 41, 51, 60]  # first, every 10 steps, last
    assert "\r" not in stream.getvalue()

    progress, stream, clock = make(False, every_steps=1000, every_s=10.0)
    for step in range(1, 8):
        clock.t = 100.0 + step * 4.0  # 4 s steps: the time rule decides
        progress.update(step, {})
    printed = [int(line.split()[1].split("/")[0]) for line in stream.getvalue().splitlines()]
    assert printed == [1, 4, 7]


def test_tty_rewrites_in_place() -> None:
    progress, stream, clock = make(True)
    clock.t = 103.0
    progress.update(1, {"rollout/raw_reward": 0.123456})
    first = stream.getvalue()
    assert first.startswith("\r") and "\n" not in first
    clock.t = 106.0
    progress.update(2, {"rollout/raw_reward": 1})
    second = stream.getvalue()[len(first) :]
    assert second.startswith("\r")
    assert len(second) - 1 == len(first) - 1  # padded to erase the longer previous line
    progress.close()
    progress.close()
    assert stream.getvalue().endswith("\n") and stream.getvalue().count("\n") == 1


def test_write_keeps_live_line() -> None:
    progress, stream, clock = make(True)
    progress.update(1, {})
    progress.write("checkpoint saved")
    out = stream.getvalue()
    assert "checkpoint saved" in out and out.endswith(progress.format_line(1, {}))


def test_disabled_hides_only_the_live_line() -> None:
    """tracking.progress=false (docs/experiments.md, section 7; schema.py: "live progress line") hides the progress
    line, and nothing else: a note and the closing summary (where the run's outputs and HF model are named) are
    printed as plain lines, as they are with the line on."""
    stream = io.StringIO()
    progress = Progress(10, enabled=False, stream=stream, is_tty=True)
    for step in range(1, 11):
        progress.update(step, {"rollout/raw_reward": 1.0})
    assert stream.getvalue() == ""  # no progress line, neither drawn in place nor printed
    progress.write("checkpoint saved")
    text = progress.summary(1.0, 1.0, "abc", "mlflow ui", {"outputs": "/x/out", "HF model": "/x/hf"})
    progress.close()
    assert "abc" in text and "/x/hf" in text
    # the same as a run with the line on prints below its line: the message, then the block, nothing else
    assert stream.getvalue() == "checkpoint saved\n" + text + "\n"
    assert "step " not in stream.getvalue() and "\r" not in stream.getvalue()


def test_summary_block() -> None:
    ui = "mlflow ui --backend-store-uri sqlite:////work/mlflow.db"
    text = summary(0.8125, 0.85, "0123abcd", ui, {"steps": 60, "wall time": "4:12", "kl": 0.0123456})
    lines = text.splitlines()
    assert lines[0] == lines[-1] and set(lines[0]) == {"="}
    assert "  final reward  0.8125" in lines
    assert "  best reward   0.85" in lines
    assert "  MLflow run    0123abcd" in lines
    assert f"  open the UI   {ui}" in lines
    assert "  steps         60" in lines
    assert "  kl            0.01235" in lines
    disabled = summary(None, None, None, None)
    assert "(tracking disabled)" in disabled and "open the UI" not in disabled and "n/a" in disabled


def test_progress_summary_closes_line_and_prints() -> None:
    progress, stream, _ = make(True)
    progress.update(60, {})
    text = progress.summary(0.9, 0.95, "run1", "mlflow ui --backend-store-uri sqlite:////x.db")
    assert stream.getvalue().endswith("\n" + text + "\n")
    assert "run1" in text and "mlflow ui --backend-store-uri sqlite:////x.db" in text
