# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Unit tests of _command: a deadline and an output bound that hold whatever the command does."""

import os
import time

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils import _command as command


@pytest.mark.parametrize(
    'script, expected',
    [
        ('printf out; printf err >&2; exit 3', (3, 'out', 'err')),
        # Bytes that are not UTF-8 are replaced: the text must go back to the controller as JSON.
        (r"printf 'GPU \377\376'", (0, 'GPU \ufffd\ufffd', '')),
        ('kill -9 $$', (-9, '', '')),
    ],
)
def test_run(script, expected):
    assert command.run(['sh', '-c', script], 5) == expected


def process_gone(pid):
    """Whether pid has exited (a zombie waiting for its reaper counts as exited)."""
    try:
        with open('/proc/%d/stat' % pid) as f:
            return f.read().rsplit(')', 1)[1].split()[0] == 'Z'
    except OSError:
        return True


def test_a_hung_command_and_its_children_are_killed_at_the_deadline(tmp_path):
    pidfile = tmp_path / 'child'
    # The shell ignores SIGTERM; its child holds the pipes open.
    script = "trap '' TERM; sleep 30 & echo $! > %s; wait" % pidfile
    start = time.monotonic()
    with pytest.raises(command.CommandTimeout) as exc:
        command.run(['sh', '-c', script], 1)
    assert time.monotonic() - start < 5
    assert str(exc.value) == 'sh -c %s did not finish within 1 seconds and was killed' % script
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while not process_gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_gone(child)


def test_output_past_the_bound_is_refused_at_once():
    start = time.monotonic()
    with pytest.raises(command.CommandError) as exc:
        command.run(['sh', '-c', 'head -c 100000 /dev/zero; sleep 30'], 20, max_output=1000)
    assert time.monotonic() - start < 5
    assert not isinstance(exc.value, command.CommandTimeout)
    assert str(exc.value) == 'sh -c head -c 100000 /dev/zero; sleep 30 printed more than 1000 bytes and was killed'


def test_a_missing_program_raises_oserror(tmp_path):
    with pytest.raises(OSError):
        command.run([str(tmp_path / 'absent')], 5)


def test_the_deadline_holds_for_a_command_that_exits_late_after_closing_its_pipes():
    # The pipes reach their end at once; the wait for the exit is bounded too.
    with pytest.raises(command.CommandTimeout):
        command.run(['sh', '-c', 'exec >/dev/null 2>&1; sleep 30'], 1)


def test_no_descriptor_is_left_open():
    before = len(os.listdir('/proc/self/fd'))
    for dummy in range(5):
        command.run(['true'], 5)
    assert len(os.listdir('/proc/self/fd')) == before
