# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later


import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.llmserve.vllm.plugins.filter.systemd import (
    systemd_env_name,
    systemd_env_name_problems,
    systemd_env_quote,
    systemd_exec_quote,
)


@pytest.mark.parametrize(
    'argv, expected',
    [
        (['/opt/vllm/bin/vllm', 'serve', '/models/m'], '"/opt/vllm/bin/vllm" "serve" "/models/m"'),
        (['vllm', '--path', '/models/with space'], '"vllm" "--path" "/models/with space"'),
        (['vllm', '--json', '{"a": 1}'], '"vllm" "--json" "{\\"a\\": 1}"'),
        (['cost=$5', '${HOME}'], '"cost=$$5" "$${HOME}"'),
        (['100%', '%h'], '"100%%" "%%h"'),
        (['back\\slash'], '"back\\\\slash"'),
        (["it's", 'a;b|c&d'], '"it\'s" "a;b|c&d"'),
        ([8, 0.95], '"8" "0.95"'),
    ],
)
def test_exec_quote(argv, expected):
    assert systemd_exec_quote(argv) == expected


@pytest.mark.parametrize(
    'bad, message',
    [
        ('--flag', 'systemd_exec_quote expects a list of arguments, got str'),
        (
            ['vllm', 'a\nb'],
            'systemd_exec_quote: the argument at position 1 contains a line break, which systemd cannot carry',
        ),
    ],
)
def test_exec_quote_refuses(bad, message):
    with pytest.raises(AnsibleFilterError) as error:
        systemd_exec_quote(bad)
    assert str(error.value) == message


@pytest.mark.parametrize(
    'value, expected',
    [
        ('plain', '"plain"'),
        ('sk-$ecret${X}', '"sk-\\$ecret\\${X}"'),
        ('say "hi"', '"say \\"hi\\""'),
        ('a\\b', '"a\\\\b"'),
        ('`id`', '"\\`id\\`"'),
        (3600, '"3600"'),
    ],
)
def test_env_quote(value, expected):
    assert systemd_env_quote(value) == expected


def test_env_quote_refuses_line_breaks():
    with pytest.raises(AnsibleFilterError) as error:
        systemd_env_quote('a\nb')
    assert (
        str(error.value) == 'systemd_env_quote: a value contains a line break, which an environment file cannot carry'
    )


NAME_RULE = 'systemd_env_name: an environment variable name must match ^[A-Z_][A-Z0-9_]*$, and '


@pytest.mark.parametrize(
    'name, problem',
    [
        ('NCCL_PROTO', None),
        ('_X9', None),
        # A line break would write a line of its own into the environment file root's commands read.
        ('X\nLD_PRELOAD', 'character 2 is "\\n"'),
        ('HOME\r', 'character 5 is "\\r"'),
        ('A=B', 'character 2 is "="'),
        ('nccl', 'character 1 is "n"'),
        ('9X', 'character 1 is "9"'),
        ('X\u00c9', 'character 2 is "\\u00c9"'),
        ('', 'it is empty'),
        (7, 'it is no text (int)'),
    ],
)
def test_env_name(name, problem):
    if problem is None:
        assert systemd_env_name(name) == name
        return
    with pytest.raises(AnsibleFilterError) as err:
        systemd_env_name(name)
    assert str(err.value) == NAME_RULE + problem


def test_env_name_problems_by_position():
    environment = {'NCCL_PROTO': 'LL', 'X\nLD_PRELOAD': '/tmp/x.so', 'OK': '1', 'a': '2'}
    assert systemd_env_name_problems(environment) == [
        'name 2 (counted from 1 as given): character 2 is "\\n"',
        'name 4 (counted from 1 as given): character 1 is "a"',
    ]
    assert systemd_env_name_problems({}) == []
    with pytest.raises(AnsibleFilterError, match='expects a mapping of names to values, got list'):
        systemd_env_name_problems(['A'])
