# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

import functools

from ansible.errors import AnsibleFilterError

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._writers import mode_reason

# What ansible.builtin.stat's stat and ansible.builtin.find's files both give of an entry.
_NEEDED = ('path', 'uid', 'gid', 'islnk', 'wgrp', 'woth')


def _name_of(names, kind, ident):
    """The user or group name the stat result gave, else 'uid N' or 'gid N'."""
    return names[kind] or '%s %s' % (kind[0] + 'id', ident)


def checkpoint_writers(entries):
    """Why a user other than root could change each of the entries, one text per entry that one could."""
    if not isinstance(entries, list):
        raise AnsibleFilterError(
            'checkpoint_writers expects a list of stat or find results, got %s' % type(entries).__name__
        )
    reasons = []
    for position, entry in enumerate(entries):
        missing = [key for key in _NEEDED if not isinstance(entry, dict) or key not in entry]
        if missing:
            raise AnsibleFilterError(
                'checkpoint_writers: entry %d is not a stat or find result (no %s)' % (position, ', '.join(missing))
            )
        reason = mode_reason(
            entry['path'], entry['islnk'], entry['uid'], entry['gid'], entry['wgrp'], entry['woth'],
            functools.partial(_name_of, {'user': entry.get('pw_name'), 'group': entry.get('gr_name')}),
        )  # fmt: skip
        if reason:
            reasons.append(reason)
    return reasons


class FilterModule:
    def filters(self):
        return {'checkpoint_writers': checkpoint_writers}
