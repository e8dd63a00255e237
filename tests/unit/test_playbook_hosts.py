# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Each playbook plays on its group by default and on the pattern a variable names, for a wider inventory whose groups
are named otherwise (ansible-playbook --list-hosts: nothing runs)."""

import json
import os
import re
import subprocess
import sys

import pytest

from ansible_collections.llmserve.vllm.tests.support import REPO

INVENTORY: dict = {
    'vllm': {'hosts': {'gpu-1': {}}},
    'inference': {'hosts': {'kimi-a': {}, 'kimi-b': {}}},
    'vllm_haproxy': {'hosts': {'lb-1': {}}},
    'edge': {'hosts': {'lb-a': {}}},
    'prometheus': {'hosts': {'prom-1': {}}},
    'metrics': {'hosts': {'prom-a': {}}},
}
# playbook: (the variable that names its hosts, its default group, the group the test names instead)
PLAYBOOKS = {
    'deploy.yml': ('vllm_hosts', 'vllm', 'inference'),
    'upgrade.yml': ('vllm_hosts', 'vllm', 'inference'),
    'preflight.yml': ('vllm_hosts', 'vllm', 'inference'),
    'gate.yml': ('vllm_hosts', 'vllm', 'inference'),
    'last_good.yml': ('vllm_hosts', 'vllm', 'inference'),
    'balancer.yml': ('vllm_balancer_hosts', 'vllm_haproxy', 'edge'),
    'monitoring.yml': ('vllm_monitoring_hosts', 'prometheus', 'metrics'),
}


def first_play_hosts(tmp_path, playbook, *args):
    """The hosts ansible-playbook --list-hosts lists for the playbook's first play."""
    inventory = tmp_path / 'hosts.json'
    inventory.write_text(json.dumps(INVENTORY))
    env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(REPO, 'ansible.cfg'), ANSIBLE_NOCOLOR='1')
    proc = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), 'ansible-playbook'), '--list-hosts', '-i', str(inventory)]
        + [os.path.join(REPO, 'playbooks', playbook), *args],
        capture_output=True, text=True, env=env, cwd=REPO, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    play = re.search(r'play #1 .*?hosts \(\d+\):\n(.*?)(?:\n\s*\n|\Z)', proc.stdout, flags=re.DOTALL)
    assert play, proc.stdout
    return sorted(play.group(1).split())


@pytest.mark.parametrize('playbook', sorted(PLAYBOOKS))
def test_each_playbook_plays_on_its_group_or_the_pattern_its_variable_names(tmp_path, playbook):
    variable, default, other = PLAYBOOKS[playbook]
    assert first_play_hosts(tmp_path, playbook) == sorted(INVENTORY[default]['hosts'])
    named = first_play_hosts(tmp_path, playbook, '-e', json.dumps({variable: other}))
    assert named == sorted(INVENTORY[other]['hosts'])
