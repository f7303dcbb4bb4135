"""TLS under the one client layer: a server with a certificate, a client
that checks it against a CA, mutual TLS, and what plain text gets."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from client import SBPClient
from net.pool import ConnectionPool
from net.request import Request, Responder
from net.server import Dispatcher, Server
from net.tls import TLSSettings
from sbp import messages
from sbp.enums import Opcode
from sbp.errors import ConnectionClosed


def _issue(
    name: str, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None, folder: Path
) -> tuple[x509.Name, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_name, issuer_key = issuer if issuer is not None else (subject, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is not None:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    cert = builder.sign(issuer_key, hashes.SHA256())
    (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / f"{name}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return subject, key


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    ca = _issue("ca", None, tmp_path)
    _issue("server", ca, tmp_path)
    _issue("client", ca, tmp_path)
    return tmp_path


def settings(pki: Path, name: str, *, ca: bool = True) -> TLSSettings:
    return TLSSettings(
        ca=pki / "ca.pem" if ca else None, cert=pki / f"{name}.pem", key=pki / f"{name}.key"
    )


async def heartbeat(request: Request, responder: Responder) -> None:
    header = request.header_as(messages.HeartbeatRequest)
    await responder.send(messages.HeartbeatResponse(client_id=header.client_id))


@asynccontextmanager
async def tls_server(server_tls: TLSSettings) -> AsyncIterator[str]:
    dispatcher = Dispatcher("test")
    dispatcher.register(Opcode.HEARTBEAT, heartbeat)
    server = Server(dispatcher, tls=server_tls.server_context())
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(server.serve, "127.0.0.1", 0)
        yield f"{host}:{port}"
        nursery.cancel_scope.cancel()


async def test_a_client_verifies_the_server_and_talks_over_tls(pki: Path) -> None:
    async with tls_server(TLSSettings(cert=pki / "server.pem", key=pki / "server.key")) as address:
        tls = TLSSettings(ca=pki / "ca.pem").client_context()
        async with SBPClient(address, tls=tls, timeout=5) as client:
            assert (await client.heartbeat("over tls")).client_id == "over tls"
            assert await client.ping() >= 0


async def test_mutual_tls_wants_a_client_certificate_from_its_ca(pki: Path) -> None:
    async with tls_server(settings(pki, "server")) as address:
        async with SBPClient(address, tls=settings(pki, "client").client_context()) as client:
            assert (await client.heartbeat("mutual")).client_id == "mutual"
        without = TLSSettings(ca=pki / "ca.pem").client_context()
        pool = ConnectionPool(tls=without, connect_attempts=1, connect_timeout=5)
        async with pool, SBPClient(address, pool=pool, timeout=5) as anonymous:
            with pytest.raises((ConnectionClosed, OSError, trio.BrokenResourceError)):
                await anonymous.heartbeat("no certificate")


async def test_plain_text_on_a_tls_port_gets_nothing(pki: Path) -> None:
    async with tls_server(settings(pki, "server")) as address:
        pool = ConnectionPool(connect_attempts=1, connect_timeout=5)
        async with pool, SBPClient(address, pool=pool, timeout=3) as plain:
            with pytest.raises((ConnectionClosed, OSError)):
                await plain.heartbeat("plain")
        # The server goes on serving TLS clients.
        async with SBPClient(address, tls=settings(pki, "client").client_context()) as client:
            assert (await client.heartbeat("after")).client_id == "after"
