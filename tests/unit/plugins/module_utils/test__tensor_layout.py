# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Unit tests of _tensor_layout: a checkpoint's tensors and their bytes from config.json alone."""

import json

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._tensor_layout import (
    Quantization,
    checkpoint_tensors,
    is_vision,
    sized_from_config,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._weights import runtime_weight_bytes
from ansible_collections.llmserve.vllm.tests.support import checkpoint_config, fixture_path, kimi_index_names

KIMI = checkpoint_config('kimi-k2.5-nvfp4')
with open(fixture_path('checkpoints', 'kimi-k2.5-nvfp4', 'hf_quant_config.json')) as handle:
    KIMI_QUANT = json.load(handle)
# One dense layer of a Llama: 8 heads of 16, 2 KV heads, an MLP of 128, a vocabulary of 1000.
LLAMA = {
    'model_type': 'llama',
    'hidden_size': 128,
    'num_attention_heads': 8,
    'num_key_value_heads': 2,
    'intermediate_size': 256,
    'num_hidden_layers': 1,
    'vocab_size': 1000,
    'torch_dtype': 'bfloat16',
}
FP8_BLOCK = {'quant_method': 'fp8', 'fmt': 'e4m3', 'weight_block_size': [128, 128]}


def test_a_dense_model_has_every_tensor_at_its_size():
    tensors = checkpoint_tensors(LLAMA)
    assert tensors == {
        'model.embed_tokens.weight': 1000 * 128 * 2,
        'model.norm.weight': 128 * 2,
        'lm_head.weight': 1000 * 128 * 2,
        'model.layers.0.input_layernorm.weight': 128 * 2,
        'model.layers.0.post_attention_layernorm.weight': 128 * 2,
        'model.layers.0.self_attn.q_proj.weight': 128 * 128 * 2,
        'model.layers.0.self_attn.k_proj.weight': 32 * 128 * 2,
        'model.layers.0.self_attn.v_proj.weight': 32 * 128 * 2,
        'model.layers.0.self_attn.o_proj.weight': 128 * 128 * 2,
        'model.layers.0.mlp.gate_proj.weight': 256 * 128 * 2,
        'model.layers.0.mlp.up_proj.weight': 256 * 128 * 2,
        'model.layers.0.mlp.down_proj.weight': 128 * 256 * 2,
    }


def test_tied_embeddings_have_no_lm_head():
    assert 'lm_head.weight' not in checkpoint_tensors(dict(LLAMA, tie_word_embeddings=True))


def test_fp8_blocks_keep_a_float32_scale_a_block_and_the_router_and_lm_head_in_bf16():
    config = dict(
        LLAMA,
        model_type='qwen3_moe',
        num_experts=2,
        moe_intermediate_size=64,
        quantization_config=dict(FP8_BLOCK, modules_to_not_convert=['lm_head']),
    )
    tensors = checkpoint_tensors(config)
    expert = 'model.layers.0.mlp.experts.1.down_proj'
    assert tensors[expert + '.weight'] == 128 * 64  # one byte an element
    assert tensors[expert + '.weight_scale_inv'] == 1 * 1 * 4  # ceil(128/128) x ceil(64/128) blocks
    assert tensors['model.layers.0.mlp.gate.weight'] == 2 * 128 * 2
    assert tensors['lm_head.weight'] == 1000 * 128 * 2
    assert tensors['model.layers.0.self_attn.q_norm.weight'] == 16 * 2


def test_nvfp4_packs_two_values_a_byte_with_an_fp8_scale_each_16():
    quant = Quantization(KIMI, KIMI_QUANT)
    assert quant.method == 'nvfp4'
    assert quant.tensors('language_model.model.layers.3.mlp.experts.7.up_proj', 2048, 7168, 2) == {
        'language_model.model.layers.3.mlp.experts.7.up_proj.weight': 2048 * 7168 // 2,
        'language_model.model.layers.3.mlp.experts.7.up_proj.weight_scale': 2048 * 7168 // 16,
        'language_model.model.layers.3.mlp.experts.7.up_proj.weight_scale_2': 4,
        'language_model.model.layers.3.mlp.experts.7.up_proj.input_scale': 4,
    }
    assert not quant.quantizes('language_model.lm_head')  # hf_quant_config.json excludes it
    assert not quant.quantizes('vision_tower.encoder.blocks.0.wqkv')


def test_compressed_tensors_integer_groups_and_their_ignore_patterns():
    quant = Quantization(
        {
            'quantization_config': {
                'quant_method': 'compressed-tensors',
                'format': 'pack-quantized',
                'config_groups': {
                    'group_0': {'weights': {'num_bits': 4, 'type': 'int', 'strategy': 'group', 'group_size': 32}}
                },
                'ignore': ['lm_head', 're:.*self_attn.*'],
            }
        },
        None,
    )
    assert quant.tensors('model.layers.1.mlp.experts.0.gate_proj', 2048, 7168, 2) == {
        'model.layers.1.mlp.experts.0.gate_proj.weight_packed': 2048 * 7168 // 8 * 4,
        'model.layers.1.mlp.experts.0.gate_proj.weight_scale': 2048 * 7168 // 32 * 2,
        'model.layers.1.mlp.experts.0.gate_proj.weight_shape': 16,
    }
    assert not quant.quantizes('model.layers.1.self_attn.o_proj')


def test_a_scheme_not_modelled_quantizes_nothing():
    quant = Quantization({'quantization_config': {'quant_method': 'gptq', 'bits': 4}}, None)
    assert (quant.method, quant.quantizes('model.layers.0.mlp.up_proj')) == ('gptq', False)


def test_a_family_not_modelled_has_no_layout():
    assert checkpoint_tensors(dict(LLAMA, model_type='gpt_oss')) is None
    assert sized_from_config(['model.embed_tokens.weight'], dict(LLAMA, model_type='gpt_oss')) is None


def test_kimi_index_sized_from_config():
    """Every tensor the real index names gets its size, the routed experts in NVFP4, the vision tower in bf16."""
    names = kimi_index_names()
    sized = sized_from_config(names, KIMI, KIMI_QUANT)
    assert set(sized) == set(names)
    expert = 'language_model.model.layers.5.mlp.experts.100.down_proj.weight'
    assert sized[expert] == 7168 * 2048 // 2
    assert sized['vision_tower.encoder.blocks.0.wqkv.weight'] == 3 * 1152 * 1152 * 2
    assert sum(sized.values()) == 581902680384  # the ~540 GiB of the model card


def test_the_index_says_which_modules_are_quantized():
    """A weight without a scale beside it in the index is stored unquantized, whatever the exclusions say."""
    names = [
        n
        for n in kimi_index_names()
        if not n.startswith('language_model.model.layers.2.self_attn.o_proj.') or n.endswith('.weight')
    ]
    sized = sized_from_config(names, KIMI, KIMI_QUANT)
    assert sized['language_model.model.layers.2.self_attn.o_proj.weight'] == 7168 * 64 * 128 * 2
    assert sized['language_model.model.layers.3.self_attn.o_proj.weight'] == 7168 * 64 * 128 // 2


def test_an_index_named_otherwise_is_not_sized():
    """A layout that knows fewer than 90 % of the index's names does not stand for the checkpoint."""
    names = ['transformer.h.%d.attn.c_attn.weight' % i for i in range(20)] + ['model.embed_tokens.weight']
    assert sized_from_config(names, LLAMA) is None


def test_vision_tensors():
    assert is_vision('vision_tower.encoder.blocks.0.wo.weight') and is_vision('mm_projector.proj.0.weight')
    assert not is_vision('language_model.model.layers.0.mlp.gate.weight')


DEEPSEEK_FP8 = dict(
    model_type='deepseek_v3',
    num_hidden_layers=61,
    num_attention_heads=128,
    hidden_size=7168,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    quantization_config=FP8_BLOCK,
)


@pytest.mark.parametrize(
    'config, version, expected',
    [
        # a quantized kv_b_proj: one bf16 copy of this rank's 16 heads of (128 + 128) x 512
        (DEEPSEEK_FP8, '0.33.0', 61 * 512 * 16 * 256 * 2),
        # an unquantized one is only viewed
        (dict(DEEPSEEK_FP8, quantization_config=None), '0.33.0', 0),
        # vLLM 0.7 also absorbs: W_QR (1536 x 16 x 64, bf16), W_Q_UK (1536 x 8192) and W_UV_O (8192 x 7168) in FP8
        # with a float32 scale per 128 x 128 block
        (
            DEEPSEEK_FP8,
            '0.7.3',
            61 * (512 * 16 * 256 * 2 + 1536 * 16 * 64 * 2 + 1536 * 8192 + 12 * 64 * 4 + 8192 * 7168 + 64 * 56 * 4),
        ),
        (LLAMA, '0.7.3', 0),
    ],
    ids=['fp8-current', 'bf16-current', 'fp8-absorbed-0.7', 'not-mla'],
)
def test_what_vllm_adds_to_mla_weights_after_loading(config, version, expected):
    assert runtime_weight_bytes(config, 8, vllm_version=version) == expected
