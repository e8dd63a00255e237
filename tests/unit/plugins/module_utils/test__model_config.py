# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Unit tests of _model_config: the model's longest context from config.json."""

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._model_config import derived_max_model_len
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._preflight_common import PreflightError
from ansible_collections.llmserve.vllm.tests.support import checkpoint_config

LLAMA = checkpoint_config('tiny-llama')


@pytest.mark.parametrize(
    'config, expected',
    [
        (LLAMA, 4096),
        ({'text_config': {'max_position_embeddings': 2048}, 'max_position_embeddings': 4096}, 2048),
        # vLLM reads the top-level config too.
        ({'text_config': {}, 'max_position_embeddings': 4096}, 4096),
        ({'max_position_embeddings': None}, None),
    ],
)
def test_derived_max_model_len(config, expected):
    assert derived_max_model_len(config) == expected


@pytest.mark.parametrize(
    'config, message',
    [
        (
            dict(LLAMA, max_position_embeddings=-5),
            'config.json: max_position_embeddings is -5, where an integer of at least 1 was expected',
        ),
        (
            {'text_config': {}, 'seq_length': '4k'},
            'config.json: seq_length is "4k", where an integer of at least 1 was expected',
        ),
    ],
)
def test_derived_max_model_len_refuses_a_bad_length(config, message):
    with pytest.raises(PreflightError) as exc:
        derived_max_model_len(config)
    assert str(exc.value) == message
