# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""vllm_kimi_cuda_home: which CUDA toolkit the preflight puts in the plan (for the unit's PATH and CUDA_HOME), and the
refusal of one without nvcc, run as preflight.yml's own tasks on this machine."""

import json
import os

import pytest
import yaml

from ansible_collections.llmserve.vllm.tests.support import LOAD_VLLM_KIMI_VARS, VLLM_KIMI, run_local_play

TASKS = ('Find the CUDA toolkit the unit names', 'Refuse a CUDA toolkit without nvcc')
PLAN_TASK = 'Keep the plan every later phase follows'


def preflight_tasks(out):
    """The two tasks, then the plan task reduced to its cuda_home (its own expression), then the plan written to out."""
    with open(os.path.join(VLLM_KIMI, 'tasks', 'preflight.yml')) as handle:
        tasks = {task['name']: task for task in yaml.safe_load(handle) if task.get('name') in TASKS + (PLAN_TASK,)}
    plan = tasks[PLAN_TASK]
    plan['ansible.builtin.set_fact']['__vllm_kimi_plan'] = {
        'cuda_home': plan['ansible.builtin.set_fact']['__vllm_kimi_plan']['cuda_home']
    }
    write = {'ansible.builtin.copy': {'content': '{{ __vllm_kimi_plan | to_json }}', 'dest': str(out), 'mode': '0644'}}
    return LOAD_VLLM_KIMI_VARS + [tasks[name] for name in TASKS] + [plan, write]


def toolkit(tmp_path, name, with_nvcc=True):
    home = tmp_path / name
    (home / 'bin').mkdir(parents=True)
    if with_nvcc:
        (home / 'bin' / 'nvcc').write_text('#!/bin/sh\n')
        (home / 'bin' / 'nvcc').chmod(0o755)
    return str(home)


def plan_of(tmp_path, extra_vars):
    out = tmp_path / 'plan.json'
    rc, output = run_local_play(tmp_path, preflight_tasks(out), extra_vars)
    return (json.loads(out.read_text()) if rc == 0 else None), output


@pytest.mark.parametrize(
    'accelerator, setting, found',
    [
        pytest.param('nvidia', 'toolkit', 'toolkit', id='named'),
        pytest.param('nvidia', 'toolkit/', 'toolkit', id='trailing-slash'),
        pytest.param('nvidia', '', '', id='none'),
        pytest.param('cpu', 'toolkit', '', id='cpu-build'),
    ],
)
def test_the_plan_names_the_toolkit_the_unit_gets(tmp_path, accelerator, setting, found):
    home = toolkit(tmp_path, 'toolkit')
    setting = setting.replace('toolkit', home) if setting else ''
    plan, output = plan_of(tmp_path, {'vllm_kimi_accelerator': accelerator, 'vllm_kimi_cuda_home': setting})
    assert plan == {'cuda_home': found.replace('toolkit', home) if found else ''}, output


def test_auto_takes_usr_local_cuda_only_where_it_has_nvcc(tmp_path):
    plan, output = plan_of(tmp_path, {'vllm_kimi_accelerator': 'nvidia', 'vllm_kimi_cuda_home': 'auto'})
    expected = '/usr/local/cuda' if os.access('/usr/local/cuda/bin/nvcc', os.F_OK) else ''
    assert plan == {'cuda_home': expected}, output


@pytest.mark.parametrize(
    'setting',
    [
        pytest.param('no-nvcc', id='no-nvcc'),
        pytest.param('missing', id='missing'),
        pytest.param('relative/cuda', id='relative'),
    ],
)
def test_a_toolkit_without_nvcc_is_refused_naming_the_variable(tmp_path, setting):
    if setting == 'no-nvcc':
        setting = toolkit(tmp_path, 'no-nvcc', with_nvcc=False)
    elif setting == 'missing':
        setting = str(tmp_path / 'missing')
    plan, output = plan_of(tmp_path, {'vllm_kimi_accelerator': 'nvidia', 'vllm_kimi_cuda_home': setting})
    assert plan is None
    assert (
        'vllm_kimi_cuda_home is %s, which is no absolute path with a bin/nvcc: set it to the toolkit' % setting
    ) in ' '.join(output.split()), output
