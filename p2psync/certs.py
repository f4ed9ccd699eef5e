"""The cluster's certificate authority and node certificates (X.509 through ``cryptography``).

Every link between two nodes, and between a client and a node, is mutually
authenticated TLS (:mod:`p2psync.transport.tls`): each side presents a
certificate issued by the cluster CA, which the operator keeps (``p2psync
keygen`` makes it beside the trainer key; ``p2psync cert issue`` issues a node's
certificate). A node certificate names the node: its id is the subject's common
name (and a ``p2psync://node/<id>`` URI SAN), its region the organizational
unit. What a node claims about itself on the wire (the id in gossip, leases and
results, the child header) must equal the id in the certificate it connected
with. p2psync's own clients check that id, not the host name; the certificate
also names the hosts the node is reached at (DNS and IP SANs: ``localhost``,
``127.0.0.1``, ``::1`` and each ``--host``), so that a standard TLS client
(``curl --cacert ca.crt``, Python's default context, a browser) verifies it
with its usual host-name check.

Files of a certificate folder (what ``issue`` writes, what a node reads as
``tls.dir``)::

    ca.crt      the cluster CA's certificate (trust anchor, public)
    node.crt    this node's certificate
    node.key    this node's private key (0600)

Keys are ECDSA P-256 (fast to make, accepted by every TLS stack and browser).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from p2psync.errors import ConfigError

CA_CERT, CA_KEY = "ca.crt", "ca.key"
NODE_CERT, NODE_KEY = "node.crt", "node.key"
URI_PREFIX = "p2psync://node/"
CLIENT_UNIT = "client"
"""Organizational unit of a client-only certificate (the CLI, an operator): it may call nodes, never serve."""
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
"""Hosts every node certificate names (a node on loopback, a client on the node's machine)."""
_DNS_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


@dataclass(frozen=True)
class Identity:
    """Who a certificate names."""

    id: str
    region: str
    serial: int
    client_only: bool = False


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    os.replace(tmp, path)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def create_ca(directory: Path, name: str = "p2psync cluster CA", days: int = 3650) -> Path:
    """Make the cluster CA (``ca.key``, ``ca.crt``) in ``directory``; refuses to overwrite one."""
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    if cert_path.exists() or key_path.exists():
        raise ConfigError("output", f"{cert_path} or {key_path} already exists; refusing to overwrite the CA")
    key = _new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name),
                         x509.NameAttribute(NameOID.ORGANIZATION_NAME, "p2psync")])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write_key(key, key_path)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path


def _load_ca(ca_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        cert = x509.load_pem_x509_certificate((ca_dir / CA_CERT).read_bytes())
        key = serialization.load_pem_private_key((ca_dir / CA_KEY).read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise ConfigError("ca", f"cannot read the cluster CA in {ca_dir} ({CA_CERT}, {CA_KEY}): {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError("ca", f"{ca_dir / CA_KEY} is not an ECDSA key made by p2psync keygen")
    return cert, key


def check_id(value: str, field: str = "id") -> str:
    if not _ID.match(value):
        raise ConfigError(field, f"must be 1-128 letters, digits or ._:@- (starting with a letter or digit), "
                                 f"got {value!r}")
    return value


def host_names(hosts: Iterable[str]) -> list[x509.GeneralName]:
    """Subject alternative names for ``hosts`` (IP addresses, else DNS names, ``*.`` wildcards allowed);
    :data:`LOCAL_HOSTS` first. Raises :class:`ConfigError` naming ``host`` for anything else."""
    out: list[x509.GeneralName] = []
    seen: set[str] = set()
    for raw in (*LOCAL_HOSTS, *hosts):
        host = raw.strip().lower()
        if host in seen:
            continue
        seen.add(host)
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
            continue
        except ValueError:
            pass
        labels = host[2:].split(".") if host.startswith("*.") else host.split(".")
        if not host or len(host) > 253 or not all(_DNS_LABEL.match(x) for x in labels):
            raise ConfigError("host", f"must be an IP address or a DNS name (e.g. node1.example.org), got {raw!r}")
        out.append(x509.DNSName(host))
    return out


def issue(ca_dir: Path, node_id: str, region: str, out_dir: Path, *, days: int = 365,
          client_only: bool = False, hosts: Iterable[str] = ()) -> Path:
    """Issue a certificate for ``node_id`` in ``region`` into ``out_dir`` (``ca.crt``, ``node.crt``,
    ``node.key``; replaced if present). ``client_only``: may call nodes (CLI, operator), never serve.
    ``hosts``: the DNS names and IP addresses the node is reached at, beside :data:`LOCAL_HOSTS`
    (a client-only certificate names none)."""
    check_id(node_id)
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(URI_PREFIX + node_id)]
    hosts = list(hosts)
    if client_only and hosts:
        raise ConfigError("host", "a client-only certificate is never served, so it names no host")
    if not client_only:
        check_id(region, "region")
        names += host_names(hosts)
    ca_cert, ca_key = _load_ca(ca_dir)
    key = _new_key()
    unit = CLIENT_UNIT if client_only else region
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id),
                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, unit),
                         x509.NameAttribute(NameOID.ORGANIZATION_NAME, "p2psync")])
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] if client_only else [ExtendedKeyUsageOID.SERVER_AUTH,
                                                                     ExtendedKeyUsageOID.CLIENT_AUTH]
    now = _now()
    ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=True, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
            .sign(ca_key, hashes.SHA256()))
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_key(key, out_dir / NODE_KEY)
    (out_dir / NODE_CERT).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out_dir / CA_CERT).write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    return out_dir / NODE_CERT


