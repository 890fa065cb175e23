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

    # a run's saved config of a plugin's algorithm (`plugins:` and `algorithm.name` in the file), reused without
    # plugins= on the command line (`relax-train -cp <dir> -cn config`): its check imports the file's own plugins
    # before it looks the algorithm up (before: "algorithm.name='savedtoy' is not one of ...")
    from omegaconf import OmegaConf

    from relax.algorithms.base import AlgorithmConfig
    from relax.config.compose import compose

    write_plugin(tmp_path, "savedplug", "savedtoy")
    plain = OmegaConf.to_container(compose(["train.num_rollout=2"]))
    plain["algorithm"] = {**OmegaConf.to_container(OmegaConf.structured(AlgorithmConfig)), "name": "savedtoy",
                          "scale": 0.25}
    for name, plugins in (("saved", "savedplug.register"), ("unimportable", "no_such_plugin")):
        (tmp_path / name).mkdir()
        OmegaConf.save(OmegaConf.create({**plain, "plugins": [plugins]}), tmp_path / name / "config.yaml")
    assert "savedplug.register" not in sys.modules  # nothing registered savedtoy before the check
    assert problems(["-cp", str(tmp_path / "saved"), "-cn", "config", "train.lr=1e-5"]) is None
    assert load_config(["train.lr=1e-5"], tmp_path / "saved", config_name="config").algorithm.scale == 0.25
    # the control: a module of the file's that cannot be imported is named as the file's `plugins`
    assert problems(["-cp", str(tmp_path / "unimportable"), "-cn", "config"]) == (
        "invalid config (1 problem):\n"
        "  - plugins: cannot import module 'no_such_plugin': ModuleNotFoundError: No module named 'no_such_plugin'")


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
def test_a_plugins_algorithm_trains_its_hooks_called_in_the_driver_and_the_actor(tmp_path, monkeypatch, capfd):
    """A real relax-train of one step on the tiny model with the plugin's algorithm (from the plugin's own
    conf/algorithm/toy.yaml): the driver computed the advantages, the actor's Ray process (another pid) the loss,
    both with the YAML's scale. The control: without plugins= the algorithm is unknown, before anything starts."""
    write_package(tmp_path)
    log = tmp_path / "calls.log"
    args = ["algorithm=toy", "train.num_rollout=1", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4",
            "train.global_batch_size=8", "train.micro_batch_size=8", "tracking.enabled=false",
            f"train.save_dir={tmp_path}/ckpt"]
    # (in this process: it is refused before anything starts; the plugin's directory importable, as below)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TOYPLUG_LOG", str(log))
    code, _, err = relax_train_here(args, capfd)
    assert code == 2 and "group algorithm has no option 'toy'" in err and not log.exists(), err

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


def write_plugin(root: Path, pkg: str, algo: str) -> None:
    """A package `pkg` under `root` whose module `register` registers the algorithm `algo` (config class in the same
    module) and whose conf/algorithm/<algo>.yaml selects it; a name of its own per test, since a process imports a
    module once and its registry keeps what was registered."""
    (root / pkg / "conf" / "algorithm").mkdir(parents=True)
    (root / pkg / "__init__.py").write_text("")
    (root / pkg / "register.py").write_text(CONFIG_PY.replace('"toy"', repr(algo)) + f"""
from relax.algorithms import hooks
from relax.algorithms.base import Algorithm, register

register(Algorithm(name={algo!r}, config_cls=ToyConfig, compute_advantages=hooks.group_relative_advantages,
                   policy_loss=hooks.ppo_clip_policy_loss, summary="a plugin's toy algorithm"))
""")
    (root / pkg / "conf" / "algorithm" / f"{algo}.yaml").write_text(f"defaults:\n  - {algo}_schema\nscale: 0.5\n")


