"""A sweep's jobs' last output lines reach the sweep's own output, before its table: Ray forwards each job's stdout
and stderr to the driver (log_to_driver) from its log monitor, after the job wrote them and often after its task
returned, and `ray.shutdown` drops what has not arrived. Before, the launcher shut Ray down as soon as the last job
returned (its fixed one-second wait was in a branch a sweep that starts or joins Ray never took): the last lines of
the jobs that ended last were lost. Now each job ends its output with a mark on stdout and stderr (the launcher's
`OUTPUT_MARK`) that the driver waits to see, bounded, and does not print. A real sweep of a tiny Hydra app on the
launcher's own local Ray (the same shutdown as on a joined cluster), in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
LINES = 3000
APP = f'''
import sys

import hydra


def check(cfg):
    """The launcher's precheck: any config of this app is valid."""


@hydra.main(config_path="conf", config_name="config", version_base=None)
def app(cfg):
    for k in range({LINES}):
        print(f"job {{cfg.seed}} out {{k}}")
        print(f"job {{cfg.seed}} err {{k}}", file=sys.stderr)
    return {{"final_reward": 1.0}}


if __name__ == "__main__":
    app()
'''
CONF = """defaults:
  - override hydra/launcher: relax_ray
  - _self_

seed: 1
tracking:
  enabled: false

hydra:
  job:
    chdir: false
  sweep:
    dir: multirun
    subdir: ${hydra.job.num}
  launcher:
    precheck: __main__:check
"""


def test_each_jobs_last_lines_reach_the_sweeps_output_before_its_table(tmp_path: Path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text(CONF)
    (tmp_path / "app.py").write_text(APP)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), PYTHONUNBUFFERED="1",
               RAY_DEDUP_LOGS="0")  # every job's lines as written: Ray would fold lines alike across jobs
    seeds = (1, 2, 3)
    out = subprocess.run([sys.executable, "app.py", "-m", f"seed={','.join(map(str, seeds))}"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (tmp_path / "stdout").write_text(out.stdout)  # for a failure's reading
    (tmp_path / "stderr").write_text(out.stderr)
    table = out.stdout.index("FINISHED")  # the table's first row
    for seed in seeds:
        for stream, text in (("out", out.stdout), ("err", out.stderr)):
            # a line may have the driver's own ("job 1 finished ...") printed into it before its newline
            seen = {int(k) for k in re.findall(rf"job {seed} {stream} (\d+)(?!\d)", text)}
            missing = [k for k in range(LINES) if k not in seen]
            assert not missing, (seed, stream, f"{len(missing)} of {LINES} lines missing, the first {missing[:5]}")
        assert out.stdout.index(f"job {seed} out {LINES - 1}") < table
    # the marks are the driver's, not printed
    assert "relax-sweep-job-output" not in out.stdout + out.stderr


def test_the_marks_are_found_inside_a_line_and_a_stopped_job_is_waited_for_once_it_began():
    """A job's last text without a newline and its end mark arrive as one forwarded line: the text is printed, the
    mark is not, and it counts. A job the sweep's Ctrl-C stopped is waited for once it began (one cancelled before it
    ran writes nothing), and what never arrives is named (bounded)."""
    from hydra_plugins.relax_ray_launcher.launcher import _mark, _OutputEnds

    ends, printed = _OutputEnds(), []
    ends.printer = printed.append
    ends._handle({"lines": ["step 3 done", f"no newline{_mark(0, 'end')}", _mark(1, "begin")], "is_err": False})
    ends._handle({"lines": [_mark(0, "end")], "is_err": True})
    assert printed == [{"lines": ["step 3 done", "no newline"], "is_err": False}]
    assert ends.wait([0], [], 5) == []  # job 0 returned, both its ends seen
    assert ends.wait([], [1, 2], 0.2) == [1]  # job 1 began and its end never came; job 2 never began
    ends._handle({"lines": [_mark(1, "end")], "is_err": False})
    ends._handle({"lines": [_mark(1, "end")], "is_err": True})
    assert ends.wait([], [1, 2], 5) == [] and len(printed) == 1
