"""The `endpoints` check before Ray (`relax.runner.preflight`): every address a run must reach that the user gave is
probed with a TCP connection, bounded, before anything starts; a refused one is named with its option. Each case
against a real closed port (bound, then closed: nothing listens there) and, as the negative control, a real
listening socket (an HTTP server for the options that name one, which must also answer a request: a socket that
accepts and says nothing is named as hung). Then what follows a reachable server that is never healthy: one clear
error, exit 2.

Without the check: `ray.init` retries `cluster.address=127.0.0.1:1` for ever; a refused `rollout.sglang.urls` server
was waited on for all of `rollout.sglang.request_timeout_s` and ended in a traceback; a refused `tracking.uri` took
MLflow's HTTP retries, minutes."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from relax_train_inprocess import relax_train

from relax.config import load_config
from relax.runner.endpoints import ENDPOINT_TIMEOUT_S, endpoint_targets
from relax.runner.errors import RunError
from relax.runner.preflight import preflight


class _Answering(http.server.BaseHTTPRequestHandler):
    """Any answer will do: the check asks whether the server answers, not what (its health is the start's)."""

    status = 404

    def do_GET(self):  # noqa: N802 - the stdlib's name
        self.send_response(self.status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


class _Unhealthy(_Answering):
    status = 503


def _serve(handler: type) -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def answering() -> Iterator[int]:
    """A port where an HTTP server answers."""
    yield from _serve(_Answering)


@pytest.fixture(autouse=True)
def _clean(monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("MODEL_DIR", raising=False)
    monkeypatch.chdir(tmp_path)


# the option as the message names it -> (overrides of a run that must reach port P, the address named)
CASES = {
    "cluster.address": (lambda p: [f"cluster.address=127.0.0.1:{p}"], "127.0.0.1:{p}"),
    "cluster.address (Ray Client)": (lambda p: [f"cluster.address=ray://127.0.0.1:{p}"], "ray://127.0.0.1:{p}"),
    "rollout.sglang.urls[0]": (lambda p: ["rollout=sglang", f"rollout.sglang.urls=[http://127.0.0.1:{p}]"],
                               "http://127.0.0.1:{p}"),
    "tracking.uri": (lambda p: [f"tracking.uri=http://127.0.0.1:{p}"], "http://127.0.0.1:{p}"),
    "data.reward": (lambda p: [f"data.reward=http://127.0.0.1:{p}/score"], "http://127.0.0.1:{p}/score"),
    "reward_model.url": (lambda p: ["reward_model=judge", "reward_model.engine=openai",
                                    f"reward_model.url=http://127.0.0.1:{p}/v1"], "http://127.0.0.1:{p}/v1"),
}


HTTP = {"rollout.sglang.urls[0]", "tracking.uri", "data.reward", "reward_model.url"}  # servers that must answer


@pytest.mark.parametrize("name", list(CASES))
def test_a_refused_address_is_named_with_its_option_and_a_listening_one_passes(closed_port, name, grpc_listening,
                                                                                answering):
    overrides, address = CASES[name]
    option = name.split(" ")[0]
    port = closed_port()
    t0 = time.monotonic()
    pre = preflight(load_config(overrides(port)), only=("endpoints",))
    assert time.monotonic() - t0 < ENDPOINT_TIMEOUT_S  # refused at once, not waited on
    assert pre.status["endpoints"] == "failed", pre.render()
    expected = f"{option}={address.format(p=port)}: connection to 127.0.0.1:{port} refused"
    assert pre.problems["endpoints"].startswith(expected), pre.problems["endpoints"]
    # the negative control: the same option at a port where its server answers (HTTP; gRPC, as a Ray head's)
    ok = preflight(load_config(overrides(answering if name in HTTP else grpc_listening)), only=("endpoints",))
    assert ok.status["endpoints"] == "ok" and ok.ok, ok.render()


def test_an_http_server_that_accepts_and_never_answers_is_named_as_hung(listening):
    """A server whose process hangs (stopped, deadlocked) still has its connections completed by the kernel: the
    run would have waited its whole request time-out (or MLflow's retries), Ray's client for ever. Every option that
    names an HTTP server, and Ray's address, which must begin a gRPC exchange, at once (probed together)."""
    overrides = [o for name in sorted(HTTP) for o in CASES[name][0](listening)]
    t0 = time.monotonic()
    pre = preflight(load_config([*overrides, f"cluster.address=127.0.0.1:{listening}"]), only=("endpoints",))
    assert time.monotonic() - t0 < 2 * ENDPOINT_TIMEOUT_S + 2  # bounded: a connection, then an answer's wait
    text = pre.problems["endpoints"]
    assert text.startswith(f"{len(HTTP) + 1} addresses cannot be reached: "), text
    for name in HTTP:
        assert (f"{name}={CASES[name][1].format(p=listening)}: 127.0.0.1:{listening} accepts connections but did "
                f"not answer an HTTP request within {ENDPOINT_TIMEOUT_S:g} s (hung?)") in text, name
    assert (f"cluster.address=127.0.0.1:{listening}: 127.0.0.1:{listening} accepts connections but did not begin "
            f"a gRPC exchange within {ENDPOINT_TIMEOUT_S:g} s (hung?)") in text


@pytest.mark.parametrize("ray", ["127.0.0.1:{p}", "ray://127.0.0.1:{p}"])
def test_a_ray_address_where_another_server_answers_is_refused(ray, answering, grpc_listening):
    """An address where something else listens (a web server, a dashboard's port given for the GCS's): Ray's client
    retried it for ever in its C++ loop (no error, no end). It must answer HTTP/2's preface as a gRPC server does;
    the control is a real gRPC server (grpcio's, as Ray's head is one)."""
    t0 = time.monotonic()
    pre = preflight(load_config([f"cluster.address={ray.format(p=answering)}"]), only=("endpoints",))
    assert time.monotonic() - t0 < ENDPOINT_TIMEOUT_S  # it answered at once: no wait
    assert pre.problems["endpoints"].startswith(
        f"cluster.address={ray.format(p=answering)}: 127.0.0.1:{answering} answers, but not as a gRPC server (it "
        "answered b'<!DOCTYPE'), as a Ray head's GCS port"), pre.render()
    ok = preflight(load_config([f"cluster.address={ray.format(p=grpc_listening)}"]), only=("endpoints",))
    assert ok.status["endpoints"] == "ok", ok.render()


def test_a_ray_cluster_with_tls_is_probed_over_tls(monkeypatch, grpc_listening):
    """RAY_USE_TLS=1 (Ray's clients speak TLS to the cluster): the check shakes hands in TLS before HTTP/2's preface,
    as Ray's client does; a plaintext gRPC server is then no Ray head this client can join. Controls: a real gRPC
    server over TLS (a self-signed certificate) passes with RAY_USE_TLS=1 and is refused without it."""
    from ports import grpc_port

    with grpc_port(tls=True) as tls_port:
        monkeypatch.setenv("RAY_USE_TLS", "1")
        ok = preflight(load_config([f"cluster.address=127.0.0.1:{tls_port}"]), only=("endpoints",))
        assert ok.status["endpoints"] == "ok", ok.render()
        plain = preflight(load_config([f"cluster.address=127.0.0.1:{grpc_listening}"]), only=("endpoints",))
        assert (f"127.0.0.1:{grpc_listening} answers, but not as a gRPC server over TLS (RAY_USE_TLS is on): the TLS "
                "handshake failed") in plain.problems["endpoints"], plain.render()
        monkeypatch.delenv("RAY_USE_TLS")
        clear = preflight(load_config([f"cluster.address=127.0.0.1:{tls_port}"]), only=("endpoints",))
        assert "answers, but not as a gRPC server" in clear.problems["endpoints"], clear.render()


def test_ray_address_is_probed_when_it_will_be_joined(closed_port, monkeypatch, grpc_listening):
    port = closed_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    pre = preflight(load_config([]), only=("endpoints",))
    assert pre.problems["endpoints"].startswith(f"RAY_ADDRESS=127.0.0.1:{port}: connection to 127.0.0.1:{port} "
                                                "refused"), pre.render()
    assert "cluster.address is unset" in pre.problems["endpoints"]
    # cluster.address wins over RAY_ADDRESS (relax.runner.cluster.RayRuntime): only it is probed
    joined = preflight(load_config([f"cluster.address=127.0.0.1:{grpc_listening}"]), only=("endpoints",))
    assert joined.ok, joined.render()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{grpc_listening}")
    assert preflight(load_config([]), only=("endpoints",)).status["endpoints"] == "ok"


def test_what_cannot_be_probed_is_left_to_ray_and_local_stores_are_not_probed(monkeypatch):
    for overrides in (["cluster.address=auto"], [], ["tracking.uri=sqlite:///x.db"]):
        assert endpoint_targets(load_config(overrides)) == [], overrides
        assert preflight(load_config(overrides), only=("endpoints",)).status["endpoints"] == "n/a"
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    assert endpoint_targets(load_config([])) == []


def test_every_unreachable_address_is_reported_at_once_with_the_other_problems(closed_port, answering):
    a, b = closed_port(), closed_port()
    cfg = load_config([f"cluster.address=127.0.0.1:{a}", "rollout=sglang", "rollout.num_replicas=2",
                       f"rollout.sglang.urls=[http://127.0.0.1:{answering},http://127.0.0.1:{b}]",
                       "model.lora_rank=4", "model.lora_target_modules=[no_such_proj]"])
    pre = preflight(cfg)
    assert sorted(pre.problems) == ["endpoints", "lora"], pre.render()
    text = pre.problems["endpoints"]
    assert text.startswith("2 addresses cannot be reached: ")
    assert f"cluster.address=127.0.0.1:{a}: connection to 127.0.0.1:{a} refused" in text
    assert f"rollout.sglang.urls[1]=http://127.0.0.1:{b}: connection" in text
    assert "urls[0]" not in text  # the answering one
    message = str(pre.error())
    assert message.startswith("2 problems:") and "no_such_proj" in message and f"127.0.0.1:{b}" in message


def test_the_real_start_stops_before_ray_and_relax_train_exits_2(closed_port, monkeypatch, capfd, tmp_path):
    """`relax-train train.num_rollout=3 tracking.uri=http://127.0.0.1:P`: no MLflow retries, no Ray, exit 2."""
    from relax.runner.cluster import RayRuntime

    def refuse(self):
        raise AssertionError("Ray started: the endpoints check did not stop the run")

    monkeypatch.setattr(RayRuntime, "__enter__", refuse)
    port = closed_port()
    t0 = time.monotonic()
    code, out, err = relax_train(["train.num_rollout=3", f"tracking.uri=http://127.0.0.1:{port}",
                                  f"hydra.run.dir={tmp_path / 'out'}"], capfd)
    assert code == 2, out + err
    assert f"relax-train: error: tracking.uri=http://127.0.0.1:{port}: connection to 127.0.0.1:{port} refused" in err
    assert "Traceback" not in out + err
    assert time.monotonic() - t0 < 60  # the check itself: milliseconds; the rest is the tokenizer and data


def test_relax_train_dry_run_names_an_unreachable_ray_cluster(closed_port, capfd):
    port = closed_port()
    code, out, err = relax_train(["dry_run=true", "train.num_rollout=3", f"cluster.address=127.0.0.1:{port}"], capfd)
    assert code == 2, out + err
    assert "failed   endpoints" in out and "ok       tokenizer" in out
    assert (f"relax-train: error: dry run: a start would stop before Ray: cluster.address=127.0.0.1:{port}: "
            f"connection to 127.0.0.1:{port} refused (is a Ray head (ray start --head) running there") in err
    assert "Traceback" not in out + err


def test_a_sweep_names_an_unreachable_tracking_server_before_its_parent_run_or_any_job(closed_port, capfd, tmp_path,
                                                                                      answering, monkeypatch):
    """`relax-train -m`: the launcher checks each job (`check_sweep_job`: rules and addresses) before it opens the
    sweep's MLflow parent run (MLflow's retries: minutes) or starts Ray; the same sweep at a listening port (the
    control) passes the check and goes on to the parent run, which is stopped here."""
    from hydra_plugins.relax_ray_launcher import launcher

    def stop(self):
        raise SystemExit(99)  # the parent run would open now: the check passed

    monkeypatch.setattr(launcher.RelaxRayLauncher, "_start_parent", stop)
    port = closed_port()
    sweep = ["-m", "seed=1,2", "train.num_rollout=1", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    code, out, err = relax_train([*sweep, f"tracking.uri=http://127.0.0.1:{port}"], capfd)
    assert code == 2, out + err
    # said once, as what it is: the store cannot be reached (no config of the jobs is wrong)
    assert err.strip() == (f"relax-train: error: the MLflow tracking store is unreachable: tracking.uri=http://127.0.0.1:"
                           f"{port}: connection to 127.0.0.1:{port} refused (is an MLflow tracking server running "
                           "there, and reachable from this machine?) (every job); nothing started (no sweep job, no "
                           "MLflow run)"), err
    code, out, err = relax_train([*sweep, f"tracking.uri=http://127.0.0.1:{answering}"], capfd)
    assert code == 99, out + err


def test_a_sweep_names_an_unreachable_tracking_store_without_its_secrets_apart_from_a_jobs_own_problem(
        closed_port, capfd, tmp_path):
    """A token in the URI's query is not echoed (users and passwords in URLs are refused by the rules); a job's own
    problem (a reward that does not import) is still listed as before, under its job."""
    port = closed_port()
    code, out, err = relax_train(["-m", "seed=1", "train.num_rollout=1", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                                  "data.reward='no_such_module:fn',digits",
                                  f"tracking.uri='http://127.0.0.1:{port}/mlflow?token=s3cr3t'"], capfd)
    assert code == 2, out + err
    first, rest = err.split("\n", 1)
    assert first == (f"relax-train: error: the MLflow tracking store is unreachable: tracking.uri=http://127.0.0.1:"
                     f"{port}/mlflow?***: connection to 127.0.0.1:{port} refused (is an MLflow tracking server running "
                     "there, and reachable from this machine?) (every job); nothing started (no sweep job, no MLflow "
                     "run)"), err
    assert rest.startswith("relax-train: error: invalid config in 1 of 2 sweep jobs (nothing started):\njob 0 ("), err
    assert "no_such_module" in rest and "tracking" not in rest.split("\n", 1)[1].split("):", 1)[1], err
    assert "s3cr3t" not in err and "mlflow?***'" in rest  # nor in the job's line


@pytest.mark.parametrize("override,shown", [
    ("data.reward='https://h:1/score?key=k3y',digits", "data.reward='https://h:1/score?***',digits"),
    ("reward_model.url=http://h:2/v1?token=k3y", "reward_model.url=http://h:2/v1?***"),
    ("rollout.sglang.urls=[http://h:3?a=k3y,http://h:4]", "rollout.sglang.urls=[http://h:3?***,http://h:4]"),
    ("data.prompt_key=what?", "data.prompt_key=what?"),  # no URL: as written
    ("reward_model.url=https://me:pw@h:5/v1#k3y", "reward_model.url=https://***@h:5/v1?***"),  # a fragment, a user
])
def test_a_sweep_jobs_header_hides_every_urls_query(override, shown):
    """The sweep's job headers show an override as the user wrote it, but the query of any http(s) URL in it (a
    token of a reward service, a judge or a server behind a proxy) as `?***`, as the endpoint lines do."""
    from relax.config.credentials import masked_override

    assert masked_override(override) == shown


# ---------------------------------------------------------------------------- reachable, but never healthy
@pytest.fixture
def unhealthy_server() -> Iterator[str]:
    for port in _serve(_Unhealthy):
        yield f"http://127.0.0.1:{port}"


def test_a_user_server_that_is_never_healthy_is_one_clear_error(unhealthy_server, tmp_path: Path):
    from relax.runner.rollout_driver.sglang_engines import SGLangEngines

    cfg = load_config(["rollout=sglang", f"rollout.sglang.urls=[{unhealthy_server}]",
                       "rollout.sglang.request_timeout_s=0.5"])
    assert preflight(cfg, only=("endpoints",)).ok  # reachable: the check lets it through
    engines = SGLangEngines(cfg, eos_token_ids=(2,), pad_token_id=0, log_dir=tmp_path, start_server=None,
                            push=lambda *args: None)
    with pytest.raises(RunError) as info:
        engines.start()
    text = str(info.value)
    assert text.startswith(f"the SGLang server of rollout.sglang.urls[0] at {unhealthy_server}/health was not "
                           "healthy within 0.5 s (last: HTTP 503)"), text
    assert text.count(unhealthy_server) == 1 and "not started by Relax" not in text and "log (" not in text
    assert "rollout.sglang.request_timeout_s" in text


def test_the_cli_turns_a_startup_error_into_a_message(monkeypatch, capfd, tmp_path):
    """A server process of the run that never became healthy (`StartupError`: the router, an engine) ends as
    `relax-train: error:`, exit 2, not a traceback."""
    from relax.rollout.sglang.process import StartupError
    from relax.runner import train

    def fails(*args, **kwargs):
        raise StartupError("the router at http://127.0.0.1:9/health was not healthy within 1 s (last: HTTP 503)")

    monkeypatch.setattr(train, "run", fails)
    code, out, err = relax_train(["train.num_rollout=3", f"hydra.run.dir={tmp_path / 'out'}"], capfd)
    assert code == 2, out + err
    assert "relax-train: error: the router at http://127.0.0.1:9/health was not healthy" in err
    assert "Traceback" not in out + err


def test_a_token_in_a_url_query_is_not_echoed(closed_port, answering):
    """A tracking server or reward service behind a proxy that takes its token in the query (`?token=...`): the
    message names the address without it (the sweep's lines do the same: `relax.config.credentials.without_secrets`)."""
    port = closed_port()
    pre = preflight(load_config([f"tracking.uri='http://127.0.0.1:{port}/mlflow?token=s3cr3t'"]), only=("endpoints",))
    text = pre.problems["endpoints"]
    assert text.startswith(f"tracking.uri=http://127.0.0.1:{port}/mlflow?***: connection to 127.0.0.1:{port} "
                           "refused"), text
    assert "s3cr3t" not in pre.render()


def test_a_sweep_job_keeps_its_tracking_store_apart_by_the_endpoints_mark_not_by_the_message(closed_port, monkeypatch):
    """`check_sweep_job` says an unreachable MLflow store apart (`SweepJobError.store`, said once by the launcher) by
    what the endpoints check marks it (`Endpoint.tracking_store`), not by its message's `tracking.uri=` prefix: the
    store named otherwise (here MLFLOW_TRACKING_URI, as Ray's head is named RAY_ADDRESS when cluster.address is
    unset) is still the store. The control, an unreachable reward service, stays the job's problem. Before: the
    store's message was one of the job's problems, and `store` None."""
    import dataclasses

    from relax.config import compose
    from relax.runner import sweep_check

    real = sweep_check.endpoint_targets

    def renamed(cfg):
        return [dataclasses.replace(t, option="MLFLOW_TRACKING_URI") if t.option == "tracking.uri" else t
                for t in real(cfg)]

    monkeypatch.setattr(sweep_check, "endpoint_targets", renamed)
    store, service = closed_port(), closed_port()
    with pytest.raises(sweep_check.SweepJobError) as exc:
        sweep_check.check_sweep_job(compose([f"tracking.uri=http://127.0.0.1:{store}", "train.num_rollout=1",
                                             f"data.reward=http://127.0.0.1:{service}/score"]))
    assert exc.value.store is not None and exc.value.store.startswith(
        f"the MLflow tracking store is unreachable: MLFLOW_TRACKING_URI=http://127.0.0.1:{store}: connection to "), \
        (exc.value.store, exc.value.problems)
    assert len(exc.value.problems) == 1 and exc.value.problems[0].startswith(
        f"data.reward=http://127.0.0.1:{service}/score: connection to 127.0.0.1:{service} refused"), exc.value.problems
