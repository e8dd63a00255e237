# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later


import re
import signal
import socket
import time

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils._deadline import DeadlinePassed, deadline


def wait_on_a_silent_socket():
    left, right = socket.socketpair()
    try:
        left.recv(1)
    finally:
        left.close()
        right.close()


def swallow_exceptions():
    try:
        time.sleep(5)
    except Exception:  # what a library may do; the deadline must get through it
        pass


@pytest.mark.parametrize(
    'block',
    [
        lambda: time.sleep(5),
        wait_on_a_silent_socket,
        # re has no timeout of its own; this backtracks for longer than anyone waits.
        lambda: re.search('(a+)+$', 'a' * 40 + '!'),
        swallow_exceptions,
    ],
    ids=['sleep', 'silent-socket', 'catastrophic-regex', 'except-exception'],
)
def test_a_block_that_runs_late_is_interrupted(block):
    began = time.monotonic()
    with pytest.raises(DeadlinePassed), deadline(0.3):
        block()
    assert 0.3 <= time.monotonic() - began < 2
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_block_in_time_leaves_no_alarm_behind():
    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGALRM, mine)
    try:
        with deadline(5):
            value = 42
        assert value == 42
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        assert signal.getsignal(signal.SIGALRM) is mine
    finally:
        signal.signal(signal.SIGALRM, previous)
