# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""vllm_kimi's start ledger (vars/main.yml `_vllm_kimi_start_ledger` and the line tasks/gate.yml prints), rendered by
Ansible from chat_check's results: every figure counts from the unit's start, and a gate that began after the API was
up says so, never "API ready after 0.0 s"."""

import json

import pytest
import yaml

from ansible_collections.llmserve.vllm.tests.support import REPO, run_local_play

with open(REPO + '/roles/vllm_kimi/vars/main.yml') as role_vars:
    ROLE_VARS = yaml.safe_load(role_vars)
LEDGER_VARS = {
    name: ROLE_VARS[name]
    for name in ('_vllm_kimi_start_phases', '_vllm_kimi_start_ledger', '_vllm_kimi_start_api_ready')
}
CPU_START = {'weights_read_seconds': 0.04, 'engine_init_seconds': 0.04, 'kv_tokens': 4096, 'kv_cache_device': 'CPU'}


@pytest.mark.parametrize(
    ('gate', 'ledger', 'line'),
    [
        # A deploy's gate, begun right after the restart: it saw the start.
        (
            {'healthy_after': 22.9, 'startup': dict(CPU_START, gate_began_seconds=0.2, api_ready_seconds=23.1)},
            {
                'weights_read_seconds': 0.04,
                'engine_init_seconds': 0.04,
                'gate_began_seconds': 0.2,
                'api_ready_seconds': 23.1,
            },
            'API ready after 23.1 s',
        ),
        # make demo's playbooks/gate.yml after the deploy: the API answered the first question, the journal dates it.
        (
            {'healthy_after': 0.0, 'startup': dict(CPU_START, gate_began_seconds=95.0, api_ready_seconds=23.4)},
            {
                'weights_read_seconds': 0.04,
                'engine_init_seconds': 0.04,
                'gate_began_seconds': 95.0,
                'api_ready_seconds': 23.4,
            },
            'API ready after 23.4 s, the gate began 95.0 s after the start',
        ),
        (
            {'healthy_after': 0.0, 'startup': dict(CPU_START, gate_began_seconds=95.0)},
            {'weights_read_seconds': 0.04, 'engine_init_seconds': 0.04, 'gate_began_seconds': 95.0},
            'API ready before the gate began, 95.0 s after the start (no journal line dates it)',
        ),
        (
            {'healthy_after': 0.0, 'startup': {}},
            {},
            "API ready 0.0 s after the gate began (the unit's start is not known)",
        ),
    ],
    ids=['gate-saw-the-start', 'gate-after-the-start', 'not-dated', 'no-unit-start'],
)
def test_the_ledger_counts_from_the_units_start(tmp_path, gate, ledger, line):
    out = tmp_path / 'ledger.json'
    shown = '{{ {"ledger": _vllm_kimi_start_ledger, "line": _vllm_kimi_start_api_ready} | to_json }}'
    tasks = [{'ansible.builtin.copy': {'content': shown, 'dest': str(out), 'mode': '0644'}}]
    rc, output = run_local_play(tmp_path, tasks, dict(LEDGER_VARS, __vllm_kimi_gate=gate))
    assert rc == 0, output
    assert json.loads(out.read_text()) == {'ledger': ledger, 'line': line}