def test_the_megatron_actor_ranks_import_the_plugins_at_start(tmp_path, monkeypatch):
    """A rank of train.backend=megatron imports `plugins` when it is made (before its process group or model), as the
    torch backend's roles do. The config is built without them (load_config would import them itself), so only the
    rank can have imported the module."""
    import dataclasses

    from relax.roles.megatron_actor import MegatronRank
    from relax.roles.workers import ModelInfo

    write_plugin(tmp_path, "megplug", "megtoy")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = dataclasses.replace(load_config(["train.backend=megatron"]), plugins=["megplug.register"])
    assert "megplug.register" not in sys.modules
    threads = __import__("torch").get_num_threads()
    try:
        MegatronRank(cfg, ModelInfo(vocab_size=8, pad_token_id=0, eos_token_ids=(1,)), rank=0, world_size=1)
    finally:
        __import__("torch").set_num_threads(threads)
    assert "megplug.register" in sys.modules
    from relax import algorithms

    assert algorithms.get("megtoy").name == "megtoy"


def test_ppos_advantages_service_imports_the_plugins_at_start(tmp_path, monkeypatch):
    """PPO's advantages service is given the run's `plugins` and imports them when it is made: it looks the
    algorithm's compute_advantages up by name in its own process's registry."""
    import inspect

    from relax.roles.workers import AdvantagesWorker
    from relax.runner import cluster

    write_plugin(tmp_path, "advplug", "advtoy")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "advplug.register" not in sys.modules
    AdvantagesWorker(plugins=["advplug.register"])
    assert "advplug.register" in sys.modules
    # the runner hands it the run's list (starting a Ray cluster here would cost minutes)
    assert 'self._remote(AdvantagesWorker, "advantages", 0, plugins=list(cfg.plugins))' in \
        inspect.getsource(cluster.Cluster)


def test_relax_submit_imports_the_plugins_before_its_config_check(tmp_path, monkeypatch, capsys):
    """relax-submit --dry-run with a plugin's algorithm (selected by the plugin's conf/algorithm/<name>.yaml): the
    check here imports the plugin first, as relax-train does, and the job's command line is the user's own (the
    job's relax-train imports it again on the cluster). The control: without plugins= the algorithm is unknown."""
    import json

    import ray.job_submission

    from relax.cli import submit
    from tests.cli.jobs_stub import Jobs

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", Jobs)
    monkeypatch.setattr(submit, "enable_token_auth", lambda: False)
    monkeypatch.delenv("EXP_DIR", raising=False)
    write_plugin(tmp_path, "subplug", "subtoy")
    monkeypatch.syspath_prepend(str(tmp_path))
    absolute = ["tracking.uri=sqlite:////shared/mlflow.db", "train.save_dir=/shared/ckpt", "hydra.run.dir=/shared/out"]

    with pytest.raises(SystemExit) as exit_:
        submit.main(["--dry-run", "--", "algorithm=subtoy", *absolute])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "algorithm=subtoy: config group algorithm has no option 'subtoy'" in err, err

    with pytest.raises(SystemExit) as exit_:
        submit.main(["--dry-run", "--", "plugins=[no_such_plugin]", "algorithm=subtoy", *absolute])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("relax-submit: error: plugins: cannot import module 'no_such_plugin': "
                                       "ModuleNotFoundError: No module named 'no_such_plugin'\n"
                                       "Nothing was submitted.\n")

    submit.main(["--dry-run", "--", "plugins=[subplug.register]", "algorithm=subtoy", *absolute])
    entrypoint = json.loads(capsys.readouterr().out)["entrypoint"]
    assert entrypoint == " ".join([submit.TRAIN_ENTRYPOINT, "'plugins=[subplug.register]'", "algorithm=subtoy",
                                   *absolute])


# a plugin that registers an architecture with transformers: a reward model of that architecture loads only in a
# process that imported it
RM_PLUGIN = '''
from transformers import (AutoConfig, AutoModel, AutoModelForSequenceClassification, Qwen3Config,
                          Qwen3ForSequenceClassification, Qwen3Model)


class PlugRMConfig(Qwen3Config):
    model_type = "plug_rm"


class PlugRMModel(Qwen3Model):
    config_class = PlugRMConfig


class PlugRMForSequenceClassification(Qwen3ForSequenceClassification):
    config_class = PlugRMConfig


AutoConfig.register("plug_rm", PlugRMConfig)
AutoModel.register(PlugRMConfig, PlugRMModel)
AutoModelForSequenceClassification.register(PlugRMConfig, PlugRMForSequenceClassification)
'''


