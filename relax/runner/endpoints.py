"""The addresses a run must reach that the user gave, and whether each accepts a TCP connection (and, for an HTTP
server, answers a request): preflight's `endpoints` check, which the sweep launcher's check of each job runs too
(`relax.runner.sweep_check`). Light: sockets and the config only."""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional
from urllib.parse import urlsplit

from relax.config.credentials import without_secrets
from relax.config.schema import RelaxConfig
from relax.rewards.remote import is_url
from relax.tracking.db_store import DATABASE_PORTS, database_engine

ENDPOINT_TIMEOUT_S = 3.0  # a TCP connect to each address the run must reach (`endpoints`); all are probed at once;
# an HTTP server has as long again for the first byte of its answer to a GET


@dataclass(frozen=True)
class Endpoint:
    """An address the run must reach: the option that names it (`option`, as the user sets it), its value, and the
    host and port a connection is opened to."""

    option: str
    value: str
    host: str
    port: int
    what: str  # what should listen there, for the message
    scheme: Optional[str] = None  # "http" / "https": an HTTP server, which must also answer a request; "grpc": a
    # gRPC server (a Ray head's GCS, a Ray Client server), which must begin an HTTP/2 exchange
    tracking_store: bool = False  # the run's MLflow tracking store (tracking.uri): a sweep says it apart, once


@dataclass(frozen=True)
class Unreachable:
    """One address that `unreachable_endpoints` found not to accept a connection: its `endpoint` (what it is, e.g.
    `endpoint.tracking_store`) and the `message` naming it with its option."""

    endpoint: Endpoint
    message: str


def _host_port(address: str, default_port: Optional[int] = None) -> Optional[tuple[str, int]]:
    """(host, port) of `scheme://host:port/...` or `host:port`; None when it names no host, or no port and there is
    no default."""
    parts = urlsplit(address if "://" in address else "//" + address)
    try:
        host, port = parts.hostname, parts.port
    except ValueError:  # a port that is not a number: the start's own parser says so
        return None
    port = port if port is not None else default_port
    return (host, port) if host and port is not None else None


def _ray_endpoint(cfg: RelaxConfig) -> Optional[Endpoint]:
    """The Ray cluster a start joins (as `relax.runner.cluster.RayRuntime` chooses it: `cluster.address`, else
    RAY_ADDRESS), or None: a local instance is started, or the address cannot be probed (`ray_endpoint`)."""
    option, address, what = "cluster.address", cfg.cluster.address, "a Ray head (ray start --head)"
    if address is None:
        option, address = "RAY_ADDRESS", os.environ.get("RAY_ADDRESS") or None
        what = "the Ray head that RAY_ADDRESS names (joined: cluster.address is unset)"
    return ray_endpoint(option, address, what)


def ray_endpoint(option: str, address: Optional[str], what: str = "a Ray head (ray start --head)"
                 ) -> Optional[Endpoint]:
    """The Ray cluster at `address` that the option `option` names, to probe; None where there is nothing to probe:
    no address (a local instance is started), "auto" (Ray finds the cluster itself, from its session file or a local
    head), "local", or an address without a port (what it means is Ray's to decide). Also the sweep launcher's
    check of `hydra.launcher.address`, which its jobs join instead of `cluster.address` or RAY_ADDRESS."""
    if address is None or address.strip().lower() in ("auto", "local"):
        return None
    # "ray://host:port": the Ray Client server; "host:port": the head's GCS; either accepts TCP at host:port
    target = _host_port(address.strip())
    if target is None:
        return None
    return Endpoint(option, address, *target, what=what, scheme="grpcs" if ray_uses_tls() else "grpc")


def ray_uses_tls() -> bool:
    """Whether Ray's clients speak TLS to the cluster (RAY_USE_TLS, read as Ray reads it): its gRPC servers then
    answer only after a TLS handshake."""
    return os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")


def _url_endpoint(option: str, value: str, what: str, tracking_store: bool = False,
                  default_port: Optional[int] = None) -> Optional[Endpoint]:
    """The server at URL `value` (of option `option`) to probe; None for one that names no host and port (the
    config rules let it through unparsed: the start's own error names it)."""
    scheme = urlsplit(value).scheme.lower()
    target = _host_port(value, {"http": 80, "https": 443}.get(scheme, default_port))
    if target is None:
        return None
    return Endpoint(option, value, *target, what=what, scheme=scheme if scheme in ("http", "https") else None,
                    tracking_store=tracking_store)


