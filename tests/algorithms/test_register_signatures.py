"""`register` checks each hook's signature against the arguments Relax calls it with (relax.algorithms.loss, the
runner, the trainers, validation): a hook that cannot take them is a ValueError at registration naming the algorithm,
the hook and the parameters, not a TypeError in a Ray role after the first rollout. Every built-in passes."""

from __future__ import annotations

import dataclasses

import pytest

from relax import algorithms
from relax.algorithms.base import Algorithm, AlgorithmConfig, PolicyLossOutput, register, unregister


@dataclasses.dataclass(frozen=True)
class SigConfig(AlgorithmConfig):
    name: str = "sigtest"


def advantages(cfg, inputs):
    return None


def loss(cfg, logp, old_logp, advantages, mask):
    return PolicyLossOutput(loss=logp)


def loss_without_mask(cfg, logp, old_logp, advantages):
    return PolicyLossOutput(loss=logp)


def loss_with_stats(cfg, logp, old_logp, advantages, mask, *, stats):
    return PolicyLossOutput(loss=logp)


def stats_fn(cfg, logp, old_logp, advantages, mask):
    return {}


def entry(**changes) -> Algorithm:
    return Algorithm(**{"name": "sigtest", "config_cls": SigConfig, "compute_advantages": advantages,
                        "policy_loss": loss, "summary": "signature test", **changes})


@pytest.fixture(autouse=True)
def _clean():
    yield
    unregister("sigtest")


def test_a_well_formed_algorithm_registers():
    assert register(entry()) is algorithms.get("sigtest")
    unregister("sigtest")
    assert register(entry(step_statistics=stats_fn, policy_loss=loss_with_stats)).step_statistics is stats_fn


@pytest.mark.parametrize("changes, says", [
    ({"policy_loss": loss_without_mask},
     "algorithm 'sigtest': policy_loss must accept (cfg, logp, old_logp, advantages, mask), as Relax calls it, but "
     "loss_without_mask(cfg, logp, old_logp, advantages) cannot: too many positional arguments"),
    ({"compute_advantages": lambda inputs: None},
     "algorithm 'sigtest': compute_advantages must accept (cfg, inputs), as Relax calls it, but <lambda>(inputs) "
     "cannot: too many positional arguments"),
    ({"compute_advantages": lambda cfg, inputs, extra: None},
     "algorithm 'sigtest': compute_advantages must accept (cfg, inputs), as Relax calls it, but "
     "<lambda>(cfg, inputs, extra) cannot: missing a required argument: 'extra'"),
    ({"step_statistics": stats_fn},  # policy_loss without stats=
     "algorithm 'sigtest': policy_loss must accept (cfg, logp, old_logp, advantages, mask, *, stats) (the algorithm "
     "has step_statistics, whose result policy_loss receives as stats=), as Relax calls it, but "
     "loss(cfg, logp, old_logp, advantages, mask) cannot: got an unexpected keyword argument 'stats'"),
    ({"step_statistics": lambda cfg, logp: {}, "policy_loss": loss_with_stats},
     "algorithm 'sigtest': step_statistics must accept (cfg, logp, old_logp, advantages, mask), as Relax calls it"),
    ({"check": lambda: []}, "algorithm 'sigtest': check must accept (cfg), as Relax calls it"),
    ({"critic_only_steps": lambda: 0}, "algorithm 'sigtest': critic_only_steps must accept (cfg), as Relax calls it"),
    ({"policy_loss": "loss"}, "algorithm 'sigtest': policy_loss is str, not a function of "
                              "(cfg, logp, old_logp, advantages, mask)"),
])
def test_a_hook_of_the_wrong_signature_is_refused_at_registration(changes, says):
    with pytest.raises(ValueError) as caught:
        register(entry(**changes))
    assert str(caught.value).startswith(says), str(caught.value)
    assert "sigtest" not in algorithms.names()  # nothing half-registered


def test_keyword_and_variadic_hooks_are_accepted():
    register(entry(policy_loss=lambda cfg, *args, **kw: None, compute_advantages=lambda *a: None))


@pytest.mark.parametrize("name", algorithms.names())
def test_every_built_in_algorithm_passes_the_check(name):
    from relax.algorithms.base import check_hooks

    check_hooks(algorithms.get(name))
