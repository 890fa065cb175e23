"""The launcher's side of a run imports no torch: `import relax.config`, composing and validating a config (the CLI's
precheck), the plan, and `relax-train --help` (relax.algorithms.lazy). Each check runs in a fresh interpreter; the
last shows that the check sees torch once the math is used (a negative control)."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "ray", "mlflow")


def _loaded_after(code: str) -> list[str]:
    probe = code + f"\nimport sys\nprint(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))\n"
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    return eval(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("code", [
    "import relax.config",
    # the CLI before Ray: its module, compose + validate (the precheck), the help text, the plan
    "import relax.cli.train as t\nt._precheck(['algorithm=ppo', 'train.mode=sync'])\nt.help_text()",
    "from relax.config import load_config\nfrom relax.runner.plan import build_plan\n"
    "print(build_plan(load_config(['train.mode=fully_async']))"
    ".render())",
])
def test_launcher_imports_no_torch(code):
    assert _loaded_after(code) == []


def test_math_still_imports_torch_on_first_use():
    """Negative control: the same probe reports torch once an algorithm's math runs."""
    code = ("import relax.config\nfrom relax import algorithms\nfrom relax.algorithms.base import AdvantageInputs\n"
            "import torch\nalgo = algorithms.get('grpo')\n"
            "out = algo.compute_advantages(algo.config_cls(), AdvantageInputs(rewards=torch.tensor([1.0, 0.0]), "
            "mask=torch.ones(2, 3), group_size=2))\nassert out.advantages.shape == (2, 3)\n"
            "assert callable(algorithms.compute_loss)")
    assert _loaded_after(code) == ["torch"]
