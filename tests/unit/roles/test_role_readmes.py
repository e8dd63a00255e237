# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Each role's README has Galaxy's sections and a variables table that names every variable with its real default."""

import os
import re

import pytest
import yaml

ROLES_DIR = os.path.join(os.path.dirname(__file__), '..', '..', '..', 'roles')
ROLES = ('vllm_kimi', 'vllm_monitoring', 'vllm_haproxy')
SECTIONS = ('Requirements', 'Role Variables', 'Dependencies', 'Example Playbook', 'License')
# | `name` | `default` | description |
ROW = re.compile(r'^\| `(?P<name>[a-z0-9_]+)` \| `(?P<default>[^`]*)` \| (?P<description>.+) \|$')


def _read(role, relative):
    with open(os.path.join(ROLES_DIR, role, relative)) as handle:
        return handle.read()


def _rows(role):
    return [ROW.match(line) for line in _read(role, 'README.md').splitlines() if ROW.match(line)]


@pytest.mark.parametrize('role', ROLES)
def test_readme_has_the_sections_galaxy_shows_in_order(role):
    headings = re.findall(r'^## (.+)$', _read(role, 'README.md'), flags=re.MULTILINE)
    assert [heading for heading in headings if heading in SECTIONS] == list(SECTIONS)


@pytest.mark.parametrize('role', ROLES)
def test_variables_table_names_each_variable_once_and_only_real_ones(role):
    names = [row['name'] for row in _rows(role)]
    specs = yaml.safe_load(_read(role, 'meta/argument_specs.yml'))['argument_specs']['main']['options']
    assert len(names) == len(set(names))
    assert sorted(names) == sorted(specs)


@pytest.mark.parametrize('role', ROLES)
def test_variables_table_shows_the_default_of_defaults_main(role):
    defaults = yaml.safe_load(_read(role, 'defaults/main.yml'))
    # The cells are YAML as one would write it in an inventory; `""` is the empty string. A table cell escapes the
    # pipes of a Jinja filter as \|.
    cells = {row['name']: row['default'].replace('\\|', '|') for row in _rows(role)}
    wrong = {name: cell for name, cell in cells.items() if yaml.safe_load(cell) != defaults[name]}
    assert wrong == {}


# The releases each role supports (docs/gpu-host.md): Debian's stable and its LTS predecessor, Ubuntu's two LTS.
PLATFORMS = [{'name': 'Debian', 'versions': ['bookworm', 'trixie']}, {'name': 'Ubuntu', 'versions': ['jammy', 'noble']}]


@pytest.mark.parametrize('role', ROLES)
def test_every_role_lists_the_supported_platforms(role):
    assert yaml.safe_load(_read(role, os.path.join('meta', 'main.yml')))['galaxy_info']['platforms'] == PLATFORMS
