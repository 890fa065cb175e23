"""relax-compare's statistics against hand-computed values, on an MLflow store built here."""

import csv
import math
import re
import time

import pytest

from relax.cli.compare import main as compare_main
from relax.tracking.compare import (
    CompareError,
    bootstrap_ci,
    compare,
    final_value,
    mean_std,
    paired_interval,
    render,
    t_interval,
    t_quantile,
    t_two_sided_probability,
)

# its tests share the module-scoped store (MLflow's schema migrations take seconds): one xdist worker runs them
pytestmark = pytest.mark.xdist_group("compare")

# arm -> seed -> history of rollout/raw_reward over steps 0..4; with last_k=2 the final is the mean of steps 3, 4
HISTORIES = {
    "A": {"1": [0, 0, 0, 1, 3], "2": [0, 0, 0, 2, 4], "3": [0, 0, 0, 4, 4]},  # finals 2, 3, 4
    "B": {"1": [0, 0, 0, 3, 5], "2": [0, 0, 0, 4, 6], "3": [0, 0, 0, 7, 7]},  # finals 4, 5, 7
    "C": {"1": [1, 1, 1, 1, 1], "4": [2, 2, 2, 2, 2]},  # seed 4 has no control pair
    "D": {"2": [0, 0, 0, 0, 1]},  # a single seed
}


def _metrics(points: dict[str, list[tuple[int, float]]]) -> list:
    """MLflow metric entities of `points` (metric -> [(step, value)]), written with one log_batch per run: a
    log_metric call per point is a store transaction of its own; what is stored (key, step, value) is the same."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    return [Metric(key, value, now, step) for key, series in points.items() for step, value in series]


@pytest.fixture(scope="module")
def store(tmp_path_factory, mlflow_template):
    import shutil

    from mlflow import MlflowClient

    tmp = tmp_path_factory.mktemp("store")
    shutil.copyfile(mlflow_template, tmp / "mlflow.db")  # an empty migrated store (migrations take seconds)
    uri = f"sqlite:///{tmp}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("cmp", artifact_location=str(tmp / "artifacts"))
    t0 = int(time.time() * 1000) - 100_000
    old = client.create_run(exp, tags={"sweep_id": "S0"}, start_time=t0)  # an older sweep
    client.set_terminated(old.info.run_id, "FINISHED")
    parent = client.create_run(exp, tags={"sweep_id": "S1"}, start_time=t0 + 1000)
    pid = parent.info.run_id
    for i, (arm, seeds) in enumerate(HISTORIES.items()):
        for seed, values in seeds.items():
            run = client.create_run(exp, start_time=t0 + 2000 + i, tags={
                "mlflow.parentRunId": pid, "sweep_id": "S1", "arm": arm, "seed": seed, "algorithm": arm.lower()})
            points = {"rollout/raw_reward": list(enumerate(values))}
            if arm == "A":
                points["eval/digits/pass_at_1"] = [(4, 0.5)]
            client.log_batch(run.info.run_id, metrics=_metrics(points))
            client.set_terminated(run.info.run_id, "FINISHED")
    failed = client.create_run(exp, start_time=t0 + 3000, tags={
        "mlflow.parentRunId": pid, "sweep_id": "S1", "arm": "B", "seed": "9"})
    client.log_metric(failed.info.run_id, "rollout/raw_reward", 100.0, step=0)
    client.set_terminated(failed.info.run_id, "FAILED")
    client.set_terminated(pid, "FINISHED")
    return tmp, uri, pid


def test_statistics_helpers():
    assert final_value([(0, 0.0), (1, 1.0), (2, 3.0)], 2) == 2.0
    assert final_value([(2, 3.0), (0, 0.0), (1, 1.0)], 10) == pytest.approx(4 / 3)  # fewer steps than K
    assert math.isnan(final_value([], 3))
    assert mean_std([2.0, 3.0, 4.0]) == (3.0, 1.0)
    m, s = mean_std([1.0])
    assert m == 1.0 and math.isnan(s)
    lo, hi = bootstrap_ci([2.0, 2.0, 3.0], n_boot=5000, seed=3)
    assert 2.0 <= lo <= 7 / 3 <= hi <= 3.0
    assert bootstrap_ci([2.0, 2.0, 3.0], n_boot=5000, seed=3) == (lo, hi)  # reproducible


# Two-sided critical values t_{1-alpha/2, dof} from printed tables (e.g. NIST/SEMATECH e-Handbook 1.3.6.7.2).
T_TABLE_95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 10: 2.228, 30: 2.042}
T_TABLE_99 = {1: 63.657, 2: 9.925, 3: 5.841, 10: 3.169}


def test_t_quantile_against_tables_and_closed_forms():
    for dof, t in T_TABLE_95.items():
        assert t_quantile(0.95, dof) == pytest.approx(t, abs=6e-4), dof
    for dof, t in T_TABLE_99.items():
        assert t_quantile(0.99, dof) == pytest.approx(t, abs=6e-4), dof
    # closed forms: dof 1 is the Cauchy distribution, t = tan(pi (p - 1/2)); dof 2: t = (2p - 1) / sqrt(2 p (1 - p))
    p = 0.975
    assert t_quantile(0.95, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)
    assert t_quantile(0.95, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-9)
    assert t_quantile(0.95, 1000) == pytest.approx(1.962, abs=1e-3)  # tends to the normal's 1.960


def _t_density_integral(t: float, dof: int, n: int = 20_000) -> float:
    """P(|T| <= t) by Simpson's rule on the t density (Gamma functions), independent of the A&S sums."""
    c = math.exp(math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2)) / math.sqrt(dof * math.pi)
    h = t / n
    f = [c * (1 + (i * h) ** 2 / dof) ** (-(dof + 1) / 2) for i in range(n + 1)]
    return 2 * h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))


@pytest.mark.parametrize("dof", [1, 2, 3, 4, 5, 8])
def test_t_probability_against_numerical_integration(dof):
    for t in (0.3, 1.0, 2.5, 6.0):
        assert t_two_sided_probability(t, dof) == pytest.approx(_t_density_integral(t, dof), abs=1e-9)
    assert t_two_sided_probability(0.0, dof) == 0.0


def test_paired_interval_by_number_of_pairs():
    # n = 3, hand computation: mean 7/3, sd = sqrt(((−1/3)^2 * 2 + (2/3)^2) / 2) = sqrt(1/3), se = sd / sqrt(3) = 1/3
    lo, hi, how = paired_interval([2.0, 2.0, 3.0])
    assert how == "t, 2 dof"
    assert (lo, hi) == pytest.approx((7 / 3 - 4.302653 / 3, 7 / 3 + 4.302653 / 3), abs=1e-6)
    assert t_interval([2.0, 2.0, 3.0]) == (lo, hi)
    # n = 2: differences 1 and 3, mean 2, sd sqrt(2), se 1: 2 +- 12.706
    lo, hi, how = paired_interval([1.0, 3.0])
    assert how == "t, 1 dof" and (lo, hi) == pytest.approx((2 - 12.7062, 2 + 12.7062), abs=1e-4)
    # n = 1: no interval
    lo, hi, how = paired_interval([0.5])
    assert how == "n too small" and math.isnan(lo) and math.isnan(hi)
    # n >= 5: the percentile bootstrap, as bootstrap_ci computes it
    five = [0.1, 0.4, -0.2, 0.3, 0.25]
    lo, hi, how = paired_interval(five, n_boot=3000, seed=5)
    assert how == "bootstrap" and (lo, hi) == bootstrap_ci(five, n_boot=3000, seed=5)
    assert min(five) <= lo < sum(five) / 5 < hi <= max(five)


