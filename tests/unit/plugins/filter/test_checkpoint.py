# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""llmserve.vllm.checkpoint_writers on the entries ansible.builtin.stat and find give."""

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.llmserve.vllm.plugins.filter.checkpoint import checkpoint_writers


def entry(path, uid=0, gid=0, islnk=False, wgrp=False, woth=False, **names):
    return dict(path=path, uid=uid, gid=gid, islnk=islnk, wgrp=wgrp, woth=woth, **names)


def test_root_alone_changes_nothing_to_report():
    assert checkpoint_writers([entry('/m'), entry('/m/config.json', wgrp=True)]) == []


@pytest.mark.parametrize(
    'given, reason',
    [
        (entry('/m/a.py', uid=1000, pw_name='alice'), '/m/a.py is owned by alice'),
        (entry('/m/a.py', uid=1000, pw_name=''), '/m/a.py is owned by uid 1000'),
        (entry('/m/w', woth=True), '/m/w is writable by every user'),
        (entry('/m/c', gid=50, wgrp=True, gr_name='models'), '/m/c is writable by group models'),
        (entry('/m/c', gid=50, wgrp=True), '/m/c is writable by group gid 50'),
        # A root-owned link may lead anywhere, another user's file included.
        (entry('/m/l', islnk=True), '/m/l is a symbolic link'),
    ],
)
def test_each_way_another_user_could_change_an_entry_is_named(given, reason):
    assert checkpoint_writers([entry('/m'), given]) == [reason]


def test_one_reason_per_entry_the_owner_first():
    assert checkpoint_writers([entry('/m/x', uid=7, woth=True, pw_name='bob')]) == ['/m/x is owned by bob']


@pytest.mark.parametrize(
    'given, message',
    [
        ('/m', 'checkpoint_writers expects a list of stat or find results, got str'),
        ([{'path': '/m'}], 'checkpoint_writers: entry 0 is not a stat or find result (no uid, gid, islnk, wgrp, woth)'),
        (
            [entry('/m'), 'x'],
            'checkpoint_writers: entry 1 is not a stat or find result (no path, uid, gid, islnk, wgrp, woth)',
        ),
    ],
)
def test_what_is_no_list_of_entries_is_refused_by_position(given, message):
    with pytest.raises(AnsibleFilterError) as caught:
        checkpoint_writers(given)
    assert str(caught.value) == message
