"""relax-submit gives the job the grace `ray job stop` needs: the job's RAY_JOB_STOP_WAIT_TIME_S (read by Ray's job
supervisor, 3 s by default) is the longest relax-train takes to stop with a checkpoint, computed from the config; and
the `ray job` commands it prints work where relax-submit itself had to turn token authentication on. The payload is
captured from a stand-in Ray Jobs client (nothing is contacted); the real stop is
tests/experiments/test_submit.py::test_ray_job_stop_lets_the_submitted_run_commit_its_checkpoint."""

from __future__ import annotations

import inspect
import json

import pytest

from relax.cli import submit
from relax.cli.submit import STOP_WAIT_ENV, main
from tests.cli.jobs_stub import Jobs

ABSOLUTE = ["tracking.uri=sqlite:////shared/mlflow.db", "train.save_dir=/shared/ckpt", "hydra.run.dir=/shared/out",
            "hydra.sweep.dir=/shared/multirun"]


@pytest.fixture
def env(monkeypatch):
    for name in ("EXP_DIR", STOP_WAIT_ENV, "RAY_AUTH_MODE"):
        monkeypatch.delenv(name, raising=False)
    import ray.job_submission

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", Jobs)
    monkeypatch.setattr(submit, "enable_token_auth", lambda: False)
    Jobs.submitted = []
    return monkeypatch


def grace(capsys, *argv: str) -> str | None:
    main(["--dry-run", *argv])
    return json.loads(capsys.readouterr().out)["runtime_env"]["env_vars"].get(STOP_WAIT_ENV)


def test_rays_job_supervisor_reads_the_variable():
    """The name is Ray's, not ours: its job supervisor waits that long after the stop signal before SIGKILL."""
    from ray.dashboard.modules.job.job_supervisor import JobSupervisor

    source = inspect.getsource(JobSupervisor)
    assert f'"{STOP_WAIT_ENV}"' in source and "SIGKILL" in source


def test_the_grace_is_the_longest_relax_train_takes_to_stop_with_a_checkpoint(env, capsys):
    # a run: cluster.heartbeat_timeout_s (the step in progress) + train.checkpoint_timeout_s + 120 s to close MLflow
    assert grace(capsys, "--", *ABSOLUTE) == str(300 + 1800 + 120)
    assert grace(capsys, "--", "train.checkpoint_timeout_s=10", "cluster.heartbeat_timeout_s=5.5", *ABSOLUTE) \
        == str(10 + 6 + 120)  # 135.5 s, rounded up
    # a sweep: its relax-train kills the jobs still running after hydra.launcher.stop_timeout_s, then closes
    assert grace(capsys, "--", "-m", "seed=1,2", *ABSOLUTE) == str(120 + 120)
    assert grace(capsys, "--", "-m", "seed=1,2", "hydra.launcher.stop_timeout_s=30", *ABSOLUTE) == str(30 + 120)


def test_a_timeout_read_from_the_jobs_environment(env, capsys):
    """`${oc.env:HB}` is read with the job's --env set, as the config check reads it; one that only the cluster can
    resolve leaves Ray's default with a note (the job is still submitted), not a traceback."""
    import os

    env.delenv("HB", raising=False)
    heartbeat = "cluster.heartbeat_timeout_s=${oc.env:HB}"
    assert grace(capsys, "--env", "HB=30", "--", heartbeat, *ABSOLUTE) == str(30 + 1800 + 120)
    assert "HB" not in os.environ  # restored after the read
    stop = "hydra.launcher.stop_timeout_s=${oc.env:HB}"
    assert grace(capsys, "--env", "HB=30", "--", "-m", "seed=1,2", stop, *ABSOLUTE) == str(30 + 120)
    main(["--dry-run", "--", "-m", "seed=1,2", stop, *ABSOLUTE])  # HB set on the cluster's nodes only
    out, err = capsys.readouterr()
    assert STOP_WAIT_ENV not in json.loads(out)["runtime_env"]["env_vars"]
    assert ("relax-submit: note: the job's stop grace cannot be read here (hydra.launcher.stop_timeout_s: "
            "InterpolationResolutionError: ") in err and "pass --stop-grace-s SECONDS" in err


def test_the_users_grace_wins(env, capsys):
    assert grace(capsys, "--stop-grace-s", "60", "--", *ABSOLUTE) == "60"
    assert grace(capsys, "--env", f"{STOP_WAIT_ENV}=7", "--stop-grace-s", "60", "--", *ABSOLUTE) == "7"
    # another entrypoint has no config to read: Ray's own default unless given
    assert grace(capsys, "--entrypoint", "python prepare.py") is None
    assert grace(capsys, "--entrypoint", "python prepare.py", "--stop-grace-s", "30") == "30"
    with pytest.raises(SystemExit) as exc:
        main(["--dry-run", "--stop-grace-s", "-1", "--", *ABSOLUTE])
    assert exc.value.code == 2 and "--stop-grace-s -1: must be a number of seconds >= 0" in capsys.readouterr().err


