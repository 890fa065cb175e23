"""`relax-compare --uri` and `relax-verify-run --uri` probe the store's server first, with the probe relax-train's
`endpoints` check uses (`relax.runner.endpoints.tracking_store_unreachable`): a server that is not there is one line,
exit 2, in seconds (before, MLflow's HTTP client retried for about 4 minutes, then relax-compare printed a 112-line
traceback). A store that answers but fails MLflow's request is one line too (`is_store_error`), not a traceback."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator

import pytest

from relax.cli import compare as compare_cli
from relax.cli import verify_run as verify_cli


@pytest.fixture()
def not_mlflow() -> Iterator[int]:
    """An HTTP server that answers every request with a 404 (no MLflow API there); stopped after the test."""

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_error(404)

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args: object) -> None:
            pass

    class Quiet(http.server.ThreadingHTTPServer):
        def handle_error(self, request: object, client_address: object) -> None:
            pass  # a client that hangs up before reading the 404's body: socketserver would print its traceback to
            # stderr, which the test reads as the command's own output

    server = Quiet(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _compare(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as stop:
        compare_cli.main(argv)
    return stop.value.code, capsys.readouterr().err


@pytest.mark.parametrize("uri", ["http://127.0.0.1:{port}", "postgresql://relax@127.0.0.1:{port}/mlflow"])
def test_an_unreachable_store_is_one_line_in_seconds(closed_port, uri, capsys):
    port = closed_port()
    uri = uri.format(port=port)
    t0 = time.monotonic()
    code, err = _compare(["--uri", uri, "--no-log"], capsys)
    assert code == 2
    [line] = err.strip().splitlines()
    assert line.startswith("relax-compare: error: --uri=") and f"connection to 127.0.0.1:{port} refused" in line
    assert "relax@" not in line  # the user part of a database URL is hidden, as relax-train hides it
    assert verify_cli.main(["--uri", uri, "0123456789abcdef0123456789abcdef"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("relax-verify-run: error: --uri=") and f"127.0.0.1:{port} refused" in line
    assert time.monotonic() - t0 < 60  # the probes' time-outs, not MLflow's minutes of retries


def test_a_server_that_fails_mlflows_requests_is_one_line(not_mlflow, capsys):
    """Negative control: on the code before, relax-compare let MLflow's exception out (a traceback)."""
    code, err = _compare(["--uri", f"http://127.0.0.1:{not_mlflow}", "--no-log"], capsys)
    assert code == 2
    [line] = err.strip().splitlines()
    assert line.startswith(f"relax-compare: error: cannot read the MLflow store http://127.0.0.1:{not_mlflow}: ")
    assert "404" in line
    assert verify_cli.main(["--uri", f"http://127.0.0.1:{not_mlflow}", "0123456789abcdef0123456789abcdef"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("relax-verify-run: error: ")


def test_a_local_store_is_not_probed(tmp_path):
    """sqlite or a directory: nothing to connect to, so nothing is probed (the command reads the store as before)."""
    from relax.runner.endpoints import tracking_store_unreachable

    assert tracking_store_unreachable(f"sqlite:///{tmp_path}/mlflow.db", "--uri") is None
    assert tracking_store_unreachable(str(tmp_path), "--uri") is None
