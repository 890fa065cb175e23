"""`relax-train` run in the test's own process (the dry-run tests: nothing starts, so no subprocess is needed)."""

from __future__ import annotations

import logging
import sys


def relax_train(args: list[str], capfd) -> tuple[int, str, str]:
    """`relax-train ARGS` in this process: (exit code, stdout, stderr); Hydra's global state put back after."""
    from hydra.core.hydra_config import HydraConfig

    from relax.cli import train as cli

    argv, root = sys.argv, logging.getLogger()
    handlers, level = list(root.handlers), root.level
    sys.argv = ["relax-train", *args]
    code = 0
    try:
        cli.main()
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.argv = argv
        HydraConfig.instance().cfg = None
        for handler in set(root.handlers) - set(handlers):
            root.removeHandler(handler)
            handler.close()
        root.setLevel(level)
    out, err = capfd.readouterr()
    return code, out, err
