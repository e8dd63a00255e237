# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The judgement of a TLS server's certificate and key before the server is (re)started on them: present and readable,
the key the certificate's, valid now and for a while yet, and naming the host clients ask for. Each refusal names the
file (by the option that gave it) and what to do; the key's content is never part of any message.

PRIVATE to the collection: this is not a public API; it may change without notice.
"""

import os
import pwd
import stat
from datetime import datetime
from typing import Any, NamedTuple, Optional

from ansible_collections.llmserve.vllm.plugins.module_utils.tls._der import DerError, pem_blocks
from ansible_collections.llmserve.vllm.plugins.module_utils.tls._host_names import name_for_host, url_host, wanted_entry
from ansible_collections.llmserve.vllm.plugins.module_utils.tls._public_key import (
    PrivateKeyError,
    Pubout,
    private_key_public_half,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.tls._x509 import Certificate, parse_certificate

# Far more than any chain; a device or a wrong path (a disk image) is not read whole.
MAX_PEM_BYTES = 1024 * 1024
DAY_SECONDS = 86400
RENEW = 'renew it (docs/security.md, "The front door\'s certificate") and put it there'
WILDCARD_RULE = (
    ' (a wildcard stands for exactly one whole left-most label: *.example.com names a.example.com, '
    'neither example.com nor a.b.example.com)'
)


class Judgement(NamedTuple):
    problems: list[str]
    warnings: list[str]
    facts: dict[str, Any]


class PemFile(NamedTuple):
    """A PEM file's text, or the refusal that says why it could not be read; its mode."""

    text: Optional[str]
    problem: Optional[str]
    mode: int


def unreadable(path: str, option: str, exc: OSError) -> str:
    """The refusal of a file this process's user cannot read: nginx's master reads it as root, and so must the play."""
    user = pwd.getpwuid(os.geteuid()).pw_name
    return '%s %s cannot be read by %s (%s): run the play with become, as nginx reads it as root.' % (
        option,
        path,
        user,
        exc.strerror,
    )


