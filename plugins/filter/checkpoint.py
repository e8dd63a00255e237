# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later


from ansible.errors import AnsibleFilterError

# What ansible.builtin.stat's stat and ansible.builtin.find's files both give of an entry.
_NEEDED = ('path', 'uid', 'gid', 'islnk', 'wgrp', 'woth')


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
        path = entry['path']
        # A link's own owner and mode say nothing of what it leads to, which may be anywhere.
        if entry['islnk']:
            reasons.append('%s is a symbolic link' % path)
        elif entry['uid'] != 0:
            reasons.append('%s is owned by %s' % (path, entry.get('pw_name') or 'uid %s' % entry['uid']))
        elif entry['woth']:
            reasons.append('%s is writable by every user' % path)
        elif entry['wgrp'] and entry['gid'] != 0:
            reasons.append('%s is writable by group %s' % (path, entry.get('gr_name') or 'gid %s' % entry['gid']))
    return reasons


class FilterModule:
    def filters(self):
        return {'checkpoint_writers': checkpoint_writers}