def test_compare_against_hand_computed_values(store, tmp_path):
    tmp, uri, pid = store
    r = compare(uri=uri, control="A", last_k=2, n_boot=4000, seed=11, out_dir=tmp_path / "out")
    comp = r.comparison
    assert comp.metrics == ["rollout/raw_reward", "eval/digits/pass_at_1"]  # default: reward, every eval/*
    stats = {(s.metric, s.arm): s for s in comp.stats}
    a, b = stats[("rollout/raw_reward", "A")], stats[("rollout/raw_reward", "B")]
    assert (a.n, a.mean, a.std) == (3, 3.0, 1.0)
    assert b.n == 3 and b.mean == pytest.approx(16 / 3) and b.std == pytest.approx(math.sqrt(7 / 3))
    assert b.seeds == ["1", "2", "3"]  # the FAILED seed-9 run is left out
    diffs = {(d.metric, d.arm): d for d in comp.diffs}
    d = diffs[("rollout/raw_reward", "B")]
    assert d.n_pairs == 3 and d.mean == pytest.approx(7 / 3)  # (4-2) + (5-3) + (7-4) over 3
    # 3 pairs (< 5): Student t with 2 dof on the differences 2, 2, 3 (hand computation in the test above)
    assert d.ci_method == "t, 2 dof"
    assert (d.ci_low, d.ci_high) == pytest.approx((7 / 3 - 4.302653 / 3, 7 / 3 + 4.302653 / 3), abs=1e-6)
    c = diffs[("rollout/raw_reward", "C")]
    assert c.n_pairs == 1 and c.mean == pytest.approx(1 - 2) and c.ci_method == "n too small"
    assert math.isnan(c.ci_low) and math.isnan(c.ci_high)
    notes = "\n".join(comp.notes)
    assert "is FAILED: left out" in notes
    assert "arm D has a single seed" in notes
    assert "arms C and A have different seed sets (4 only in C; 2, 3 only in A)" in notes
    assert "eval/digits/pass_at_1: arm B has no values for seed(s) 1, 2, 3" in notes
    assert "rollout/raw_reward: C vs A has one pair: n too small for an interval" in notes
    # the outputs, also logged on the sweep's parent run
    assert r.csv_path.is_file() and r.png_path.stat().st_size > 1000
    rows = list(csv.DictReader(open(r.csv_path)))
    row = next(x for x in rows if x["metric"] == "rollout/raw_reward" and x["arm"] == "B")
    assert float(row["mean"]) == pytest.approx(16 / 3, rel=1e-5) and float(row["diff_mean"]) == pytest.approx(7 / 3,
                                                                                                             rel=1e-5)
    assert row["diff_ci_method"] == "t, 2 dof" and float(row["diff_ci_low"]) == pytest.approx(0.899116, rel=1e-5)
    row = next(x for x in rows if x["metric"] == "rollout/raw_reward" and x["arm"] == "C")
    assert (row["n_pairs"], row["diff_ci_low"], row["diff_ci_high"], row["diff_ci_method"]) == ("1", "", "",
                                                                                               "n too small")
    assert r.logged_to == pid
    from mlflow import MlflowClient

    names = {f.path for f in MlflowClient(tracking_uri=uri).list_artifacts(pid, "compare")}
    assert names == {"compare/compare.csv", "compare/compare.png"}


def test_cli_prints_tables_and_notes(store, tmp_path, capsys):
    tmp, uri, pid = store
    compare_main(["--uri", uri, "--sweep", "S1", "--control", "A", "--last-k", "2", "--bootstrap", "500",
                  "--metrics", "rollout/raw_reward", "eval/digits/pass_at_1", "--out", str(tmp_path), "--no-log"])
    out = capsys.readouterr().out
    assert "A (control)  3        3.0000  1.0000  1,2,3" in out
    assert "note: eval/digits/pass_at_1: arm B has no values for seed(s) 1, 2, 3" in out  # in some runs: a note
    assert "arm  n pairs  diff     ci low   ci high  interval     seeds" in out
    # 7/3 -+ 4.302653/3 = 0.8991, 3.7676 (t, 2 dof); C has one pair: no interval
    assert re.search(r"^  B\s+3\s+\+2\.3333\s+\+0\.8991\s+\+3\.7676\s+t, 2 dof\s+1,2,3$", out, re.M), out
    assert re.search(r"^  C\s+1\s+-1\.0000\s+-\s+-\s+n too small\s+1$", out, re.M), out
    assert "Student t with n-1 dof below 5 pairs" in out
    assert "  verdict for B: CI above 0: B higher than A\n  verdict for C: no interval (one pair): no conclusion" in out
    with pytest.raises(SystemExit) as exc:
        compare_main(["--uri", uri, "--eval-last-k", "0"])
    assert exc.value.code == 2 and "--eval-last-k must be >= 1" in capsys.readouterr().err


def test_selection_errors_are_messages(store, tmp_path, capsys):
    tmp, uri, _ = store
    with pytest.raises(CompareError, match="control arm 'Z'"):
        compare(uri=uri, control="Z", out_dir=tmp_path, log=False)
    with pytest.raises(CompareError, match="no runs match"):
        compare(uri=uri, tags={"arm": "nope"}, out_dir=tmp_path, log=False)
    with pytest.raises(SystemExit) as exc:
        compare_main(["--uri", f"sqlite:///{tmp_path}/none.db"])
    assert exc.value.code == 2 and "no tracking store" in capsys.readouterr().err


def test_group_by_a_param_or_tag(store, tmp_path):
    _, uri, _ = store
    r = compare(uri=uri, by="algorithm", last_k=2, out_dir=tmp_path, log=False, metrics=["rollout/raw_reward"])
    assert r.comparison.arms == ["a", "b", "c", "d"]


def test_the_control_arm_may_be_named_as_it_was_launched():
    """A sweep over `rollout.routing_replay=true,false` tags its arms with Hydra's parsed values (`...=False`): the
    control typed as launched names that arm; a value that differs otherwise names none."""
    from relax.tracking.compare import resolve_control

    arms = ["data.blank_images=False,seed_group=a", "data.blank_images=True,seed_group=a", "model.path=None"]
    assert resolve_control("data.blank_images=true,seed_group=a", arms) == "data.blank_images=True,seed_group=a"
    assert resolve_control("data.blank_images=False,seed_group=a", arms) == "data.blank_images=False,seed_group=a"
    assert resolve_control("model.path=null", arms) == "model.path=None"
    assert resolve_control("data.blank_images=true,seed_group=b", arms) == "data.blank_images=true,seed_group=b"
    assert resolve_control("algorithm=TRUE", ["algorithm=true", "algorithm=True"]) == "algorithm=TRUE"  # two: neither
    assert resolve_control(None, arms) is None


