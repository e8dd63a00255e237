# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The adversarial suite's tally: each case records its outcome; the totals end the run.

`make adversarial` prints them (and writes .build/adversarial-totals.json); every
outcome other than a clean error or a correct success fails its case.
"""

import collections
import json
import os

import pytest

from ansible_collections.llmserve.vllm.tests.adversarial import harness

_TALLY: collections.defaultdict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
TOTALS_FILE = os.path.join(os.path.dirname(__file__), '..', '..', '.build', 'adversarial-totals.json')


class Verdict:
    """verdict(module, outcome): records the outcome of the current case and fails it unless it is good."""

    def __call__(self, module, outcome, detail=''):
        _TALLY[module][outcome] += 1
        assert outcome in harness.GOOD, '%s: %s %s' % (module, outcome, detail)


@pytest.fixture
def verdict():
    return Verdict()


def pytest_terminal_summary(terminalreporter):
    if not _TALLY:
        return
    totals = collections.Counter()
    terminalreporter.section('adversarial totals')
    for module in sorted(_TALLY):
        counts = _TALLY[module]
        totals.update(counts)
        terminalreporter.write_line(
            '%-18s tried %3d  %s'
            % (
                module,
                sum(counts.values()),
                ', '.join('%s %d' % (outcome, counts[outcome]) for outcome in harness.OUTCOMES),
            )
        )
    terminalreporter.write_line(
        '%-18s tried %3d  %s'
        % ('all', sum(totals.values()), ', '.join('%s %d' % (outcome, totals[outcome]) for outcome in harness.OUTCOMES))
    )
    os.makedirs(os.path.dirname(TOTALS_FILE), exist_ok=True)
    with open(TOTALS_FILE, 'w') as f:
        json.dump({module: dict(counts) for module, counts in _TALLY.items()}, f, indent=2, sort_keys=True)
