# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Whether a certificate names the host a client asks for, by the rules the clients apply: RFC 6125 6.4 as Python's
ssl module (OpenSSL's X509_check_host with X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS, which the role's own check of the
front door uses) and browsers apply it. A DNS name matches a dNSName; a wildcard stands for exactly one whole
left-most label, under at least two labels; an address matches an iPAddress only, never a dNSName; the subject's
CN is never read.

PRIVATE to the collection: this is not a public API; it may change without notice.
"""

import ipaddress
from collections.abc import Sequence
from typing import Optional
from urllib.parse import urlsplit


def url_host(url: str) -> str:
    """The host of url, lower case, without brackets or a trailing dot; '' where it names none."""
    try:
        host = urlsplit(url).hostname or ''
    except ValueError:
        return ''
    return host.rstrip('.')


def ip_host(host: str) -> Optional[str]:
    """host as a normalized address where it is one, else None."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


def ascii_host(host: str) -> str:
    """A DNS host as its A-labels (IDNA), as the client sends it in SNI and compares it."""
    try:
        return host.encode('idna').decode('ascii').lower()
    except UnicodeError:
        return host.lower()


def dns_name_matches(pattern: str, host: str) -> bool:
    """Whether a dNSName matches host (both A-labels)."""
    pattern = pattern.lower().rstrip('.')
    if '*' not in pattern:
        return pattern == host
    labels = pattern.split('.')
    if labels[0] != '*' or '*' in '.'.join(labels[1:]) or len(labels) < 3:
        return False
    host_labels = host.split('.')
    return len(host_labels) == len(labels) and host_labels[0] != '' and host_labels[1:] == labels[1:]


def name_for_host(host: str, dns_names: Sequence[str], ip_addresses: Sequence[str]) -> Optional[str]:
    """The subjectAltName entry (DNS:x, IP:y) that names host, or None."""
    address = ip_host(host)
    if address is not None:
        return next(('IP:' + ip for ip in ip_addresses if ip_host(ip) == address), None)
    wanted = ascii_host(host)
    return next(('DNS:' + name for name in dns_names if dns_name_matches(name, wanted)), None)


def wanted_entry(host: str) -> str:
    """The subjectAltName entry a certificate for host needs, as openssl's -addext writes it."""
    return ('IP:' if ip_host(host) is not None else 'DNS:') + host
