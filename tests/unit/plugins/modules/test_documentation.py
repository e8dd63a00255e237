# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Every module's DOCUMENTATION, EXAMPLES and RETURN, and every filter's documentation, parse as YAML: what ansible-doc
and ansible-test's validate-modules read first (a ': ' inside a plain line of prose is a mapping to YAML), caught
before make sanity."""

import ast
import glob
import os

import pytest
import yaml

from ansible_collections.llmserve.vllm.tests.support import REPO

MODULES = sorted(glob.glob(os.path.join(REPO, 'plugins', 'modules', '*.py')))
FILTER_DOCS = sorted(glob.glob(os.path.join(REPO, 'plugins', 'filter', '*.yml')))
SECTIONS = ('DOCUMENTATION', 'EXAMPLES', 'RETURN')


def sections(path):
    """{name: text} of the module's documentation strings, read without importing it."""
    with open(path) as handle:
        tree = ast.parse(handle.read())
    return {
        node.targets[0].id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], 'id', None) in SECTIONS
    }


@pytest.mark.parametrize('path', MODULES, ids=os.path.basename)
def test_a_modules_documentation_parses(path):
    found = sections(path)
    assert sorted(found) == sorted(SECTIONS)
    documentation = yaml.safe_load(found['DOCUMENTATION'])
    assert documentation['module'] == os.path.basename(path)[:-3]
    # Every line of a description is text: "- Never shown: ..." would be a mapping.
    for name, option in documentation['options'].items():
        lines = option['description'] if isinstance(option['description'], list) else [option['description']]
        assert all(isinstance(line, str) for line in lines), name
    yaml.safe_load(found['EXAMPLES'])
    yaml.safe_load(found['RETURN'])


@pytest.mark.parametrize('path', FILTER_DOCS, ids=os.path.basename)
def test_a_filters_documentation_parses(path):
    with open(path) as handle:
        documentation = yaml.safe_load(handle)
    assert documentation['DOCUMENTATION']['name'] == os.path.basename(path)[:-4]
