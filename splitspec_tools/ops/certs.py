"""`splitspec certs --out DIR`: a development CA and one certificate per service, for compose
and the tests (not for production: the CA key sits next to the certificates).

Every service certificate is valid as a server AND as a client (mTLS: the gateway dials the
target and the draft with its own certificate), for the names and addresses the services are
reached by: localhost, the compose service names (target, draft, gateway), 127.0.0.1 and ::1,
and the loopback addresses of the scale-out namespace (splitspec_tools/ops/scaleout.py)."""
from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

SERVICES = ("target", "draft", "gateway", "client")
DNS_NAMES = ("localhost", "target", "draft", "gateway")
SCALEOUT_ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6", "127.0.0.7")
IP_ADDRESSES = ("127.0.0.1", "::1", *SCALEOUT_ADDRESSES)


# cryptography is imported inside the functions: `splitspec health` (a container health check,
# every few seconds) builds the same parser and should not pay for it.

def _key():
    from cryptography.hazmat.primitives.asymmetric import ec
    return ec.generate_private_key(ec.SECP256R1())     # fast to make, supported by gRPC and OpenSSL


def _name(common_name: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "splitspec dev"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        os.chmod(path, 0o600)


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca(days: int = 825):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name("splitspec dev CA")).issuer_name(_name("splitspec dev CA"))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


def make_cert(ca_key, ca_cert, common_name: str, *, dns=DNS_NAMES, ips=IP_ADDRESSES, days: int = 825):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    san = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(a)) for a in ips]
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def write_dev_certs(out: str | Path, services=SERVICES, days: int = 825) -> dict[str, Path]:
    """Write ca.pem (+ ca-key.pem) and NAME.pem / NAME-key.pem for each service; returns the
    paths by name ("ca", "target", ...)."""
    from cryptography.hazmat.primitives import serialization
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = make_ca(days)
    _write(out / "ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM))
    _write(out / "ca-key.pem", _pem_key(ca_key), private=True)
    paths = {"ca": out / "ca.pem"}
    for name in services:
        key, cert = make_cert(ca_key, ca_cert, name, days=days)
        _write(out / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM))
        _write(out / f"{name}-key.pem", _pem_key(key), private=True)
        paths[name] = out / f"{name}.pem"
    return paths


def add_parser(sub) -> None:
    p = sub.add_parser("certs", help="write a development CA and service certificates (TLS / mTLS)")
    p.add_argument("--out", required=True, help="folder to write ca.pem and NAME.pem / NAME-key.pem into")
    p.add_argument("--days", type=int, default=825, help="validity of the certificates")


def main(args) -> int:
    paths = write_dev_certs(args.out, days=args.days)
    print(f"wrote a dev CA and certificates for {', '.join(SERVICES)} to {Path(args.out).resolve()}")
    print(f"e.g. splitspec-target ... --tls-cert {paths['target']} --tls-key {Path(args.out) / 'target-key.pem'} "
          f"--tls-ca {paths['ca']}")
    return 0
