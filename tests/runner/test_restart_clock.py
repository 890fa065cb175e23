"""A run whose service graph restarts (`train.max_restarts`): the closing summary's wall time and the progress line's
elapsed count from the start of the run, not of the last start of the graph, and the summary has a `restarts` line.
Before, both restarted at 0 (an operator's bill and time-to-result include the hang and the restart) and the summary
said nothing of the restart. And `perf/overhead_time` is never negative (it was, when the engines' own measure of
their time exceeded the rest of the step).

The run is the tiny model in process; the role failure is raised by the test at the first step, and the run's start
is moved an hour back (the clock of `relax.runner.restarts`, read once, when the run begins): a failure that took an
hour to be detected, without an hour of test."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

from relax.metrics import OVERHEAD_FRACTION, OVERHEAD_TIME
from relax.tracking.progress import Progress

HOUR = 3600.0


def test_a_restarted_run_counts_its_time_from_its_start_and_says_it_restarted(in_process, small_run, tmp_path,
                                                                                 monkeypatch, capsys):
    from relax.config import load_config
    from relax.runner import restarts as restarts_module
    from relax.runner import train
    from relax.runner.errors import RoleFailure

    real = time.monotonic
    monkeypatch.setattr(restarts_module, "time", SimpleNamespace(monotonic=lambda: real() - HOUR), raising=False)
    original = train.Recipe.step
    failed: list[int] = []

    def step(self, index: int) -> None:
        if not failed:  # the first step of the first start of the graph: its actor "dies"
            failed.append(index)
            self.restarts.step = index
            raise RoleFailure("actor", "died: injected by the test")
        return original(self, index)

    monkeypatch.setattr(train.Recipe, "step", step)
    cfg = load_config(small_run("tracking.progress=true", steps=2))
    result = train.run(cfg, output_dir=tmp_path / "out")
    assert failed == [0] and [s for s, _ in result.history] == [0, 1]
    err = capsys.readouterr().err
    assert "restarting the service graph from the first step" in err, err
    (wall,) = re.findall(r"^  wall time +(\d+) s$", err, re.M)
    assert HOUR <= int(wall) < HOUR + 600, err
    (restarts,) = re.findall(r"^  restarts +(.*)$", err, re.M)
    assert restarts.startswith("1 of train.max_restarts=") and "actor died: injected by the test; restarted from " \
        "the first step (no checkpoint yet)" in restarts, restarts
    progress = re.findall(r"^step +2/2 .*\| elapsed (\S+) \| eta (\S+)$", err, re.M)
    assert progress and progress[-1][0].startswith("1:0"), err  # h:mm:ss past the hour
    assert all(m[OVERHEAD_TIME] >= 0 for _, m in result.history if OVERHEAD_TIME in m)


def test_elapsed_counts_from_the_runs_start_and_eta_from_this_starts_pace():
    """`Progress(started=...)`: the graph started again at t=100 (the run at t=0) from step 0; after 2 steps at t=110
    the line says elapsed 1:50 (the run's time) and eta 0:40 (8 steps left at 5 s each, this start's pace: the time
    lost to the failure is not a cost of each step still to come)."""
    now = [100.0]
    progress = Progress(10, clock=lambda: now[0], started=0.0, is_tty=False)
    now[0] = 110.0
    line = progress.format_line(2)
    assert line.endswith("| elapsed 1:50 | eta 0:40"), line
    assert Progress(10, clock=lambda: now[0], is_tty=False).format_line(2, now=115.0).endswith(
        "| elapsed 0:05 | eta 0:20")  # control: without `started`, from the loop's start as before


def test_the_eta_leaves_out_the_start_up():
    """`begin()` at the first step: a start-up of 30 s (roles, engines) then a step of 1 s gives eta 0:09 for the 9
    steps left, not 4:39 (31 s a step); elapsed still counts the start-up."""
    now = [0.0]
    progress = Progress(10, clock=lambda: now[0], is_tty=False)
    now[0] = 30.0
    progress.begin()
    now[0] = 31.0
    line = progress.format_line(1)
    assert line.endswith("| elapsed 0:31 | eta 0:09"), line


def test_the_overhead_is_never_negative():
    """The engines' time (their own measure) and the actor's compute can add up to more than the driver's step time."""
    from relax.runner.train import StepTimer

    metrics = StepTimer().metrics(step_time=1.0, engine_time=0.7, actor_compute_time=0.4, tokens=10.0)
    assert metrics[OVERHEAD_TIME] == 0.0 and metrics[OVERHEAD_FRACTION] == 0.0
    metrics = StepTimer().metrics(step_time=1.0, engine_time=0.5, actor_compute_time=0.25, tokens=10.0)
    assert metrics[OVERHEAD_TIME] == 0.25 and metrics[OVERHEAD_FRACTION] == 0.25  # control: as before
