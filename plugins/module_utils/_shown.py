# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""A value as the filters' refusals show it, and whether it reads as one word of a command line.

PRIVATE to the collection: this is not a public API; it may change without notice.

A value from an inventory can be of any size: a text of a megabyte, or an integer of more digits than Python writes
(str() and repr() of one raise ValueError). A refusal quotes it cut, and never raises while it does.
"""

from typing import Any

# The most of a value a refusal quotes.
MAX_SHOWN_CHARS = 200


def shown(value: Any, limit: int = MAX_SHOWN_CHARS) -> str:
    """repr(value), cut to limit characters and marked with how many it had; an integer of more digits than Python
    writes is described instead."""
    try:
        text = repr(value)
    except ValueError:  # an int beyond sys.get_int_max_str_digits(), alone or inside a container
        return 'a value holding an integer of more digits than Python writes'
    except RecursionError:
        return 'a value nested too deeply to write'
    return text if len(text) <= limit else '%s... (%d characters)' % (text[:limit], len(text))


def is_word(value: Any) -> bool:
    """Whether value reads as one command-line word: a text or a number that Python writes; None, a boolean or a
    container would be spelt as Python writes it (None, True, [...])."""
    if isinstance(value, str):
        return True
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        str(value)
    except ValueError:  # an int of more digits than Python writes
        return False
    return True
