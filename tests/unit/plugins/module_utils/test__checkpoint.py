# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Unit tests of _checkpoint: config reading and vLLM's --kv-cache-dtype auto resolution."""

import json

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import (
    CheckpointError,
    kv_cache_quant_algo_string,
    load_config,
    model_dtype,
    resolve_kv_cache_dtype,
)

DS = {'model_type': 'deepseek_v3', 'kv_lora_rank': 512, 'qk_rope_head_dim': 64, 'torch_dtype': 'bfloat16'}
LLAMA = {'model_type': 'llama', 'torch_dtype': 'bfloat16'}
MODELOPT_FLAT = {
    'quant_method': 'modelopt',
    'quant_algo': 'NVFP4',
    'kv_cache_scheme': {'dynamic': False, 'num_bits': 8, 'type': 'float'},
}
LEGACY = {
    'producer': {'name': 'modelopt', 'version': '0.29.0'},
    'quantization': {'quant_algo': 'NVFP4', 'group_size': 16, 'kv_cache_quant_algo': 'FP8', 'exclude_modules': []},
}


@pytest.mark.parametrize(
    'quant_cfg, expected',
    [
        (MODELOPT_FLAT, 'fp8_e4m3'),
        (dict(MODELOPT_FLAT, kv_cache_scheme='FP8'), 'fp8_e4m3'),
        (dict(MODELOPT_FLAT, kv_cache_scheme=None, kv_cache_quant_algo='fp8'), 'fp8_e4m3'),
        (dict(MODELOPT_FLAT, kv_cache_scheme=None), None),
        (dict(MODELOPT_FLAT, kv_cache_scheme={'num_bits': 4, 'type': 'float'}), 'nvfp4'),
        (dict(MODELOPT_FLAT, kv_cache_scheme={'num_bits': 8, 'type': 'int'}), 'auto'),
        (dict(MODELOPT_FLAT, kv_cache_scheme='INT8'), 'auto'),
        # hf_quant_config.json has no quant_method: vLLM derives modelopt_fp4 from the producer.
        (LEGACY, 'fp8_e4m3'),
        (
            {'producer': {'name': 'modelopt'}, 'quantization': {'quant_algo': 'NVFP4', 'kv_cache_quant_algo': None}},
            None,
        ),
        ({'quant_method': 'compressed-tensors', 'kv_cache_scheme': {'num_bits': 8, 'type': 'float'}}, None),
        ({'quant_method': 'fp8'}, None),
    ],
)
def test_kv_cache_quant_algo_string_mirrors_vllm(quant_cfg, expected):
    assert kv_cache_quant_algo_string(quant_cfg) == expected


CT = {'quant_method': 'compressed-tensors', 'kv_cache_scheme': {'num_bits': 8, 'type': 'float', 'strategy': 'tensor'}}


@pytest.mark.parametrize(
    'requested, config, hf_quant, expected',
    [
        (
            'auto',
            dict(LLAMA),
            None,
            (
                'bfloat16',
                'kv_cache_dtype auto resolves to the model dtype bfloat16: the checkpoint asks for no KV-cache quantization',
                None,
            ),
        ),
        (
            'auto',
            dict(DS, quantization_config=MODELOPT_FLAT),
            None,
            (
                'fp8_e4m3',
                'kv_cache_dtype auto resolves to fp8_e4m3 from config.json (quant_method modelopt), as in vLLM',
                None,
            ),
        ),
        (
            'auto',
            {'model_type': 'kimi_k25', 'text_config': DS},
            LEGACY,
            (
                'fp8_e4m3',
                'kv_cache_dtype auto resolves to fp8_e4m3 from hf_quant_config.json (quant_method modelopt_fp4), as in vLLM',
                None,
            ),
        ),
        # config.json's quantization_config wins over hf_quant_config.json.
        (
            'auto',
            dict(DS, quantization_config=dict(MODELOPT_FLAT, kv_cache_scheme=None)),
            LEGACY,
            (
                'bfloat16',
                'kv_cache_dtype auto resolves to the model dtype bfloat16: the checkpoint asks for no KV-cache quantization',
                None,
            ),
        ),
        # compressed-tensors: vLLM's Attention layer turns auto into fp8, its MLAAttention does not.
        (
            'auto',
            dict(LLAMA, quantization_config=CT),
            None,
            (
                'fp8',
                'kv_cache_dtype auto resolves to fp8 from the kv_cache_scheme in config.json (compressed-tensors), as in vLLM',
                None,
            ),
        ),
        (
            'auto',
            dict(DS, quantization_config=CT),
            None,
            (
                'bfloat16',
                'kv_cache_dtype auto resolves to the model dtype bfloat16: the checkpoint asks for no KV-cache quantization',
                None,
            ),
        ),
        (
            'auto',
            {'model_type': 'kimi_k25', 'text_config': dict(DS, quantization_config=MODELOPT_FLAT)},
            None,
            (
                'bfloat16',
                'kv_cache_dtype auto resolves to the model dtype bfloat16: the checkpoint asks for no KV-cache quantization',
                'text_config.quantization_config asks for a quantized KV cache, but vLLM resolves --kv-cache-dtype auto from the '
                'top-level quantization_config only',
            ),
        ),
        (
            'bfloat16',
            dict(DS, quantization_config=MODELOPT_FLAT),
            None,
            ('bfloat16', 'kv_cache_dtype bfloat16 as requested', None),
        ),
    ],
)
def test_resolve_kv_cache_dtype(tmp_path, requested, config, hf_quant, expected):
    if hf_quant is not None:
        (tmp_path / 'hf_quant_config.json').write_text(json.dumps(hf_quant))
    assert resolve_kv_cache_dtype(requested, str(tmp_path), config) == expected


@pytest.mark.parametrize(
    'config, expected',
    [
        ({'torch_dtype': 'float16'}, 'float16'),
        ({'dtype': 'bfloat16'}, 'bfloat16'),
        ({'torch_dtype': 'float32'}, 'bfloat16'),
        ({'text_config': {'torch_dtype': 'float16'}, 'torch_dtype': 'bfloat16'}, 'float16'),
        ({}, 'bfloat16'),
    ],
)
def test_model_dtype(config, expected):
    assert model_dtype(config) == expected


@pytest.mark.parametrize(
    'content, message',
    [
        (None, '{p} does not exist: is {d} a Hugging Face checkpoint directory?'),
        ('{"a": ', '{p} is not valid JSON: Expecting value: line 1 column 7 (char 6)'),
        ('[1]', '{p} does not hold a JSON object'),
    ],
)
def test_load_config_errors(tmp_path, content, message):
    p = tmp_path / 'config.json'
    if content is not None:
        p.write_text(content)
    with pytest.raises(CheckpointError) as exc:
        load_config(str(tmp_path))
    assert str(exc.value) == message.format(p=p, d=tmp_path)
