"""`SGLangEngines.close` stops every server it started, also one whose actor is still busy starting a replacement.

Such an actor runs one call at a time: its `stop` waits behind the `start`, and the server it is starting would
outlive the run (seen under load in tests/runner/test_sglang_training.py's killed-engine run: the run ended while
the replacement loaded). The close kills that actor after its wait, and the server process dies with it
(PR_SET_PDEATHSIG: tests/sglang/test_options.py starts real servers that way). Here a stand-in for Ray's
`wait`/`kill` says which actors answered, so the decision is checked without starting servers.
"""

from __future__ import annotations

import sys
import threading
import types

from relax.runner.rollout_driver.sglang_engines import SGLangEngines


class Server:
    """An engine server actor whose `stop` answers, or does not (busy with a start)."""

    def __init__(self, busy: bool):
        self.busy, self.stopped, self.killed = busy, False, False
        self.stop = types.SimpleNamespace(remote=self._stop)

    def _stop(self):
        self.stopped = not self.busy
        return (self, self.stopped)


def fake_ray(waited: list):
    def wait(refs, num_returns, timeout):
        waited.append((num_returns, timeout))
        return [r for r in refs if r[1]], [r for r in refs if not r[1]]

    def kill(actor):
        actor.killed = True

    return types.SimpleNamespace(wait=wait, kill=kill)


def closing(servers: list[Server]) -> SGLangEngines:
    engines = object.__new__(SGLangEngines)
    engines._stop = threading.Event()
    engines.episodes = engines.agents = engines._watchdog = engines._local = engines.router = None
    engines.sg = types.SimpleNamespace(urls=None)
    engines.servers = servers
    return engines


def test_a_server_still_starting_is_killed_and_the_others_stop(monkeypatch, capsys):
    waited: list = []
    monkeypatch.setitem(sys.modules, "ray", fake_ray(waited))
    servers = [Server(busy=False), Server(busy=True), Server(busy=False)]
    closing(servers).close()
    # one bounded wait for all of them, then one for the killed actor's stop (it fails once the actor is dead), so
    # that its server is going when the close returns
    assert waited == [(3, 15.0), (1, 15.0)]
    assert [(s.stopped, s.killed) for s in servers] == [(True, False), (False, True), (True, False)]
    assert capsys.readouterr().err == ""  # nothing failed: the busy one is dealt with, not reported


def test_servers_that_stop_are_not_killed(monkeypatch):
    waited: list = []
    monkeypatch.setitem(sys.modules, "ray", fake_ray(waited))
    servers = [Server(busy=False), Server(busy=False)]
    closing(servers).close()
    assert not any(s.killed for s in servers) and all(s.stopped for s in servers)
    assert waited == [(2, 15.0)]  # nothing killed: nothing more to wait for
