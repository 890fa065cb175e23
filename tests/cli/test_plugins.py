"""`plugins=[module, ...]`: the user's own modules, imported by relax-train in the driver before the config is
composed (so `algorithm=<theirs>` and `<theirs>_schema` resolve, and a `conf/` directory beside a module adds its
YAML options) and by every role process at its start (so the roles' registries hold the algorithm too, and not by the
accident of unpickling its config class). A module that cannot be imported is one line before anything starts.
And `hydra.searchpath=[file:///dir]` adds a directory's config groups, as Hydra documents (relax-train's own check
composed without it). The package is written here, into tmp_path: nothing of the user's is in the repository."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from relax_train_inprocess import relax_train as relax_train_here

from relax.cli.config_check import problems
from relax.config import ConfigError, load_config
from relax.config.store import PluginError, plugins_in_overrides, with_search_path

# the config class in one module, its registration in another: a role that only unpickled the config would have
# imported toyplug.config, never toyplug.register, and not know the algorithm
CONFIG_PY = '''
from dataclasses import dataclass

from relax.algorithms.base import AlgorithmConfig


@dataclass(frozen=True)
class ToyConfig(AlgorithmConfig):
    name: str = "toy"
    scale: float = 1.0
'''

REGISTER_PY = '''
import os

from relax.algorithms import hooks
from relax.algorithms.base import Algorithm, register
from toyplug.config import ToyConfig


def record(what, cfg):
    with open(os.environ["TOYPLUG_LOG"], "a") as f:
        f.write(f"{what} {os.getpid()} {cfg.scale}\\n")


def compute_advantages(cfg, inputs):
    record("advantages", cfg)
    return hooks.group_relative_advantages(cfg, inputs)


def policy_loss(cfg, logp, old_logp, advantages, mask):
    record("loss", cfg)
    return hooks.ppo_clip_policy_loss(cfg, logp, old_logp, advantages, mask)


register(Algorithm(name="toy", config_cls=ToyConfig, compute_advantages=compute_advantages,
                   policy_loss=policy_loss, summary="a plugin's toy algorithm"))
'''


def write_package(root: Path) -> Path:
    """toyplug/ under `root`: config.py, register.py, and conf/algorithm/toy.yaml (which sets scale: 0.5)."""
    pkg = root / "toyplug"
    (pkg / "conf" / "algorithm").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text(CONFIG_PY)
    (pkg / "register.py").write_text(REGISTER_PY)
    (pkg / "conf" / "algorithm" / "toy.yaml").write_text("defaults:\n  - toy_schema\nscale: 0.5\n")
    (root / "broken.py").write_text("raise RuntimeError('the plugin broke')\n")
    return pkg


def relax_train(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cwd), os.environ.get("PYTHONPATH", "")]), **env}
    return subprocess.run([sys.executable, "-m", "relax.cli.train", *args], capture_output=True, text=True,
                          timeout=600, cwd=cwd, env=environ)


def test_plugins_are_read_from_the_command_line():
    assert plugins_in_overrides(["algorithm=toy", "plugins=[a.b,c]", "seed=2"]) == ["a.b", "c"]
    assert plugins_in_overrides(["plugins=[a],[a,b]"]) == ["a", "b"]  # a sweep: every module of every job
    assert plugins_in_overrides(["seed=1"]) == []
    with pytest.raises(PluginError, match=r"plugins is a list of module names: write plugins=\[mypkg.algos\]"):
        plugins_in_overrides(["plugins=mypkg.algos"])


def test_search_path_entries_are_added_after_the_users_own():
    assert with_search_path(["seed=1"], [Path("/p/conf")]) == ["seed=1", "hydra.searchpath=['file:///p/conf']"]
    assert with_search_path(["hydra.searchpath=[file:///mine]", "seed=1"], [Path("/p/conf")]) == [
        "hydra.searchpath=['file:///mine','file:///p/conf']", "seed=1"]


def test_a_plugin_that_cannot_be_imported_is_refused_by_the_config_check(tmp_path, monkeypatch):
    write_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"plugins: cannot import module 'no_such_plugin': ModuleNotFoundError"):
        load_config(["plugins=[no_such_plugin]"])
    with pytest.raises(ConfigError, match=r"plugins: cannot import module 'broken': RuntimeError: the plugin broke "
                                          r"\(raised while importing it\)"):
        load_config(["plugins=[broken]"])


def test_relax_train_refuses_an_unimportable_plugin_in_one_line_before_anything(tmp_path):
    write_package(tmp_path)
    out = relax_train(["plugins=[toyplug.register,no_such_plugin]", "dry_run=true"], tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == ("relax-train: error: plugins: cannot import module 'no_such_plugin': "
                                  "ModuleNotFoundError: No module named 'no_such_plugin'")


def test_hydra_searchpath_adds_a_directorys_config_groups(tmp_path, capfd, monkeypatch):
    """What Hydra documents for adding config groups from a directory: relax-train's own check and Hydra's main
    both see them (--cfg job prints the composed config: the option's value is in it)."""
    conf = tmp_path / "myconf" / "algorithm"
    conf.mkdir(parents=True)
    (conf / "grpo_wide.yaml").write_text("defaults:\n  - grpo_schema\neps_clip_high: 0.28\n")
    monkeypatch.chdir(tmp_path)
    searchpath = f"hydra.searchpath=[file://{tmp_path / 'myconf'}]"
    assert problems(["algorithm=grpo_wide", searchpath]) is None
    code, out, err = relax_train_here(["algorithm=grpo_wide", searchpath, "--cfg", "job"], capfd)
    assert code == 0, err
    assert "eps_clip_high: 0.28" in out


@pytest.mark.slow
def test_a_plugins_algorithm_trains_its_hooks_called_in_the_driver_and_the_actor(tmp_path):
    """A real relax-train of one step on the tiny model with the plugin's algorithm (from the plugin's own
    conf/algorithm/toy.yaml): the driver computed the advantages, the actor's Ray process (another pid) the loss,
    both with the YAML's scale. The control: without plugins= the algorithm is unknown, before anything starts."""
    write_package(tmp_path)
    log = tmp_path / "calls.log"
    args = ["algorithm=toy", "train.num_rollout=1", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4",
            "train.global_batch_size=8", "train.micro_batch_size=8", "tracking.enabled=false",
            f"train.save_dir={tmp_path}/ckpt"]
    without = relax_train(args, tmp_path, TOYPLUG_LOG=str(log))
    assert without.returncode == 2 and "algorithm/toy" in without.stderr and not log.exists()

    proc = subprocess.Popen([sys.executable, "-c", "import os, sys; print(os.getpid(), flush=True); "
                             "sys.argv = ['relax-train', *sys.argv[1:]]; from relax.cli.train import main; main()",
                             "plugins=[toyplug.register]", *args], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "TOYPLUG_LOG": str(log),
                                 "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])})
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    driver = out.split()[0]
    calls = [line.split() for line in log.read_text().splitlines()]
    advantages = {pid for what, pid, _ in calls if what == "advantages"}
    losses = {pid for what, pid, _ in calls if what == "loss"}
    assert advantages == {driver}, (calls, driver)
    assert losses and driver not in losses, (calls, driver)  # the actor's own Ray worker process
    assert {scale for _, _, scale in calls} == {"0.5"}  # toyplug/conf/algorithm/toy.yaml applied
