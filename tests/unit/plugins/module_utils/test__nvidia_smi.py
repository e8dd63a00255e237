# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Unit tests of _nvidia_smi: the queries and their parsers, on output captured on a real H200 host."""

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils._command import CommandTimeout
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._nvidia_smi import (
    parse_apps,
    parse_gpus,
    parse_persistence,
    query_nvidia_smi,
    query_persistence,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._preflight_common import PreflightError
from ansible_collections.llmserve.vllm.tests.support import recorded


def smi(name):
    return recorded('nvidia-smi', name)


H200_0 = {
    'index': 0,
    'name': 'NVIDIA H200',
    'memory_total_mib': 143771,
    'compute_capability': '9.0',
    'driver_version': '580.159.04',
    'uuid': 'GPU-5cc339a9-9917-25f6-912e-7bd3ebe1758a',
}
H200_1 = {
    'index': 1,
    'name': 'NVIDIA H200',
    'memory_total_mib': 143771,
    'compute_capability': '9.0',
    'driver_version': '580.159.04',
    'uuid': 'GPU-b4434b79-99e2-18bd-807a-1fe6ca5173b0',
}


@pytest.mark.parametrize(
    'fixture, used',
    [
        ('query-gpu-idle.txt', [0, 0]),
        ('query-gpu-busy.txt', [10767, 21007]),
    ],
)
def test_parse_gpus_real_captures(fixture, used):
    assert parse_gpus(smi(fixture)) == [dict(H200_0, memory_used_mib=used[0]), dict(H200_1, memory_used_mib=used[1])]


@pytest.mark.parametrize(
    'fixture, expected',
    [
        ('query-apps-idle.txt', []),
        (
            'query-apps-busy.txt',
            [
                {'pid': 578, 'process_name': 'python3', 'used_memory_mib': 10758, 'gpu_uuid': H200_0['uuid']},
                {'pid': 579, 'process_name': 'python3', 'used_memory_mib': 20998, 'gpu_uuid': H200_1['uuid']},
            ],
        ),
    ],
)
def test_parse_apps_real_captures(fixture, expected):
    assert parse_apps(smi(fixture)) == expected


@pytest.mark.parametrize('used', ['[N/A]', '[Insufficient Permissions]', '1e400', 'nan', '-5'])
def test_parse_apps_unreadable_memory(used):
    assert parse_apps('42, vllm, %s, GPU-x\n' % used) == [
        {'pid': 42, 'process_name': 'vllm', 'used_memory_mib': None, 'gpu_uuid': 'GPU-x'}
    ]


@pytest.mark.parametrize(
    'parser, text, message',
    [
        (
            parse_gpus,
            '0, NVIDIA H200, 143771\n',
            'nvidia-smi printed 3 fields where 7 (index,name,memory.total,memory.used,compute_cap,driver_version,uuid) '
            'were expected, in line: 0, NVIDIA H200, 143771',
        ),
        (
            parse_gpus,
            '0, NVIDIA H200, [N/A], 0, 9.0, 580, GPU-x\n',
            "nvidia-smi printed memory.total '[N/A]' where a number was expected, in line: 0, NVIDIA H200, [N/A], 0, 9.0, 580, GPU-x",
        ),
        (
            parse_apps,
            'x, python3, 1, GPU-x\n',
            "nvidia-smi printed pid 'x' where a number was expected, in line: x, python3, 1, GPU-x",
        ),
        (
            parse_apps,
            '1, python3\n',
            'nvidia-smi printed 2 fields where 4 (pid,process_name,used_memory,gpu_uuid) were expected, in line: 1, python3',
        ),
        # A zero total would divide the plan by zero; an overflowing one is no number; neither is a GPU.
        (
            parse_gpus,
            '0, H200, 0, 0, 9.0, 580, GPU-x\n',
            "nvidia-smi printed memory.total '0' where a number of at least 1 was expected, in line: 0, H200, 0, 0, 9.0, 580, GPU-x",
        ),
        (
            parse_gpus,
            '0, H200, 1e400, 0, 9.0, 580, GPU-x\n',
            "nvidia-smi printed memory.total '1e400' where a number was expected, in line: 0, H200, 1e400, 0, 9.0, 580, GPU-x",
        ),
        (
            parse_gpus,
            '0, H200, 1e300, 0, 9.0, 580, GPU-x\n',
            "nvidia-smi printed memory.total '1e300' where a number of at most 8796093022208 was expected, in line: "
            '0, H200, 1e300, 0, 9.0, 580, GPU-x',
        ),
        (
            parse_gpus,
            '0, H200, 143771, -1, 9.0, 580, GPU-x\n',
            "nvidia-smi printed memory.used '-1' where a number of at least 0 was expected, in line: 0, H200, 143771, -1, 9.0, 580, GPU-x",
        ),
        (
            parse_gpus,
            'nan, H200, 143771, 0, 9.0, 580, GPU-x\n',
            "nvidia-smi printed index 'nan' where a number was expected, in line: nan, H200, 143771, 0, 9.0, 580, GPU-x",
        ),
    ],
)
def test_parse_bad_output(parser, text, message):
    with pytest.raises(PreflightError) as exc:
        parser(text)
    assert str(exc.value) == message


def fake_smi(gpu_answer, apps_answer):
    calls = []

    def run(argv):
        calls.append(argv)
        answer = gpu_answer if argv[1].startswith('--query-gpu') else apps_answer
        if isinstance(answer, Exception):
            raise answer
        return answer

    return run, calls


def test_query_nvidia_smi_real_captures():
    run, calls = fake_smi((0, smi('query-gpu-busy.txt'), ''), (0, smi('query-apps-busy.txt'), ''))
    gpus, apps = query_nvidia_smi(run, '/usr/bin/nvidia-smi')
    assert [g['memory_used_mib'] for g in gpus] == [10767, 21007]
    assert [a['pid'] for a in apps] == [578, 579]
    assert calls == [
        [
            '/usr/bin/nvidia-smi',
            '--query-gpu=index,name,memory.total,memory.used,compute_cap,driver_version,uuid',
            '--format=csv,noheader,nounits',
        ],
        [
            '/usr/bin/nvidia-smi',
            '--query-compute-apps=pid,process_name,used_memory,gpu_uuid',
            '--format=csv,noheader,nounits',
        ],
    ]


@pytest.mark.parametrize(
    'gpu_answer, message',
    [
        # Real: nvidia-smi prints a bad field's complaint on stdout and exits 2.
        (
            (int(smi('query-bad-field.rc.txt')), smi('query-bad-field.txt'), ''),
            '/usr/bin/nvidia-smi --query-gpu=index,name,memory.total,memory.used,compute_cap,driver_version,uuid '
            '--format=csv,noheader,nounits failed with exit code 2: Field "no_such_field" is not a valid field to query.',
        ),
        (
            (9, '', "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"),
            '/usr/bin/nvidia-smi --query-gpu=index,name,memory.total,memory.used,compute_cap,driver_version,uuid '
            "--format=csv,noheader,nounits failed with exit code 9: NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.",
        ),
        (
            OSError(2, 'No such file or directory'),
            'cannot run /usr/bin/nvidia-smi: No such file or directory (is the NVIDIA driver installed? set nvidia_smi_path)',
        ),
        (
            CommandTimeout('/usr/bin/nvidia-smi --query-gpu=... did not finish within 30 seconds and was killed'),
            '/usr/bin/nvidia-smi --query-gpu=... did not finish within 30 seconds and was killed: is the NVIDIA driver hung? '
            '(nvidia_smi_timeout sets the deadline)',
        ),
        (
            (-9, '', ''),
            '/usr/bin/nvidia-smi --query-gpu=index,name,memory.total,memory.used,compute_cap,driver_version,uuid '
            '--format=csv,noheader,nounits was killed by signal 9',
        ),
    ],
)
def test_query_nvidia_smi_failures(gpu_answer, message):
    run, calls = fake_smi(gpu_answer, (0, '', ''))
    with pytest.raises(PreflightError) as exc:
        query_nvidia_smi(run, '/usr/bin/nvidia-smi')
    assert str(exc.value) == message


# ---------------------------------------------------------------- persistence mode


def test_parse_persistence():
    # Synthetic: what the H200 host's plain nvidia-smi table showed (Persistence-M On), in the query's CSV form.
    assert parse_persistence(smi('query-persistence-off.txt')) == {
        'GPU-5cc339a9-9917-25f6-912e-7bd3ebe1758a': 'Enabled',
        'GPU-b4434b79-99e2-18bd-807a-1fe6ca5173b0': 'Disabled',
    }


@pytest.mark.parametrize(
    'answer, expected',
    [
        (
            (6, '', 'Field "persistence_mode" is not a valid field to query.'),
            '/usr/bin/nvidia-smi --query-gpu=uuid,persistence_mode --format=csv,noheader,nounits failed with exit '
            'code 6: Field "persistence_mode" is not a valid field to query.',
        ),
        (
            (0, 'GPU-5cc339a9, Enabled, 9.0\n', ''),
            'nvidia-smi printed 3 fields where 2 (uuid,persistence_mode) were expected, in line: GPU-5cc339a9, '
            'Enabled, 9.0',
        ),
    ],
    ids=['refused', 'wrong-shape'],
)
def test_query_persistence_errors(answer, expected):
    with pytest.raises(PreflightError) as err:
        query_persistence(lambda argv: answer, '/usr/bin/nvidia-smi')
    assert str(err.value) == expected
