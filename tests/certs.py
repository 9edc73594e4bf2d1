"""Certificates for the gRPC TLS tests: a CA, a server certificate for 127.0.0.1 and
localhost, and a client certificate, all signed by the CA (written as PEM files)."""
from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Certs:
    ca: str             # the CA's certificate
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str       # a CA that signed none of them


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _ca(cn: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _leaf(ca_key, ca_cert, cn: str, usage, names=()):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def make_certs(directory: str) -> Certs:
    os.makedirs(directory, exist_ok=True)
    pem = serialization.Encoding.PEM
    ca_key, ca_cert = _ca("shmserve test CA")
    _, other = _ca("another CA")
    s_key, s_cert = _leaf(ca_key, ca_cert, "localhost", ExtendedKeyUsageOID.SERVER_AUTH,
                          [x509.DNSName("localhost"),
                           x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    c_key, c_cert = _leaf(ca_key, ca_cert, "client", ExtendedKeyUsageOID.CLIENT_AUTH)
    j = os.path.join
    return Certs(_write(j(directory, "ca.pem"), ca_cert.public_bytes(pem)),
                 _write(j(directory, "server.pem"), s_cert.public_bytes(pem)),
                 _write(j(directory, "server.key"), _pem_key(s_key)),
                 _write(j(directory, "client.pem"), c_cert.public_bytes(pem)),
                 _write(j(directory, "client.key"), _pem_key(c_key)),
                 _write(j(directory, "other-ca.pem"), other.public_bytes(pem)))
