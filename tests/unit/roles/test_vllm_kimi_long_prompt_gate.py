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


SIZING = ['_vllm_kimi_long_context_sized', '_vllm_kimi_long_context_tokens', '_vllm_kimi_long_prompt_max_tokens']


@pytest.mark.parametrize(
    'extra, sized',
    [
        # The seed case at 131,072 under plain tensor parallelism: over the threshold.
        ({'__vllm_kimi_plan': {'max_model_len': 131072, 'decode_context_parallel_size': 1}}, [True, 117964, 1024]),
        # 262,144 with the dcp the preflight plans for it.
        ({'__vllm_kimi_plan': {'max_model_len': 262144, 'decode_context_parallel_size': 2}}, [True, 235929, 1024]),
        # A short context, but decode context parallelism: proven all the same.
        ({'__vllm_kimi_plan': {'max_model_len': 32768, 'decode_context_parallel_size': 4}}, [True, 29491, 1024]),
        ({'__vllm_kimi_plan': {'max_model_len': 65536, 'decode_context_parallel_size': 1}}, [False, 58982, 1024]),
        # The sandbox inventory: every context counts as long; the answer gets what 90 % of 1024 leaves.
        (
            {
                '__vllm_kimi_plan': {'max_model_len': 1024, 'decode_context_parallel_size': 1},
                'vllm_kimi_long_context_threshold': 0,
                'vllm_kimi_coherence_max_tokens': 256,
            },
            [True, 921, 103],
        ),
        # playbooks/gate.yml plans nothing: the variables, and auto keeps the repeats.
        ({'vllm_kimi_max_model_len': 131072}, [True, 117964, 1024]),
        ({'vllm_kimi_max_model_len': 'auto', 'vllm_kimi_decode_context_parallel_size': 8}, [False, 0, 1024]),
    ],
    ids=['seed-131072', 'seed-262144-dcp', 'short-with-dcp', 'at-threshold', 'sandbox', 'gate-play', 'gate-play-auto'],
)
def test_the_long_prompt_is_sized_where_the_plan_serves_a_long_or_split_context(tmp_path, extra, sized):
    show = {'ansible.builtin.debug': {'msg': '{{ %s }}' % ' ~ "|" ~ '.join('(%s | string)' % name for name in SIZING)}}
    rc, output = run_local_play(tmp_path, LOAD_VLLM_KIMI_VARS + [show], extra)
    assert rc == 0, output
    assert 'msg: %s\n' % '|'.join(str(value) for value in sized) in output, output
