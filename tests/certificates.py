# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Certificates and keys made in the tests, with the dates and names each case needs, by the `cryptography` of the tool
venv: the module under test reads them with its own DER reader, so that they are an independent oracle."""

import ipaddress
import os
from datetime import datetime, timedelta, timezone

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import NameOID

NOW = datetime.now(timezone.utc).replace(microsecond=0)
DAY = timedelta(days=1)
# A CA of the tests' own signs every certificate, as an internal CA would.
CA_KEY = ec.generate_private_key(ec.SECP256R1())


def make_key(kind='ec'):
    """A new private key: ec (P-256), ec384, rsa (2048 bits) or ed25519."""
    if kind == 'rsa':
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)
    if kind == 'ed25519':
        return ed25519.Ed25519PrivateKey.generate()
    return ec.generate_private_key(ec.SECP384R1() if kind == 'ec384' else ec.SECP256R1())


def san_entry(name):
    """DNS:x or IP:y as a GeneralName."""
    kind, value = name.split(':', 1)
    return x509.IPAddress(ipaddress.ip_address(value)) if kind == 'IP' else x509.DNSName(value)


def certificate_pem(key, names=('DNS:localhost', 'IP:127.0.0.1'), not_before=None, not_after=None, common_name='front'):
    """A server certificate for key's public half, valid from not_before (a day ago) to not_after (a year on); names
    None leaves subjectAltName out."""
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, 'tests CA')]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before or NOW - DAY)
        .not_valid_after(not_after or NOW + 365 * DAY)
    )
    if names is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName([san_entry(n) for n in names]), critical=False)
    return builder.sign(CA_KEY, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def key_pem(key, form='pkcs8', password=None):
    """The key as PEM: pkcs8 (BEGIN PRIVATE KEY), or traditional (BEGIN RSA/EC PRIVATE KEY), encrypted with password."""
    encryption = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    fmt = serialization.PrivateFormat.PKCS8 if form == 'pkcs8' else serialization.PrivateFormat.TraditionalOpenSSL
    return key.private_bytes(serialization.Encoding.PEM, fmt, encryption)


def write_pair(directory, name, key=None, cert_key=None, chain=b'', key_mode=0o600, **certificate):
    """certificate and key files NAME.pem and NAME.key in directory; cert_key issues the certificate for another key.
    Returns their paths."""
    key = key or make_key()
    cert_path, key_path = (os.path.join(str(directory), name + ext) for ext in ('.pem', '.key'))
    with open(cert_path, 'wb') as handle:
        handle.write(certificate_pem(cert_key or key, **certificate) + chain)
    with open(key_path, 'wb') as handle:
        handle.write(key_pem(key))
    os.chmod(key_path, key_mode)
    return cert_path, key_path
