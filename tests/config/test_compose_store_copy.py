"""Hydra deep-copies its config repository, ConfigStore included, on every compose; Relax's copy of the store
(relax.config.store._copy_store) shares the stored nodes instead of copying them. Checked: the copy is still a
snapshot (its own dicts and records: a later `store()` does not show in it, as Hydra's Singleton.get_state needs),
and composing with it gives what composing with the stock deep copy gives, the errors' words included."""

from __future__ import annotations

import copy

import pytest
from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from omegaconf import OmegaConf

from relax.config import compose, load_config
from relax.config.store import register_configs
from relax.config.validate import ConfigError


def test_store_copy_shares_nodes_but_is_a_snapshot() -> None:
    register_configs()
    live = ConfigStore.instance()
    snap = copy.deepcopy(live)
    assert snap is not live and snap.repo is not live.repo
    assert snap.repo["algorithm"] is not live.repo["algorithm"]
    assert snap.repo["relax_schema.yaml"] is not live.repo["relax_schema.yaml"]
    assert snap.repo["relax_schema.yaml"].node is live.repo["relax_schema.yaml"].node  # shared, not copied
    state = Singleton.get_state()
    try:
        live.store(group="algorithm", name="zz_snapshot_probe", node={"a": 1})
        assert "zz_snapshot_probe.yaml" not in snap.repo["algorithm"]
        assert "zz_snapshot_probe.yaml" not in state["instances"][ConfigStore].repo["algorithm"]
    finally:
        del live.repo["algorithm"]["zz_snapshot_probe.yaml"]


CASES = [
    [],
    ["algorithm=ppo", "model=tiny_moe", "train.lr=2e-6"],  # an algorithm's schema node, read from the copied store
    ["+experiment=m2po", "rollout=sglang"],
    ["algorithm=nope", "train.lrr=1"],  # a choice that names no option and an unknown key: composed twice
    ["algorithm.kl2_budget=1", "+train.foo=1"],
]


def _outcome(overrides: list[str]) -> tuple[str, str]:
    try:
        composed = OmegaConf.to_yaml(compose(overrides))
    except Exception as exc:  # noqa: BLE001 - the message is what is compared
        composed = f"{type(exc).__name__}: {exc}"
    try:
        loaded = repr(load_config(overrides))
    except ConfigError as exc:
        loaded = f"ConfigError: {exc}"
    return composed, loaded


def test_compose_same_as_with_hydras_deep_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    shared = [_outcome(o) for o in CASES]
    monkeypatch.delattr(ConfigStore, "__deepcopy__")  # Hydra's own: copy.deepcopy of every stored node
    stock = [_outcome(o) for o in CASES]
    assert shared == stock
    assert sum(loaded.startswith("ConfigError") for _, loaded in stock) == 2  # the error cases are errors
