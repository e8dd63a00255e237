# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The preflight's refusal of a service other hosts reach without a key (tasks/preflight.yml, vars/main.yml), run by
Ansible on the role's defaults and the settings of each case, and the gpu inventory's key from Ansible Vault."""

import os

import pytest
import yaml

from ansible_collections.llmserve.vllm.tests.support import REPO, run_local_play

ROLE = os.path.join(REPO, 'roles', 'vllm_kimi')
GPU_VARS = os.path.join(REPO, 'inventories', 'gpu', 'group_vars', 'vllm.yml')
LOAD_VARS = [
    {'ansible.builtin.include_vars': os.path.join(ROLE, 'defaults', 'main.yml')},
    {'ansible.builtin.include_vars': os.path.join(ROLE, 'vars', 'main.yml')},
]
REFUSAL_TASK = 'Refuse settings that open the service beyond its front door'
KEY = 'sk-t3st-key'


def preflight_refusal():
    with open(os.path.join(ROLE, 'tasks', 'preflight.yml')) as handle:
        return [task for task in yaml.safe_load(handle) if task.get('name') == REFUSAL_TASK]


def refusal(tmp_path, extra_vars, more_vars=()):
    """The preflight's message for these settings (the role's variables, then more_vars's files), or None where it
    lets them through."""
    loads = LOAD_VARS + [{'ansible.builtin.include_vars': path} for path in more_vars]
    rc, output = run_local_play(tmp_path, loads + preflight_refusal(), extra_vars)
    if rc == 0:
        return None
    assert 'TASK [%s]' % REFUSAL_TASK in output and 'fatal: [localhost]' in output, output
    return output


OPEN = 'The service answers anyone who reaches %s without a key: set vllm_kimi_api_key'


@pytest.mark.parametrize(
    'extra_vars, refused_at',
    [
        pytest.param({}, '0.0.0.0:8443', id='defaults-front-door-on-every-address'),
        pytest.param({'vllm_kimi_front_address': '10.0.0.5'}, '10.0.0.5:8443', id='front-door-on-a-lan-address'),
        pytest.param({'vllm_kimi_front_address': '::'}, ':::8443', id='front-door-on-every-ipv6-address'),
        pytest.param({'vllm_kimi_api_key': KEY}, None, id='with-a-key'),
        pytest.param({'vllm_kimi_allow_anonymous_endpoint': True}, None, id='open-endpoint-accepted'),
        pytest.param({'vllm_kimi_front_address': '127.0.0.1'}, None, id='front-door-on-loopback'),
        pytest.param({'vllm_kimi_front_address': '127.0.1.1'}, None, id='front-door-on-another-loopback-address'),
        pytest.param({'vllm_kimi_front_door': False}, None, id='no-front-door-vllm-on-loopback'),
        pytest.param(
            {'vllm_kimi_front_door': False, 'vllm_kimi_host': '0.0.0.0'}, '0.0.0.0:8000', id='no-front-door-vllm-open'
        ),
    ],
)
def test_a_service_other_hosts_reach_needs_a_key(tmp_path, extra_vars, refused_at):
    output = refusal(tmp_path, extra_vars)
    if refused_at is None:
        assert output is None
    else:
        assert OPEN % refused_at in output, output
        assert 'or set vllm_kimi_allow_anonymous_endpoint to serve an open endpoint.' in output


def test_the_gpu_inventory_takes_its_key_from_the_vault_and_stops_without_it(tmp_path):
    with_gpu_vars = [GPU_VARS]
    assert refusal(tmp_path, {'vault_vllm_kimi_api_key': KEY}, with_gpu_vars) is None
    output = refusal(tmp_path, {}, with_gpu_vars)
    assert "'vault_vllm_kimi_api_key' is undefined" in output, output
    # A vault that holds an empty key is the open endpoint, refused as such.
    assert OPEN % '0.0.0.0:8443' in refusal(tmp_path, {'vault_vllm_kimi_api_key': ''}, with_gpu_vars)
