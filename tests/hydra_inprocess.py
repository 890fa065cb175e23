"""Hydra's own main in the test's process, for the tests that compare relax-train's reading of a command line with
Hydra's (what it composes, how it runs): the independent reading; and the state Hydra's main leaves in a process,
put back (`hydra_state`: also for relax-train run in process, tests/relax_train_inprocess.py)."""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def hydra_state() -> Iterator[None]:
    """Put back what a Hydra main changes in this process: sys.argv, the root logger's handlers and level, the loggers
    its logging config disabled (`disable_existing_loggers`: a later test's caplog would see nothing of them), and
    Hydra's global config."""
    from hydra.core.hydra_config import HydraConfig

    argv, root = list(sys.argv), logging.getLogger()
    handlers, level = list(root.handlers), root.level
    disabled = {name: lg.disabled for name, lg in logging.Logger.manager.loggerDict.items()
                if isinstance(lg, logging.Logger)}
    try:
        yield
    finally:
        sys.argv = argv
        HydraConfig.instance().cfg = None
        for handler in set(root.handlers) - set(handlers):
            root.removeHandler(handler)
            handler.close()
        for handler in handlers:  # (Hydra's logging config removes the ones it finds)
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(level)
        for name, lg in list(logging.Logger.manager.loggerDict.items()):
            if isinstance(lg, logging.Logger):
                lg.disabled = disabled.get(name, False)


def hydra_main(argv: list[str], task: Callable[[Any], None]) -> None:
    """Run Hydra's main on Relax's conf/ with `argv` (relax-train's arguments: the caller adds the launcher, output
    directories and logging it needs) and `task` as its task function (`hydra_state` put back after). Hydra's
    warnings (-m beside hydra.mode=RUN, ...) are not the tests'."""
    import hydra

    from relax.config import conf_dir, register_configs

    register_configs()
    with hydra_state(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sys.argv = ["relax-train", *argv]
        hydra.main(config_path=str(conf_dir()), config_name="config", version_base=None)(task)()
