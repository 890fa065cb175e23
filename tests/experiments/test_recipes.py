"""Every recipe in conf/experiment composes and validates; the RLOO recipe reads its batch sizes from the env."""

import subprocess
import sys
from pathlib import Path

import pytest

from relax.config import ConfigError, conf_dir, load_config

RECIPES = sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml"))
SCRIPTS = Path(__file__).resolve().parents[2] / "launch" / "recipes"


def test_the_expected_recipes_exist():
    assert {"rloo_qwen3_0.6b_gsm8k", "grpo_qwen3_4b", "ppo_qwen35_9b", "cispo", "gspo", "sapo", "m2po",
            "rloo_vs_grpo_cpu", "rloo_smollm2_gsm8k_cpu"} <= set(RECIPES)
    for name in RECIPES:
        assert (conf_dir() / "experiment" / f"{name}.yaml").read_text().startswith("# @package _global_")


# Recipes that train with Megatron (cluster=8xgpu): they validate where megatron-core is installed.
NEEDS_MEGATRON = {"cispo", "gspo", "m2po", "sapo", "grpo_qwen3_4b", "ppo_qwen35_9b"}


def compose_recipe(name: str, *more: str):
    """The recipe's config; for a Megatron recipe the same with train.backend=torch (its values, not its cluster)."""
    torch_only = ["train.backend=torch", "cluster=1xgpu"] if name in NEEDS_MEGATRON else []
    return load_config([f"+experiment={name}", *more, *torch_only])


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_validates_or_is_rejected_for_its_backend(name, monkeypatch):
    if name in NEEDS_MEGATRON:
        assert load_config([f"+experiment={name}"]).train.backend == "megatron"
        from relax.config import megatron_rules  # without megatron-core: one message, how to install it

        monkeypatch.setattr(megatron_rules, "megatron_installed", lambda: False)
        with pytest.raises(ConfigError, match=r"needs megatron-core, which is not installed: pip install"):
            load_config([f"+experiment={name}"])
        return
    cfg = load_config([f"+experiment={name}"])
    assert cfg.tracking.experiment  # each recipe records into its own MLflow experiment


def test_recipe_values_from_the_seed_document():
    m2po = compose_recipe("m2po").algorithm
    assert (m2po.name, m2po.kl2_budget, m2po.miniclip_low, m2po.miniclip_high, m2po.use_tis) == \
        ("m2po", 0.01, 0.2, 0.28, True)
    cispo = compose_recipe("cispo").algorithm
    assert (cispo.use_kl_loss, cispo.kl_loss_coef, cispo.eps_clip, cispo.eps_clip_high, cispo.use_tis) == \
        (True, 0.001, 0.2, 10.0, True)
    ppo = compose_recipe("ppo_qwen35_9b")
    assert ppo.algorithm.name == "ppo" and ppo.model.name == "Qwen3.5-9B"
    # the control arm of a recipe: same recipe, another algorithm, same seed
    rloo, grpo = (load_config(["+experiment=rloo_qwen3_0.6b_gsm8k", f"algorithm={a}"]) for a in ("rloo", "grpo"))
    assert (rloo.algorithm.name, grpo.algorithm.name) == ("rloo", "grpo") and rloo.seed == grpo.seed
    # the GSM8K recipe on a CPU (SmolLM2-135M): the same data, RLOO's invariant at the sizes of a CPU
    for a in ("rloo", "grpo"):
        cpu = load_config(["+experiment=rloo_smollm2_gsm8k_cpu", f"algorithm={a}"])
        assert (cpu.algorithm.name, cpu.seed, cpu.data.task, cpu.model.name, cpu.cluster.gpus_per_node) == \
            (a, rloo.seed, "gsm8k", "SmolLM2-135M-Instruct", 0)
        assert cpu.rollout.rollout_batch_size * cpu.rollout.n_samples_per_prompt == cpu.train.global_batch_size
        assert cpu.train.eval_interval > 0 and cpu.data.num_eval_prompts > 0


def test_rloo_recipe_batch_sizes_come_from_the_environment(monkeypatch):
    cfg = load_config(["+experiment=rloo_qwen3_0.6b_gsm8k"])
    assert (cfg.rollout.rollout_batch_size, cfg.rollout.n_samples_per_prompt, cfg.train.global_batch_size,
            cfg.train.num_rollout) == (4, 8, 32, 60)
    for k, v in {"ROLLOUT_BATCH_SIZE": "2", "N_SAMPLES": "4", "GLOBAL_BATCH_SIZE": "8", "NUM_ROLLOUT": "5"}.items():
        monkeypatch.setenv(k, v)
    cfg = load_config(["+experiment=rloo_qwen3_0.6b_gsm8k"])
    values = (cfg.rollout.rollout_batch_size, cfg.rollout.n_samples_per_prompt, cfg.train.global_batch_size,
              cfg.train.num_rollout)
    assert values == (2, 4, 8, 5) and all(type(v) is int for v in values)
    monkeypatch.setenv("GLOBAL_BATCH_SIZE", "16")  # breaks RLOO's invariant: rejected
    with pytest.raises(Exception, match="must equal train.global_batch_size"):
        load_config(["+experiment=rloo_qwen3_0.6b_gsm8k"])


