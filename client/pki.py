"""A local certificate authority for ``sbp-cluster --tls`` (and tests): a CA,
and certificates it signs for the cluster's own processes (``pm``,
``datanode``) and for clients (any name: the principal ACLs speak of).

Every certificate names the loopback addresses and ``localhost`` as
subjectAltNames, so that a client checking the server it dialed by address
accepts it. Keys are P-256, written readable by their owner only. What
exists is kept: running the cluster again reuses its CA and certificates.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: the names a local cluster's certificates hold
LOCAL_HOSTS: Final = ("127.0.0.1", "::1", "localhost")
VALID_DAYS: Final = 825
#: the certificate ``sbp`` presents to a local cluster
CLIENT_NAME: Final = "client"


@dataclass(frozen=True, slots=True)
class Issued:
    """A certificate and its key, as PEM files."""

    cert: Path
    key: Path


class LocalCA:
    """A CA kept as ``ca.pem`` and ``ca.key`` in ``folder`` (made when absent)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.cert_path = folder / "ca.pem"
        key_path = folder / "ca.key"
        if self.cert_path.is_file() and key_path.is_file():
            self._key = serialization.load_pem_private_key(key_path.read_bytes(), None)
            self._cert = x509.load_pem_x509_certificate(self.cert_path.read_bytes())
            return
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sbp local CA")])
        cert = (
            _builder(name, name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        _write_key(key_path, key)
        self.cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self._key, self._cert = key, cert

    def issue(
        self, name: str, hosts: Sequence[str] = LOCAL_HOSTS, *, days: int = VALID_DAYS
    ) -> Issued:
        """``name``.pem and ``name``.key: subject CN ``name``, the ``hosts``
        as subjectAltNames, good for both ends of a connection for ``days``
        (negative: expired that long ago, for tests). Kept when they exist
        already."""
        issued = Issued(self.folder / f"{name}.pem", self.folder / f"{name}.key")
        if issued.cert.is_file() and issued.key.is_file():
            return issued
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (
            _builder(subject, self._cert.subject, key.public_key(), days)
            .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())  # type: ignore[arg-type]
        )
        _write_key(issued.key, key)
        issued.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return issued


def local_cluster_pki(folder: Path) -> tuple[Path, dict[str, Issued]]:
    """The CA and the certificates a local cluster uses: ``pm``,
    ``datanode`` and ``client`` (what ``sbp`` presents)."""
    ca = LocalCA(folder)
    return ca.cert_path, {name: ca.issue(name) for name in ("pm", "datanode", CLIENT_NAME)}


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    days: int = VALID_DAYS,
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    until = now + datetime.timedelta(days=days)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(
            min(now - datetime.timedelta(minutes=5), until - datetime.timedelta(days=1))
        )
        .not_valid_after(until)
    )


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(pem)
