"""`relax-train --help` lists the config's keys from the schema (relax.cli.train.config_keys): every top-level
section and key of RelaxConfig, with the sections inside one (reward_model.* and data.reward_service.* were left
out of a hand-written list)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from relax.cli.train import config_keys, help_text
from relax.config.schema import RelaxConfig


def test_help_lists_every_top_level_key_of_the_schema():
    text = help_text()
    keys_line = " ".join(line.strip() for line in text.split("Keys: ", 1)[1].split("\n  relax-train")[0].splitlines())
    cfg = RelaxConfig()
    for f in dataclasses.fields(cfg):
        shown = f"{f.name}.*" if dataclasses.is_dataclass(getattr(cfg, f.name)) else f.name
        assert shown in keys_line, (shown, keys_line)
    assert "reward_model.*" in keys_line and "data.reward_service.*" in keys_line and "rollout.sglang.*" in keys_line
    assert config_keys()[0] == "algorithm.*" and config_keys()[-2:] == ["seed", "dry_run"]


def test_the_help_printed_is_the_one_built():
    """What `relax-train --help` prints (the control: the groups and algorithms around the list are still there)."""
    out = subprocess.run([sys.executable, "-m", "relax.cli.train", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "reward_model.*" in out.stdout and "data.* (data.reward_service.*, data.sandbox.*)" in out.stdout
    for word in ("Config groups", "Algorithms:", "rloo", "dry_run=true"):
        assert word in out.stdout
