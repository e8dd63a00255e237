# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""vllm_kimi refuses vllm_kimi_service_settings that would break the unit file: its own check task from
tasks/service.yml, run by Ansible on values that must pass and values that must not."""

import os

import pytest
import yaml

from ansible_collections.llmserve.vllm.tests.support import REPO, run_local_play


def check(tmp_path, settings):
    with open(os.path.join(REPO, 'roles', 'vllm_kimi', 'tasks', 'service.yml')) as f:
        task = [t for t in yaml.safe_load(f) if t['name'] == 'Refuse unit settings that would break the unit file']
    return run_local_play(tmp_path, task, {'vllm_kimi_service_settings': settings})


@pytest.mark.parametrize('settings', [{}, {'CPUAffinity': '0-47', 'MemoryMax': '900G', 'Nice': 5, 'CPUQuota': '15%'}])
def test_settings_that_pass(tmp_path, settings):
    rc, output = check(tmp_path, settings)
    assert rc == 0, output


@pytest.mark.parametrize(
    'settings',
    [
        {'CPUQuota': '15%\nExecStartPre=/bin/evil'},
        {'MemoryMax': '1G\r'},
        {'cpuQuota': '15%'},
        {'CPU Quota': '15%'},
        {'Nice=1\nUser': 'root'},
        ['CPUQuota=15%'],
    ],
)
def test_settings_that_would_break_the_unit_are_refused(tmp_path, settings):
    rc, output = check(tmp_path, settings)
    assert rc == 2, output
    assert 'vllm_kimi_service_settings must map systemd setting names' in output
