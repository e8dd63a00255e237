# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The CPU build's ranks under TP > 1: tasks/preflight.yml's own tasks split the unit's CPUs between them (its
AllowedCPUs, else this machine's online CPUs) and templates/environment.j2 hands vLLM the split; too few CPUs stop
the preflight, before any change; the user's own VLLM_CPU_OMP_THREADS_BIND wins."""

import pytest
import yaml

from ansible_collections.llmserve.vllm.tests.support import REPO, run_local_play

ROLE = REPO + '/roles/vllm_kimi'
with open(ROLE + '/tasks/preflight.yml') as handle:
    BINDING_TASKS = [task for task in yaml.safe_load(handle) if 'CPU build' in task['name']]


def run(tmp_path, **role_vars):
    out = tmp_path / 'environment'
    tasks = [
        {'ansible.builtin.include_vars': ROLE + '/defaults/main.yml'},
        {'ansible.builtin.include_vars': ROLE + '/vars/main.yml'},
        *BINDING_TASKS,
        # The part of the preflight's plan the environment file reads beside the binding: no CUDA toolkit here.
        {'ansible.builtin.set_fact': {'__vllm_kimi_plan': {'cuda_home': ''}}},
        {'ansible.builtin.template': {'src': ROLE + '/templates/environment.j2', 'dest': str(out), 'mode': '0600'}},
    ]
    rc, output = run_local_play(tmp_path, tasks, role_vars)
    binds = [line for line in out.read_text().splitlines() if 'OMP_THREADS_BIND' in line] if rc == 0 else None
    return rc, output, binds


def online_cpus():
    with open('/sys/devices/system/cpu/online') as handle:
        return handle.read().strip()


@pytest.mark.parametrize(
    ('role_vars', 'binds'),
    [
        (
            {'vllm_kimi_tensor_parallel_size': 2, 'vllm_kimi_service_settings': {'AllowedCPUs': '0-3'}},
            ['VLLM_CPU_OMP_THREADS_BIND="0-1|2-3"'],
        ),
        (
            {
                'vllm_kimi_tensor_parallel_size': 1,
                'vllm_kimi_pipeline_parallel_size': 2,
                'vllm_kimi_service_settings': {'CPUAffinity': '4 5'},
            },
            ['VLLM_CPU_OMP_THREADS_BIND="4|5"'],
        ),
        ({'vllm_kimi_tensor_parallel_size': 1}, []),
        (
            {'vllm_kimi_tensor_parallel_size': 2, 'vllm_kimi_environment': {'VLLM_CPU_OMP_THREADS_BIND': 'auto'}},
            ['VLLM_CPU_OMP_THREADS_BIND="auto"'],
        ),
        ({'vllm_kimi_tensor_parallel_size': 2, 'vllm_kimi_accelerator': 'nvidia'}, []),
    ],
    ids=['allowed-cpus', 'cpu-affinity', 'one-rank', 'users-own-wins', 'gpu-build'],
)
def test_the_ranks_get_the_units_cpus(tmp_path, role_vars, binds):
    rc, output, found = run(tmp_path, **dict({'vllm_kimi_accelerator': 'cpu'}, **role_vars))
    assert rc == 0, output
    assert found == binds


def test_without_a_cpu_setting_the_ranks_share_the_hosts_online_cpus(tmp_path):
    cpus = online_cpus()
    if cpus != '0-1':
        pytest.skip('this machine has CPUs %s; the expected split is written for 0-1' % cpus)
    rc, output, found = run(tmp_path, vllm_kimi_accelerator='cpu', vllm_kimi_tensor_parallel_size=2)
    assert rc == 0, output
    assert found == ['VLLM_CPU_OMP_THREADS_BIND="0|1"']


def test_too_few_cpus_for_the_ranks_stop_the_preflight(tmp_path):
    rc, output, found = run(
        tmp_path,
        vllm_kimi_accelerator='cpu',
        vllm_kimi_tensor_parallel_size=2,
        vllm_kimi_service_settings={'AllowedCPUs': '3'},
    )
    assert rc != 0
    assert (
        'cpu_threads_bind: 1 CPU(s) (3) for 2 ranks: each rank needs one of its own, from '
        'vllm_kimi_service_settings.AllowedCPUs' in output
    )