def test_a_metric_no_selected_run_has_is_an_error_and_earlier_outputs_stay(store, tmp_path, capsys):
    """A misspelled --metrics name exits 2 naming it, the close names and the metrics the runs have; neither the
    local CSV nor the parent run's compare/ artifacts of an earlier comparison are replaced by an empty one."""
    from mlflow import MlflowClient

    _, uri, pid = store
    client = MlflowClient(tracking_uri=uri)
    out = tmp_path / "out"
    compare_main(["--uri", uri, "--sweep", "S1", "--last-k", "2", "--out", str(out)])  # the earlier comparison
    capsys.readouterr()
    before = (out / "compare.csv").read_text()
    (tmp_path / "dl1").mkdir()
    (tmp_path / "dl2").mkdir()
    logged = client.download_artifacts(pid, "compare/compare.csv", str(tmp_path / "dl1"))
    assert "rollout/raw_reward,B" in open(logged).read()
    with pytest.raises(SystemExit) as exc:
        compare_main(["--uri", uri, "--sweep", "S1", "--metrics", "rollout/raw_rewrad", "--out", str(out)])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "metric 'rollout/raw_rewrad' is in none of the 9 selected runs (did you mean rollout/raw_reward?)" in err
    assert "metrics they have: eval/digits/pass_at_1, rollout/raw_reward" in err
    assert (out / "compare.csv").read_text() == before
    logged = client.download_artifacts(pid, "compare/compare.csv", str(tmp_path / "dl2"))
    assert open(logged).read() == open(tmp_path / "dl1" / "compare.csv").read()
    # the control: the same command with the metric spelled right compares
    r = compare(uri=uri, sweep="S1", metrics=["rollout/raw_reward"], last_k=2, out_dir=out, log=False)
    assert {s.arm for s in r.comparison.stats} == {"A", "B", "C", "D"}


def test_a_by_key_no_selected_run_has_is_an_error(store, tmp_path):
    """--by with a key no run has would put every run into one arm `(none)` and keep one run per seed: refused,
    naming the key, the closest one and the keys the runs have. A key some runs lack still groups (a note)."""
    _, uri, _ = store
    with pytest.raises(CompareError) as exc:
        compare(uri=uri, sweep="S1", by="algoritm", out_dir=tmp_path, log=False)
    text = str(exc.value)
    assert "--by algoritm: none of the 9 selected runs has a tag or param 'algoritm'" in text
    assert "(did you mean algorithm?)" in text and "tags they have: algorithm, arm, seed, sweep_id" in text
    with pytest.raises(CompareError, match="'nosuchkey'"):
        compare(uri=uri, sweep="S1", by="nosuchkey", out_dir=tmp_path, log=False)
    r = compare(uri=uri, sweep="S1", by="algorithm", last_k=2, out_dir=tmp_path, log=False)  # the control
    assert r.comparison.arms == ["a", "b", "c", "d"]


def test_runs_that_logged_evaluations_a_step_early_are_named(tmp_path, fresh_store):
    """A run made before relax.eval_step logged the evaluation after 0-based step s at s; compared with runs that log
    it at s + 1, a note names it (the values are compared as logged); runs of one convention get no note."""
    from mlflow import MlflowClient

    from relax.metrics import EVAL_STEP_TAG, EVAL_STEP_WEIGHTS
    from relax.tracking.compare import load_runs

    fresh_store(tmp_path)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.create_experiment("steps", artifact_location=str(tmp_path / "artifacts"))

    def made(seed: str, tag: str | None, eval_step: int):
        run = client.create_run(exp, tags={"arm": "a", "seed": seed, **({EVAL_STEP_TAG: tag} if tag else {})})
        client.log_metric(run.info.run_id, "rollout/raw_reward", 0.5, step=0)
        client.log_metric(run.info.run_id, "eval/digits/pass_at_1", 0.25, step=eval_step)
        client.set_terminated(run.info.run_id, "FINISHED")
        return client.get_run(run.info.run_id)

    new, older = made("1", EVAL_STEP_WEIGHTS, 1), made("2", None, 0)
    _, _, notes = load_runs(client, [new, older])
    (note,) = [n for n in notes if EVAL_STEP_TAG in n]
    assert older.info.run_id in note and new.info.run_id not in note and "sit one step early" in note
    assert f"{EVAL_STEP_TAG}: none" in note
    # the controls: runs of one convention, or no eval/* metric compared
    assert not [n for n in load_runs(client, [new, made("3", EVAL_STEP_WEIGHTS, 1)])[2] if EVAL_STEP_TAG in n]
    assert not [n for n in load_runs(client, [new, older], metrics=["rollout/raw_reward"])[2] if EVAL_STEP_TAG in n]


