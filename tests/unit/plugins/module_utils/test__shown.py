# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A value as a filter's refusal shows it, whatever its size."""

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils._shown import is_word, shown


@pytest.mark.parametrize(
    'value, expected',
    [
        ('8443', "'8443'"),
        (None, 'None'),
        ('x' * 300, "'" + 'x' * 199 + '... (302 characters)'),
        (10**5000, 'a value holding an integer of more digits than Python writes'),
        ([1, 10**5000], 'a value holding an integer of more digits than Python writes'),
    ],
    ids=['a text', 'none', 'a long text', 'a huge integer', 'in a list'],
)
def test_shown(value, expected):
    assert shown(value) == expected


@pytest.mark.parametrize(
    'value, word',
    [('x', True), (8, True), (0.5, True), (True, False), (None, False), ([1], False), (10**5000, False)],
    ids=['a text', 'an integer', 'a fraction', 'a boolean', 'none', 'a list', 'a huge integer'],
)
def test_is_word(value, word):
    assert is_word(value) is word
