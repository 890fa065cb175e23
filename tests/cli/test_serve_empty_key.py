"""relax-serve refuses an empty key before it binds, naming where the key came from: `$RELAX_SERVE_API_KEY` set but
empty (a failed `$(cat keyfile)`) when `--api-key` was not given, `--api-key` when the flag gave it (whatever the
variable holds). One line, exit 2.

Negative control: before, an empty variable with no flag was reported as `--api-key: an empty key`, a flag the user
had not given.
"""

from __future__ import annotations

import pytest

from relax.cli import serve

ENV = "RELAX_SERVE_API_KEY"


def start(monkeypatch, capsys, env: str | None, argv: list[str]) -> tuple[int, str]:
    """relax-serve's exit code and stderr with $RELAX_SERVE_API_KEY `env` (None: unset) and `argv`."""
    if env is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, env)
    with pytest.raises(SystemExit) as info:
        serve.main(["--port", "0", *argv, "model=tiny"])
    return info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_variable_without_the_flag_is_named(monkeypatch, capsys, value):
    code, err = start(monkeypatch, capsys, value, [])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"relax-serve: error: ${ENV} is set but empty (--api-key not given): an empty key"), err
    assert "--api-key:" not in err


@pytest.mark.parametrize("env", [None, "", "a-good-key"])
def test_an_empty_flag_is_named_whatever_the_variable_holds(monkeypatch, capsys, env):
    code, err = start(monkeypatch, capsys, env, ["--api-key", " "])
    assert code == 2 and err.strip() == "relax-serve: error: --api-key: an empty key", err


def test_the_variable_still_gives_the_key_beyond_loopback(monkeypatch, capsys):
    """The control that the variable is still read without the flag: beyond loopback, no key is refused (naming
    both), and with the variable set the start goes past that check (to the next refusal, a --max-body-mb of 0, so
    nothing binds)."""
    code, err = start(monkeypatch, capsys, None, ["--host", "0.0.0.0"])
    assert code == 2 and "is reachable beyond this machine: give a key" in err, err
    code, err = start(monkeypatch, capsys, "a-good-key", ["--host", "0.0.0.0", "--max-body-mb", "0"])
    assert code == 2 and err.strip() == "relax-serve: error: --max-body-mb=0: must be > 0", err
