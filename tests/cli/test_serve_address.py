"""relax-serve refuses a port outside 0..65535 and a --host that is neither an IP address nor a name this machine
resolves, in one line before anything loads (review-user #8: --port 99999 was an OverflowError traceback after the
model loaded; --host 0.0.0.0.0 was called "reachable beyond this machine"). The model named here does not exist, so a
check that came after loading the config and the model files would report that instead."""

from __future__ import annotations

import pytest

from relax.cli import serve

MISSING_MODEL = ["model.source=hf", "model.path=/nonexistent/relax-serve-model"]


def start(capsys, *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        serve.main([*args, *MISSING_MODEL])
    return info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("port,says", [("99999", "99999 is not a port number"), ("-1", "-1 is not a port number"),
                                       ("65536", "65536 is not a port number"), ("x", "'x' is not a port number")])
def test_a_port_outside_the_tcp_range_is_a_usage_error(capsys, port, says):
    code, err = start(capsys, "--port", port)
    assert code == 2
    assert err.strip().splitlines() == [f"relax-serve: error: argument --port: {says} (0 to 65535; 0: any free port) "
                                        "(see relax-serve --help)"], err


@pytest.mark.parametrize("host", ["0.0.0.0.0", "300.1.1.1", "no such host.invalid"])
def test_a_malformed_host_is_invalid_not_reachable(capsys, host):
    code, err = start(capsys, "--port", "0", "--host", host)
    assert code == 2
    assert err.strip().splitlines() == [f"relax-serve: error: --host {host} is not a valid address: give an IP "
                                        "address (127.0.0.1, ::1, 0.0.0.0) or a name this machine resolves "
                                        "(localhost)"], err


@pytest.mark.parametrize("args", [["--port", "65535"], ["--port", "0", "--host", "localhost"],
                                  ["--port", "0", "--host", "::1"], ["--port", "0", "--host", "0.0.0.0"]])
def test_a_valid_port_and_host_go_on_to_the_next_check(capsys, args):
    """The control: these pass the address checks, and the start stops at the missing model (or, beyond loopback
    without a key, at the key rule), never at the port or the host."""
    code, err = start(capsys, *args)
    assert code == 2
    assert "not a port number" not in err and "not a valid address" not in err
    assert "/nonexistent/relax-serve-model" in err or "reachable beyond this machine" in err, err
