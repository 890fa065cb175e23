"""Relax's algorithms: pure tensor math and the algorithm registry. Imports torch only.

Importing this package registers every built-in algorithm; `get(name)` returns its `Algorithm`.

Layer 0 of 0-9 (docs/design.md): imports no other Relax package.
"""

from __future__ import annotations

from relax.algorithms import functional
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
from relax.algorithms.loss import compute_loss, compute_value_loss
from relax.algorithms.m2po import M2POConfig
from relax.algorithms.opd import OPDConfig
from relax.algorithms.ppo import PPOConfig
from relax.algorithms.reinforce_pp import ReinforcePPConfig
from relax.algorithms.reinforce_pp_baseline import ReinforcePPBaselineConfig
from relax.algorithms.rloo import RLOOConfig
from relax.algorithms.sapo import SAPOConfig

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
