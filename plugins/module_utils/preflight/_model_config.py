# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The language model's sizes from config.json, each checked before any arithmetic uses it.

PRIVATE to the collection: this is not a public API; it may change without notice.
"""

import json
from typing import Any, Optional, overload

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import (
    CONFIG_NAME,
    Config,
    text_config,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._preflight_common import PreflightError

# Config fields are int64 in vLLM (torch); larger ones are corrupt and would overflow the float arithmetic.
MAX_CONFIG_INT = 2**63 - 1

# Where vLLM looks for the model's longest context, in its order.
MAX_LENGTH_KEYS = ('max_position_embeddings', 'n_positions', 'max_seq_len', 'seq_length', 'max_sequence_length')


@overload
def config_int(config: Config, key: str, minimum: int = ..., maximum: int = ..., *, missing: int) -> int:
    """With an int for missing, always an int."""


@overload
def config_int(
    config: Config, key: str, minimum: int = ..., maximum: int = ..., missing: Optional[int] = ...
) -> Optional[int]:
    """Else None when the field is absent or null."""


def config_int(
    config: Config, key: str, minimum: int = 1, maximum: int = MAX_CONFIG_INT, missing: Optional[int] = None
) -> Optional[int]:
    """The integer field key of the language model's config (text_config of a multimodal one), or missing when
    absent or null. Anything but a JSON integer from minimum to maximum raises PreflightError naming the field."""
    value = text_config(config).get(key)
    if value is None:
        return missing
    return checked_int(value, config_field(config, key), minimum, maximum)


def checked_int(value: Any, field: str, minimum: int = 1, maximum: int = MAX_CONFIG_INT) -> int:
    """value, the config.json field named field, when it is a JSON integer from minimum to maximum."""
    # JSON true is no layer count, though bool is an int in Python.
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if not is_int or not minimum <= value <= maximum:
        bound = 'at most %d' % maximum if is_int and value > maximum else 'at least %d' % minimum
        raise PreflightError(
            '%s: %s is %s, where an integer of %s was expected' % (CONFIG_NAME, field, json.dumps(value)[:500], bound)
        )
    return value


def config_field(config: Config, key: str) -> str:
    """How a message names the field key: text_config.key where the language model's config is text_config."""
    return key if text_config(config) is config else 'text_config.' + key


def derived_max_model_len(config: Config) -> Optional[int]:
    """The longest context the model's config allows (vLLM's derived max_model_len, simplified)."""
    for key in MAX_LENGTH_KEYS:
        value = config_int(config, key)
        if value is None and config.get(key) is not None:
            value = checked_int(config[key], key)
        if value is not None:
            return value
    return None
