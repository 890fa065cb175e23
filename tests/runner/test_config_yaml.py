"""The YAML a run writes of its config (config.resolved.yaml, each checkpoint's config.yaml) is the text OmegaConf
renders of the same config: earlier versions wrote it with `OmegaConf.to_yaml(OmegaConf.structured(cfg))`, and a resume
reads what they wrote. `relax.runner.checkpoint.config_yaml` renders it from the dataclass's values; OmegaConf's own
rendering is the reference, on values whose text is easy to get wrong."""

from __future__ import annotations

import dataclasses
import enum

import pytest
from omegaconf import OmegaConf

from relax.config import load_config
from relax.runner.checkpoint import config_yaml


@pytest.fixture(scope="module")
def cfg():
    return load_config(["algorithm=ppo"])  # an algorithm config subclass under the `algorithm: Any` field


def _reference(cfg) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def test_the_default_config_renders_as_omegaconf_renders_it(cfg):
    assert config_yaml(cfg) == _reference(cfg)


def test_values_whose_text_could_change_render_as_omegaconf_renders_them(cfg):
    """Strings that read as other types (quoted), None, unicode, nested mappings and lists under free-form fields,
    floats in exponent form."""
    data = dataclasses.replace(
        cfg.data,
        reward={"combine": "sum", "parts": [{"name": "digits", "weight": 0.5}, {"name": "1e-3", "weight": None}]},
        eval_sets={"held out": {"path": "data/é.jsonl", "prompt_key": "true", "label_key": "null"}},
        tools=["calculator", "007", "yes", "~"])
    model = dataclasses.replace(cfg.model, lora_target_modules=["q_proj", "1.5"], name="ü: tiny")
    train = dataclasses.replace(cfg.train, lr=1e-06, save_dir="")
    cluster = dataclasses.replace(cfg.cluster, role_cores={"actor": "0-1", "rollout": "2"})
    edited = dataclasses.replace(cfg, data=data, model=model, train=train, cluster=cluster, plugins=["my.mod"])
    text = config_yaml(edited)
    assert text == _reference(edited)
    assert "'007'" in text and "'true'" in text and "é" in text  # the cases above reached the text
    # negative control: a plain yaml.safe_dump of the same values is not that text (the comparison can fail)
    import yaml

    assert yaml.safe_dump(dataclasses.asdict(edited), sort_keys=False) != text


class Mode(enum.Enum):
    FAST = 1
    SAFE = 2


def test_a_plugins_enum_field_and_a_tuple_render_as_omegaconf_renders_them(cfg):
    """A plugin's algorithm config may declare an Enum field (OmegaConf writes its name), and a free-form field may hold
    a tuple (a list in OmegaConf's text): neither may come out as a Python-tagged object that no loader reads back."""
    from omegaconf import OmegaConf as oc

    @dataclasses.dataclass(frozen=True)
    class WithMode(type(cfg.algorithm)):
        mode: Mode = Mode.SAFE

    algorithm = WithMode(**{f.name: getattr(cfg.algorithm, f.name) for f in dataclasses.fields(cfg.algorithm)})
    edited = dataclasses.replace(cfg, algorithm=algorithm,
                                 data=dataclasses.replace(cfg.data, reward=("digits", ("a", 1))))
    text = config_yaml(edited)
    assert text == _reference(edited)
    assert "mode: SAFE" in text and "!!python" not in text
    assert oc.create(text).algorithm.mode == "SAFE"  # it loads back
