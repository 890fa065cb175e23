"""Ports for tests that must name them before a process binds them (Ray heads, rendezvous stores, nodes), and the two
ends of an endpoint check: ports where nothing listens, one where a socket does (and one where a real gRPC server
answers, as a Ray head's does)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free now: the sockets are held together while picking (one at a time, each closed before
    the next, the kernel may give the same port twice)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


@contextlib.contextmanager
def closed_ports() -> Iterator[Callable[[], int]]:
    """`take()` gives a port where nothing listens, each held until the context ends: its socket stays bound (without
    SO_REUSEADDR) and never listens, so a connection to it is refused and nobody else can bind it meanwhile. A port
    picked free and closed could be taken at once by another process (another xdist worker's Ray or server), and the
    check that expects "refused" would reach that server."""
    with contextlib.ExitStack() as stack:

        def take() -> int:
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

        yield take


@contextlib.contextmanager
def listening_port() -> Iterator[int]:
    """A port where a socket listens while the context lasts (it never accepts: the kernel completes a connection to
    it all the same, which is what an endpoint check asks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


@contextlib.contextmanager
def grpc_port(tls: bool = False) -> Iterator[int]:
    """A port where a real gRPC server (grpcio, which Ray depends on) listens while the context lasts: what the
    check of a Ray address asks for is a gRPC server's answer, as a Ray head's GCS and Ray Client server give.
    `tls`: over TLS, with a self-signed certificate made here (a cluster with RAY_USE_TLS=1)."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    if tls:
        key, cert = _self_signed("127.0.0.1")
        port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
    else:
        port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port
    finally:
        server.stop(grace=None)


def _self_signed(host: str) -> tuple[bytes, bytes]:
    """(private key PEM, certificate PEM) of a self-signed certificate for `host`, valid for a day."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), critical=False)
            .sign(key, hashes.SHA256()))
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    return pem, cert.public_bytes(serialization.Encoding.PEM)
