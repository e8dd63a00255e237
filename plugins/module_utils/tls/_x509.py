# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""What a server certificate says that decides whether clients accept it (RFC 5280): its validity, the names in its
subjectAltName, its subject's common name (for the messages only: clients no longer match it), its public key.

PRIVATE to the collection: this is not a public API; it may change without notice.
"""

import ipaddress
from datetime import datetime
from typing import NamedTuple, Optional

from ansible_collections.llmserve.vllm.plugins.module_utils.tls._der import (
    OCTET_STRING,
    SEQUENCE,
    DerError,
    Element,
    children,
    expect,
    oid,
    parse_one,
    time,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.tls._public_key import PublicKey, from_spki

SUBJECT_ALT_NAME = '2.5.29.17'
COMMON_NAME = '2.5.4.3'
DNS_NAME_TAG = 0x82  # GeneralName dNSName [2] IA5String, implicit
IP_ADDRESS_TAG = 0x87  # GeneralName iPAddress [7] OCTET STRING, implicit


class Certificate(NamedTuple):
    not_before: datetime
    not_after: datetime
    dns_names: list[str]
    ip_addresses: list[str]
    has_subject_alt_name: bool
    common_name: Optional[str]
    public_key: PublicKey

    def subject_alt_names(self) -> list[str]:
        """The names as openssl prints them: DNS:host, IP:address."""
        return ['DNS:' + name for name in self.dns_names] + ['IP:' + address for address in self.ip_addresses]


def _common_name(name: Element) -> Optional[str]:
    """The first CN of an X.501 Name."""
    for relative in children(name):
        for attribute in children(relative):
            kind, value = children(attribute)[:2]
            if oid(kind) == COMMON_NAME:
                return value.content.decode('utf-8', 'replace')
    return None


def _subject_alt_names(extensions: Element) -> Optional[Element]:
    """The GeneralNames of the subjectAltName extension, or None where there is none."""
    for extension in children(expect(children(extensions)[0], SEQUENCE, 'the extensions')):
        fields = children(extension)
        if oid(fields[0]) == SUBJECT_ALT_NAME:
            return parse_one(expect(fields[-1], OCTET_STRING, 'subjectAltName').content, SEQUENCE, 'subjectAltName')
    return None


def _names(general_names: Optional[Element]) -> tuple[list[str], list[str]]:
    """The dNSName and iPAddress entries; other kinds (email, URI) name no server."""
    dns, ips = [], []
    for name in children(general_names) if general_names else []:
        if name.tag == DNS_NAME_TAG:
            dns.append(name.content.decode('ascii', 'replace'))
        elif name.tag == IP_ADDRESS_TAG and len(name.content) in (4, 16):
            ips.append(str(ipaddress.ip_address(name.content)))
    return dns, ips


def parse_certificate(der: bytes) -> Certificate:
    """The certificate's facts from its DER. Raises DerError naming what is malformed."""
    try:
        tbs = children(children(parse_one(der, SEQUENCE, 'the certificate'))[0])
        # version [0] is optional (v1 certificates have none): serial, signature, issuer, validity, subject, key follow.
        fields = tbs[1:] if tbs[0].tag == 0xA0 else tbs
        validity, subject, spki = fields[3], fields[4], fields[5]
        not_before, not_after = (time(t) for t in children(validity)[:2])
        extensions = next((f for f in fields[6:] if f.tag == 0xA3), None)
        general_names = _subject_alt_names(extensions) if extensions else None
        dns, ips = _names(general_names)
        return Certificate(
            not_before, not_after, dns, ips, general_names is not None, _common_name(subject), from_spki(spki)
        )
    except IndexError:
        raise DerError('fields missing') from None
    except ValueError as exc:
        raise DerError(str(exc)) from None
