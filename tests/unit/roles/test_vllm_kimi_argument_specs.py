# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The role's defaults and meta/argument_specs.yml describe the same variables with the same defaults."""

import os
import re

import pytest
import yaml

ROLE = os.path.join(os.path.dirname(__file__), '..', '..', '..', 'roles', 'vllm_kimi')


def _load(relative):
    with open(os.path.join(ROLE, relative)) as handle:
        return yaml.safe_load(handle)


DEFAULTS = _load('defaults/main.yml')
SPECS = _load('meta/argument_specs.yml')['argument_specs']['main']['options']


def test_every_default_is_documented_and_every_documented_variable_has_a_default():
    assert sorted(DEFAULTS) == sorted(SPECS)


@pytest.mark.parametrize('name', sorted(DEFAULTS))
def test_documented_default_equals_the_real_default(name):
    if DEFAULTS[name] is None:
        assert 'default' not in SPECS[name], '%s: defaults/main.yml has no value, the spec documents one' % name
    else:
        assert SPECS[name].get('default') == DEFAULTS[name]


@pytest.mark.parametrize('name', sorted(SPECS))
def test_each_variable_has_a_type_and_a_description(name):
    assert SPECS[name].get('type')
    assert SPECS[name].get('description')


def test_internal_variables_stay_out_of_the_defaults():
    with open(os.path.join(ROLE, 'vars', 'main.yml')) as handle:
        internal = yaml.safe_load(handle)
    assert all(name.startswith('_vllm_kimi_') for name in internal)
    assert all(re.match(r'^vllm_kimi_[a-z0-9_]+$', name) for name in DEFAULTS)
