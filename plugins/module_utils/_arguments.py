# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Argument types shared by the modules.

PRIVATE to the collection: this is not a public API and may change at any time.
Only the modules of llmserve.vllm may import it.
"""

import math
from typing import Optional, Union

from ansible.module_utils.common.validation import check_type_path

# A day: the longest that any option of the collection's modules lets a wait, a timeout or a probe run.
MAX_WAIT_SECONDS = 86400

Number = Union[int, float]


def range_problem(
    name: str,
    value: Number,
    minimum: Optional[Number] = None,
    maximum: Optional[Number] = None,
    unit: str = '',
    above: bool = False,
) -> Optional[str]:
    """The refusal of a number option outside its range, or None: one wording for every module.

    "timeout must be from 1 to 86400 seconds, got 0"; "at least 1" or "at most 86400" where one bound is given;
    above: the minimum itself is refused, "more than 0 and at most 2 seconds". NaN and the infinities are refused
    whatever the bounds, as no option takes them. unit follows the bounds, with its space ("' seconds'").
    """
    inside = (
        (not isinstance(value, float) or math.isfinite(value))
        and (minimum is None or (value > minimum if above else value >= minimum))
        and (maximum is None or value <= maximum)
    )
    if inside:
        return None
    lowest = '%s %s' % ('more than' if above else 'at least', minimum) if minimum is not None else ''
    if minimum is not None and maximum is not None:
        wanted = ('%s and at most %s' % (lowest, maximum)) if above else 'from %s to %s' % (minimum, maximum)
    else:
        wanted = lowest or 'at most %s' % maximum
    return '%s must be %s%s, got %s' % (name, wanted, unit, value)


def nul_free_path(value: object) -> str:
    """Ansible's `type='path'` (user and variables expanded), refusing a NUL character and text that is not UTF-8.

    The refusals have to come from the argument spec: AnsibleModule logs its arguments once they
    are validated, and that logging fails before the module's own code runs. Since Python 3.12
    syslog raises on a NUL, so the user reads "Failed to log to syslog"; and ansible-core encodes
    each argument to UTF-8 first, so a lone surrogate (what a file name in another encoding
    decodes to, '\\udcff') ends the module in a traceback. As a type, the refusal names the option
    on every Python. The expanded path is checked, as that is what gets logged: a variable of the
    environment may hold such a name too.
    """
    if '\0' in str(value):
        raise ValueError('a path cannot hold a NUL character')
    path = check_type_path(value)
    try:
        path.encode('utf-8')
    except UnicodeEncodeError:
        raise ValueError('a path must be valid UTF-8, got %s' % ascii(path)) from None
    return path
