# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Every path option refuses a NUL by name, before AnsibleModule logs its arguments to syslog.

Since Python 3.12 syslog raises on a NUL, so a check in the module's own code is never reached and the
user reads "Failed to log to syslog" instead; the argument spec's type speaks first on every Python.
"""

import pytest

CASES = [
    ('checkpoint_sealed', {'path': '/x\0y'}, 'path'),
    ('checkpoint_verify', {'path': '/x\0y', 'manifest': '/m.json'}, 'path'),
    ('checkpoint_verify', {'path': '/x', 'manifest': '/m\0.json'}, 'manifest'),
    ('checkpoint_verify', {'path': '/x', 'manifest': '/m.json', 'cache_dir': '/c\0'}, 'cache_dir'),
    ('gpu_preflight', {'model_path': '/m\0', 'tensor_parallel_size': 1}, 'model_path'),
    ('gpu_preflight', {'model_path': '/m', 'tensor_parallel_size': 1, 'shm_path': '/dev/shm\0x'}, 'shm_path'),
    (
        'gpu_preflight',
        {'model_path': '/m', 'tensor_parallel_size': 1, 'nvidia_smi_path': 'nvidia-smi\0'},
        'nvidia_smi_path',
    ),
    ('deployment', {'path': '/d\0'}, 'path'),
    ('deployment', {'path': '/d', 'state': 'restored', 'unit_file': '/u\0', 'environment_file': '/e'}, 'unit_file'),
    ('kv_cache_quant', {'path': '/ckpt\0'}, 'path'),
    ('progress', {'results_file': '/j\0'}, 'results_file'),
    (
        'tls_certificate_check',
        {'certificate_path': '/c\0', 'private_key_path': '/k', 'url': 'https://h'},
        'certificate_path',
    ),
    (
        'tls_certificate_check',
        {'certificate_path': '/c', 'private_key_path': '/k\0', 'url': 'https://h'},
        'private_key_path',
    ),
]


@pytest.mark.parametrize(('module', 'args', 'option'), CASES, ids=['%s-%s' % (c[0], c[2]) for c in CASES])
def test_a_nul_in_a_path_is_refused_by_the_options_name(module, args, option, module_result):
    rc, result = module_result(module, args)
    assert rc == 1, result
    assert result['msg'] == (
        "argument '%s' is of type str and we were unable to convert to nul_free_path: "
        'a path cannot hold a NUL character' % option
    )
