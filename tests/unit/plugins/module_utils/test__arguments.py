# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""range_problem: the one wording of every module's refusal of a number outside its range."""

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils._arguments import range_problem


@pytest.mark.parametrize(
    'value, bounds, expected',
    [
        (0, dict(minimum=1, maximum=86400, unit=' seconds'), 'timeout must be from 1 to 86400 seconds, got 0'),
        (86401, dict(minimum=1, maximum=86400), 'timeout must be from 1 to 86400, got 86401'),
        (-1, dict(minimum=0), 'timeout must be at least 0, got -1'),
        (10**400, dict(maximum=9), 'timeout must be at most 9, got 1' + '0' * 400),
        (
            0.0,
            dict(minimum=0, maximum=2.0, unit=' seconds', above=True),
            'timeout must be more than 0 and at most 2.0 seconds, got 0.0',
        ),
        (0, dict(minimum=0, above=True), 'timeout must be more than 0, got 0'),
        (float('nan'), dict(minimum=0), 'timeout must be at least 0, got nan'),
        (float('inf'), dict(minimum=0), 'timeout must be at least 0, got inf'),
        (float('-inf'), dict(maximum=5), 'timeout must be at most 5, got -inf'),
    ],
)
def test_a_number_outside_its_range_is_refused_in_one_wording(value, bounds, expected):
    assert range_problem('timeout', value, **bounds) == expected


@pytest.mark.parametrize(
    'value, bounds',
    [
        (1, dict(minimum=1, maximum=86400)),
        (86400, dict(minimum=1, maximum=86400)),
        (0, dict(minimum=0)),
        (2.0, dict(minimum=0, maximum=2.0, above=True)),
        (10**400, dict(minimum=1)),
        (-(10**400), dict(maximum=0)),
    ],
)
def test_a_number_inside_its_range_passes(value, bounds):
    assert range_problem('timeout', value, **bounds) is None
