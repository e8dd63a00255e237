# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Which public key a certificate carries and which one a private key belongs to, compared as numbers: an RSA key by
its modulus and exponent, an EC key by its curve and point. A private key that does not carry its public half
(Ed25519, Ed448, an EC key written without its point) is answered by `openssl pkey -pubout`, which the caller passes.

PRIVATE to the collection: this is not a public API; it may change without notice.
"""

from typing import Callable, NamedTuple, Optional

from ansible_collections.llmserve.vllm.plugins.module_utils.tls._der import (
    BIT_STRING,
    OCTET_STRING,
    SEQUENCE,
    DerError,
    Element,
    bit_string,
    children,
    integer,
    oid,
    parse_one,
    pem_blocks,
)

RSA = ('1.2.840.113549.1.1.1', '1.2.840.113549.1.1.10')  # rsaEncryption, RSASSA-PSS (RFC 8017)
EC = '1.2.840.10045.2.1'  # id-ecPublicKey (RFC 5480)
CURVES = {'1.2.840.10045.3.1.7': 'P-256', '1.3.132.0.34': 'P-384', '1.3.132.0.35': 'P-521'}
OTHER_KINDS = {'1.3.101.112': 'Ed25519', '1.3.101.113': 'Ed448', '1.2.840.10040.4.1': 'DSA'}
PRIVATE_KEY_LABELS = ('PRIVATE KEY', 'RSA PRIVATE KEY', 'EC PRIVATE KEY')


class PublicKey(NamedTuple):
    """A public key as compared: kind (RSA, EC, Ed25519...), what describes it (2048-bit, P-256), and the numbers
    that make it this key (an EC point by x and the parity of y, so that compressed and uncompressed forms agree)."""

    kind: str
    detail: str
    identity: tuple[object, ...]

    def describe(self) -> str:
        return ('%s %s' % (self.kind, self.detail)).strip()


class PrivateKeyError(Exception):
    """A private key whose public half cannot be had; the message says why and what to do, after the key's path."""


# Given a key file's path, the PEM text of `openssl pkey -pubout` for it; raises PrivateKeyError with the reason.
Pubout = Callable[[str], str]

ENCRYPTED = (
    'is encrypted: nginx would ask for its passphrase at every start, and the front door would not start. '
    'Store it unencrypted and readable by root only: openssl pkey -in KEY -out KEY.new, chmod 0600 KEY.new, '
    'then move it into place'
)


def rsa_key(n: int, e: int) -> PublicKey:
    return PublicKey('RSA', '%d-bit' % n.bit_length(), (n, e))


def ec_key(curve_oid: str, point: bytes) -> PublicKey:
    """An EC public key from its curve and its SEC 1 point (04 x y, or 02/03 x)."""
    if point[:1] == b'\x04' and len(point) % 2 == 1:
        x, parity = point[1 : 1 + len(point) // 2], point[-1] & 1
    elif point[:1] in (b'\x02', b'\x03'):
        x, parity = point[1:], point[0] - 2
    else:
        raise DerError('an EC point in no form SEC 1 knows')
    return PublicKey('EC', CURVES.get(curve_oid, curve_oid), (curve_oid, int.from_bytes(x, 'big'), parity))


def from_spki(spki: Element) -> PublicKey:
    """The public key of a SubjectPublicKeyInfo (RFC 5280 4.1.2.7)."""
    algorithm, key_bits = children(spki)[:2]
    parts = children(algorithm)
    kind = oid(parts[0])
    key = bit_string(key_bits)
    if kind in RSA:
        n, e = children(parse_one(key, SEQUENCE, 'an RSA public key'))[:2]
        return rsa_key(integer(n), integer(e))
    if kind == EC:
        return ec_key(oid(parts[1]), key)
    return PublicKey(OTHER_KINDS.get(kind, kind), '', (kind, key))


def _from_sec1(der: bytes, curve_oid: Optional[str]) -> Optional[PublicKey]:
    """The public key an ECPrivateKey (RFC 5915) carries in its [1] field, or None where it has none."""
    fields = children(parse_one(der, SEQUENCE, 'an EC private key'))
    for field in fields[2:]:
        if field.tag == 0xA0:
            curve_oid = oid(children(field)[0])
        elif field.tag == 0xA1 and curve_oid:
            return ec_key(curve_oid, bit_string(parse_one(field.content, BIT_STRING, 'an EC public key')))
    return None


def _from_pkcs1(der: bytes) -> PublicKey:
    fields = children(parse_one(der, SEQUENCE, 'an RSA private key'))
    return rsa_key(integer(fields[1]), integer(fields[2]))


def _from_pkcs8(der: bytes) -> Optional[PublicKey]:
    """The public key a PrivateKeyInfo (RFC 5208) carries, or None where only openssl can derive it."""
    fields = children(parse_one(der, SEQUENCE, 'a PKCS #8 private key'))
    algorithm = children(fields[1])
    kind = oid(algorithm[0])
    inner = fields[2]
    if inner.tag != OCTET_STRING:
        raise DerError('a PKCS #8 private key without its key')
    if kind in RSA:
        return _from_pkcs1(inner.content)
    if kind == EC:
        return _from_sec1(inner.content, oid(algorithm[1]) if len(algorithm) > 1 else None)
    return None


def private_key_public_half(text: str, path: str, pubout: Pubout) -> PublicKey:
    """The public key of the first private key in the PEM text of the file at path. Raises DerError where there is
    none, PrivateKeyError where it is encrypted or openssl cannot derive it."""
    blocks = [b for b in pem_blocks(text) if b.label in PRIVATE_KEY_LABELS or b.label.startswith('ENCRYPTED')]
    if not blocks:
        raise DerError('no PEM private key (-----BEGIN PRIVATE KEY-----)')
    block = blocks[0]
    if block.encrypted:
        raise PrivateKeyError(ENCRYPTED)
    try:
        if block.label == 'RSA PRIVATE KEY':
            found: Optional[PublicKey] = _from_pkcs1(block.der)
        elif block.label == 'EC PRIVATE KEY':
            found = _from_sec1(block.der, None)
        else:
            found = _from_pkcs8(block.der)
    except IndexError:
        raise DerError('a %s block with fields missing' % block.label) from None
    if found is not None:
        return found
    spkis = [b for b in pem_blocks(pubout(path)) if b.label == 'PUBLIC KEY']
    if not spkis:
        raise PrivateKeyError('carries no public key that openssl pkey -pubout could write')
    return from_spki(parse_one(spkis[0].der, SEQUENCE, 'the public key openssl wrote'))
