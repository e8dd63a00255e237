# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._systemd import (
    judge_unit,
    parse_unit_show,
    unit_number,
)
from ansible_collections.llmserve.vllm.tests.support import unit_state

SHOW_RUNNING = (
    'LoadState=loaded\nActiveState=active\nSubState=running\nResult=success\nNRestarts=0\n'
    'ExecMainStatus=0\nExecMainStartTimestampMonotonic=5000000\n'
)


def test_parse_unit_show():
    assert parse_unit_show(SHOW_RUNNING + 'garbage line\nEmpty=\n') == {
        'LoadState': 'loaded',
        'ActiveState': 'active',
        'SubState': 'running',
        'Result': 'success',
        'NRestarts': '0',
        'ExecMainStatus': '0',
        'ExecMainStartTimestampMonotonic': '5000000',
        'Empty': '',
    }


@pytest.mark.parametrize(
    'state, baseline, max_restarts, expected',
    [
        (unit_state('active', 'running'), 0, 1, None),
        (unit_state('activating', 'start'), 0, 1, None),
        (unit_state('activating', 'auto-restart', 1, 'exit-code', 1), 0, 1, None),
        (unit_state('deactivating', 'stop-sigterm'), 0, 1, None),
        (unit_state('active', 'running', 4), 3, 1, None),
        (
            unit_state('failed', 'failed', 0, 'exit-code', 1),
            0,
            1,
            'The unit vllm.service failed (ActiveState=failed, SubState=failed, Result=exit-code, ExecMainStatus=1, '
            'NRestarts=0)',
        ),
        (
            unit_state('failed', 'failed', 3, 'start-limit-hit', 1),
            0,
            5,
            'The unit vllm.service failed (ActiveState=failed, SubState=failed, Result=start-limit-hit, '
            'ExecMainStatus=1, NRestarts=3)',
        ),
        (
            unit_state('inactive', 'dead'),
            0,
            1,
            'The unit vllm.service is not running (ActiveState=inactive, SubState=dead, Result=success, '
            'ExecMainStatus=0, NRestarts=0)',
        ),
        (
            unit_state('inactive', 'dead', load='not-found'),
            0,
            1,
            'The unit vllm.service is not loaded (LoadState=not-found)',
        ),
        (
            unit_state('activating', 'auto-restart', 2, 'exit-code', 1),
            0,
            1,
            'The unit vllm.service is in a restart loop: systemd restarted it 2 times while waiting (more than '
            'max_restarts=1) (ActiveState=activating, SubState=auto-restart, Result=exit-code, ExecMainStatus=1, '
            'NRestarts=2)',
        ),
        (
            unit_state('active', 'running', 1),
            0,
            0,
            'The unit vllm.service is in a restart loop: systemd restarted it 1 times while waiting (more than '
            'max_restarts=0) (ActiveState=active, SubState=running, Result=success, ExecMainStatus=0, NRestarts=1)',
        ),
    ],
)
def test_judge_unit(state, baseline, max_restarts, expected):
    assert judge_unit('vllm.service', state, baseline, max_restarts) == expected


@pytest.mark.parametrize(
    'state, expected',
    [
        ({'NRestarts': '3'}, 3),
        ({'NRestarts': ''}, 0),
        ({'NRestarts': 'n/a'}, 0),
        ({}, 0),
    ],
    ids=['number', 'empty', 'not-a-number', 'missing'],
)
def test_unit_number(state, expected):
    assert unit_number(state, 'NRestarts') == expected