def test_recipe_script_maps_env_to_overrides(tmp_path):
    env = {"ADVANTAGE_ESTIMATOR": "grpo", "EXP_DIR": str(tmp_path / "exp"), "PATH": str(Path(sys.executable).parent)
           + ":/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(SCRIPTS / "rloo_qwen3_0.6b_gsm8k.sh"), "dry_run=true"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert "algorithm=grpo" in proc.stderr and f"tracking.uri=sqlite:///{tmp_path}/exp/mlflow.db" in proc.stderr
    assert "algorithm  grpo" in proc.stdout  # the config the overrides made, printed by the dry run
    # without $MODEL_DIR (no Qwen3-0.6B here) the dry run stops where the start would, before Ray
    assert proc.returncode == 2 and "$MODEL_DIR is not set" in proc.stderr, proc.stderr


SWEEP_SCRIPTS = ("rloo_vs_grpo_cpu", "m2po_staleness_cpu", "rloo_smollm2_gsm8k_cpu")
# what a stand-in relax-train prints for a sweep that ran (the sweep launcher's first line and its final table), so
# that the sweep scripts compare it
SWEEP_RAN = ('echo "Sweep 20260101-000000-abcdef: 1 jobs"; echo "Sweep 20260101-000000-abcdef: 1 of 1 jobs finished"; '
             'echo "0  seed=1  FINISHED  1 s  0123456789abcdef0123456789abcdef  0.5"\n')


@pytest.mark.parametrize("script", SWEEP_SCRIPTS)
@pytest.mark.parametrize("exp_dir", [True, False])
def test_a_sweep_scripts_comparison_is_written_under_exp_dir(tmp_path, script, exp_dir):
    """The sweep scripts with EXP_DIR: relax-compare runs in EXP_DIR (its compare/<sweep id or time>/ is relative to
    where it runs, relax.tracking.compare) and reads EXP_DIR's store. relax-train and relax-compare are stand-ins on
    PATH that record where they ran and their arguments. Control: without EXP_DIR, both run in the current directory
    with its mlflow.db, as before. Before: relax-compare ran in the current directory whatever EXP_DIR said."""
    bin_dir, work, exp = tmp_path / "bin", tmp_path / "work", tmp_path / "exp"
    bin_dir.mkdir()
    work.mkdir()
    for tool in ("relax-train", "relax-compare"):
        stub = bin_dir / tool
        stub.write_text(f'#!/bin/sh\necho "{tool} $(pwd) $*" >> "{tmp_path}/calls"\n' + SWEEP_RAN)
        stub.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    if exp_dir:
        env["EXP_DIR"] = str(exp)
    proc = subprocess.run(["bash", str(SCRIPTS / f"{script}.sh")], env=env, cwd=work, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    compare = [c for c in calls if c.startswith("relax-compare ")]
    trains = [c for c in calls if c.startswith("relax-train ")]
    assert len(compare) == 1 and trains, calls
    if exp_dir:
        assert compare[0].startswith(f"relax-compare {exp} --uri sqlite:///{exp}/mlflow.db "), compare
        assert all(f"tracking.uri=sqlite:///{exp}/mlflow.db" in t for t in trains), trains
    else:
        assert compare[0].startswith(f"relax-compare {work} --uri sqlite:///mlflow.db "), compare


def recorded_trains(tmp_path: Path, script: str, shown: str, argument: str,
                    env: dict[str, str]) -> dict[str | None, tuple[Path, list[list[str]]]]:
    """`bash <script>.sh <argument>` from tmp_path/work, with EXP_DIR=exp and without (None), relax-train and
    relax-compare stand-ins on PATH: EXP_DIR -> (the starting directory, each relax-train call's lines: the shell
    words `shown` (e.g. '"$(pwd)" "$MODEL_DIR"'), then its arguments)."""
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    bin_dir.mkdir()
    work.mkdir()
    for tool in ("relax-train", "relax-compare"):
        stub = bin_dir / tool
        stub.write_text(f'#!/bin/sh\nprintf "%s\\n" {shown} "$@" > "{tmp_path}/{tool}.$$"\n' + SWEEP_RAN)
        stub.chmod(0o755)
    base = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), **env}
    found: dict[str | None, tuple[Path, list[list[str]]]] = {}
    for exp_dir in ("exp", None):
        for old in tmp_path.glob("relax-*.*"):
            old.unlink()
        proc = subprocess.run(["bash", str(SCRIPTS / f"{script}.sh"), argument],
                              env={**base, **({"EXP_DIR": exp_dir} if exp_dir else {})}, cwd=work,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        trains = [p.read_text().splitlines() for p in tmp_path.glob("relax-train.*")]
        assert trains, proc.stderr
        found[exp_dir] = (work, trains)
    return found


@pytest.mark.parametrize("script", ["m2po", *SWEEP_SCRIPTS])
def test_with_exp_dir_the_recipes_checkpoints_go_under_it(tmp_path, script):
    """EXP_DIR set (relative, as a user may give it): relax-train runs in EXP_DIR, so its checkpoints
    (`checkpoints/<experiment>/<run name>`, relax-train's default, relative to where it runs) are under EXP_DIR for
    a single-run recipe and every job of a sweep; the environment's directories are made absolute first (a relative
    MODEL_DIR would name a directory in EXP_DIR); an argument that sets tracking.uri replaces the script's (which
    relax-train would refuse as a key given twice). relax-train is a stand-in on PATH that records where it ran, its
    arguments and MODEL_DIR. Control: without EXP_DIR it runs where the script was started. Before: relax-train
    ran in the current directory whatever EXP_DIR said, the checkpoints in ./checkpoints."""
    from relax.runner.checkpoint import resolve_save_dir

    found = recorded_trains(tmp_path, script, '"$(pwd)" "$MODEL_DIR"', "tracking.uri=sqlite:////srv/m.db",
                            {"MODEL_DIR": "models"})
    for exp_dir, (work, trains) in found.items():
        where = work / exp_dir if exp_dir else work
        for cwd, model_dir, *args in trains:
            assert (cwd, model_dir) == (str(where), str(work / "models") if exp_dir else "models"), (cwd, model_dir)
            assert [a for a in args if a.startswith("tracking.uri=")] == ["tracking.uri=sqlite:////srv/m.db"], args
            assert not any(a.startswith("train.save_dir=") for a in args)
        # where relax-train puts the checkpoints of that recipe, run there
        cfg = load_config([f"+experiment={script}", "tracking.enabled=false"]) if script != "m2po" else None
        if cfg is not None:
            assert resolve_save_dir(cfg, cwd=Path(trains[0][0])).is_relative_to(where / "checkpoints")


@pytest.mark.parametrize("script", ["m2po", *SWEEP_SCRIPTS])
def test_the_callers_override_and_pythonpath_reach_relax_train(tmp_path, script):
    """An argument that sets a key the script sets itself (each sweep script's algorithm axis) replaces the script's:
    relax-train gets the key once, the caller's value (it refuses a key given twice); with EXP_DIR, where relax-train
    runs, PYTHONPATH's relative entries are made absolute against the starting directory, so that a project's
    modules (PYTHONPATH=.) still import. relax-train is a stand-in on PATH that records PYTHONPATH and its arguments.
    RELAX_PROJECT_DIR names the starting directory (the run's project git tags). Control: without EXP_DIR,
    PYTHONPATH is passed on as given. Before: the script's algorithm=... and the caller's both reached relax-train,
    PYTHONPATH=. named EXP_DIR, and the project tags were EXP_DIR's."""
    found = recorded_trains(tmp_path, script, '"$PYTHONPATH" "$RELAX_PROJECT_DIR"', "algorithm=grpo",
                            {"PYTHONPATH": "src:."})
    for exp_dir, (work, trains) in found.items():
        for pythonpath, project_dir, *args in trains:
            assert pythonpath == (f"{work}/src:{work}" if exp_dir else "src:."), pythonpath
            # the project's git state is where the script started (git_info reads it), not EXP_DIR (the sweep scripts
            # name it always, the single-run recipes where they leave that directory)
            assert project_dir == (str(work) if exp_dir or script != "m2po" else ""), project_dir
            assert [a for a in args if a.startswith("algorithm=")] == ["algorithm=grpo"], args


# A stand-in relax-train for the sweep scripts, by FAKE_TRAIN: `nothing` (exit 2, the launcher's invalid config before
# anything starts), `dry` (a passing dry run: no `Sweep` line, exit 0), `interrupted` (the first line, then exit
# 130, as a Ctrl-C), `failed` (one job FAILED, exit 1) and `ok`. Each sweep that starts prints the launcher's first
# line with a new id and ends with its table (hydra_plugins/relax_ray_launcher/sweep.py format_table); it appends
# the id to `ids` and its jobs' run ids to `runs`, and its arguments to `trains`.
FAKE_TRAIN = r'''#!/bin/sh
T=$(dirname "$0")/..
n=$(( $(cat "$T/count" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$T/count"
echo "$*" >> "$T/trains"
case "$FAKE_TRAIN" in
  nothing) echo "relax-train: error: invalid config in 4 of 4 sweep jobs (nothing started)" >&2; exit 2 ;;
  dry) echo "Dry run of 4 jobs: all valid (nothing started)"; exit 0 ;;
esac
id=20261207-17000$n-5eed0$n
run1=$(printf 'a%031d' "$n"); run2=$(printf 'b%031d' "$n")
echo "$id" >> "$T/ids"
echo "Sweep $id: 2 jobs, MLflow parent run $(printf 'c%031d' "$n")"
if [ "$FAKE_TRAIN" = interrupted ]; then echo "KeyboardInterrupt" >&2; exit 130; fi
echo "(a job's output) Sweep 20200101-000000-0ld0ld: 9 jobs"
status=FINISHED; [ "$FAKE_TRAIN" = failed ] && status=FAILED
echo "Sweep $id: 1 of 2 jobs finished (MLflow parent run $(printf 'c%031d' "$n"))"
echo "#  overrides (those that differ)  status    time  mlflow run                        final reward"
echo "-  -----------------------------  --------  ----  --------------------------------  ------------"
echo "0  algorithm=rloo seed=1          FINISHED  3 s   $run1  0.5000"
echo "1  algorithm=grpo seed=1          $status  2 s   $run2"
printf '%s\n%s\n' "$run1" "$run2" >> "$T/runs"
[ "$FAKE_TRAIN" = failed ] && exit 1
exit 0
'''
OLD_SWEEP = "20261206-090000-01d5ee"  # the store's earlier sweep: what relax-compare reads without --sweep


@pytest.mark.parametrize("script", SWEEP_SCRIPTS)
@pytest.mark.parametrize(("mode", "argument", "rc", "compared"), [
    ("nothing", "train.lrr=1", 2, False),
    ("dry", "dry_run=true", 0, False),
    ("interrupted", "train.num_rollout=2", 130, False),
    ("failed", "train.num_rollout=2", 1, True),
    ("ok", "train.num_rollout=2", 0, True),
    ("ok", "tracking.uri=sqlite:///other.db", 0, True),
])
def test_a_sweep_script_compares_the_sweep_it_ran(tmp_path, script, mode, argument, rc, compared):
    """The sweep scripts keep relax-train's exit code and compare exactly the sweep(s) they just ran, in the store the
    sweep wrote to. relax-train is a stand-in on PATH (FAKE_TRAIN) that records the ids and run ids it printed;
    relax-compare one that records its arguments; the store holds an older sweep (OLD_SWEEP), the one relax-compare
    reads when no sweep is selected (relax/tracking/compare.py select_runs). Nothing started (2), interrupted (130):
    that exit code, no comparison (m2po_staleness_cpu: no second sweep); a dry run: its output, exit 0, no
    comparison; some job failed (1): what finished is compared, exit 1. The comparison names the sweep relax-train
    printed (m2po_staleness_cpu: the run ids of both its sweeps' tables), never the older one, and reads the store
    of a caller's tracking.uri. Before: `|| true` and a comparison without --sweep: exit 0 after comparing the older
    sweep, and the script's store whatever tracking.uri said."""
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    bin_dir.mkdir()
    work.mkdir()
    (work / "mlflow.db").write_text(OLD_SWEEP)  # not read by the stand-in: the store an older sweep ran into
    (bin_dir / "relax-train").write_text(FAKE_TRAIN)
    (bin_dir / "relax-compare").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{tmp_path}/compare.$$"\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "FAKE_TRAIN": mode}
    proc = subprocess.run(["bash", str(SCRIPTS / f"{script}.sh"), argument], env=env, cwd=work,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == rc, (proc.stdout, proc.stderr)
    trains = (tmp_path / "trains").read_text().splitlines()
    two = script == "m2po_staleness_cpu" and mode not in ("nothing", "interrupted")
    assert len(trains) == (2 if two else 1), trains
    calls = [p.read_text().splitlines() for p in tmp_path.glob("compare.*")]
    if mode == "dry":
        assert "Dry run of 4 jobs: all valid (nothing started)" in proc.stdout
    if not compared:
        assert calls == [], calls
        return
    assert len(calls) == 1, calls
    args = calls[0]
    ids = (tmp_path / "ids").read_text().split()
    runs = (tmp_path / "runs").read_text().split()
    assert OLD_SWEEP not in args and "20200101-000000-0ld0ld" not in args, args
    assert args[:2] == ["--uri", "sqlite:///other.db" if argument.startswith("tracking.uri=") else
                        "sqlite:///mlflow.db"], args
    if script == "m2po_staleness_cpu":
        assert "--sweep" not in args and "--experiment" not in args, args
        assert args[args.index("--run-ids") + 1:args.index("--control")] == runs and len(runs) == 4, args
    else:
        assert args[args.index("--sweep") + 1] == ids[0] and len(ids) == 1, (args, ids)