def test_an_unknown_run_id_is_an_error_naming_it(store, tmp_path, capsys):
    """--run-ids with an id the store does not hold exits 2 naming it (no MLflow traceback); known ids compare."""
    from mlflow import MlflowClient

    _, uri, _ = store
    with pytest.raises(SystemExit) as exc:
        compare_main(["--uri", uri, "--run-ids", "deadbeef", "--no-log", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.startswith(f"relax-compare: error: no run deadbeef in {uri} (an MLflow run id has 32 hex characters; "
                          "deadbeef has 8)"), err
    assert "Traceback" not in err and "MlflowException" not in err
    client = MlflowClient(tracking_uri=uri)
    known = [r.info.run_id for r in client.search_runs([client.get_experiment_by_name("cmp").experiment_id],
                                                        filter_string="tags.arm = 'A'")]
    with pytest.raises(CompareError, match=f"^no run {'f' * 32} in "):  # among known ids: the unknown one is named
        compare(uri=uri, run_ids=[*known, "f" * 32], out_dir=tmp_path, log=False)
    r = compare(uri=uri, run_ids=known, last_k=2, out_dir=tmp_path, log=False, metrics=["rollout/raw_reward"])
    assert r.comparison.stats[0].mean == 3.0  # the control: arm A's finals 2, 3, 4
    assert r.text.startswith(f"relax-compare: 3 runs of runs {', '.join(known)}, grouped by arm ({uri})"), r.text
    one = compare(uri=uri, run_ids=known[:1], out_dir=tmp_path, log=False, metrics=["rollout/raw_reward"])
    assert one.text.startswith(f"relax-compare: 1 run of run {known[0]}, grouped by arm ({uri})"), one.text


def _runs_store(tmp_path, fresh_store, runs):
    """A store with one experiment 'e' holding `runs`: (tags, params, {metric: [(step, value)]}, status), started
    1 s apart in that order; returns its URI and the run ids."""
    from mlflow import MlflowClient
    from mlflow.entities import Param

    fresh_store(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("e", artifact_location=str(tmp_path / "artifacts"))
    t0 = int(time.time() * 1000) - 100_000
    ids = []
    for i, (tags, params, metrics, status) in enumerate(runs):
        run = client.create_run(exp, tags=tags, start_time=t0 + 1000 * i)
        # one write for all of them (a run's own logs its params so too)
        client.log_batch(run.info.run_id, metrics=_metrics(metrics), params=[Param(k, v) for k, v in params.items()])
        client.set_terminated(run.info.run_id, status)
        ids.append(run.info.run_id)
    return uri, ids


R, E = "rollout/raw_reward", "eval/digits/mean_at_1"


def test_one_run_per_seed_for_every_metric_and_config_differences(tmp_path, fresh_store):
    """Two finished runs of arm a, seed 1: every metric of seed 1 comes from the newer one, even one it lacks (the
    older run's reward is not used, and the note that seed 1 has no reward agrees with the table); a newer KILLED run
    kept by --include-unfinished does not replace a finished one. Runs of one arm that differ in config beyond the
    seed get a note; the params that differ between arms are listed, the seed and tracking.* are not."""
    base = {"algorithm.name": "grpo", "train.num_rollout": "4", "seed": "1", "tracking.run_name": "x"}
    uri, ids = _runs_store(tmp_path, fresh_store, [
        ({"arm": "a", "seed": "1"}, base, {R: [(0, 0.1), (1, 0.4)], E: [(2, 0.3)]}, "FINISHED"),  # older seed 1
        ({"arm": "a", "seed": "2"}, {**base, "seed": "2", "train.num_rollout": "6", "tracking.run_name": "y"},
         {R: [(0, 0.2), (1, 0.6)], E: [(2, 0.5)]}, "FINISHED"),
        ({"arm": "a", "seed": "1"}, base, {E: [(2, 0.9)]}, "FINISHED"),  # newer seed 1: no reward logged
        ({"arm": "b", "seed": "1"}, {**base, "algorithm.name": "rloo"}, {R: [(1, 0.5)], E: [(2, 0.4)]}, "FINISHED"),
        ({"arm": "a", "seed": "2"}, {**base, "seed": "2"}, {R: [(1, 9.0)], E: [(2, 9.0)]}, "KILLED"),  # newest
    ])
    comp = compare(uri=uri, experiment="e", last_k=1, out_dir=tmp_path / "out", log=False,
                   include_unfinished=True).comparison
    stats = {(s.metric, s.arm): s for s in comp.stats}
    assert stats[(R, "a")].finals == {"2": 0.6}  # not seed 1's older 0.4, not the KILLED run's 9.0
    assert stats[(E, "a")].finals == {"1": 0.9, "2": 0.5}
    assert {r.run_id for r in comp.runs} == {ids[1], ids[2], ids[3]}  # the curves too
    notes = "\n".join(comp.notes)
    assert "did not finish" not in notes  # the KILLED run kept by the flag is not a chosen one
    assert f"arm a: 2 runs with seed 1: every metric of that seed comes from the most recent finished one, {ids[2]}" \
           in notes and f"left out: {ids[0]} (FINISHED" in notes
    assert f"arm a: 2 runs with seed 2: every metric of that seed comes from the most recent finished one, {ids[1]}" \
           in notes and f"left out: {ids[4]} (KILLED" in notes
    assert f"{R}: arm a has no values for seed(s) 1" in notes
    assert "arm a: its runs differ in config beyond the seed, so its spread over seeds is not seed noise alone: " \
           "train.num_rollout: 4 (a/seed 1), 6 (a/seed 2)" in notes
    assert comp.config_diff == [("algorithm.name", {"a": "grpo", "b": "rloo"}),
                                ("train.num_rollout", {"a": "4 | 6", "b": "4"})]
    text = render(comp)
    assert re.search(r"^config: the arms differ in 2 param\(s\)", text, re.M)
    assert re.search(r"^  algorithm\.name\s+grpo\s+rloo$", text, re.M), text
    rows = list(csv.DictReader(open(tmp_path / "out" / "compare.csv")))
    assert [(x["metric"], x["arm"], x["finals"]) for x in rows if x["arm"] == "a"] == [(R, "a", "2=0.6"),
                                                                                      (E, "a", "1=0.9;2=0.5")]


def test_runs_of_different_configs_in_one_arm_are_refused_naming_the_params_and_the_by(tmp_path, fresh_store,
                                                                                        capsys):
    """review-exp 3: a full fine-tune and a LoRA run both tagged arm grpo, seed 1, are not a run and its rerun (the
    older one was dropped with a note); nor are they two seeds of one arm. Refused, exit 2, before any file is
    written, naming each differing param with its runs and the --by that separates them; --by model.lora_rank then
    compares them. Control: a rerun that differs only in the run name, where it resumes from, its length and its
    eval sets (what a resume may change) is still one seed, the newest used."""
    full = {"algorithm.name": "grpo", "model.lora_rank": "0", "train.lr": "0.001", "train.num_rollout": "2",
            "seed": "1", "tracking.run_name": "None", "data.eval_sets": "{}"}
    lora = {**full, "model.lora_rank": "4", "train.lr": "0.01", "tracking.run_name": "lora"}
    rerun = {**full, "tracking.run_name": "logm", "train.num_rollout": "3", "train.resume": "auto",
             "data.eval_sets.two": "/x/two.jsonl", "train.eval_interval": "2"}
    rerun.pop("data.eval_sets")
    grpo = {"arm": "grpo", "seed": "1"}
    uri, ids = _runs_store(tmp_path, fresh_store, [
        (grpo, full, {R: [(0, 0.1), (1, 0.3)]}, "FINISHED"),
        (grpo, lora, {R: [(0, 0.2), (1, 0.5)]}, "FINISHED"),
        (grpo, rerun, {R: [(0, 0.1), (1, 0.4)]}, "FINISHED"),
    ])
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        compare_main(["--uri", uri, "--run-ids", ids[0], ids[1], "--no-log", "--out", str(out)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    assert err.startswith("relax-compare: error: runs of different configs share an arm"), err
    assert f"arm grpo: 2 runs of 2 different configs: model.lora_rank: 0 [{ids[0]} seed 1], 4 [{ids[1]} seed 1]; " \
           f"train.lr: 0.001 [{ids[0]} seed 1], 0.01 [{ids[1]} seed 1]." in err, err
    assert "; compare them as arms with --by model.lora_rank,train.lr (model.lora_rank alone also tells them apart: " \
           "--by model.lora_rank), or select the runs of one config" in err, err
    assert "tracking.run_name" not in err and not out.exists()
    # the same two as seeds 1 and 2 of the arm: not averaged as seed noise either
    with pytest.raises(CompareError, match=r"arm grpo: 3 runs of 2 different configs: model\.lora_rank: 0 \["):
        compare(uri=uri, experiment="e", out_dir=out, log=False)
    split = compare(uri=uri, run_ids=ids[:2], by="model.lora_rank", last_k=1, out_dir=out, log=False).comparison
    assert {(s.arm, s.mean) for s in split.stats} == {("0", 0.3), ("4", 0.5)}
    same = compare(uri=uri, run_ids=[ids[0], ids[2]], last_k=1, out_dir=out, log=False).comparison
    assert [(s.arm, s.finals) for s in same.stats] == [("grpo", {"1": 0.4})]
    assert any(n.startswith(f"arm grpo: 2 runs with seed 1: every metric of that seed comes from the most recent "
                            f"finished one, {ids[2]}") for n in same.notes), same.notes


def test_by_takes_several_keys_and_the_refusal_names_every_differing_one(tmp_path, fresh_store, capsys):
    """A 2x2 grid (train.lr x model.lora_rank) under one arm label, seeds 1 and 2: no one param tells the four
    configs apart, so the refusal names --by with both; typed (as a comma list, or the option repeated) it makes
    four arms `train.lr=...,model.lora_rank=...` of two seeds each, whose means are the hand-computed ones, and
    --control takes an arm as it is named. Control: --by train.lr alone is still refused (lora_rank differs within
    its arms), naming the --by with both keys."""
    runs, grid = [], (("0.001", "0", 0.1), ("0.001", "4", 0.2), ("0.01", "0", 0.3), ("0.01", "4", 0.4))
    for lr, rank, base in grid:
        for seed in ("1", "2"):
            params = {"algorithm.name": "grpo", "train.lr": lr, "model.lora_rank": rank, "seed": seed}
            runs.append(({"arm": "grpo", "seed": seed}, params, {R: [(0, base + int(seed) / 100)]}, "FINISHED"))
    uri, ids = _runs_store(tmp_path, fresh_store, runs)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        compare_main(["--uri", uri, "--experiment", "e", "--no-log", "--out", str(out)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "arm grpo: 8 runs of 4 different configs" in err, err
    assert "compare them as arms with --by model.lora_rank,train.lr, or select the runs of one config" in err, err
    assert not out.exists()
    with pytest.raises(CompareError, match=r"train\.lr 0\.001: 4 runs of 2 different configs: model\.lora_rank: "
                                           r".*compare them as arms with --by train\.lr,model\.lora_rank, or select"):
        compare(uri=uri, experiment="e", by="train.lr", out_dir=out, log=False)
    expected = {f"train.lr={lr},model.lora_rank={rank}": pytest.approx(base + 0.015)
                for lr, rank, base in grid}
    for argv in (["--by", "train.lr,model.lora_rank"], ["--by", "train.lr", "--by", "model.lora_rank"]):
        compare_main(["--uri", uri, "--experiment", "e", "--no-log", "--out", str(out), "--last-k", "1",
                      "--control", "train.lr=0.001,model.lora_rank=0", *argv])
        text = capsys.readouterr().out
        assert "grouped by train.lr,model.lora_rank" in text and "train.lr=0.001,model.lora_rank=0 (control)" in text
    comp = compare(uri=uri, experiment="e", by=("train.lr", "model.lora_rank"), last_k=1, out_dir=out, log=False,
                   control="train.lr=0.001,model.lora_rank=0").comparison
    assert {s.arm: s.mean for s in comp.stats} == expected and all(s.n == 2 for s in comp.stats)
    assert {d.arm: d.mean for d in comp.diffs} == {"train.lr=0.001,model.lora_rank=4": pytest.approx(0.1),
                                                   "train.lr=0.01,model.lora_rank=0": pytest.approx(0.2),
                                                   "train.lr=0.01,model.lora_rank=4": pytest.approx(0.3)}
    with pytest.raises(SystemExit) as exc:  # a key twice, or an empty one: a usage error before the store is read
        compare_main(["--uri", uri, "--by", "train.lr,,seed"])
    assert exc.value.code == 2 and "--by train.lr,,seed: a key is empty" in capsys.readouterr().err


def test_a_run_lacking_a_by_key_is_grouped_under_none(tmp_path, fresh_store):
    """Runs made outside relax-train's tagging may lack the --by key: with the default --by arm such a run is the arm
    `(none)`, with a note (as docs/experiments.md says); with two keys, a run lacking one is the arm that names it
    `(none)`, apart from the runs of other combinations. Means by hand."""
    params = {"algorithm.name": "grpo", "train.lr": "0.01"}
    runs = [({"arm": "a", "seed": "1"}, {**params, "seed": "1"}, {R: [(0, 0.1)]}, "FINISHED"),
            ({"seed": "1"}, {**params, "seed": "1", "model.lora_rank": "4"}, {R: [(0, 0.3)]}, "FINISHED"),
            ({"arm": "b", "seed": "1"}, {**params, "seed": "1", "model.lora_rank": "4"}, {R: [(0, 0.5)]}, "FINISHED")]
    uri, ids = _runs_store(tmp_path, fresh_store, runs)
    result = compare(uri=uri, experiment="e", last_k=1, out_dir=tmp_path / "one", log=False)
    assert {s.arm: s.mean for s in result.comparison.stats} == {"a": pytest.approx(0.1), "(none)": pytest.approx(0.3),
                                                                 "b": pytest.approx(0.5)}
    assert any(f"run {ids[1]} has no tag or param 'arm': grouped as (none)" in n for n in result.comparison.notes)
    result = compare(uri=uri, experiment="e", by=("arm", "model.lora_rank"), last_k=1, out_dir=tmp_path / "two",
                     log=False)
    assert {s.arm: s.mean for s in result.comparison.stats} == {
        "arm=a,model.lora_rank=(none)": pytest.approx(0.1), "arm=(none),model.lora_rank=4": pytest.approx(0.3),
        "arm=b,model.lora_rank=4": pytest.approx(0.5)}


def test_evaluation_only_runs_are_an_arm_of_their_own(tmp_path, fresh_store):
    """An evaluation-only run (train.num_rollout=0) tagged with a training arm and seed is not that seed's run: next
    to training runs it forms the arm '<arm> (evaluation-only)'; among evaluation-only runs alone, arms are as
    tagged."""
    train, ev = {"train.num_rollout": "4", "model.source": "config"}, {"train.num_rollout": "0", "model.source": "hf"}
    uri, ids = _runs_store(tmp_path, fresh_store, [
        ({"arm": "grpo", "seed": "1"}, train, {R: [(3, 0.4)], E: [(4, 0.5)]}, "FINISHED"),
        ({"arm": "grpo", "seed": "1"}, ev, {E: [(0, 0.7)]}, "FINISHED"),
    ])
    comp = compare(uri=uri, experiment="e", out_dir=tmp_path / "o", log=False).comparison
    assert comp.arms == ["grpo", "grpo (evaluation-only)"]
    stats = {(s.metric, s.arm): s.finals for s in comp.stats}
    assert stats == {(R, "grpo"): {"1": 0.4}, (E, "grpo"): {"1": 0.5}, (E, "grpo (evaluation-only)"): {"1": 0.7}}
    assert any(n.startswith("1 evaluation-only run(s) (train.num_rollout=0) are an arm of their own") and ids[1] in n
               for n in comp.notes)
    assert ("model.source", {"grpo": "config", "grpo (evaluation-only)": "hf"}) in comp.config_diff
    only = compare(uri=uri, run_ids=[ids[1]], out_dir=tmp_path / "o", log=False).comparison  # the control
    assert only.arms == ["grpo"]


def test_evaluation_only_runs_of_each_seeds_export_are_the_seeds_of_one_arm(tmp_path, fresh_store):
    """review-code 2: evaluation-only runs of each seed's export (model.source=hf model.path=<that seed's export>,
    train.num_rollout=0, tagged with the training arm and seed) differ in model.path by design: they are the seeds of
    'grpo (evaluation-only)', with the note naming the paths (866f17c refused them as runs of different configs).
    Controls: training runs that differ in model.path, and evaluation-only runs that differ elsewhere, are still
    refused."""
    train = {"train.num_rollout": "4", "model.source": "config", "model.path": "None", "rollout.max_response_len": "64"}
    runs = [({"arm": "grpo", "seed": s}, {**train, "seed": s}, {R: [(3, 0.4)], E: [(4, 0.5)]}, "FINISHED")
            for s in ("1", "2")]
    for s, value in (("1", 0.7), ("2", 0.6)):
        ev = {**train, "train.num_rollout": "0", "model.source": "hf", "model.path": f"/x/hf-seed{s}", "seed": s}
        runs.append(({"arm": "grpo", "seed": s}, ev, {E: [(0, value)]}, "FINISHED"))
    another_model = {**train, "model.source": "hf", "model.path": "/x/base", "seed": "3"}
    runs.append(({"arm": "grpo", "seed": "3"}, another_model, {R: [(3, 0.2)]}, "FINISHED"))
    longer = {**runs[2][1], "model.path": "/x/hf-seed3", "seed": "3", "rollout.max_response_len": "128"}
    runs.append(({"arm": "grpo", "seed": "3"}, longer, {E: [(0, 0.1)]}, "FINISHED"))
    uri, ids = _runs_store(tmp_path, fresh_store, runs)
    comp = compare(uri=uri, run_ids=ids[:4], out_dir=tmp_path / "o", log=False).comparison
    assert comp.arms == ["grpo", "grpo (evaluation-only)"]
    stats = {(s.metric, s.arm): s.finals for s in comp.stats}
    assert stats[(E, "grpo (evaluation-only)")] == {"1": 0.7, "2": 0.6}
    assert stats[(E, "grpo")] == {"1": 0.5, "2": 0.5}
    assert ("arm grpo (evaluation-only): its runs differ in config beyond the seed, so its spread over seeds is not "
            "seed noise alone: model.path: /x/hf-seed1 (grpo (evaluation-only)/seed 1), /x/hf-seed2 "
            "(grpo (evaluation-only)/seed 2)") in comp.notes, comp.notes
    alone = compare(uri=uri, run_ids=ids[2:4], out_dir=tmp_path / "o", log=False).comparison
    assert alone.arms == ["grpo"] and [s.finals for s in alone.stats] == [{"1": 0.7, "2": 0.6}]
    # training runs of another model under one arm: still different configs
    with pytest.raises(CompareError, match=rf"arm grpo: 2 runs of 2 different configs: model\.path: None "
                                           rf"\[{ids[0]} seed 1\], /x/base \[{ids[4]} seed 3\]; model\.source: "):
        compare(uri=uri, run_ids=[ids[0], ids[4]], out_dir=tmp_path / "o", log=False)
    # evaluation-only runs that differ beyond the weights: still refused, naming only that param
    with pytest.raises(CompareError, match=rf"arm grpo: 2 runs of 2 different configs: rollout\.max_response_len: "
                                           rf"64 \[{ids[2]} seed 1\], 128 \[{ids[5]} seed 3\]\. Runs"):
        compare(uri=uri, run_ids=[ids[2], ids[5]], out_dir=tmp_path / "o", log=False)


def test_by_a_param_never_makes_evaluations_of_different_training_arms_one_arm(tmp_path, fresh_store):
    """`--by train.lr` over a train.lr sweep (arms tagged train.lr=0.01 / 0.001, seeds 1, 2) and the evaluation-only
    runs of each seed's export, tagged with its training arm and seed. Evaluations that reuse the training run's
    config (-cp <checkpoint> -cn config) carry its train.lr: an arm of their own per training arm, never mixed with
    the training runs of that value. Evaluations started from Relax's config carry the default train.lr (1e-06, the
    evaluation's own value: it trains nothing): grouped by it, the evaluations of both training arms' weights would be
    one arm, each seed's newer run kept and the other arm's dropped as a 'rerun' (so it was); they are refused, naming
    the arm tags and the --by that tells them apart, which then gives each training arm's evaluations as seeds of
    an arm. Selected alone, the same."""
    base = {"model.source": "config", "model.path": "None"}
    train, reused, fresh = [], [], []
    for lr, rewards, evals in (("0.01", (0.2, 0.3), (0.7, 0.8)), ("0.001", (0.5, 0.6), (0.1, 0.15))):
        for seed, reward, value in zip(("1", "2"), rewards, evals, strict=True):
            tags, run = {"arm": f"train.lr={lr}", "seed": seed}, {**base, "train.lr": lr, "seed": seed}
            export = {"train.num_rollout": "0", "model.source": "hf", "model.path": f"/x/lr{lr}-s{seed}"}
            train.append((tags, {**run, "train.num_rollout": "4"}, {R: [(3, reward)], E: [(4, reward)]}, "FINISHED"))
            reused.append((tags, {**run, **export}, {E: [(0, value)]}, "FINISHED"))
            fresh.append((tags, {**run, **export, "train.lr": "1e-06"}, {E: [(0, value + 0.01)]}, "FINISHED"))
    uri, ids = _runs_store(tmp_path, fresh_store, train + reused + fresh)
    trained, evaluated, evaluated_fresh = ids[:4], ids[4:8], ids[8:]

    def finals(comp):
        return {(s.metric, s.arm): s.finals for s in comp.stats}

    comp = compare(uri=uri, run_ids=trained + evaluated, by="train.lr", out_dir=tmp_path / "o", log=False).comparison
    assert comp.arms == ["0.001", "0.001 (evaluation-only)", "0.01", "0.01 (evaluation-only)"]
    assert finals(comp)[(E, "0.01")] == {"1": 0.2, "2": 0.3}
    assert finals(comp)[(E, "0.01 (evaluation-only)")] == {"1": 0.7, "2": 0.8}
    assert finals(comp)[(E, "0.001 (evaluation-only)")] == {"1": 0.1, "2": 0.15}

    tags = (rf"arm tag train\.lr=0\.001 \[{evaluated_fresh[2]} seed 1, {evaluated_fresh[3]} seed 2\], "
            rf"train\.lr=0\.01 \[{evaluated_fresh[0]} seed 1, {evaluated_fresh[1]} seed 2\]")
    with pytest.raises(CompareError, match=r"train\.lr 1e-06 \(evaluation-only\): 4 evaluation-only runs of the "
                                           rf"weights of 2 training arms, {tags}\. Runs of one arm .* compare them "
                                           r"as arms with --by train\.lr,arm, or select"):
        compare(uri=uri, run_ids=trained + evaluated_fresh, by="train.lr", out_dir=tmp_path / "o", log=False)
    comp = compare(uri=uri, run_ids=trained + evaluated_fresh, by="train.lr,arm", out_dir=tmp_path / "o",
                   log=False).comparison
    assert finals(comp)[(E, "train.lr=1e-06,arm=train.lr=0.01 (evaluation-only)")] == \
        {"1": pytest.approx(0.71), "2": pytest.approx(0.81)}
    assert finals(comp)[(E, "train.lr=1e-06,arm=train.lr=0.001 (evaluation-only)")] == \
        {"1": pytest.approx(0.11), "2": pytest.approx(0.16)}
    assert finals(comp)[(E, "train.lr=0.01,arm=train.lr=0.01")] == {"1": 0.2, "2": 0.3}
    with pytest.raises(CompareError, match=rf"train\.lr 1e-06: 4 evaluation-only runs of the weights of 2 training "
                                           rf"arms, {tags}\. .* --by train\.lr,arm \(arm alone also tells them "
                                           r"apart: --by arm\)"):
        compare(uri=uri, run_ids=evaluated_fresh, by="train.lr", out_dir=tmp_path / "o", log=False)


def test_eval_final_is_the_last_evaluation_with_verdicts(tmp_path, fresh_store, capsys):
    """An eval/* metric's final value is the last evaluation by default (--eval-last-k K: the mean of the last K), a
    training metric's the mean of the last --last-k values; the header says how many values at which steps. Each
    paired difference gets a verdict; two arms against one control get the multiple-comparisons note."""
    def runs(arm, seed, reward, evals):
        return ({"arm": arm, "seed": seed}, {},
                {R: list(enumerate(reward)), E: list(zip((10, 20, 30), evals, strict=True))}, "FINISHED")

    uri, _ = _runs_store(tmp_path, fresh_store, [
        runs("c", "1", [0.0] * 30, [0.1, 0.2, 0.3]), runs("c", "2", [0.0] * 30, [0.1, 0.2, 0.5]),
        runs("x", "1", [1.0] * 30, [0.1, 0.2, 0.6]), runs("x", "2", [1.0] * 30, [0.1, 0.2, 0.7]),
        runs("y", "1", [0.0] * 29 + [1.0], [0.9, 0.9, 0.1]), runs("y", "2", [0.0] * 29 + [-1.0], [0.9, 0.9, 0.7]),
    ])
    compare_main(["--uri", uri, "--experiment", "e", "--control", "c", "--out", str(tmp_path / "o"), "--no-log"])
    out = capsys.readouterr().out
    assert f"{E}: final value = each run's last evaluation (step 30; --eval-last-k 1); mean and std" in out
    assert f"{R}: final value = mean of each run's last 10 values (steps 21..30 (MLflow steps 20..29); --last-k 10); " \
        "mean and std" in out
    # last evaluations: c 0.3, 0.5 (mean 0.4); x 0.6, 0.7: differences 0.3, 0.2, mean 0.25, sd 0.0707, t(1 dof) CI
    # 0.25 +- 12.706 * 0.05 = [-0.385, 0.885]: contains 0. Rewards: x - c = 1 for both seeds (sd 0): CI [1, 1]
    assert re.search(r"^  x\s+2\s+\+0\.2500\s+-0\.3853\s+\+0\.8853\s+t, 1 dof\s+1,2$", out, re.M), out
    assert "  verdict for x: CI contains 0: no difference shown" in out
    assert "  verdict for x: CI above 0: x higher than c" in out
    assert "  verdict for y: CI contains 0: no difference shown" in out
    assert "note: 2 arms are each compared with the control c: each 95% interval holds on its own" in out
    assert "(a Bonferroni correction would read each at 97.5% instead of 95%)" in out
    # the mean of the last 3 evaluations: c (0.2, 0.2667), x (0.3, 0.3333)
    comp = compare(uri=uri, experiment="e", control="c", eval_last_k=3, out_dir=tmp_path / "o", log=False).comparison
    x = next(s for s in comp.stats if s.metric == E and s.arm == "x")
    assert x.finals == pytest.approx({"1": 0.3, "2": 1 / 3}) and x.tails == {"1": [10, 20, 30], "2": [10, 20, 30]}
    assert "mean of each run's last 3 evaluations (steps 10, 20, 30; --eval-last-k 3)" in render(comp)


def _header_steps(text: str) -> list[int]:
    """`a, b, c` or `a..b` of a header: the numbers it names (a range: every one of them)."""
    if ".." in text:
        first, last = map(int, text.split(".."))
        return list(range(first, last + 1))
    return [int(x) for x in text.split(", ")]


def test_training_steps_are_named_as_the_progress_line_counts_them_then_as_mlflow(tmp_path, fresh_store):
    """relax-compare names a training metric's steps as the progress line does (its MLflow step + 1: `step 3/3` is
    MLflow step 2), then MLflow's numbers (docs/operations.md, "Verifying a run"); an evaluation's step is MLflow's
    (the number of steps trained), as logged; the CSV's final_steps keeps MLflow's numbers. Checked against the
    steps the runs were logged at: the header's numbers are those + 1. Before, the header printed MLflow's steps
    bare (`steps 0, 1, 2`) beside the evaluation's `step 3`."""
    T, L = "rollout/turns_mean", "train/loss"
    logged = {R: [0, 1, 2], T: [0, 2], E: [3]}  # turns_mean at every other step; the evaluation after 3 steps
    ends = {("c", "1"): 2, ("c", "2"): 2, ("x", "1"): 2, ("x", "2"): 4}  # x seed 2's loss runs 2 steps longer

    def run(arm, seed):
        points = {m: [(s, 0.1 * s + (arm == "x")) for s in steps] for m, steps in logged.items()}
        points[L] = [(s, 1.0 - 0.1 * s) for s in range(ends[arm, seed] + 1)]
        return {"arm": arm, "seed": seed}, {}, points, "FINISHED"

    uri, _ = _runs_store(tmp_path, fresh_store, [run(a, s) for a, s in ends])
    result = compare(uri=uri, experiment="e", control="c", metrics=[R, T, E], last_k=10, out_dir=tmp_path / "o",
                     log=False)
    text = render(result.comparison)
    for metric in (R, T):
        header = next(line for line in text.splitlines() if line.startswith(f"{metric}: final value = "))
        m = re.search(r"\(steps ([\d., ]+) \(MLflow steps ([\d., ]+)\)(, all there are)?; --last-k 10\)", header)
        assert m, header
        assert _header_steps(m[2]) == logged[metric], header  # MLflow's numbers, as logged
        assert _header_steps(m[1]) == [s + 1 for s in logged[metric]], header  # the progress line's: + 1
    assert f"{R}: final value = mean of each run's last 3 values (steps 1, 2, 3 (MLflow steps 0..2), all there are; " \
        "--last-k 10)" in text
    assert f"{T}: final value = mean of each run's last 2 values (steps 1, 3 (MLflow steps 0, 2), all there are; " \
        "--last-k 10)" in text
    assert f"{E}: final value = each run's last evaluation (step 3; --eval-last-k 1)" in text  # as logged
    rows = list(csv.DictReader(open(result.csv_path)))
    assert {r["final_steps"] for r in rows if r["metric"] == R} == {"1=0, 1, 2;2=0, 1, 2"}  # MLflow's numbers
    # runs that end at different steps: the header and the note name them so too
    one = render(compare(uri=uri, experiment="e", control="c", metrics=[L], last_k=1, out_dir=tmp_path / "o1",
                         log=False).comparison)
    assert f"{L}: final value = each run's last value (--last-k 1; the runs' last steps differ: 3, 5 (MLflow " \
        "steps 2, 4))" in one
    note = next(line for line in one.splitlines() if "last values are at different steps" in line)
    assert "(step 3 (MLflow step 2): " in note and "; step 5 (MLflow step 4): " in note, note


def test_a_sweep_continued_by_another_and_a_control_named_by_its_value(tmp_path, fresh_store):
    """--sweep <old id> whose finished runs a later sweep took over, and whose crashed job's run stayed KILLED: the
    error names the later sweep and the KILLED run with the --include-unfinished hint; compared with it, a note
    names the run the later sweep took. --control grpo when the arm is algorithm=grpo: 'did you mean'."""
    from relax.tracking.mlflow_run import PREVIOUS_SWEEP_TAG

    uri, ids = _runs_store(tmp_path, fresh_store, [
        ({"arm": "algorithm=grpo", "seed": "1", "sweep_id": "OLD"}, {}, {R: [(0, 0.1)]}, "KILLED"),
        ({"arm": "algorithm=grpo", "seed": "2", "sweep_id": "NEW", PREVIOUS_SWEEP_TAG: "OLD"}, {}, {R: [(0, 0.2)]},
         "FINISHED"),
        ({"arm": "algorithm=rloo", "seed": "2", "sweep_id": "NEW"}, {}, {R: [(0, 0.3)]}, "FINISHED"),
    ])
    with pytest.raises(CompareError) as exc:
        compare(uri=uri, sweep="OLD", out_dir=tmp_path, log=False)
    assert str(exc.value) == (
        "no finished runs in sweep OLD: some of its runs were reopened by a job of sweep NEW (a resume, or an "
        "evaluation of a checkpoint), so they belong to that sweep now; compare them with --sweep NEW\n"
        f"  run {ids[0]} (arm=algorithm=grpo, seed 1) is KILLED: left out (--include-unfinished keeps it)")
    kept = compare(uri=uri, sweep="OLD", include_unfinished=True, out_dir=tmp_path, log=False)  # as the hint says
    assert [r.run_id for r in kept.comparison.runs] == [ids[0]]
    # a number from a run that did not finish says so (a note), with where it stopped
    assert f"1 run(s) did not finish (--include-unfinished): their final values are where they stopped: {ids[0]} " \
           "(algorithm=grpo/seed 1, KILLED, last step 0)" in kept.comparison.notes
    # the run that sweep NEW took over is named where sweep OLD is compared without it
    assert kept.comparison.notes[0] == (
        f"1 run(s) of sweep OLD are left out: {ids[1]} (arm algorithm=grpo, seed 2, now in sweep NEW); they were "
        "reopened by a job of sweep NEW (a resume, or an evaluation of a checkpoint), so they belong to that sweep "
        "now; compare them with --sweep NEW")
    assert kept.comparison.notes[0] in kept.text
    with pytest.raises(CompareError, match=r"control arm 'grpo' is not among the arms: algorithm=grpo, "
                                           r"algorithm=rloo \(did you mean algorithm=grpo\?\)$"):
        compare(uri=uri, sweep="NEW", control="grpo", out_dir=tmp_path, log=False)
    assert compare(uri=uri, sweep="NEW", control="algorithm=grpo", out_dir=tmp_path, log=False).comparison.diffs


K = "train/ppo_kl_m2_after"


GRPO9 = [f"algorithm=grpo,train.max_staleness={k}" for k in range(5)]
M2PO9 = [f"algorithm=m2po,train.max_staleness={k}" for k in range(4)]


def _nine_arms(tmp_path, fresh_store):
    """Nine arms of one seed each, as a staleness sweep gives: five GRPO ones, four M2PO ones that also log K and
    `algorithm.kl2_budget`; compared with the first GRPO arm as the control."""
    grpo, m2po = GRPO9, M2PO9
    runs = []
    for arm in grpo + m2po:
        algo, k = arm.split(",")[0].partition("=")[2], arm[-1]
        params = {"algorithm.name": algo, "train.max_staleness": k, **({"algorithm.kl2_budget": "0.01"}
                                                                        if algo == "m2po" else {})}
        metrics = {R: [(0, 0.1), (1, 0.2 + int(k) / 10)], **({K: [(0, 0.0), (1, 0.01)]} if algo == "m2po" else {})}
        runs.append(({"arm": arm, "seed": "1"}, params, metrics, "FINISHED"))
    uri, _ = _runs_store(tmp_path, fresh_store, runs)
    return compare(uri=uri, experiment="e", metrics=[R, K], last_k=1, control=grpo[0], out_dir=tmp_path / "o",
                   log=False).comparison


def test_a_note_said_of_many_arms_is_one_line_naming_them(tmp_path, fresh_store):
    """A note that says the same of several arms is one line naming them (every arm of the comparison counted
    instead: "all 9 arms", "all 8 arms" besides the control), each fact still said, none repeated per arm; the per-arm
    facts stay in `notes`."""
    grpo, m2po = GRPO9, M2PO9
    comp = _nine_arms(tmp_path, fresh_store)
    # the facts, one per arm, as before
    assert sum("has a single seed" in n for n in comp.notes) == 9 + 4
    assert sum("has one pair" in n for n in comp.notes) == 8
    assert sum("has no values for seed(s) 1" in n for n in comp.notes) == 5
    text = render(comp)
    notes = [line for line in text.splitlines() if line.startswith("note: ")]
    assert notes == [
        f"note: {R}: all 9 arms have a single seed each: no spread, and any difference is anecdotal",
        f"note: {K}: 4 arms ({', '.join(m2po)}) have a single seed each: no spread, and any difference is anecdotal",
        f"note: {R}: all 8 arms vs {grpo[0]} have one pair each: n too small for an interval",
        f"note: {K}: 5 arms ({', '.join(grpo)}) have no values for seed(s) 1",
        f"note: {K}: the control arm {grpo[0]} has no values: no paired differences",
    ], "\n".join(notes)


def test_the_config_table_of_many_arms_is_a_row_per_arm(tmp_path, fresh_store):
    """Nine arms with long names: a column per arm would be over 300 characters wide; the table is a row per arm, a
    column per param, instead (two arms keep a column per arm: test_one_run_per_seed_for_every_metric_...)."""
    grpo, m2po = GRPO9, M2PO9
    text = render(_nine_arms(tmp_path, fresh_store))
    table = text.split("config: the arms differ in 3 param(s) (seed, train.resume and tracking.* left out)\n")[1]
    table = table.split("\n\n")[0].splitlines()
    assert [line.split() for line in table] == [
        ["arm", "algorithm.kl2_budget", "algorithm.name", "train.max_staleness"],
        ["-" * 36, "-" * 20, "-" * 14, "-" * 19],
        *[[a, "(not", "logged)", "grpo", a[-1]] for a in grpo], *[[a, "0.01", "m2po", a[-1]] for a in m2po]]
    assert max(map(len, table)) < 120


def test_the_arm_merged_notes_keep_a_single_arms_note_as_it_was(tmp_path, fresh_store):
    """One arm of a single seed among arms of several: its note reads as it always did (no "1 arms")."""
    uri, _ = _runs_store(tmp_path, fresh_store, [
        ({"arm": "a", "seed": "1"}, {}, {R: [(0, 0.1)]}, "FINISHED"),
        ({"arm": "a", "seed": "2"}, {}, {R: [(0, 0.2)]}, "FINISHED"),
        ({"arm": "b", "seed": "1"}, {}, {R: [(0, 0.3)]}, "FINISHED"),
    ])
    text = render(compare(uri=uri, experiment="e", last_k=1, out_dir=tmp_path / "o", log=False).comparison)
    assert f"note: {R}: arm b has a single seed: no spread, and any difference is anecdotal" in text.splitlines()


def test_its_default_output_directory_is_ignored_by_git_at_the_repository_root(store, tmp_path, monkeypatch):
    """relax-compare writes compare/<sweep id or time>/ in the current directory by default; the recipe scripts run
    from the repository root (docs/experiments.md) must not leave it untracked there, as the runs' own outputs
    (outputs/, multirun/, mlflow.db, mlruns/, checkpoints/) are not."""
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    monkeypatch.chdir(tmp_path)
    _, uri, _ = store
    result = compare(uri=uri, sweep="S1", last_k=2, log=False)  # the default output directory
    written = result.csv_path.resolve().relative_to(tmp_path)
    assert written.parts[0] == "compare"
    check = subprocess.run(["git", "-C", str(root), "check-ignore", "--no-index", "-q", str(written)])
    assert check.returncode == 0, f"{written} is not ignored by the repository's .gitignore"
