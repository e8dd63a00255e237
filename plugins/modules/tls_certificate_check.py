#!/usr/bin/python
# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

DOCUMENTATION = r"""
---
module: tls_certificate_check
short_description: Judge a TLS server's certificate and key before the server starts on them
version_added: 0.2.0
description:
  - "Refuses, before anything is (re)started on them, a certificate and key that the server (nginx) or its clients
    would refuse: a file missing or unreadable as the module's user (root, with become), a file that holds no PEM
    certificate or key, an encrypted key (nginx would ask for its passphrase), a key that is not the certificate's,
    a certificate not valid yet or expired, and one whose subjectAltName does not name the host of O(url)."
  - "The certificate file may hold a chain: the first certificate is the server's own and the one judged
    (RV(certificate.chain_length) counts them). Its chain is not verified here: the server's clients do that, against
    the trust store they use."
  - "Names follow RFC 6125 as Python's C(ssl) module and browsers apply them: a DNS host matches a dNSName, a wildcard
    stands for exactly one whole left-most label (V(*.example.com) names V(a.example.com), neither V(example.com) nor
    V(a.b.example.com) nor, for V(f*.example.com), V(foo.example.com)); an IP address matches an iPAddress entry only.
    The subject's common name is never matched, as clients no longer read it."
  - "Certificates and keys are read in pure Python (a DER reader of the collection's own): RSA and EC keys, in PKCS #8
    (C(BEGIN PRIVATE KEY)) or OpenSSL's traditional form (C(BEGIN RSA PRIVATE KEY), C(BEGIN EC PRIVATE KEY)), are
    compared with the certificate's public key by their numbers (modulus and exponent; curve and point). A key that
    does not carry its public half (Ed25519, Ed448, an EC key written without its point) is asked of
    C(openssl pkey -pubout), and refused, saying so, where C(openssl) is not installed."
  - "A certificate that expires within O(warn_days) days is a warning with the date; a key every user of the host may
    read is a warning too."
  - The key's content is never part of a message or of the result.
author:
  - llmserve.vllm contributors (@llmserve)
extends_documentation_fragment:
  - llmserve.vllm.attributes
  - llmserve.vllm.attributes.READ_ONLY
options:
  certificate_path:
    description: The server's certificate, PEM, its chain after it (nginx's C(ssl_certificate)).
    type: path
    required: true
  private_key_path:
    description: Its private key, PEM, unencrypted (nginx's C(ssl_certificate_key)). Read as the module's user.
    type: path
    required: true
  url:
    description: The URL the server's clients use; the certificate must name its host.
    type: str
    required: true
  warn_days:
    description: A certificate that expires within this many days (0 to 3650) is a warning.
    type: int
    default: 30
  setting_names:
    description:
      - The caller's own name for each option it sets from a setting of its own, so that a message names the setting
        to change (C(vllm_kimi_front_tls_certificate)) instead of the option (C(certificate_path)).
    type: dict
    default: {}
"""

EXAMPLES = r"""
- name: Refuse a front door certificate that nginx or its clients would refuse
  become: true
  llmserve.vllm.tls_certificate_check:
    certificate_path: /etc/ssl/certs/vllm-kimi.pem
    private_key_path: /etc/ssl/private/vllm-kimi.key
    url: https://gpu1.example.com:8443
"""

RETURN = r"""
host:
  description: The host of O(url), which the certificate must name.
  returned: always
  type: str
  sample: gpu1.example.com
matched_name:
  description: The subjectAltName entry that names RV(host); null when none does.
  returned: when the certificate was read
  type: str
  sample: DNS:*.example.com
certificate:
  description: What the first certificate of O(certificate_path) says.
  returned: when the certificate was read
  type: dict
  contains:
    not_before:
      description: Its notBefore, in UTC.
      returned: always
      type: str
      sample: 2026-12-01 00:00:00 UTC
    not_after:
      description: Its notAfter, in UTC.
      returned: always
      type: str
      sample: 2027-12-01 00:00:00 UTC
    days_left:
      description: Whole days until RV(certificate.not_after); negative once it has passed.
      returned: always
      type: int
      sample: 360
    subject_alt_names:
      description: Its subjectAltName's DNS names and addresses, as openssl prints them.
      returned: always
      type: list
      elements: str
      sample: [DNS:gpu1.example.com, IP:192.0.2.10]
    common_name:
      description: Its subject's CN, for the reader (clients do not match it); null when it has none.
      returned: always
      type: str
      sample: gpu1.example.com
    public_key:
      description: The kind and size of its public key.
      returned: always
      type: str
      sample: EC P-256
    chain_length:
      description: How many certificates the file holds, the server's own first.
      returned: always
      type: int
      sample: 2
problems:
  description: Each refusal, naming the file and what to do; the module fails when there is any.
  returned: always
  type: list
  elements: str
  sample: []
"""

import datetime

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmserve.vllm.plugins.module_utils._arguments import nul_free_path, range_problem
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._setting_names import (
    callers_texts,
    in_callers_words,
    unknown_setting_names,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.tls._certificate_check import judge
from ansible_collections.llmserve.vllm.plugins.module_utils.tls._public_key import PrivateKeyError

ARGUMENT_SPEC = dict(
    certificate_path=dict(type=nul_free_path, required=True),
    # A path, not the key: the key itself is never read into a result or a message.
    private_key_path=dict(type=nul_free_path, required=True, no_log=False),
    url=dict(type='str', required=True),
    warn_days=dict(type='int', default=30),
    setting_names=dict(type='dict', default={}),
)


def openssl_pubout(module):
    """The public half of a key file, as `openssl pkey -pubout` writes it: the path is an argument, the key's content
    never leaves the file."""

    def pubout(path):
        openssl = module.get_bin_path('openssl')
        if not openssl:
            raise PrivateKeyError(
                'carries no public half that this module derives itself (Ed25519, Ed448, or an EC key written '
                'without its point), and openssl is not installed to derive it: install openssl (apt-get install '
                'openssl), or use an RSA or EC key as openssl writes it'
            )
        rc, out, err = module.run_command([openssl, 'pkey', '-in', path, '-pubout'])
        if rc != 0:
            raise PrivateKeyError('is no key openssl pkey reads (%s)' % (err.strip().splitlines() or ['rc %d' % rc])[0])
        return out

    return pubout


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    p = module.params
    names = p['setting_names']
    # The paths and the URL are the caller's words: an option's name inside them is never renamed.
    words = callers_texts(p)
    error = unknown_setting_names(names, ARGUMENT_SPEC) or range_problem('warn_days', p['warn_days'], 0, 3650)
    if error:
        module.fail_json(msg=in_callers_words(error, names, words))
    now = datetime.datetime.now(datetime.timezone.utc)
    verdict = judge(p['certificate_path'], p['private_key_path'], p['url'], now, p['warn_days'], openssl_pubout(module))
    for warning in verdict.warnings:
        module.warn(in_callers_words(warning, names, words))
    problems = [in_callers_words(problem, names, words) for problem in verdict.problems]
    if not verdict.facts['host']:
        problems.insert(0, in_callers_words('url %s names no host.' % p['url'], names, words))
    if problems:
        module.fail_json(msg=' '.join(problems), problems=problems, changed=False, **verdict.facts)
    module.exit_json(changed=False, problems=[], **verdict.facts)


if __name__ == '__main__':
    main()