def tracking_endpoint(uri: str, option: str = "tracking.uri") -> Optional[Endpoint]:
    """The server of MLflow tracking store `uri` (the value of `option`) to probe: an MLflow tracking server
    (http, https), or a database server (postgresql://, mysql://, mssql://: a TCP connection is all that is asked, its
    protocol is the driver's); None for a local store (sqlite, a directory) or a URI without a host (a database's
    local socket named in the query is the driver's). Also what relax-compare and relax-verify-run probe before
    their first MLflow call."""
    uri = uri.strip()
    if urlsplit(uri).scheme.lower() in ("http", "https"):
        return _url_endpoint(option, uri, "an MLflow tracking server", tracking_store=True)
    if (engine := database_engine(uri)) is not None:
        return _url_endpoint(option, uri, f"the {engine} server of the MLflow store", tracking_store=True,
                             default_port=DATABASE_PORTS[engine])
    return None


def tracking_store_unreachable(uri: str, option: str) -> Optional[str]:
    """Why the server of MLflow tracking store `uri` (the value of `option`, as the message names it) does not
    accept a connection (or, an HTTP server, answer a request) within `ENDPOINT_TIMEOUT_S`, else None (it does, or
    the store is local): a check that takes seconds where MLflow's client retries for minutes."""
    target = tracking_endpoint(uri, option)
    problems = unreachable([target]) if target is not None else []
    return problems[0] if problems else None


def endpoint_targets(cfg: RelaxConfig) -> list[Endpoint]:
    """Every address a start of `cfg` must reach that the user gave (the `endpoints` check)."""
    targets: list[Endpoint] = []

    def url(option: str, value: str, what: str) -> None:
        if (target := _url_endpoint(option, value, what)) is not None:
            targets.append(target)

    if (ray := _ray_endpoint(cfg)) is not None:
        targets.append(ray)
    if cfg.rollout.backend == "sglang" and cfg.rollout.sglang.urls:
        for i, u in enumerate(cfg.rollout.sglang.urls):
            url(f"rollout.sglang.urls[{i}]", u, "an SGLang server")
    if cfg.tracking.enabled and (store := tracking_endpoint(cfg.tracking.uri)) is not None:
        targets.append(store)
    if is_url(cfg.data.reward):
        url("data.reward", cfg.data.reward.strip(), "a reward service")
    elif not isinstance(cfg.data.reward, str):  # a list: each service of it (relax.rewards.combined)
        for i, spec in enumerate(cfg.data.reward):
            if is_url(spec):
                url(f"data.reward[{i}]", spec.strip(), "a reward service")
    rm = cfg.reward_model
    if rm.kind != "none" and rm.engine == "openai" and rm.url:
        url("reward_model.url", rm.url, "an OpenAI-compatible API")
    return targets


