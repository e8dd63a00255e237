# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""decode_json: the collection's one JSON decoder, its source named in every refusal."""

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils._json_text import decode_json, nests_deeper


class Refused(Exception):
    pass


def nested(levels):
    return '[' * levels + ']' * levels


@pytest.mark.parametrize(
    'data, max_depth, expected',
    [
        (
            b'\xff{}',
            None,
            "F is not UTF-8 text: 'utf-8' codec can't decode byte 0xff in position 0: invalid start byte",
        ),
        (b'{"a": ', None, 'F is not valid JSON: Expecting value: line 1 column 7 (char 6)'),
        (
            '{"a": 1,}',
            None,
            'F is not valid JSON: Illegal trailing comma before end of object: line 1 column 8 (char 7)',
        ),
        (nested(100000), None, 'F is nested too deeply to be read as JSON'),
        # With a depth of its own, the format's limit is the one said, whether Python's parser could read it or not.
        (nested(100000), 32, 'F nests arrays and objects more than 32 levels deep'),
        (nested(33), 32, 'F nests arrays and objects more than 32 levels deep'),
        ('{"a": %s}' % nested(32), 32, 'F nests arrays and objects more than 32 levels deep'),
    ],
)
def test_a_refusal_names_the_source_and_the_cause(data, max_depth, expected):
    with pytest.raises(Refused) as err:
        decode_json(data, 'F', Refused, max_depth)
    assert str(err.value) == expected


@pytest.mark.parametrize('data', [b'{"a": [1, {"b": null}]}', '{"a": [1, {"b": null}]}'])
def test_bytes_and_text_decode_alike(data):
    assert decode_json(data, 'F', Refused) == {'a': [1, {'b': None}]}


def test_as_deep_as_allowed_is_read():
    value = decode_json(nested(32), 'F', Refused, 32)
    for _level in range(31):
        value = value[0]
    assert value == []


@pytest.mark.parametrize(
    'value, max_depth, deeper',
    [(1, 0, False), ([], 0, True), ([], 1, False), ({'a': [{}]}, 2, True), ({'a': [{}]}, 3, False)],
)
def test_nesting_is_counted_by_levels_of_arrays_and_objects(value, max_depth, deeper):
    assert nests_deeper(value, max_depth) is deeper
