# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Properties of gpu_preflight's readers and arithmetic over any input Hypothesis makes up.

Whatever config.json, nvidia-smi output, safetensors header or index holds, the pure
functions raise only their own error (PreflightError, CheckpointError), and what they
return keeps the plan's invariants: a positive KV size per token, whole blocks of tokens,
never a fit without a token, and a result that goes back to the controller as JSON.
"""

import json
import os
import struct
import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import CheckpointError, load_config
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._safetensors import (
    DTYPE_BITS,
    Checkpoint,
    entry_problem,
    read_header,
    scan,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._gpu_preflight import plan
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._kv_cache import kv_bytes_per_token
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._nvidia_smi import (
    MAX_SMI_NUMBER,
    parse_apps,
    parse_gpus,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._preflight_common import PreflightError

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True)
GIB = 1024**3

# What a hostile config.json holds where an integer belongs.
ODD_NUMBERS = st.one_of(
    st.integers(min_value=-3, max_value=300),
    st.sampled_from([0, -1, 2**31, 2**63 - 1, 2**63, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
)
LAYOUT_KEYS = (
    'num_hidden_layers',
    'num_attention_heads',
    'num_key_value_heads',
    'head_dim',
    'hidden_size',
    'kv_lora_rank',
    'qk_rope_head_dim',
    'q_lora_rank',
    'n_routed_experts',
    'first_k_dense_replace',
    'num_nextn_predict_layers',
    'max_position_embeddings',
    'seq_length',
)
# Mostly sound layouts, so that the plan's arithmetic is reached, with odd values mixed in.
SOUND_LAYOUT = st.fixed_dictionaries(
    {
        'num_hidden_layers': st.integers(1, 8),
        'num_attention_heads': st.integers(1, 8),
        'num_key_value_heads': st.integers(1, 8),
        'head_dim': st.integers(1, 256),
        'kv_lora_rank': st.integers(1, 512),
        'qk_rope_head_dim': st.integers(1, 64),
        'max_position_embeddings': st.integers(1, 10**6),
    }
)
LAYOUT = st.tuples(SOUND_LAYOUT, st.dictionaries(st.sampled_from(LAYOUT_KEYS), ODD_NUMBERS, max_size=2)).map(
    lambda t: dict(t[0], **t[1])
)
CONFIGS = st.one_of(
    LAYOUT.map(lambda d: dict(d, model_type='llama')),
    LAYOUT.map(lambda d: dict(d, model_type='deepseek_v3')),
    LAYOUT.map(lambda d: {'model_type': 'kimi_k25', 'text_config': dict(d, model_type='deepseek_v3')}),
    st.tuples(LAYOUT, st.sampled_from(['llama', 'deepseek_v3'])).map(
        lambda t: {'text_config': dict(t[0], model_type=t[1]), 'max_position_embeddings': 4096}
    ),
)
TENSOR_NAMES = st.sampled_from(
    [
        'model.embed_tokens.weight',
        'model.layers.0.self_attn.kv_a_proj_with_mqa.weight',
        'model.layers.1.mlp.experts.0.up_proj.weight',
        'model.layers.2.self_attn.o_proj.weight',
        'model.layers.7.self_attn.k_proj.weight',
        'model.norm.weight',
        'lm_head.weight',
        'vision_tower.layers.9.w',
    ]
)
CHECKPOINTS = st.one_of(
    st.none(),
    st.tuples(st.dictionaries(TENSOR_NAMES, st.one_of(st.none(), st.integers(0, 2**40))), st.integers(0, 2**44)),
)


def checkpoint(spec):
    if spec is None:
        return None
    ckpt = Checkpoint()
    ckpt.tensors, ckpt.total_bytes = spec
    ckpt.source = 'index' if all(v is None for v in ckpt.tensors.values()) else 'headers'
    return ckpt


PARAMS = st.fixed_dictionaries(
    {
        'tensor_parallel_size': st.integers(1, 16),
        'pipeline_parallel_size': st.integers(1, 4),
        'gpu_memory_utilization': st.floats(0.01, 1.0),
        'max_model_len': st.one_of(st.just('auto'), st.integers(1, 10**7)),
        'kv_cache_dtype': st.sampled_from(['auto', 'bfloat16', 'fp8', 'float32']),
        'kv_cache_memory_bytes': st.one_of(st.none(), st.integers(0, 2**16), st.integers(0, 2**40)),
        'weights_bytes_per_gpu': st.one_of(st.none(), st.integers(0, 2**40)),
        'reserve_bytes_per_gpu': st.integers(0, 2**36),
        'block_size': st.integers(1, 256),
        'fail_on_misfit': st.booleans(),
        'accelerator': st.sampled_from(['nvidia', 'cpu']),
        'fp8_kv_cache_policy': st.sampled_from(['auto', 'strip', 'keep']),
        'shm_min_bytes': st.just(0),
    }
)
GPUS = st.lists(
    st.fixed_dictionaries(
        {
            'name': st.text(max_size=8),
            'memory_total_mib': st.integers(1, 2**20),
            'memory_used_mib': st.integers(0, 2**20),
            'compute_capability': st.sampled_from(['9.0', '12.0', '']),
            'uuid': st.sampled_from(['u0', 'u1']),
        }
    ),
    max_size=4,
)


# The problems that say why no context length fits.
NOTHING_FITS = (
    'No context length fits',
    'No available memory for the cache blocks',
    'accelerator cpu needs kv_cache_memory_bytes',
)


@SETTINGS
@given(CONFIGS, PARAMS, GPUS, CHECKPOINTS)
def test_plan_raises_only_its_own_error_and_never_fits_nothing(config, params, gpus, ckpt_spec):
    dtype = params['kv_cache_dtype'] if params['kv_cache_dtype'] != 'auto' else 'bfloat16'
    gpus = [dict(g, index=i) for i, g in enumerate(gpus)]
    try:
        r = plan(params, config, checkpoint(ckpt_spec), gpus, [], (dtype, 'test', None))
    except PreflightError as exc:
        assert 'config.json' in str(exc) or 'pipeline_parallel_size' in str(exc)
        return
    json.dumps(r, allow_nan=False)
    block = params['block_size']
    assert r['kv_cache_bytes_per_token'] > 0
    assert r['kv_cache_tokens'] >= 0 and r['kv_cache_tokens'] % block == 0
    assert r['kv_cache_tokens'] * r['kv_cache_bytes_per_token'] <= r['kv_cache_bytes']
    assert 0 <= r['max_model_len_fit'] <= r['kv_cache_tokens']
    if r['fits']:
        assert r['kv_cache_tokens'] > 0 and r['max_model_len'] >= 1 and r['problems'] == []
        assert r['max_model_len'] <= r['max_model_len_fit'] or params['max_model_len'] != 'auto'
    if r['max_model_len_fit'] == 0:
        assert any(p.startswith(NOTHING_FITS) or 'GPU(s) found' in p for p in r['problems']), (
            'nothing fits, no problem says so'
        )


@SETTINGS
@given(CONFIGS, st.integers(1, 4), st.integers(1, 16))
def test_kv_bytes_per_token_is_positive_or_refused(config, dtype_bytes, tp):
    try:
        per_token, attention = kv_bytes_per_token(config, dtype_bytes, tp)
    except PreflightError as exc:
        assert str(exc).startswith('config.json')
        return
    assert per_token > 0 and attention in ('mla', 'standard')


SMI_FIELDS = st.one_of(
    st.sampled_from(['0', '1', '143771', '[N/A]', '1e400', 'nan', '-5', '9.0', 'GPU-a', '', ' ']), st.text(max_size=6)
)


@SETTINGS
@given(st.lists(st.lists(SMI_FIELDS, min_size=1, max_size=8).map(', '.join), max_size=4).map('\n'.join))
def test_nvidia_smi_parsers_raise_only_their_own_error(text):
    try:
        gpus = parse_gpus(text)
    except PreflightError as exc:
        assert str(exc).startswith('nvidia-smi printed')
    else:
        assert all(1 <= g['memory_total_mib'] <= MAX_SMI_NUMBER and g['memory_used_mib'] >= 0 for g in gpus)
        json.dumps(gpus, allow_nan=False)
    try:
        apps = parse_apps(text)
    except PreflightError as exc:
        assert str(exc).startswith('nvidia-smi printed')
    else:
        assert all(a['used_memory_mib'] is None or a['used_memory_mib'] >= 0 for a in apps)
        json.dumps(apps, allow_nan=False)


JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=6)),
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=8,
)
ENTRIES = st.one_of(
    st.fixed_dictionaries(
        {
            'dtype': st.one_of(st.sampled_from(sorted(DTYPE_BITS)), JSON_VALUES),
            'shape': st.one_of(st.lists(st.integers(-2, 8), max_size=3), JSON_VALUES),
            'data_offsets': st.one_of(st.lists(st.integers(-4, 64), min_size=2, max_size=2), JSON_VALUES),
        }
    ),
    JSON_VALUES,
)


def write_safetensors(directory, header, length=None, data=64):
    path = os.path.join(directory, 'model.safetensors')
    raw = header if isinstance(header, bytes) else json.dumps(header).encode('utf-8')
    with open(path, 'wb') as f:
        f.write(struct.pack('<Q', len(raw) if length is None else length) + raw + b'\0' * data)
    return path


@SETTINGS
@given(st.dictionaries(st.text(max_size=6), ENTRIES, max_size=4), st.integers(0, 128))
def test_read_header_raises_only_its_own_error(header, data):
    with tempfile.TemporaryDirectory() as d:
        path = write_safetensors(d, header, data=data)
        try:
            shard = read_header(path)
        except CheckpointError as exc:
            assert str(exc).startswith(path) and not str(exc).endswith(': None')
            return
    assert shard.data_bytes <= shard.file_bytes - shard.header_bytes
    for name, nbytes in shard.tensors.items():
        info = header[name]
        assert nbytes == info['data_offsets'][1] - info['data_offsets'][0] >= 0
        # JSON true and false pass the lean check as 1 and 0 where the sizes agree (entry_problem refuses them).
        booleans = [v for v in info['shape'] + info['data_offsets'] if isinstance(v, bool)]
        assert entry_problem(info) is None or booleans


@SETTINGS
@given(st.binary(max_size=64), st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_read_header_of_any_bytes(raw, length):
    with tempfile.TemporaryDirectory() as d:
        path = write_safetensors(d, raw, length=length, data=0)
        try:
            read_header(path)
        except CheckpointError as exc:
            assert str(exc).startswith(path) or str(exc).startswith('cannot read ' + path)


@SETTINGS
@given(JSON_VALUES, st.dictionaries(st.text(max_size=4), JSON_VALUES, max_size=3))
def test_scan_of_any_index_raises_only_its_own_error(weight_map, metadata):
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, 'model.safetensors.index.json'), 'w') as f:
            json.dump({'weight_map': weight_map, 'metadata': metadata}, f)
        try:
            ckpt = scan(d)
        except CheckpointError as exc:
            assert d in str(exc)
            return
    assert 0 <= ckpt.total_bytes <= 2**63 - 1


@SETTINGS
@given(st.one_of(st.binary(max_size=64), JSON_VALUES.map(lambda v: json.dumps(v).encode('utf-8'))))
def test_load_config_of_any_bytes(raw):
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, 'config.json'), 'wb') as f:
            f.write(raw)
        try:
            config = load_config(d)
        except CheckpointError as exc:
            assert os.path.join(d, 'config.json') in str(exc)
            return
    assert isinstance(config, dict)
