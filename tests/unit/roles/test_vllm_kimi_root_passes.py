# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Root's passes over a revision the fetch's user owns (tasks/model.yml): root never follows that user's links.

The open pass (its directories to the fetch) and the seals (root's and read-only) change owners and modes in a tree
the fetch's user owns. Every pass comes after the fetch's own unit is stopped, which ends every process of the fetch,
an interrupted run's included; and every pass is llmserve-own-tree, which resolves no path through a link (raced for
real in test_own_tree.py).
"""

import os

import yaml

from ansible_collections.llmserve.vllm.tests.support import REPO

ROLE = os.path.join(REPO, 'roles', 'vllm_kimi')


def flat_tasks(tasks):
    for task in tasks:
        if 'block' in task:
            yield from flat_tasks(task['block'])
        else:
            yield task


def model_tasks():
    with open(os.path.join(ROLE, 'tasks', 'model.yml')) as handle:
        return list(flat_tasks(yaml.safe_load(handle)))


def role_vars():
    with open(os.path.join(ROLE, 'vars', 'main.yml')) as handle:
        return yaml.safe_load(handle)


def argv_of(task):
    command = task.get('ansible.builtin.command') or {}
    argv = command.get('argv', [])
    return argv if isinstance(argv, list) else [argv]


def is_root_pass(task):
    return argv_of(task) in (['{{ _vllm_kimi_seal_argv }}'], ['{{ _vllm_kimi_open_argv }}'])


def stops_the_fetch(task):
    return argv_of(task) == ['systemctl', 'stop', '{{ _vllm_kimi_fetch_unit }}.service']


def starts_the_fetch(task):
    return argv_of(task) == ['{{ _vllm_kimi_fetch_argv }}']


def test_every_root_pass_comes_after_the_fetch_is_stopped():
    tasks = model_tasks()
    passes = [index for index, task in enumerate(tasks) if is_root_pass(task)]
    assert len(passes) == 3, [tasks[index]['name'] for index in passes]
    assert [task['name'] for task in tasks if starts_the_fetch(task)], 'the fetch is no longer started here'
    for index in passes:
        before = [task for task in tasks[:index] if stops_the_fetch(task) or starts_the_fetch(task)]
        assert before and stops_the_fetch(before[-1]), tasks[index]['name']


def test_the_fetch_runs_in_the_unit_that_is_stopped():
    variables = role_vars()
    assert variables['_vllm_kimi_fetch_unit'] == '{{ vllm_kimi_service_name }}-fetch'
    assert "['systemd-run', '--unit=' ~ _vllm_kimi_fetch_unit," in variables['_vllm_kimi_fetch_argv']


def test_every_root_pass_is_the_tree_owner_that_follows_no_link():
    variables = role_vars()
    assert variables['_vllm_kimi_own_tree'] == ['/usr/bin/python3', '-I', '{{ _vllm_kimi_libexec }}/llmserve-own-tree']
    assert variables['_vllm_kimi_open_argv'].startswith("{{ _vllm_kimi_own_tree + ['open', _vllm_kimi_model_dir,")
    assert variables['_vllm_kimi_seal_argv'].startswith("{{ _vllm_kimi_own_tree + ['seal', _vllm_kimi_model_dir,")
    passes = [task for task in model_tasks() if is_root_pass(task)]
    # No other command of the model phase changes owners or modes.
    others = [argv_of(task) for task in model_tasks() if not is_root_pass(task)]
    assert not [argv for argv in others if {'chown', 'chmod', 'find'} & {str(word) for word in argv}], others
    assert len(passes) == 3
