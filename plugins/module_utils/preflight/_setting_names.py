# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The preflight's own messages in its caller's words: a role that sets the module's options from variables of its
own has its users told which variable to change (vllm_kimi_max_model_len), not which option (max_model_len).

PRIVATE to the collection: this is not a public API; it may change without notice.
"""

import re
from collections.abc import Mapping
from typing import Optional

# An option's name stands alone: not part of a longer name, a flag (--max-model-len), a dotted key or a path.
_EDGE_BEFORE = r'(?<![\w./-])'
_EDGE_AFTER = r'(?![\w/-])'


def unknown_setting_names(names: Mapping[str, str], options: Mapping[str, object]) -> Optional[str]:
    """The message when setting_names maps what is no option of the module, or to no name; else None."""
    unknown = sorted(key for key in names if key not in options)
    if unknown:
        return 'setting_names maps %s, which %s no option of this module' % (
            ', '.join(unknown),
            'is' if len(unknown) == 1 else 'are',
        )
    empty = sorted(key for key, name in names.items() if not isinstance(name, str) or not name.strip())
    if empty:
        return 'setting_names gives %s no name' % ', '.join(empty)
    return None


def in_callers_words(text: str, names: Mapping[str, str]) -> str:
    """text with every option that names maps written as the caller's name for it."""
    if not names:
        return text
    # Longest first, so that an option that begins another's name never takes the other's place.
    pattern = '|'.join(re.escape(option) for option in sorted(names, key=len, reverse=True))
    return re.sub(_EDGE_BEFORE + '(' + pattern + ')' + _EDGE_AFTER, lambda match: names[match.group(1)], text)
