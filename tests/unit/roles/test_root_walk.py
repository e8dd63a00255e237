# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The walk root's two programs over another user's tree share: one text in both files. Each program is installed and
run on its own by the target's system interpreter (python3 -I, which puts no program's folder on the import path), so
each carries the walk; this test keeps the two copies one."""

import ast
import os

import pytest

FILES = os.path.join(os.path.dirname(__file__), '..', '..', '..', 'roles', 'vllm_kimi', 'files')
PROGRAMS = ('llmserve-own-tree', 'llmserve-seal-caches')
SHARED = ('OPEN_FLAGS', 'DIRECTORY_FLAGS', 'MAX_DEPTH', 'identity', 'open_listed', 'walk')


def definitions(program):
    """{name: source text} of the program's top-level functions and assignments."""
    with open(os.path.join(FILES, program)) as handle:
        text = handle.read()
    found = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = ast.get_source_segment(text, node)
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            found[node.targets[0].id] = ast.get_source_segment(text, node)
    return found


@pytest.mark.parametrize('name', SHARED)
def test_both_programs_walk_with_the_same_code(name):
    own_tree, seal_caches = (definitions(program) for program in PROGRAMS)
    assert own_tree[name] == seal_caches[name]


def test_neither_program_walks_with_os_fwalk():
    # os.fwalk opens each subdirectory without O_NOFOLLOW (and on Python 3.11 without O_NONBLOCK: a FIFO swapped in
    # for a directory blocked root), and recurses.
    for program in PROGRAMS:
        with open(os.path.join(FILES, program)) as handle:
            assert 'fwalk(' not in handle.read(), program
