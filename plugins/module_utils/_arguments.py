# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Argument types shared by the modules.

PRIVATE to the collection: this is not a public API and may change at any time.
Only the modules of llmserve.vllm may import it.
"""

from ansible.module_utils.common.validation import check_type_path

# A day: the longest that any option of the collection's modules lets a wait, a timeout or a probe run.
MAX_WAIT_SECONDS = 86400


def nul_free_path(value: object) -> str:
    """Ansible's `type='path'` (user and variables expanded), refusing a NUL character.

    The refusal has to come from the argument spec: AnsibleModule logs its arguments to syslog
    once they are validated, and since Python 3.12 syslog raises on a NUL, so a check in the
    module's own code never runs and the user reads "Failed to log to syslog" instead of the
    option's name. As a type, the refusal names the option on every Python.
    """
    if '\0' in str(value):
        raise ValueError('a path cannot hold a NUL character')
    return check_type_path(value)