def identity_of(cert_path: Path) -> Identity:
    """The identity a certificate file names."""
    try:
        cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError("tls.dir", f"cannot read certificate {cert_path}: {exc}") from None
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ou = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    unit = str(ou[0].value) if ou else ""
    return Identity(str(cn[0].value) if cn else "", unit, cert.serial_number, unit == CLIENT_UNIT)


def check_issued_by(cert_path: Path, ca_path: Path) -> None:
    """Raise :class:`ConfigError` unless ``cert_path`` is signed by the CA in ``ca_path``: a node
    whose certificate does not chain to the ``ca.crt`` beside it is refused by every peer (they
    hold that CA), so it must not start."""
    try:
        cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
        ca = x509.load_pem_x509_certificate(Path(ca_path).read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError("tls.dir", f"cannot read certificate {cert_path} or {ca_path}: {exc}") from None
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise ConfigError("tls.dir", f"certificate not issued by this cluster's CA: {cert_path} does not chain "
                                     f"to the {ca_path.name} beside it; issue it with this cluster's CA "
                                     "(`p2psync cert issue --ca CA_DIR`) or put this cluster's ca.crt there") from None


def hosts_of(cert_path: Path) -> list[str]:
    """The DNS names and IP addresses a certificate file names (its host SANs)."""
    cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [*san.get_values_for_type(x509.DNSName), *(str(ip) for ip in san.get_values_for_type(x509.IPAddress))]


def identity_from_peercert(peercert: dict | None) -> Identity | None:
    """The identity in :meth:`ssl.SSLSocket.getpeercert`'s dict (None without a certificate)."""
    if not peercert:
        return None
    fields = {k: v for rdn in peercert.get("subject", ()) for k, v in rdn}
    cn, unit = fields.get("commonName", ""), fields.get("organizationalUnitName", "")
    if not cn:
        return None
    return Identity(cn, unit, int(peercert.get("serialNumber", "0"), 16), unit == CLIENT_UNIT)


class Authority:
    """A cluster CA in a folder, made on first use: for harnesses that start a whole cluster on
    one machine (the demo, the WAN testbed, benchmarks, tests). Operators use ``p2psync keygen``
    and ``p2psync cert issue`` instead, and keep the CA's key away from the nodes."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        if not (self.directory / CA_CERT).exists():
            create_ca(self.directory)

    def node(self, node_id: str, region: str, out_dir: Path, hosts: Iterable[str] = ()) -> Path:
        """Issue ``node_id``'s certificate into ``out_dir`` (a node's default: ``<data_dir>/tls``)."""
        issue(self.directory, node_id, region, Path(out_dir), hosts=hosts)
        return Path(out_dir)

    def client(self, name: str = "operator") -> Path:
        """A client-only certificate folder (issued once, kept under the CA's folder)."""
        out = self.directory / "clients" / name
        if not (out / NODE_CERT).exists():
            issue(self.directory, name, CLIENT_UNIT, out, client_only=True)
        return out