def test_the_reward_model_roles_import_the_plugins_at_start(tmp_path, monkeypatch):
    """A classifier of an architecture that a plugin registers with transformers (model_type plug_rm) loads in the
    reward-model role because the role imports `plugins` first, as every other role does; the control: the same
    role without them cannot read its config.json. The judge's role imports them too. The configs are built without
    the plugins (load_config would import them itself), so only the role can have imported them."""
    import dataclasses
    import json

    from relax.config.schema import ModelConfig
    from relax.data.tokenizer import ModelFileError, build_tiny_tokenizer
    from relax.models.hf import qwen3_config
    from relax.roles.reward_model import ClassifierWorker, JudgeWorker
    from tests.rewards.reward_models import tiny_classifier

    model, tokenizer = tiny_classifier(seed=0)
    rm_dir = tmp_path / "rm"
    model.save_pretrained(str(rm_dir))
    tokenizer.save_pretrained(str(rm_dir))
    config = json.loads((rm_dir / "config.json").read_text())
    config.update(model_type="plug_rm", architectures=["PlugRMForSequenceClassification"])
    (rm_dir / "config.json").write_text(json.dumps(config))
    (tmp_path / "rmplug.py").write_text(RM_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(["reward_model=classifier", f"reward_model.path={rm_dir}", "reward_model.dtype=float32"])
    with pytest.raises(ModelFileError, match="plug_rm"):
        ClassifierWorker(cfg)
    assert "rmplug" not in sys.modules
    worker = ClassifierWorker(dataclasses.replace(cfg, plugins=["rmplug"]))
    assert type(worker.model).__name__ == "PlugRMForSequenceClassification"
    scores, errors = worker.score(["repeat 1"], ["1"])
    assert errors == [None] and isinstance(scores[0], float)

    from transformers import Qwen3ForCausalLM

    tok = build_tiny_tokenizer()
    judge_dir = tmp_path / "judge"
    Qwen3ForCausalLM(qwen3_config(ModelConfig(), len(tok), tok.pad_token_id)).save_pretrained(str(judge_dir))
    tok.save_pretrained(str(judge_dir))
    (tmp_path / "judgeplug.py").write_text("")
    judge = load_config(["reward_model=judge", f"reward_model.path={judge_dir}", "reward_model.dtype=float32",
                         "reward_model.template='Rate: {response}'"])
    JudgeWorker(dataclasses.replace(judge, plugins=["judgeplug"]))
    assert "judgeplug" in sys.modules


def test_relax_submit_finds_the_plugins_in_its_working_dir(tmp_path, monkeypatch, capsys):
    """`relax-submit --working-dir DIR` with `plugins=[...]` living in DIR (not importable here otherwise): the job
    imports them from its working_dir, so the check before submitting finds them there too and the job is
    submitted with DIR as its working_dir. The control: the same command without --working-dir is refused."""
    import json

    import ray.job_submission

    from relax.cli import submit
    from tests.cli.jobs_stub import Jobs

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", Jobs)
    monkeypatch.setattr(submit, "enable_token_auth", lambda: False)
    monkeypatch.delenv("EXP_DIR", raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))  # what relax-submit adds is taken off after the test
    work = tmp_path / "project"
    write_plugin(work, "wdplug", "wdtoy")
    args = ["--", "plugins=[wdplug.register]", "algorithm=wdtoy", "tracking.uri=sqlite:////shared/mlflow.db",
            "train.save_dir=/shared/ckpt", "hydra.run.dir=/shared/out"]

    with pytest.raises(SystemExit) as exit_:
        submit.main(["--dry-run", *args])
    assert exit_.value.code == 2
    assert "plugins: cannot import module 'wdplug.register'" in capsys.readouterr().err

    submit.main(["--dry-run", "--working-dir", str(work), *args])
    payload = json.loads(capsys.readouterr().out)
    assert payload["runtime_env"]["working_dir"] == str(work.resolve())
    assert payload["entrypoint"].endswith("'plugins=[wdplug.register]' algorithm=wdtoy "
                                          "tracking.uri=sqlite:////shared/mlflow.db train.save_dir=/shared/ckpt "
                                          "hydra.run.dir=/shared/out")