def test_the_submitted_job_carries_the_grace_and_says_so(env, capsys):
    main(["--address", "http://head.example:8265", "--no-follow", "--", "train.checkpoint_timeout_s=10",
          "cluster.heartbeat_timeout_s=5", *ABSOLUTE])
    assert Jobs.submitted[-1]["runtime_env"]["env_vars"][STOP_WAIT_ENV] == "135"
    out = capsys.readouterr().out
    assert "ray job stop --address http://head.example:8265 job-1: SIGTERM, then up to 135 s for the job to stop" in out
    assert "follow it with: ray job logs --address http://head.example:8265 --follow job-1" in out


def test_printed_ray_commands_send_the_token_when_relax_submit_turned_it_on(env, capsys):
    """With a token in ~/.ray/auth_token and RAY_AUTH_MODE unset, relax-submit turns token auth on for itself; the
    bare `ray job ...` it printed was refused by the cluster (Missing authentication token)."""
    def turn_on():
        import os

        os.environ["RAY_AUTH_MODE"] = "token"  # (monkeypatch restores the environment after the test)
        return True

    env.setattr(submit, "enable_token_auth", turn_on)
    main(["--address", "http://head.example:8265", "--no-follow", "--", *ABSOLUTE])
    out = capsys.readouterr().out
    assert "follow it with: RAY_AUTH_MODE=token ray job logs --address http://head.example:8265 --follow job-1" in out
    assert "RAY_AUTH_MODE=token ray job stop --address http://head.example:8265 job-1" in out
    # control: the user set RAY_AUTH_MODE, so their shell has it already
    main(["--address", "http://head.example:8265", "--no-follow", "--", *ABSOLUTE])
    assert "follow it with: ray job logs" in capsys.readouterr().out


def test_a_stopped_job_exits_as_relax_train_does_after_sigterm():
    class Info:
        driver_exit_code = None  # what Ray reports for a job it stopped

    class Client:
        def get_job_info(self, job_id):
            return Info()

    assert submit.exit_code(Client(), "job-1", "STOPPED") == 143


def test_an_address_without_a_scheme_that_fails_says_how_ray_reads_it(env, capsys):
    """`--address HOST:8265` (the dashboard's port, no http://) is a GCS address to Ray: after its retries, Ray's
    error speaks of the GCS only."""
    class Refused:
        def __init__(self, address):
            raise ConnectionError("Timed out while waiting for GCS to become available.")

    import ray.job_submission

    env.setattr(ray.job_submission, "JobSubmissionClient", Refused)
    for address, hinted in (("head.example:8265", True), ("http://head.example:8265", False)):
        with pytest.raises(SystemExit) as exc:
            main(["--address", address, "--no-follow", "--", *ABSOLUTE])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"relax-submit: error: cannot submit to {address}: ConnectionError" in err
        assert ("without http:// is taken as the Ray head's GCS address" in err) == hinted
        assert (f"the dashboard's is http://{address}" in err) == hinted


class _Cut:
    """A Jobs client whose log stream breaks like Ray's when the websocket is cut without a close frame."""

    def __init__(self, log: str, cut: int, status_error: Exception | None = None):
        self.log, self.cut, self.status_error = log, cut, status_error

    def __call__(self, address):  # stands in for the JobSubmissionClient class
        return self

    def submit_job(self, **payload):
        return "job-1"

    async def tail_job_logs(self, job_id):
        yield self.log[: self.cut]
        # what ray.dashboard.modules.job.sdk raises for close code 1006
        raise RuntimeError("WebSocket connection closed unexpectedly with close code 1006")

    def get_job_status(self, job_id):
        if self.status_error is not None:
            raise self.status_error
        return "JobStatus.SUCCEEDED"

    def get_job_logs(self, job_id):
        return self.log

    def get_job_info(self, job_id):
        class Info:
            driver_exit_code = 0
        return Info()


def test_a_stream_cut_without_a_close_frame_is_completed_from_the_job_log():
    """docs: a log stream cut before the job ends is completed from the job's log file; an abnormal close (1006)
    raised out of relax-submit with a traceback instead."""
    import io

    log = "algorithm  grpo\n" + "".join(f"step {i}/4 | reward 0.{i}\n" for i in range(1, 5)) + "Relax run finished\n"
    out = io.StringIO()
    assert submit.follow_to_the_end(_Cut(log, cut=20), "job-1", out, poll_s=0) == "SUCCEEDED"
    assert out.getvalue() == log  # every line once, in order


def test_a_cluster_that_stops_answering_ends_with_a_message_not_a_traceback(env, capsys):
    import functools

    import ray.job_submission

    client = _Cut("algorithm  grpo\n", cut=5, status_error=ConnectionError("Connection refused"))
    env.setattr(ray.job_submission, "JobSubmissionClient", client)
    env.setattr(submit, "follow_to_the_end", functools.partial(submit.follow_to_the_end, poll_s=0, lost_after_s=0))
    with pytest.raises(SystemExit) as exc:
        main(["--address", "http://head.example:8265", "--", *ABSOLUTE])
    err = capsys.readouterr().err
    assert exc.value.code == 1
    assert ("relax-submit: error: the cluster at http://head.example:8265 stopped answering while job job-1 ran "
            "(ConnectionError: Connection refused); its state is unknown here. Once the head is back: ray job status "
            "--address http://head.example:8265 job-1") in err
    assert "Traceback" not in err
