"""`python -m relax.rollout.sglang.keyed MODULE ARG...`: run `python -m MODULE ARG... --api-key=KEY` with the key taken
from the environment (`KEY_ENV`), so that it is in no command line.

SGLang's `launch_server` and sglang-router take their key only as `--api-key`. A process's command line is readable
by every user of the machine (`ps`, `/proc/<pid>/cmdline`) and Relax writes it at the top of each launch log
(`$ <cmd>`); its environment is readable by its own user only. This launcher reads the key from the environment,
removes it there (the server's own child processes do not inherit it), appends it to `sys.argv` and runs the module
in this process: `/proc/<pid>/cmdline` keeps the command as it was started, without the key. What the module itself
prints through Python's `sys.stdout` and `sys.stderr` (SGLang logs its server arguments) has the key replaced by
`***`.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any, TextIO

KEY_ENV = "RELAX_LAUNCH_API_KEY"
LAUNCHER = "relax.rollout.sglang.keyed"  # this module (its __name__ is __main__ when it runs)


def keyed_command(module: str, args: list[str]) -> list[str]:
    """The command that runs `python -m module args... --api-key=$KEY_ENV` through this launcher."""
    return [sys.executable, "-m", LAUNCHER, module, *args]


class _Redacting:
    """A text stream that writes to `stream` with every occurrence of `secret` replaced."""

    def __init__(self, stream: TextIO, secret: str):
        self._stream, self._secret = stream, secret

    def write(self, text: str) -> int:
        self._stream.write(text.replace(self._secret, "***"))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        sys.exit(f"usage: python -m {LAUNCHER} MODULE [ARG...] (the key in ${KEY_ENV})")
    module, args = argv[0], argv[1:]
    key = os.environ.pop(KEY_ENV, None)
    if key:
        args.append(f"--api-key={key}")  # "=": a key may start with "-"
        sys.stdout = _Redacting(sys.stdout, key)  # type: ignore[assignment]
        sys.stderr = _Redacting(sys.stderr, key)  # type: ignore[assignment]
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
