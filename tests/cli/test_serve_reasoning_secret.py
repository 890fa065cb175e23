"""relax-serve refuses to start when $RELAX_SERVE_REASONING_SECRET / $RELAX_SERVE_REASONING_SECRET_FILE cannot give the
reasoning items' key (an empty secret, a file that cannot be read, both set): one line naming the variable, exit 2,
the secret never printed. Before, the server started and every /v1/responses call was a server error. The control: a
good secret lets the start go on to the next check (an empty --api-key here, so nothing is served)."""

from __future__ import annotations

import pytest

from relax.cli import serve
from relax.serve.openai.responses import REASONING_SECRET_ENV, REASONING_SECRET_FILE_ENV

SECRET = "s3cret-that-must-not-show"


def start(monkeypatch, capsys, env: dict[str, str]) -> tuple[int, str]:
    """relax-serve's exit code and stderr under `env`. Its command line also holds an empty --api-key, a usage error
    relax-serve reports before it builds a model: whatever the secret check does, nothing is ever served here."""
    for name in (REASONING_SECRET_ENV, REASONING_SECRET_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as info:
        serve.main(["--port", "0", "--api-key", " ", "model=tiny"])
    return info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("case", ["empty", "unreadable", "both"])
def test_a_bad_reasoning_secret_stops_relax_serve_before_it_starts(monkeypatch, capsys, tmp_path, case):
    env = {"empty": {REASONING_SECRET_ENV: "  "},
           "unreadable": {REASONING_SECRET_FILE_ENV: str(tmp_path / "missing")},
           "both": {REASONING_SECRET_ENV: SECRET, REASONING_SECRET_FILE_ENV: str(tmp_path / "secret")}}[case]
    (tmp_path / "secret").write_text(SECRET + "\n")
    code, err = start(monkeypatch, capsys, env)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("relax-serve: error: the reasoning items' key: "), err
    expected = {"empty": f"${REASONING_SECRET_ENV} is empty",
                "unreadable": f"${REASONING_SECRET_FILE_ENV}={tmp_path / 'missing'}: cannot be read",
                "both": f"both ${REASONING_SECRET_ENV} and ${REASONING_SECRET_FILE_ENV} are set"}[case]
    assert expected in lines[0]
    assert SECRET not in err


def test_a_good_reasoning_secret_lets_relax_serve_go_on(monkeypatch, capsys, tmp_path):
    (tmp_path / "secret").write_text(SECRET + "\n")
    # the next check refuses (the empty --api-key), before any model is built: the secret's check passed
    code, err = start(monkeypatch, capsys, {REASONING_SECRET_FILE_ENV: str(tmp_path / "secret")})
    assert code == 2 and "--api-key: an empty key" in err and "reasoning" not in err
