# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The front door's certificate and key judged before anything starts on them: the DER reader against `cryptography`'s
own reading, the key match for each kind and form of key, and every refusal and warning in its exact words."""

import os
import pwd
import subprocess
from datetime import datetime, timezone

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from ansible_collections.llmserve.vllm.plugins.module_utils.tls._certificate_check import judge
from ansible_collections.llmserve.vllm.plugins.module_utils.tls._der import pem_blocks
from ansible_collections.llmserve.vllm.plugins.module_utils.tls._public_key import (
    PrivateKeyError,
    private_key_public_half,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.tls._x509 import parse_certificate
from ansible_collections.llmserve.vllm.tests.certificates import (
    DAY,
    NOW,
    certificate_pem,
    key_pem,
    make_key,
    write_pair,
)

URL = 'https://gpu1.example.com:8443'
NAMES = ('DNS:gpu1.example.com', 'IP:192.0.2.10')
RENEW = 'renew it (docs/security.md, "The front door\'s certificate") and put it there.'


def openssl_pubout(path):
    return subprocess.run(
        ['openssl', 'pkey', '-in', path, '-pubout'], capture_output=True, text=True, check=True
    ).stdout


def no_openssl(path):
    raise PrivateKeyError('carries no public half that this module derives itself, and openssl is not installed')


@pytest.mark.parametrize('kind', ['rsa', 'ec', 'ec384'])
def test_the_der_reader_reads_what_cryptography_reads(kind):
    pem = certificate_pem(make_key(kind), names=NAMES + ('DNS:*.cluster.example.com', 'IP:2001:db8::1'))
    mine = parse_certificate(pem_blocks(pem.decode())[0].der)
    theirs = x509.load_pem_x509_certificate(pem)
    assert (mine.not_before, mine.not_after) == (theirs.not_valid_before_utc, theirs.not_valid_after_utc)
    assert mine.subject_alt_names() == [
        'DNS:gpu1.example.com', 'DNS:*.cluster.example.com', 'IP:192.0.2.10', 'IP:2001:db8::1'
    ]  # fmt: skip
    assert mine.common_name == 'front'


@pytest.mark.parametrize(
    'kind, form, described',
    [
        ('rsa', 'pkcs8', 'RSA 2048-bit'),
        ('rsa', 'traditional', 'RSA 2048-bit'),
        ('ec', 'pkcs8', 'EC P-256'),
        ('ec', 'traditional', 'EC P-256'),
        ('ec384', 'pkcs8', 'EC P-384'),
        ('ed25519', 'pkcs8', 'Ed25519'),
    ],
    ids=['rsa-pkcs8', 'rsa-pkcs1', 'ec-pkcs8', 'ec-sec1', 'ec384-pkcs8', 'ed25519-by-openssl'],
)
def test_a_private_key_matches_its_certificate_and_no_other(tmp_path, kind, form, described):
    key = make_key(kind)
    path = tmp_path / 'key.pem'
    path.write_bytes(key_pem(key, form))
    public_half = private_key_public_half(path.read_text(), str(path), openssl_pubout)
    cert = parse_certificate(pem_blocks(certificate_pem(key).decode())[0].der)
    other = parse_certificate(pem_blocks(certificate_pem(make_key(kind)).decode())[0].der)
    assert public_half.describe() == described
    assert public_half.identity == cert.public_key.identity
    assert public_half.identity != other.public_key.identity


def test_openssls_own_certificate_and_key_pass(local_ca):
    """The openssl CLI's output (tests/support.py LocalCA, as tools/sandbox issues the sandboxes')."""
    now = datetime.now(timezone.utc)
    verdict = judge(local_ca.server_cert, local_ca.server_key, 'https://127.0.0.1:8443', now, 1, no_openssl)
    assert (verdict.problems, verdict.warnings, verdict.facts['matched_name']) == ([], [], 'IP:127.0.0.1')


def case(tmp_path, url=URL, pubout=openssl_pubout, **pair):
    cert, key = write_pair(tmp_path, 'front', names=pair.pop('names', NAMES), **pair)
    return judge(cert, key, url, NOW, 30, pubout), cert, key


def test_a_good_certificate_passes_with_its_facts(tmp_path):
    key = make_key('rsa')
    chain = certificate_pem(make_key())
    verdict, _cert, _key = case(tmp_path, key=key, chain=chain)
    assert (verdict.problems, verdict.warnings) == ([], [])
    assert verdict.facts == {
        'host': 'gpu1.example.com',
        'matched_name': 'DNS:gpu1.example.com',
        'certificate': {
            'not_before': (NOW - DAY).strftime('%Y-%m-%d %H:%M:%S UTC'),
            'not_after': (NOW + 365 * DAY).strftime('%Y-%m-%d %H:%M:%S UTC'),
            'days_left': 365,
            'subject_alt_names': list(NAMES),
            'common_name': 'front',
            'public_key': 'RSA 2048-bit',
            'chain_length': 2,
        },
    }


def test_an_address_is_named_by_an_ip_entry(tmp_path):
    verdict, _cert, _key = case(tmp_path, url='https://192.0.2.10:8443')
    assert (verdict.problems, verdict.facts['matched_name']) == ([], 'IP:192.0.2.10')


def test_a_certificate_for_another_host_is_refused(tmp_path):
    verdict, cert, _key = case(
        tmp_path, names=('DNS:gpu2.example.com', 'DNS:*.example.com'), url='https://a.b.example.com'
    )
    assert verdict.problems == [
        'certificate_path %s does not name a.b.example.com, the host of url https://a.b.example.com: its '
        'subjectAltName names DNS:gpu2.example.com, DNS:*.example.com (a wildcard stands for exactly one whole '
        'left-most label: *.example.com names a.example.com, neither example.com nor a.b.example.com), and clients '
        'refuse it. Issue it with subjectAltName DNS:a.b.example.com, or set url to a name it carries.' % cert
    ]


def test_a_certificate_without_subject_alt_name_is_refused(tmp_path):
    verdict, cert, _key = case(tmp_path, names=None, url='https://192.0.2.10:8443')
    assert verdict.problems == [
        'certificate_path %s does not name 192.0.2.10, the host of url https://192.0.2.10:8443: it has no '
        'subjectAltName (clients do not read its subject CN=front), and clients refuse it. Issue it with '
        'subjectAltName IP:192.0.2.10, or set url to a name it carries.' % cert
    ]


def test_an_expired_certificate_is_refused(tmp_path):
    verdict, cert, _key = case(tmp_path, not_before=NOW - 400 * DAY, not_after=NOW - DAY)
    assert verdict.problems == [
        'certificate_path %s expired on %s (its notAfter), and clients refuse it: %s'
        % (cert, (NOW - DAY).strftime('%Y-%m-%d %H:%M:%S UTC'), RENEW)
    ]


def test_a_certificate_not_valid_yet_is_refused(tmp_path):
    verdict, cert, _key = case(tmp_path, not_before=NOW + DAY)
    assert verdict.problems == [
        'certificate_path %s is not valid before %s (its notBefore), and clients refuse it until then: check this '
        "host's clock (timedatectl), or issue it again." % (cert, (NOW + DAY).strftime('%Y-%m-%d %H:%M:%S UTC'))
    ]


def test_a_certificate_about_to_expire_is_a_warning_with_its_date(tmp_path):
    verdict, cert, _key = case(tmp_path, not_after=NOW + 12 * DAY + DAY / 2)
    assert verdict.problems == []
    assert verdict.warnings == [
        'certificate_path %s expires on %s, in 12 days: %s before then.'
        % (cert, (NOW + 12 * DAY + DAY / 2).strftime('%Y-%m-%d %H:%M:%S UTC'), RENEW[:-1])
    ]


@pytest.mark.parametrize(
    'cert_kind, key_kind, which',
    [('ec', 'ec', "another EC P-256 key than the certificate's"), ('rsa', 'ec', "the key EC P-256, the certificate's RSA 2048-bit")],
    ids=['same-kind', 'other-kind'],
)  # fmt: skip
def test_a_key_that_is_not_the_certificates_is_refused(tmp_path, cert_kind, key_kind, which):
    verdict, cert, key = case(tmp_path, key=make_key(key_kind), cert_key=make_key(cert_kind))
    assert verdict.problems == [
        'private_key_path %s does not belong to certificate_path %s (%s), and nginx would not start: put the key the '
        'certificate was issued for there, or issue the certificate for this key.' % (key, cert, which)
    ]


def test_missing_files_are_refused_each_by_its_option(tmp_path):
    cert, key = str(tmp_path / 'none.pem'), str(tmp_path / 'none.key')
    assert judge(cert, key, URL, NOW, 30, no_openssl).problems == [
        "certificate_path %s does not exist: put the server's certificate there (PEM, its chain after it), or set "
        'certificate_path to where it is.' % cert,
        'private_key_path %s does not exist: put its private key there (PEM, readable by root only), or set '
        'private_key_path to where it is.' % key,
    ]


def test_a_file_that_cannot_be_read_is_refused_with_the_user_and_the_cause(tmp_path):
    cert, key = write_pair(tmp_path, 'front', names=NAMES)
    unreadable = cert + '/key'
    assert judge(cert, unreadable, URL, NOW, 30, no_openssl).problems == [
        'private_key_path %s cannot be read by %s (Not a directory): run the play with become, as nginx reads it as '
        'root.' % (unreadable, pwd.getpwuid(os.geteuid()).pw_name)
    ]


@pytest.mark.parametrize(
    'content, expected',
    [
        (lambda key: key_pem(key, 'pkcs8', b'secret'), 'is encrypted: nginx would ask for its passphrase'),
        (lambda key: key_pem(key, 'traditional', b'secret'), 'is encrypted: nginx would ask for its passphrase'),
        (lambda key: b'not a key', 'holds no private key nginx reads (no PEM private key (-----BEGIN PRIVATE KEY-----))'),
    ],
    ids=['pkcs8-encrypted', 'traditional-encrypted', 'no-pem'],
)  # fmt: skip
def test_a_key_nginx_cannot_read_is_refused(tmp_path, content, expected):
    key = make_key()
    cert, key_path = write_pair(tmp_path, 'front', key=key, names=NAMES)
    with open(key_path, 'wb') as handle:
        handle.write(content(key))
    (problem,) = judge(cert, key_path, URL, NOW, 30, no_openssl).problems
    assert problem.startswith('private_key_path %s %s' % (key_path, expected)), problem
    assert 'secret' not in problem and 'BEGIN ENCRYPTED' not in problem


def test_a_key_only_openssl_reads_is_refused_without_openssl(tmp_path):
    verdict, _cert, key = case(tmp_path, key=make_key('ed25519'), pubout=no_openssl)
    assert verdict.problems == [
        'private_key_path %s carries no public half that this module derives itself, and openssl is not installed.'
        % key
    ]


def test_a_der_certificate_is_refused_with_the_conversion(tmp_path):
    cert, key = write_pair(tmp_path, 'front', names=NAMES)
    with open(cert, 'rb') as handle:
        der = x509.load_pem_x509_certificate(handle.read()).public_bytes(serialization.Encoding.DER)
    with open(cert, 'wb') as handle:
        handle.write(der)
    assert judge(cert, key, URL, NOW, 30, no_openssl).problems == [
        'certificate_path %s holds no PEM certificate (-----BEGIN CERTIFICATE-----), the form nginx reads: convert a '
        'DER file with openssl x509 -inform der -in FILE -out FILE.pem, or point certificate_path at the PEM file.'
        % cert
    ]


def test_a_key_every_user_reads_is_a_warning(tmp_path):
    verdict, _cert, key = case(tmp_path, key_mode=0o644)
    os.chmod(key, 0o600)
    assert verdict.warnings == [
        'private_key_path %s can be read by every user of this host (mode 0644): chmod 0600 it (or 0640, group '
        'ssl-cert).' % key
    ]
