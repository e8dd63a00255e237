# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Each role's defaults and meta/argument_specs.yml describe the same variables with the same defaults."""

import os
import re

import pytest
import yaml

ROLES = os.path.join(os.path.dirname(__file__), '..', '..', '..', 'roles')


def _load(role, relative):
    with open(os.path.join(ROLES, role, relative)) as handle:
        return yaml.safe_load(handle)


DEFAULTS = {role: _load(role, 'defaults/main.yml') for role in ('vllm_kimi', 'vllm_monitoring', 'vllm_haproxy')}
SPECS = {role: _load(role, 'meta/argument_specs.yml')['argument_specs']['main']['options'] for role in DEFAULTS}


@pytest.mark.parametrize('role', sorted(DEFAULTS))
def test_every_default_is_documented_and_every_documented_variable_has_a_default(role):
    assert sorted(DEFAULTS[role]) == sorted(SPECS[role])


@pytest.mark.parametrize('role, name', [(role, name) for role in sorted(DEFAULTS) for name in sorted(DEFAULTS[role])])
def test_documented_default_equals_the_real_default(role, name):
    if DEFAULTS[role][name] is None:
        assert 'default' not in SPECS[role][name], '%s: defaults/main.yml has no value, the spec documents one' % name
    else:
        assert SPECS[role][name].get('default') == DEFAULTS[role][name]


@pytest.mark.parametrize('role, name', [(role, name) for role in sorted(SPECS) for name in sorted(SPECS[role])])
def test_each_variable_has_a_type_and_a_description(role, name):
    assert SPECS[role][name].get('type')
    assert SPECS[role][name].get('description')


@pytest.mark.parametrize('role', sorted(DEFAULTS))
def test_internal_variables_stay_out_of_the_defaults(role):
    internal = _load(role, 'vars/main.yml')
    assert all(name.startswith('_%s_' % role) for name in internal)
    assert all(re.match(r'^%s_[a-z0-9_]+$' % role, name) for name in DEFAULTS[role])
