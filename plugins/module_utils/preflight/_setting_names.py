# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The preflight's own messages in its caller's words: a role that sets the module's options from variables of its
own has its users told which variable to change (vllm_kimi_max_model_len), not which option (max_model_len).

PRIVATE to the collection: this is not a public API; it may change without notice.
"""

import re
from collections.abc import Iterable, Mapping
from typing import Any, Optional

# An option's name stands alone: not part of a longer name, a flag (--max-model-len), a dotted key or a path.
_EDGE_BEFORE = r'(?<![\w./-])'
_EDGE_AFTER = r'(?![\w/-])'
# How deep callers_texts looks into the options (a list of measurements, each a mapping of mappings).
MAX_TEXT_DEPTH = 4


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


def callers_texts(params: Mapping[str, Any], depth: int = MAX_TEXT_DEPTH) -> list[str]:
    """The texts the caller gave in the module's options (a path, a URL, a name), however nested, setting_names'
    own left out: the caller's words, which in_callers_words never rewrites."""
    texts: list[str] = []
    pending: list[tuple[Any, int]] = [(value, 0) for key, value in params.items() if key != 'setting_names']
    while pending:
        value, level = pending.pop()
        if isinstance(value, str):
            if value:
                texts.append(value)
        elif level < depth and isinstance(value, Mapping):
            pending.extend((item, level + 1) for item in list(value.keys()) + list(value.values()))
        elif level < depth and isinstance(value, (list, tuple)):
            pending.extend((item, level + 1) for item in value)
    return texts


def _callers_spans(text: str, callers_words: Iterable[str]) -> list[tuple[int, int]]:
    """Where in text the caller's own words stand, as given and as repr() and ascii() quote them."""
    spans = []
    for words in callers_words:
        for spelling in dict.fromkeys((words, repr(words)[1:-1], ascii(words)[1:-1])):
            at = text.find(spelling)
            while at >= 0:
                spans.append((at, at + len(spelling)))
                at = text.find(spelling, at + 1)
    return spans


def in_callers_words(text: str, names: Mapping[str, str], callers_words: Iterable[str] = ()) -> str:
    """text with every option that names maps written as the caller's name for it, but inside the caller's own words
    (callers_texts: a directory named "max_model_len tests" stays as it is)."""
    if not names:
        return text
    spans = _callers_spans(text, callers_words)
    # Longest first, so that an option that begins another's name never takes the other's place.
    pattern = '|'.join(re.escape(option) for option in sorted(names, key=len, reverse=True))

    def renamed(match: 're.Match[str]') -> str:
        inside = any(begin <= match.start() and match.end() <= end for begin, end in spans)
        return match.group(0) if inside else names[match.group(1)]

    return re.sub(_EDGE_BEFORE + '(' + pattern + ')' + _EDGE_AFTER, renamed, text)
