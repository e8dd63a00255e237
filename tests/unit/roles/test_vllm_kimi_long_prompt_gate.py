# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The long-prompt gate's settings, judged by the preflight (tasks/preflight.yml, vars/main.yml) as Ansible runs it,
and by the role's argument spec: its default, {}, passes; a gate without its prompt or answer stops the play, naming
what it lacks."""

import os

import pytest
import yaml

from ansible_collections.llmserve.vllm.tests.support import LOAD_VLLM_KIMI_VARS, REPO, VLLM_KIMI, run_local_play

TASK = 'Refuse a long-prompt gate without its prompt or answer'
GATE = {'filler': 'The sky is blue. ', 'repeats': 60, 'question': 'What is the capital of France?', 'expect': 'Paris'}


def refusal_task():
    with open(os.path.join(VLLM_KIMI, 'tasks', 'preflight.yml')) as handle:
        return [task for task in yaml.safe_load(handle) if task.get('name') == TASK]


@pytest.mark.parametrize(
    'gate, lacks',
    [
        ({}, None),
        (GATE, None),
        (dict(GATE, fact='Remember this: the secret city is Lima.', min_tokens=32768), None),
        ({key: value for key, value in GATE.items() if key != 'expect'}, 'expect'),
        ({'fact': 'Remember this.', 'repeats': 10}, 'filler, question, expect'),
    ],
    ids=['off', 'without-a-fact', 'with-a-fact', 'no-expect', 'only-a-fact'],
)
def test_a_gate_without_its_prompt_or_answer_stops_the_play_naming_what_it_lacks(tmp_path, gate, lacks):
    rc, output = run_local_play(tmp_path, LOAD_VLLM_KIMI_VARS + refusal_task(), {'vllm_kimi_long_prompt_gate': gate})
    if lacks is None:
        assert rc == 0, output
    else:
        assert rc == 2 and 'vllm_kimi_long_prompt_gate lacks %s: a long-prompt gate needs' % lacks in output, output


@pytest.mark.parametrize('inventory', ['gpu', 'nvlink', 'sandbox'])
def test_each_inventorys_gate_passes_the_preflight(tmp_path, inventory):
    with open(os.path.join(REPO, 'inventories', inventory, 'group_vars', 'vllm.yml')) as handle:
        gate = yaml.safe_load(handle)['vllm_kimi_long_prompt_gate']
    assert gate
    rc, output = run_local_play(tmp_path, LOAD_VLLM_KIMI_VARS + refusal_task(), {'vllm_kimi_long_prompt_gate': gate})
    assert rc == 0, output
