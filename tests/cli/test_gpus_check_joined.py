"""The dry run's `gpus` line for a run that joins a Ray cluster (`cluster=multinode`: cluster.address=auto): the
check does not apply (the GPUs are the cluster nodes', which only Ray sees), and the line says so. Before, it read
"ok gpus a local Ray instance gets the plan's GPUs" for a run that starts no local instance and checked nothing."""

from __future__ import annotations

from pathlib import Path

from relax_train_inprocess import relax_train

QUIET = ["tracking.progress=false", "tracking.system_metrics=false", "train.save=false", "tracking.enabled=false"]


def _gpus_line(out: str) -> str:
    (line,) = [x for x in out.splitlines() if x.split()[1:2] == ["gpus"]]
    return line


def test_a_joined_cluster_is_not_said_to_give_a_local_instance_its_gpus(tmp_path: Path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code, out, err = relax_train(["cluster=multinode", "dry_run=true", *QUIET], capfd)
    assert code == 0, out + err
    line = _gpus_line(out)
    assert line.split()[0] == "n/a", line
    assert "local Ray instance" not in line
    assert "joins a Ray cluster (cluster.address=auto)" in line, line
    # control: a plan for a local instance on this machine is still checked against its GPUs (none on CI's CPUs:
    # refused), its line naming the check
    code, out, err = relax_train(["cluster=1xgpu", "dry_run=true", *QUIET], capfd)
    line = _gpus_line(out)
    if line.split()[0] == "failed":
        assert code == 2 and "torch sees 0 CUDA device(s)" in line, line
    else:
        assert line.split()[0] == "ok" and "a local Ray instance gets the plan's GPUs" in line, line
