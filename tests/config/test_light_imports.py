"""The launcher's side of a run imports no torch (relax.algorithms.lazy): `import relax.config`, composing and
validating a config (the CLI's precheck), `relax-train --help`'s text, the plan and the module of rollout=sglang's
engine server actor (a launcher: each replica's process would pay for torch), each step checked in one fresh
interpreter; its last step runs an algorithm's math, after which the same probe must see torch (the control)."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "transformers", "ray", "mlflow")

PROBE = f"""
import json, sys
loaded = {{}}
def note(step):
    loaded[step] = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))
import relax.config
note("import relax.config")
import relax.cli.train as cli
cli._precheck(["algorithm=ppo", "train.mode=sync"])
cli.help_text()
note("the CLI's precheck and help")
from relax.config import load_config
from relax.runner.plan import build_plan
build_plan(load_config(["train.mode=fully_async", "+cluster.role_cores={{rollout: '0', actor: '1'}}"])).render()
note("the plan")
import relax.roles.sglang_server
note("the engine server's actor")
from relax import algorithms
from relax.algorithms.base import AdvantageInputs
import torch
algo = algorithms.get("grpo")
out = algo.compute_advantages(algo.config_cls(), AdvantageInputs(rewards=torch.tensor([1.0, 0.0]),
                                                                 mask=torch.ones(2, 3), group_size=2))
assert out.advantages.shape == (2, 3) and callable(algorithms.compute_loss)
note("the math")
print(json.dumps(loaded))
"""


def test_launcher_imports_no_torch():
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    loaded = json.loads(res.stdout.strip().splitlines()[-1])
    assert loaded == {"import relax.config": [], "the CLI's precheck and help": [], "the plan": [],
                      "the engine server's actor": [], "the math": ["torch"]}