def probe(host: str, port: int, timeout_s: float = ENDPOINT_TIMEOUT_S, scheme: Optional[str] = None) -> Optional[str]:
    """Why a TCP connection to host:port cannot be opened within `timeout_s` (None: it was accepted, and closed).
    With `scheme` ("http", "https") the server must also begin an answer to `GET /` within `timeout_s` more: any
    answer will do (a 404, a TLS alert); one that accepts connections and says nothing (a hung server) would
    otherwise hold the run for its whole request time-out. With "grpc" it must answer HTTP/2's connection preface
    with its SETTINGS frame, as every gRPC server does: Ray's client waits for ever on an address where something
    else listens (a web server, a stopped head), retrying in its C++ loop."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            if scheme in ("grpc", "grpcs"):
                return _not_grpc(sock, host, port, timeout_s, tls=scheme == "grpcs")
            return None if scheme is None else _silent(sock, host, port, timeout_s, scheme)
    except socket.gaierror as exc:
        return f"cannot resolve {host}: {exc.strerror or exc}"
    except ConnectionRefusedError:
        return f"connection to {host}:{port} refused"
    except TimeoutError:
        return f"no answer from {host}:{port} within {timeout_s:g} s"
    except OSError as exc:
        return f"cannot connect to {host}:{port}: {exc.strerror or exc}"


def _silent(sock: socket.socket, host: str, port: int, timeout_s: float, scheme: str) -> Optional[str]:
    """Why the HTTP server on the connected `sock` is taken for hung (None: it began an answer)."""
    silent = f"{host}:{port} accepts connections but did not answer an HTTP request within {timeout_s:g} s (hung?)"
    sock.settimeout(timeout_s)
    try:
        if scheme == "https":  # only whether it answers: the run's own client checks the certificate
            context = ssl.create_default_context()
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
            sock = context.wrap_socket(sock, server_hostname=host)
        sock.sendall(f"GET / HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
        return None if sock.recv(1) else f"{host}:{port} closed the connection without answering an HTTP request"
    except TimeoutError:
        return silent
    except ssl.SSLError:  # it answered, in TLS: what it said is the run's client's to report
        return None
    except OSError as exc:
        return f"{host}:{port} accepted the connection, then failed an HTTP request: {exc.strerror or exc}"


# HTTP/2's client connection preface, then an empty SETTINGS frame (RFC 9113 3.4, 6.5): a gRPC server answers with
# a frame header of its own whose type byte (the fourth) is SETTINGS, 0x4
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_H2_SETTINGS = 4


def _not_grpc(sock: socket.socket, host: str, port: int, timeout_s: float, *, tls: bool = False) -> Optional[str]:
    """Why the server on the connected `sock` is no gRPC server (None: it answered HTTP/2's preface with SETTINGS);
    `tls` (RAY_USE_TLS): after a TLS handshake (ALPN h2, as gRPC asks; the certificate is Ray's client's to check)."""
    sock.settimeout(timeout_s)
    if tls:
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        context.set_alpn_protocols(["h2"])
        try:
            sock = context.wrap_socket(sock, server_hostname=host)
        except TimeoutError:
            return f"{host}:{port} accepts connections but did not complete a TLS handshake within {timeout_s:g} s " \
                   "(hung?)"
        except OSError as exc:
            return f"{host}:{port} answers, but not as a gRPC server over TLS (RAY_USE_TLS is on): the TLS " \
                   f"handshake failed ({exc.strerror or exc})"
    head = b""
    try:
        sock.sendall(_H2_PREFACE)
        while len(head) < 9:
            chunk = sock.recv(9 - len(head))
            if not chunk:
                break
            head += chunk
    except TimeoutError:
        if not head:
            return f"{host}:{port} accepts connections but did not begin a gRPC exchange within {timeout_s:g} s " \
                   "(hung?)"
    except OSError as exc:
        return f"{host}:{port} accepted the connection, then failed a gRPC exchange: {exc.strerror or exc}"
    if len(head) == 9 and head[3] == _H2_SETTINGS:
        return None
    said = f" (it answered {head[:9]!r})" if head else " (it closed the connection)"
    return f"{host}:{port} answers, but not as a gRPC server{said}, as a Ray head's GCS port (ray start --head " \
           "--port, 6379 by default) and its Ray Client server (ray://, 10001) do"


def unreachable(targets: Sequence[Endpoint], timeout_s: float = ENDPOINT_TIMEOUT_S) -> list[str]:
    """The message of each of `targets` that does not accept a connection (`unreachable_endpoints`)."""
    return [u.message for u in unreachable_endpoints(targets, timeout_s)]


def unreachable_endpoints(targets: Sequence[Endpoint], timeout_s: float = ENDPOINT_TIMEOUT_S) -> list[Unreachable]:
    """Each of `targets` that does not accept a connection, with its message, probed at once (in threads: together
    they take at most about twice `timeout_s` (a connection, then an HTTP server's answer), a name that does not
    resolve at most the resolver's own time-out)."""
    found: dict[int, Optional[str]] = {}

    def one(i: int, t: Endpoint) -> None:
        found[i] = probe(t.host, t.port, timeout_s, t.scheme)

    threads = [threading.Thread(target=one, args=(i, t), name=f"relax-probe-{t.option}", daemon=True)
               for i, t in enumerate(targets)]
    for thread in threads:
        thread.start()
    wait_s = 2 * timeout_s + 2.0  # a resolver slower than the connect's time-out counts as no answer
    end = time.monotonic() + wait_s
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
    problems = []
    for i, t in enumerate(targets):
        why = found.get(i, f"no answer from {t.host}:{t.port} within {wait_s:g} s")
        if why is not None:
            # a URL's query may hold a token, a database URL's user part a password
            value = without_secrets(t.value) if t.scheme in ("http", "https") or t.tracking_store else t.value
            problems.append(Unreachable(t, f"{t.option}={value}: {why} (is {t.what} running there, and reachable "
                                           "from this machine?)"))
    return problems
