"""tests/gpu/kit.sh and bare.sh cannot rot where no GPU is lent: CI builds the kit (for this interpreter's Python) and
runs bare.sh in an environment like a bare GPU machine's (this interpreter's packages without Ray, MLflow, SGLang, TRL
and the kit's own: a virtual environment over a copy of site-packages made of links, those left out), so that
bare.sh installs the kit as it does there; the checks of tests/gpu/test_bare_gpu.py and the performance suite's bare
sections (test_bench_gpu.py) run on the CPU (RELAX_BARE_DEVICE=cpu), the CUDA-only ones are collected and skipped."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ABSENT = ("ray", "mlflow", "sglang", "trl")  # what a bare GPU machine lacks (and Relax's bare checks must not need)
KIT = ("hydra", "hydra_core", "omegaconf", "antlr4", "antlr4_python3_runtime", "gguf", "megatron",
       "megatron_core")  # what it lacks too, and tests/gpu/kit.sh brings


def _absent(name: str) -> bool:
    stem = name.lower().split("-")[0].split(".")[0]
    return any(stem == a or stem.startswith(a + "_") for a in ABSENT) or stem in KIT


@pytest.fixture(scope="module")
def bare_env(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("bare")
    purelib = Path(sysconfig.get_paths()["purelib"])
    site = tmp / "site"
    site.mkdir()
    for entry in purelib.iterdir():
        if not _absent(entry.name):
            (site / entry.name).symlink_to(entry)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (lib,) = (venv / "lib").glob("python3*/site-packages")
    (lib / "bare.pth").write_text(f"import site; site.addsitedir({str(site)!r})\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    kit = tmp / "kit"  # tests/gpu/kit.sh for this interpreter's Python (a bare machine's is 3.12)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    proc = subprocess.run(["bash", str(REPO / "tests/gpu/kit.sh")], env={**env, "RELAX_BARE_KIT": str(kit),
                                                                          "PYTHON_VERSION": version},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "kit.sh: 5 wheels" in proc.stdout, proc.stdout + proc.stderr
    return {**env, "PATH": f"{venv / 'bin'}{os.pathsep}{env['PATH']}", "RELAX_BARE_DEVICE": "cpu",
            "RELAX_BARE_KIT": str(kit)}


def test_the_environment_lacks_what_a_bare_machine_lacks(bare_env):
    """The negative control of the environment itself: what a bare machine lacks (the kit's packages included)
    does not import, what it has does."""
    probe = ("import importlib.util as u, sys\n"
             f"absent = [n for n in {ABSENT + ('hydra', 'omegaconf', 'gguf', 'megatron')!r} "
             "if u.find_spec(n) is not None]\n"
             "missing = [n for n in ('torch', 'transformers', 'peft', 'pytest') if u.find_spec(n) is None]\n"
             "sys.exit(f'importable: {absent}, missing: {missing}' if absent or missing else 0)")
    proc = subprocess.run(["python3", "-c", probe], env=bare_env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr + proc.stdout


def test_the_bare_script_runs_its_checks_without_ray_mlflow_or_sglang(bare_env):
    proc = subprocess.run(["bash", str(REPO / "tests/gpu/bare.sh")], env=bare_env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "bare.sh: torch " in out and "CUDA False" in out  # after installing the kit (else: "missing [...]")
    # tests/gpu/test_bare_gpu.py and the bench's bare sections (test_bench_gpu.py) on the CPU; the megatron checks
    # collected, skipped without CUDA
    assert "\n4 passed, 7 skipped" in out, out[-3000:]
    assert out.count("needs a CUDA GPU") == 6, out[-3000:]
    assert out.count("needs two CUDA GPUs") == 1, out[-3000:]  # test_weight_senders_gpu.py
