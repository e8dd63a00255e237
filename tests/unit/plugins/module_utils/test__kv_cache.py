# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Unit tests of _kv_cache: the KV-cache bytes a token takes on a GPU."""

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._kv_cache import kv_bytes_per_token
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._preflight_common import PreflightError
from ansible_collections.llmserve.vllm.tests.support import checkpoint_config

KIMI = checkpoint_config('kimi-k2.5-nvfp4')
LLAMA = checkpoint_config('tiny-llama')
TINY_MLA = checkpoint_config('tiny-deepseek-v3')


@pytest.mark.parametrize(
    'config, dtype_bytes, tp, expected',
    [
        # Kimi-K2.5: 61 x (512 + 64) x 2 B, the same on every one of 8 ranks.
        (KIMI, 2, 8, (70272, 'mla')),
        (KIMI, 1, 8, (35136, 'mla')),
        (KIMI, 2, 1, (70272, 'mla')),
        # DeepseekV3 configs carry head_dim and num_key_value_heads: MLA must ignore them (vLLM measured 576).
        (TINY_MLA, 2, 1, (576, 'mla')),
        # GQA: 2 x ceil(2 / TP) x 64 x 2 B x 2 layers.
        (LLAMA, 2, 1, (1024, 'standard')),
        (LLAMA, 2, 2, (512, 'standard')),
        (LLAMA, 2, 4, (512, 'standard')),
        (LLAMA, 1, 8, (256, 'standard')),
        # No head_dim: hidden_size / heads.
        (dict(LLAMA, head_dim=None), 2, 1, (1024, 'standard')),
    ],
)
def test_kv_bytes_per_token(config, dtype_bytes, tp, expected):
    assert kv_bytes_per_token(config, dtype_bytes, tp) == expected


MLA_LAYOUT = {'model_type': 'deepseek_v3', 'num_hidden_layers': 3, 'kv_lora_rank': 64, 'qk_rope_head_dim': 32}


@pytest.mark.parametrize(
    'config, message',
    [
        ({'model_type': 'llama'}, 'config.json has no num_hidden_layers: cannot size the KV cache'),
        (
            {'text_config': {'model_type': 'llama'}},
            'config.json has no text_config.num_hidden_layers: cannot size the KV cache',
        ),
        # MLA without its latent: the cache would be 0 bytes a token, and "fit" with 0 tokens.
        (dict(MLA_LAYOUT, kv_lora_rank=None), 'config.json has no kv_lora_rank: cannot size the KV cache'),
        (dict(MLA_LAYOUT, qk_rope_head_dim=None), 'config.json has no qk_rope_head_dim: cannot size the KV cache'),
        (
            dict(MLA_LAYOUT, kv_lora_rank=-64),
            'config.json: kv_lora_rank is -64, where an integer of at least 1 was expected',
        ),
        (dict(LLAMA, head_dim=-64), 'config.json: head_dim is -64, where an integer of at least 1 was expected'),
        (dict(LLAMA, head_dim=0), 'config.json: head_dim is 0, where an integer of at least 1 was expected'),
        (
            dict(LLAMA, num_hidden_layers='abc'),
            'config.json: num_hidden_layers is "abc", where an integer of at least 1 was expected',
        ),
        (
            dict(LLAMA, num_hidden_layers=float('inf')),
            'config.json: num_hidden_layers is Infinity, where an integer of at least 1 was expected',
        ),
        (
            dict(LLAMA, num_hidden_layers=True),
            'config.json: num_hidden_layers is true, where an integer of at least 1 was expected',
        ),
        (
            dict(LLAMA, num_hidden_layers=2.0),
            'config.json: num_hidden_layers is 2.0, where an integer of at least 1 was expected',
        ),
        (
            dict(LLAMA, num_hidden_layers=2**63),
            'config.json: num_hidden_layers is 9223372036854775808, where an integer of at most 9223372036854775807 was expected',
        ),
        (
            dict(LLAMA, num_key_value_heads=0),
            'config.json: num_key_value_heads is 0, where an integer of at least 1 was expected',
        ),
        (
            dict(LLAMA, head_dim=None, num_attention_heads=[4]),
            'config.json: num_attention_heads is [4], where an integer of at least 1 was expected',
        ),
        (
            dict(LLAMA, head_dim=None, hidden_size=None),
            'config.json lacks num_attention_heads/num_key_value_heads/head_dim: cannot size the KV cache',
        ),
        (
            {'text_config': dict(LLAMA, head_dim='x' * 1000)},
            'config.json: text_config.head_dim is "%s, where an integer of at least 1 was expected' % ('x' * 499),
        ),
    ],
)
def test_kv_bytes_per_token_refuses_a_bad_layout(config, message):
    with pytest.raises(PreflightError) as exc:
        kv_bytes_per_token(config, 2, 1)
    assert str(exc.value) == message
