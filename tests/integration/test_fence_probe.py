# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The role refuses a host whose systemd does not enforce the unit's IP fence, unless told to accept it.

This machine is such a host: PID 1 is not systemd (and its cgroups are v1), so the probe cannot even run. The
sandbox hosts, which enforce the fence, pass the same probe in every deploy of molecule's scenarios.
"""

import json
import os
import subprocess

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..'))
PLAYBOOK = os.path.join(REPO, 'tests', 'integration', 'playbooks', 'fence_probe.yml')
ANSIBLE_PLAYBOOK = os.path.join(REPO, '.venv', 'bin', 'ansible-playbook')
LOCAL_PYTHON = os.path.join(REPO, '.venv', 'bin', 'python')


def probe(**extra_vars):
    extra_vars['ansible_python_interpreter'] = LOCAL_PYTHON
    return subprocess.run(
        [ANSIBLE_PLAYBOOK, '-i', 'localhost,', '-c', 'local', PLAYBOOK, '-e', json.dumps(extra_vars)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.mark.skipif(
    os.path.exists('/run/systemd/system'), reason='this host runs systemd: the refusal needs one without'
)
def test_a_host_that_cannot_enforce_the_fence_is_refused_with_the_remedy():
    run = probe()
    assert run.returncode == 2, run.stdout[-3000:]
    assert "This host does not enforce systemd's IP fences" in run.stdout
    assert 'could not be run' in run.stdout
    assert 'vllm_kimi_allow_unenforced_ip_fence' in run.stdout


def test_the_operator_may_accept_an_unenforced_fence():
    run = probe(vllm_kimi_allow_unenforced_ip_fence=True)
    assert run.returncode == 0, run.stdout[-3000:]
