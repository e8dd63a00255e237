# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""A minimal DER reader and PEM unwrapper: what reading an X.509 certificate and a private key needs, in ansible-core's
own libraries (no `cryptography` on the target).

PRIVATE to the collection: this is not a public API; it may change without notice.
"""

import base64
import binascii
import re
from datetime import datetime, timezone
from typing import NamedTuple

SEQUENCE = 0x30
INTEGER = 0x02
BIT_STRING = 0x03
OCTET_STRING = 0x04
OID = 0x06
UTC_TIME = 0x17
GENERALIZED_TIME = 0x18

_PEM_BLOCK = re.compile(r'-----BEGIN ([A-Z0-9 ]+)-----(.*?)-----END \1-----', re.DOTALL)


class DerError(ValueError):
    """Bytes that are not the DER structure expected; the message says where."""


class Element(NamedTuple):
    """One DER element: its tag, its content, and all of its bytes (what a public key is compared by)."""

    tag: int
    content: bytes
    encoded: bytes


class PemBlock(NamedTuple):
    """One PEM block: its label (CERTIFICATE, PRIVATE KEY...), whether its headers say it is encrypted, its DER."""

    label: str
    encrypted: bool
    der: bytes


def read_element(data: bytes, offset: int = 0) -> tuple[Element, int]:
    """The element at offset and the offset after it."""
    if offset + 2 > len(data):
        raise DerError('truncated at byte %d' % offset)
    tag, first = data[offset], data[offset + 1]
    if tag & 0x1F == 0x1F:
        raise DerError('a multi-byte tag at byte %d' % offset)
    start = offset + 2
    if first < 0x80:
        length = first
    elif first == 0x80 or first > 0x84:
        raise DerError('a length DER does not allow at byte %d' % offset)
    else:
        count = first & 0x7F
        length = int.from_bytes(data[start : start + count], 'big')
        start += count
    end = start + length
    if end > len(data):
        raise DerError('an element at byte %d runs past the end' % offset)
    return Element(tag, data[start:end], data[offset:end]), end


def children(element: Element) -> list[Element]:
    """The elements a constructed element (SEQUENCE, SET, an explicit tag) holds."""
    found = []
    offset = 0
    while offset < len(element.content):
        child, offset = read_element(element.content, offset)
        found.append(child)
    return found


def expect(element: Element, tag: int, what: str) -> Element:
    """element, or a DerError naming what was expected."""
    if element.tag != tag:
        raise DerError('%s: expected tag 0x%02x, found 0x%02x' % (what, tag, element.tag))
    return element


def parse_one(data: bytes, tag: int, what: str) -> Element:
    """The single element data holds, of tag."""
    element, end = read_element(data)
    if end != len(data):
        raise DerError('%s: %d bytes after its end' % (what, len(data) - end))
    return expect(element, tag, what)


def integer(element: Element) -> int:
    return int.from_bytes(expect(element, INTEGER, 'an integer').content, 'big', signed=True)


def bit_string(element: Element) -> bytes:
    """The bytes of a BIT STRING of whole bytes (keys, points)."""
    content = expect(element, BIT_STRING, 'a bit string').content
    if not content or content[0] != 0:
        raise DerError('a bit string of partial bytes')
    return content[1:]


def oid(element: Element) -> str:
    """An OBJECT IDENTIFIER in dotted form."""
    content = expect(element, OID, 'an object identifier').content
    arcs: list[int] = []
    value = 0
    for byte in content:
        value = (value << 7) | (byte & 0x7F)
        if not byte & 0x80:
            arcs.append(value)
            value = 0
    if not arcs:
        raise DerError('an empty object identifier')
    first = min(arcs[0] // 40, 2)
    return '.'.join(str(arc) for arc in [first, arcs[0] - 40 * first] + arcs[1:])


def time(element: Element) -> datetime:
    """A UTCTime or GeneralizedTime in UTC, as X.509 writes them (RFC 5280 4.1.2.5: seconds, Z)."""
    text = element.content.decode('ascii', 'replace')
    if element.tag == UTC_TIME and re.match(r'^\d{12}Z$', text):
        year = int(text[:2])
        text = ('19' if year >= 50 else '20') + text
    elif element.tag != GENERALIZED_TIME or not re.match(r'^\d{14}Z$', text):
        raise DerError('a time X.509 does not allow: %r' % text)
    try:
        return datetime.strptime(text, '%Y%m%d%H%M%SZ').replace(tzinfo=timezone.utc)
    except ValueError as exc:
        raise DerError('a time that is no date: %r (%s)' % (text, exc)) from None


def pem_blocks(text: str) -> list[PemBlock]:
    """The PEM blocks of text in their order; OpenSSL's traditional encrypted keys carry a Proc-Type header."""
    blocks = []
    for match in _PEM_BLOCK.finditer(text):
        lines = [line.strip() for line in match.group(2).strip().splitlines()]
        headers = [line for line in lines if ':' in line]
        body = ''.join(line for line in lines if line and ':' not in line)
        try:
            der = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise DerError('its %s block is not valid base64' % match.group(1)) from None
        encrypted = any(h.replace(' ', '').upper().startswith('PROC-TYPE:4,ENCRYPTED') for h in headers)
        blocks.append(PemBlock(match.group(1), encrypted or match.group(1).startswith('ENCRYPTED'), der))
    return blocks
