# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""llmserve.vllm.tls_certificate_check as Ansible runs it: read-only in check mode, a refusal in the caller's words, the
key's content in no output."""

from ansible_collections.llmserve.vllm.tests.certificates import DAY, NOW, key_pem, make_key, write_pair
from ansible_collections.llmserve.vllm.tests.support import warning_texts

ROLE_NAMES = {
    'certificate_path': 'vllm_kimi_front_tls_certificate',
    'private_key_path': 'vllm_kimi_front_tls_key',
    'url': 'vllm_kimi_front_url',
}


def test_a_good_pair_passes_unchanged_in_check_mode(tmp_path, module_result):
    cert, key = write_pair(tmp_path, 'front')
    rc, result = module_result(
        'tls_certificate_check',
        {
            'certificate_path': cert,
            'private_key_path': key,
            'url': 'https://localhost:8443',
            '_ansible_check_mode': True,
        },
    )
    assert rc == 0, result
    assert (result['changed'], result['problems'], result['matched_name']) == (False, [], 'DNS:localhost')
    # A year from the tests' NOW, a moment before the module's own.
    assert result['certificate']['days_left'] == 364


def test_each_refusal_names_the_callers_setting_and_never_the_key(tmp_path, module_result):
    key = make_key()
    cert, key_path = write_pair(tmp_path, 'front', cert_key=make_key(), not_after=NOW - DAY)
    rc, result = module_result(
        'tls_certificate_check',
        {
            'certificate_path': cert,
            'private_key_path': key_path,
            'url': 'https://gpu9.example.com:8443',
            'setting_names': ROLE_NAMES,
        },
    )
    assert rc == 1
    assert [p.split(' ', 1)[0] for p in result['problems']] == [
        'vllm_kimi_front_tls_certificate', 'vllm_kimi_front_tls_certificate', 'vllm_kimi_front_tls_key'
    ]  # fmt: skip
    assert 'the host of vllm_kimi_front_url https://gpu9.example.com:8443' in result['problems'][1]
    assert result['msg'] == ' '.join(result['problems'])
    secret = key_pem(key).decode().splitlines()[1]
    with open(key_path) as handle:
        assert secret not in str(result) and handle.read().splitlines()[1] not in str(result)


def test_an_expiring_certificate_passes_with_a_warning(tmp_path, module_result):
    cert, key = write_pair(tmp_path, 'front', not_after=NOW + 3 * DAY + DAY / 2)
    rc, result = module_result(
        'tls_certificate_check',
        {'certificate_path': cert, 'private_key_path': key, 'url': 'https://127.0.0.1', 'setting_names': ROLE_NAMES},
    )
    assert rc == 0, result
    assert [w.split(', in ')[1] for w in warning_texts(result)] == [
        '3 days: renew it (docs/security.md, "The front door\'s certificate") and put it there before then.'
    ]
    assert warning_texts(result)[0].startswith('vllm_kimi_front_tls_certificate %s expires on ' % cert)


def test_a_url_without_a_host_and_a_bad_range_are_refused(tmp_path, module_result):
    cert, key = write_pair(tmp_path, 'front')
    args = {'certificate_path': cert, 'private_key_path': key, 'url': 'gpu1:8443'}
    assert module_result('tls_certificate_check', args)[1]['problems'][0] == 'url gpu1:8443 names no host.'
    rc, result = module_result('tls_certificate_check', dict(args, warn_days=-1))
    assert (rc, result['msg']) == (1, 'warn_days must be from 0 to 3650, got -1')
