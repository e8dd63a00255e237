# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""vllm_kimi's entry points (the task files the playbooks run with tasks_from) are declared in meta/argument_specs.yml,
each with exactly the role's variables its tasks read, described as the main entry point describes them."""

import glob
import os
import re

import pytest
import yaml

from ansible_collections.llmserve.vllm.tests.support import REPO, VLLM_KIMI, run_local_play


def _load(relative):
    with open(os.path.join(VLLM_KIMI, relative)) as handle:
        return yaml.safe_load(handle)


SPECS = _load('meta/argument_specs.yml')['argument_specs']
DEFAULTS = _load('defaults/main.yml')
INTERNAL = _load('vars/main.yml')
# A role variable (vllm_kimi_x) or one of the role's internal ones (_vllm_kimi_x), not a fact (__vllm_kimi_x).
REFERENCE = re.compile(r'(?<![A-Za-z0-9_])(_?vllm_kimi_[a-z0-9_]+)')
INCLUDE = re.compile(r'(?:include|import)_tasks: (\S+\.yml)')


def tasks_text(name, seen=None):
    """The text of tasks/<name> and of every task file it includes."""
    seen = set() if seen is None else seen
    seen.add(name)
    with open(os.path.join(VLLM_KIMI, 'tasks', name)) as handle:
        text = handle.read()
    for included in INCLUDE.findall(text):
        if included not in seen:
            text += tasks_text(included, seen)
    return text


def role_variables_read(text):
    """The role's variables text reads, directly or through the internal variables and defaults it reads."""
    waiting, read = set(REFERENCE.findall(text)), set()
    while waiting:
        name = waiting.pop()
        read.add(name)
        source = INTERNAL.get(name) if name.startswith('_') else DEFAULTS.get(name)
        if source is not None:
            waiting |= set(REFERENCE.findall(yaml.safe_dump(source))) - read
    return sorted(name for name in read if name in DEFAULTS)


def entry_points_used(role='vllm_kimi'):
    """The task files of the role that playbooks and scenarios run on their own, as tasks_from names them: Ansible
    validates a tasks_from by the entry point of exactly that name, so replicas.yml would be validated by none."""
    used = set()
    for path in glob.glob(os.path.join(REPO, 'playbooks', '*.yml')) + glob.glob(
        os.path.join(REPO, 'molecule', '**', '*.yml'), recursive=True
    ):
        with open(path) as handle:
            used |= set(re.findall(r'name: llmserve\.vllm\.%s\n\s+tasks_from: (\S+)' % role, handle.read()))
    return sorted(used)


def test_the_playbooks_run_declared_entry_points_only():
    assert entry_points_used() == ['gate', 'last_good', 'preflight', 'replicas']
    assert sorted(SPECS) == sorted(entry_points_used() + ['main'])
    with open(os.path.join(REPO, 'roles', 'vllm_haproxy', 'meta', 'argument_specs.yml')) as handle:
        haproxy_specs = yaml.safe_load(handle)['argument_specs']
    assert entry_points_used('vllm_haproxy') == ['drain', 'ready']
    assert sorted(haproxy_specs) == ['drain', 'main', 'ready']


@pytest.mark.parametrize('entry_point', [name for name in sorted(SPECS) if name != 'main'])
def test_an_entry_point_declares_what_its_tasks_read_as_main_describes_it(entry_point):
    options = SPECS[entry_point]['options']
    assert sorted(options) == role_variables_read(tasks_text(entry_point + '.yml'))
    assert all(options[name] == SPECS['main']['options'][name] for name in options)
    assert SPECS[entry_point]['short_description'] and SPECS[entry_point]['description']


def test_the_reads_follow_internal_variables_and_defaults():
    # gate.yml names no vllm_kimi_host: it reads it through _vllm_kimi_url.
    assert 'vllm_kimi_host' not in re.findall(r'(?<![A-Za-z0-9_])vllm_kimi_[a-z0-9_]+', tasks_text('gate.yml'))
    assert 'vllm_kimi_host' in role_variables_read(tasks_text('gate.yml'))


def test_ansible_validates_an_entry_point_by_its_own_spec(tmp_path):
    """A value of the wrong type stops replicas.yml before its first task, naming the variable and the entry point."""
    tasks = [{'ansible.builtin.include_role': {'name': 'llmserve.vllm.vllm_kimi', 'tasks_from': 'replicas'}}]
    rc, output = run_local_play(tmp_path, tasks, {'vllm_kimi_min_replicas_up': 'several'})
    assert rc != 0
    assert 'Validation of arguments failed' in output and 'vllm_kimi_min_replicas_up' in output, output
    assert "TASK [llmserve.vllm.vllm_kimi : Validating arguments against arg spec 'replicas'" in output, output
    assert 'Ask the other replicas' not in output
