"""Relax's algorithms: pure tensor math and the algorithm registry. Imports torch only.

Importing this package registers every built-in algorithm; `get(name)` returns its `Algorithm`. The registry loads
without torch (`relax.algorithms.lazy`): `functional`, `compute_loss` and `compute_value_loss` import it when first
read, as does the first call of an algorithm's math.

Layer 0 of 0-9 (docs/design.md): imports no other Relax package.
"""

from __future__ import annotations

from typing import Any

from relax.algorithms.base import (
    AdvantageInputs,
    AdvantageOutput,
    Algorithm,
    AlgorithmConfig,
    LossBatch,
    PolicyLossOutput,
    Violation,
    get,
    names,
    register,
    unregister,
)
from relax.algorithms.cispo import CISPOConfig
from relax.algorithms.grpo import GRPOConfig
from relax.algorithms.gspo import GSPOConfig
from relax.algorithms.m2po import M2POConfig
from relax.algorithms.opd import OPDConfig
from relax.algorithms.ppo import PPOConfig
from relax.algorithms.reinforce_pp import ReinforcePPConfig
from relax.algorithms.reinforce_pp_baseline import ReinforcePPBaselineConfig
from relax.algorithms.rloo import RLOOConfig
from relax.algorithms.sapo import SAPOConfig

# the torch side of the package, imported on first use (PEP 562): name -> (module, attribute or None for the module)
_LAZY = {"functional": ("relax.algorithms.functional", None), "compute_loss": ("relax.algorithms.loss", "compute_loss"),
         "compute_value_loss": ("relax.algorithms.loss", "compute_value_loss")}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    return module if attr is None else getattr(module, attr)


__all__ = [
    "functional",
    "compute_loss",
    "compute_value_loss",
    "get",
    "names",
    "register",
    "unregister",
    "AdvantageInputs",
    "AdvantageOutput",
    "Algorithm",
    "AlgorithmConfig",
    "LossBatch",
    "PolicyLossOutput",
    "Violation",
    "GRPOConfig",
    "RLOOConfig",
    "PPOConfig",
    "CISPOConfig",
    "GSPOConfig",
    "SAPOConfig",
    "M2POConfig",
    "OPDConfig",
    "ReinforcePPConfig",
    "ReinforcePPBaselineConfig",
]