def read_pem_file(path: str, option: str, remedy: str) -> PemFile:
    """The text of the file at path (option names it in the messages), read as this process's user."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return PemFile(None, '%s %s does not exist: %s.' % (option, path, remedy), 0)
    except OSError as exc:
        return PemFile(None, unreadable(path, option, exc), 0)
    if not stat.S_ISREG(info.st_mode):
        return PemFile(None, '%s %s is not a regular file: %s.' % (option, path, remedy), 0)
    if info.st_size > MAX_PEM_BYTES:
        return PemFile(
            None, '%s %s is larger than 1 MiB, which no PEM file of keys is: %s.' % (option, path, remedy), 0
        )
    try:
        with open(path, 'rb') as handle:
            text = handle.read(MAX_PEM_BYTES).decode('ascii', 'replace')
    except OSError as exc:
        return PemFile(None, unreadable(path, option, exc), 0)
    return PemFile(text, None, stat.S_IMODE(info.st_mode))


def utc(moment: datetime) -> str:
    return moment.strftime('%Y-%m-%d %H:%M:%S UTC')


def leaf_certificate(path: str, text: str) -> tuple[Optional[Certificate], int, Optional[str]]:
    """The first certificate of the file (the server's own, its chain after it), how many it holds, or the refusal."""
    try:
        blocks = [b for b in pem_blocks(text) if b.label == 'CERTIFICATE']
        if not blocks:
            return (
                None,
                0,
                (
                    'certificate_path %s holds no PEM certificate (-----BEGIN CERTIFICATE-----), the form nginx reads: '
                    'convert a DER file with openssl x509 -inform der -in FILE -out FILE.pem, or point certificate_path '
                    'at the PEM file.' % path
                ),
            )
        return parse_certificate(blocks[0].der), len(blocks), None
    except DerError as exc:
        return (
            None,
            0,
            'certificate_path %s: its first certificate is no valid X.509 (%s): issue it again.' % (path, exc),
        )


def validity_verdict(cert: Certificate, path: str, now: datetime, warn_days: int) -> tuple[list[str], list[str]]:
    """A certificate not valid yet or any more is refused; one that expires within warn_days is a warning."""
    if now < cert.not_before:
        return [
            'certificate_path %s is not valid before %s (its notBefore), and clients refuse it until then: check '
            "this host's clock (timedatectl), or issue it again." % (path, utc(cert.not_before))
        ], []
    if now >= cert.not_after:
        return ['certificate_path %s expired on %s (its notAfter), and clients refuse it: %s.' % (
            path, utc(cert.not_after), RENEW)], []  # fmt: skip
    days = int((cert.not_after - now).total_seconds() // DAY_SECONDS)
    if days < warn_days:
        return [], ['certificate_path %s expires on %s, in %d days: %s before then.' % (
            path, utc(cert.not_after), days, RENEW)]  # fmt: skip
    return [], []


def host_verdict(cert: Certificate, path: str, url: str) -> tuple[Optional[str], Optional[str]]:
    """The subjectAltName entry that names url's host, or the refusal."""
    host = url_host(url)
    matched = name_for_host(host, cert.dns_names, cert.ip_addresses)
    if matched:
        return matched, None
    if cert.has_subject_alt_name:
        has = 'its subjectAltName names %s' % (', '.join(cert.subject_alt_names()) or 'no DNS name or address')
        if any('*' in name for name in cert.dns_names):
            has += WILDCARD_RULE
    else:
        has = 'it has no subjectAltName (clients do not read its subject%s)' % (
            ' CN=' + cert.common_name if cert.common_name else '')  # fmt: skip
    return None, (
        'certificate_path %s does not name %s, the host of url %s: %s, and clients refuse it. Issue it with '
        'subjectAltName %s, or set url to a name it carries.' % (path, host, url, has, wanted_entry(host))
    )


def key_verdict(key_path: str, text: str, pubout: Pubout, cert: Certificate, cert_path: str) -> Optional[str]:
    """The refusal of a private key nginx cannot read or that is not the certificate's, or None."""
    try:
        public_half = private_key_public_half(text, key_path, pubout)
    except PrivateKeyError as exc:
        return 'private_key_path %s %s.' % (key_path, exc)
    except DerError as exc:
        return (
            'private_key_path %s holds no private key nginx reads (%s): put the PEM key the certificate was issued '
            'for there (-----BEGIN PRIVATE KEY-----).' % (key_path, exc)
        )
    if public_half.identity == cert.public_key.identity:
        return None
    mine, theirs = public_half.describe(), cert.public_key.describe()
    which = (
        "another %s key than the certificate's" % mine
        if mine == theirs
        else "the key %s, the certificate's %s" % (mine, theirs)
    )
    return (
        'private_key_path %s does not belong to certificate_path %s (%s), and nginx would not start: put the key the '
        'certificate was issued for there, or issue the certificate for this key.' % (key_path, cert_path, which)
    )


def key_mode_warning(key_path: str, mode: int) -> list[str]:
    """A key every user of the host can read is a key any process there can use to pose as the server."""
    if not mode & stat.S_IROTH:
        return []
    return [
        'private_key_path %s can be read by every user of this host (mode %04o): chmod 0600 it (or 0640, group '
        'ssl-cert).' % (key_path, mode)
    ]


def certificate_facts(cert: Certificate, chain_length: int, now: datetime) -> dict[str, Any]:
    return dict(
        not_before=utc(cert.not_before),
        not_after=utc(cert.not_after),
        days_left=int((cert.not_after - now).total_seconds() // DAY_SECONDS),
        subject_alt_names=cert.subject_alt_names(),
        common_name=cert.common_name,
        public_key=cert.public_key.describe(),
        chain_length=chain_length,
    )


def judge(cert_path: str, key_path: str, url: str, now: datetime, warn_days: int, pubout: Pubout) -> Judgement:
    """Every refusal and warning for the certificate at cert_path with the key at key_path, served at url."""
    problems: list[str] = []
    warnings: list[str] = []
    facts: dict[str, Any] = dict(host=url_host(url))
    cert_file = read_pem_file(
        cert_path,
        'certificate_path',
        "put the server's certificate there (PEM, its chain after it), or set certificate_path to where it is",
    )
    key_file = read_pem_file(
        key_path,
        'private_key_path',
        'put its private key there (PEM, readable by root only), or set private_key_path to where it is',
    )
    problems += [p for p in (cert_file.problem, key_file.problem) if p]
    if key_file.text is not None:
        warnings += key_mode_warning(key_path, key_file.mode)
    if cert_file.text is None:
        return Judgement(problems, warnings, facts)
    cert, chain_length, problem = leaf_certificate(cert_path, cert_file.text)
    if cert is None:
        return Judgement(problems + [problem or ''], warnings, facts)
    facts['certificate'] = certificate_facts(cert, chain_length, now)
    refused, warned = validity_verdict(cert, cert_path, now, warn_days)
    problems += refused
    warnings += warned
    facts['matched_name'], problem = host_verdict(cert, cert_path, url)
    problems += [problem] if problem else []
    if key_file.text is not None:
        problem = key_verdict(key_path, key_file.text, pubout, cert, cert_path)
        problems += [problem] if problem else []
    return Judgement(problems, warnings, facts)
