# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""JSON read from a file or an answer, with its source named in every refusal: the one decoder of the collection's
files (checkpoint configs and manifests, deployment records, the KV-cache edit's record).

PRIVATE to the collection: this is not a public API; it may change without notice.
Only the Python standard library is used.
"""

import json
from typing import Any, Optional, Union


def nests_deeper(value: Any, max_depth: int) -> bool:
    """Whether value nests arrays and objects more than max_depth levels, counted without recursion."""
    level = [value] if isinstance(value, (dict, list)) else []
    for _depth in range(max_depth):
        level = [
            child
            for container in level
            for child in (container.values() if isinstance(container, dict) else container)
            if isinstance(child, (dict, list))
        ]
    return bool(level)


def decode_json(data: Union[bytes, str], where: str, error: type[Exception], max_depth: Optional[int] = None) -> Any:
    """The JSON value in data (UTF-8 bytes, or text), or error(a message naming where and the cause).

    max_depth: a value that nests arrays and objects deeper is refused, whether Python's parser could read it or not.
    """
    deep = '%s nests arrays and objects more than %d levels deep' % (where, max_depth) if max_depth else None
    try:
        value = json.loads(data.decode('utf-8') if isinstance(data, bytes) else data)
    except UnicodeDecodeError as exc:
        raise error('%s is not UTF-8 text: %s' % (where, exc)) from exc
    except ValueError as exc:
        raise error('%s is not valid JSON: %s' % (where, exc)) from exc
    except RecursionError:
        raise error(deep or '%s is nested too deeply to be read as JSON' % where) from None
    if max_depth and nests_deeper(value, max_depth):
        raise error(deep)
    return value
