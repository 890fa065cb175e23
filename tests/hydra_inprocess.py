"""Hydra's own main in the test's process, for the tests that compare relax-train's reading of a command line with
Hydra's (what it composes, how it runs): the independent reading."""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable
from typing import Any


def hydra_main(argv: list[str], task: Callable[[Any], None]) -> None:
    """Run Hydra's main on Relax's conf/ with `argv` (relax-train's arguments: the caller adds the launcher, output
    directories and logging it needs) and `task` as its task function; sys.argv, the root logger's handlers and
    Hydra's global config are put back after. Hydra's warnings (-m beside hydra.mode=RUN, ...) are not the tests'."""
    import hydra
    from hydra.core.hydra_config import HydraConfig

    from relax.config import conf_dir, register_configs

    register_configs()
    saved, root = sys.argv, logging.getLogger()
    handlers, level = list(root.handlers), root.level
    sys.argv = ["relax-train", *argv]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hydra.main(config_path=str(conf_dir()), config_name="config", version_base=None)(task)()
    finally:
        sys.argv = saved
        HydraConfig.instance().cfg = None
        for handler in set(root.handlers) - set(handlers):
            root.removeHandler(handler)
        root.setLevel(level)
