"""`relax-train` run in the test's own process (the dry-run tests: nothing starts, so no subprocess is needed)."""

from __future__ import annotations

import sys

from hydra_inprocess import hydra_state


def relax_train(args: list[str], capfd) -> tuple[int, str, str]:
    """`relax-train ARGS` in this process: (exit code, stdout, stderr); Hydra's global state put back after
    (`hydra_state`). Hydra's run and sweep dirs are under the test's tmp_path unless ARGS name them
    (conf/config.yaml's default, outputs/<date>/<time> of the cwd, is the repo's when tests run, and one second apart
    workers share it)."""
    from relax.cli import train as cli

    tmp_path = capfd.request.getfixturevalue("tmp_path")
    given = {a.lstrip("+~").split("=", 1)[0] for a in args}
    keys = ("run", "sweep") if {"-m", "--multirun"} & set(args) else ("run",)
    dirs = [f"hydra.{key}.dir={tmp_path / 'hydra' / key}" for key in keys if f"hydra.{key}.dir" not in given]
    # beside the first override: Hydra's parser takes the overrides as one block (x=1 --cfg job y=2 is refused)
    at = next((i for i, a in enumerate(args) if "=" in a and not a.startswith("-")), len(args))
    code = 0
    with hydra_state():
        sys.argv = ["relax-train", *args[:at], *dirs, *args[at:]]
        try:
            cli.main()
        except SystemExit as exc:
            code = exc.code
    out, err = capfd.readouterr()
    return code, out, err
