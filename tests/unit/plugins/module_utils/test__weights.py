# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Unit tests of _weights: the weight bytes each GPU holds."""

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._preflight_common import PreflightError
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._weights import (
    estimated_replicated_bytes,
    pp_partitions,
    weights_per_gpu,
)
from ansible_collections.llmserve.vllm.tests.support import checkpoint_config

KIMI = checkpoint_config('kimi-k2.5-nvfp4')
LLAMA = checkpoint_config('tiny-llama')


@pytest.mark.parametrize(
    'layers, pp, expected',
    [
        (61, 1, [(0, 61)]),
        (61, 2, [(0, 31), (31, 61)]),
        (10, 4, [(0, 2), (2, 5), (5, 8), (8, 10)]),
        (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
    ],
)
def test_pp_partitions_follow_vllm(layers, pp, expected):
    assert pp_partitions(layers, pp) == expected


MLA_TENSORS = {
    'model.embed_tokens.weight': 8000,
    'model.layers.0.self_attn.kv_a_proj_with_mqa.weight': 800,  # replicated
    'model.layers.0.self_attn.q_a_proj.weight': 1600,  # replicated
    'model.layers.0.self_attn.kv_a_layernorm.weight': 80,  # replicated
    'model.layers.0.self_attn.q_b_proj.weight': 3200,  # split
    'model.layers.0.mlp.gate.weight': 400,  # replicated router
    'model.layers.0.mlp.gate.e_score_correction_bias': 16,  # replicated
    'model.layers.0.mlp.experts.0.gate_proj.weight': 6400,  # split (gate_proj, not the router)
    'model.layers.0.mlp.experts.0.gate_proj.weight_scale_2': 4,  # a scalar: replicated
    'model.layers.1.self_attn.o_proj.weight': 3200,  # split
    'model.layers.2.self_attn.o_proj.weight': 3200,  # MTP layer (>= num_hidden_layers): not loaded
    'model.norm.weight': 80,  # replicated
    'lm_head.weight': 8000,  # split
}
MLA_CFG = {'model_type': 'deepseek_v3', 'num_hidden_layers': 2, 'kv_lora_rank': 64, 'qk_rope_head_dim': 32}


@pytest.mark.parametrize(
    'tp, pp, expected',
    [
        # everything but the MTP layer
        (1, 1, 31780),
        # replicated 800+1600+80+400+16+4+80 = 2980; split (8000+3200+6400+3200+8000) / 8 = 3600
        (8, 1, 6580),
        # stage 0: embed 8000/2 + layer 0 (2900 + 9600/2); stage 1: layer 1 3200/2 + norm 80 + lm_head 8000/2
        (2, 2, 11700),
    ],
)
def test_weights_per_gpu_counts_replicated_tensors(tp, pp, expected):
    total = sum(MLA_TENSORS.values())
    assert weights_per_gpu(MLA_TENSORS, total, MLA_CFG, tp, pp) == (expected, False)


def test_weights_per_gpu_gqa_kv_heads_fewer_than_tp():
    cfg = dict(LLAMA, num_key_value_heads=2)
    tensors = {'model.layers.0.self_attn.k_proj.weight': 1600, 'model.layers.0.self_attn.q_proj.weight': 6400}
    # 8 ranks share 2 KV heads: each holds one head (1600 / 2); q_proj splits 8 ways.
    assert weights_per_gpu(tensors, 8000, cfg, 8, 1) == (800 + 800, False)


@pytest.mark.parametrize(
    'config, message',
    [
        # One more MTP layer than decoder layers: no config, and a tuple of 10**18 prefixes would not fit in memory.
        (
            dict(MLA_CFG, num_nextn_predict_layers=10**18),
            'config.json: num_nextn_predict_layers is 1000000000000000000, where an integer of at most 2 was expected',
        ),
        (
            dict(MLA_CFG, num_nextn_predict_layers='1'),
            'config.json: num_nextn_predict_layers is "1", where an integer of at least 0 was expected',
        ),
    ],
)
def test_weights_per_gpu_refuses_a_bad_config(config, message):
    with pytest.raises(PreflightError) as exc:
        weights_per_gpu(MLA_TENSORS, sum(MLA_TENSORS.values()), config, 1, 1)
    assert str(exc.value) == message


def test_weights_per_gpu_from_index_estimates_replicated():
    tensors = {'language_model.model.layers.0.x': None}
    replicated = 61 * 7168 * (1536 + 512 + 64) * 2 + 60 * 384 * 7168 * 2
    assert estimated_replicated_bytes(KIMI) == replicated
    per_gpu, estimated = weights_per_gpu(tensors, 540 * 10**9, KIMI, 8, 1)
    assert estimated is True
    assert per_gpu == -(-(540 * 10**9 - replicated) // 8) + replicated
