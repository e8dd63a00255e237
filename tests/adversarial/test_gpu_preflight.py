# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""gpu_preflight against bad input: hostile configs, broken checkpoints, a wedged or lying nvidia-smi.

Every case runs the module as Ansible does and must end in a clean error that names the file
or value and the cause, or in a success whose figures are right. nvidia-smi is a shell script
first on PATH; GPUs are otherwise planned with the gpus option (an RTX PRO 6000).
"""

import base64
import collections
import json
import os
import stat
import struct
from urllib.parse import quote

import pytest

from ansible_collections.llmserve.vllm.tests.adversarial import harness
from ansible_collections.llmserve.vllm.tests.fake_openai import reply
from ansible_collections.llmserve.vllm.tests.support import fake_dev, fixture_path, named_listener

# What the argument spec says of a NUL in a path option (the nul_free_path type).
NUL_REFUSED = (
    "argument '%s' is of type str and we were unable to convert to nul_free_path: a path cannot hold a NUL character"
)

MODULE = 'gpu_preflight'
GIB = 1024**3
MIB = 1024**2
SMI_GPU_QUERY = (
    '--query-gpu=index,name,memory.total,memory.used,compute_cap,driver_version,uuid --format=csv,noheader,nounits'
)
HUNG_SMI = (
    '{bin}/nvidia-smi %s did not finish within 2 seconds and was killed: is the NVIDIA driver hung? '
    '(nvidia_smi_timeout sets the deadline)'
)

LLAMA = {
    'model_type': 'llama',
    'num_hidden_layers': 2,
    'num_attention_heads': 4,
    'num_key_value_heads': 2,
    'head_dim': 64,
    'hidden_size': 256,
    'max_position_embeddings': 4096,
    'dtype': 'bfloat16',
}
MLA = {
    'model_type': 'deepseek_v3',
    'num_hidden_layers': 3,
    'kv_lora_rank': 64,
    'qk_rope_head_dim': 32,
    'num_attention_heads': 4,
    'hidden_size': 256,
    'max_position_embeddings': 4096,
    'dtype': 'bfloat16',
}
RTX = [
    {'name': 'NVIDIA RTX PRO 6000 Blackwell Server Edition', 'memory_total_mib': 97887, 'compute_capability': '12.0'}
]
EMBED = {'model.embed_tokens.weight': {'dtype': 'BF16', 'shape': [512, 256], 'data_offsets': [0, 262144]}}
H200_LINE = b'0, NVIDIA H200, 143771, 0, 9.0, 580.159.04, GPU-a\n'
# The plan for LLAMA on the RTX with the one 262144-byte shard, read from its header (no margin beside weights the
# headers give): 1024 KV bytes a token, whole blocks of 16.
WEIGHTS = 262144
RTX_BUDGET = -(-97887 * MIB * 9 // 10) - WEIGHTS - 5 * GIB
H200_BUDGET = -(-143771 * MIB * 9 // 10) - WEIGHTS - 5 * GIB


def tokens(budget, per_token=1024):
    return budget // (per_token * 16) * 16


# --- building the case on disk ---------------------------------------------------------------


def safetensors_bytes(header, data_bytes=None):
    """A safetensors file: the header (a dict, or raw bytes) and data_bytes of zeros (what the header describes)."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode('utf-8')
    if data_bytes is None:
        data_bytes = max([v['data_offsets'][1] for k, v in header.items() if k != '__metadata__'] or [0])
    return struct.pack('<Q', len(raw)) + raw + b'\0' * data_bytes


def fifo(path):
    if os.path.lexists(path):
        os.unlink(path)
    os.mkfifo(path)


def replace_with_dir(path):
    os.unlink(path)
    os.mkdir(path)


def write(path, content):
    if os.path.lexists(path):
        os.unlink(path)
    with open(path, 'wb') as f:
        f.write(content if isinstance(content, bytes) else content.encode('utf-8'))


def deep_json(depth):
    return '{"a": ' + '[' * depth + ']' * depth + '}'


def index_json(weight_map, total_size=None):
    index = {'weight_map': weight_map}
    if total_size is not None:
        index['metadata'] = {'total_size': total_size}
    return json.dumps(index)


def fake_nvidia_smi(bindir, gpu=H200_LINE, apps=b'', rc=0, before_gpu='', before_apps=''):
    """An nvidia-smi that prints gpu and apps (bytes) for the two queries, after the shell commands before_*."""
    bindir.mkdir()
    (bindir / 'gpu.out').write_bytes(gpu)
    (bindir / 'apps.out').write_bytes(apps)
    script = bindir / 'nvidia-smi'
    # Persistence mode: on, as the H200 host's nvidia-smi table showed it (tests/fixtures/nvidia-smi).
    script.write_text(
        '#!/bin/sh\ncase "$1" in\n'
        '  --query-gpu=uuid,persistence_mode) cat "%s/query-persistence-on.txt";;\n'
        '  --query-gpu=*) %s\n    cat "%s/gpu.out"; exit %d;;\n'
        '  --query-compute-apps=*) %s\n    cat "%s/apps.out";;\n'
        'esac\n' % (fixture_path('nvidia-smi'), before_gpu, bindir, rc, before_apps, bindir)
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


Case = collections.namedtuple('Case', 'config files smi args expect')
Case.__new__.__defaults__ = (None, None, None, None, None)


class Refused:
    """A failure whose message (AnsibleModule's own, worded per ansible-core version) holds all of parts."""

    def __init__(self, *parts):
        self.parts = parts

    def __call__(self, result):
        return all(part in result['msg'] for part in self.parts)


def case(expect, config=None, files=None, smi=None, **args):
    """One bad input. expect: a failure message ({m} the model directory, {bin} the fake nvidia-smi's), Refused, or
    a callable that checks a success. config: config.json's object (LLAMA when None). files(m): changes to the
    model directory. smi: fake_nvidia_smi's keywords (the gpus option plans an RTX PRO 6000 when None)."""
    return Case(config, files, smi, args, expect)


def idx(weight_map, total_size=None):
    def files(m):
        write(os.path.join(m, 'model.safetensors.index.json'), index_json(weight_map, total_size))
        os.unlink(os.path.join(m, 'model.safetensors'))

    return files


def shard(header, data_bytes=None):
    def files(m):
        write(os.path.join(m, 'model.safetensors'), safetensors_bytes(header, data_bytes))

    return files


def tensor(**info):
    entry = dict(EMBED['model.embed_tokens.weight'], **info)
    return {'model.embed_tokens.weight': entry}


def plan_is(max_model_len, kv_tokens, budget=RTX_BUDGET, per_token=1024):
    def check(r):
        return (
            r['fits'],
            r['max_model_len'],
            r['kv_cache_tokens'],
            r['kv_cache_bytes'],
            r['kv_cache_bytes_per_token'],
            r['problems'],
        ) == (True, max_model_len, kv_tokens, budget, per_token, [])

    return check


FITS = plan_is(4096, tokens(RTX_BUDGET))
ENTRY = '{m}/model.safetensors has an invalid header entry for tensor "model.embed_tokens.weight": '

CASES = {
    # --- nvidia-smi hangs, floods, lies ----------------------------------------------------
    'smi-hangs-on-gpu-query': case(HUNG_SMI % SMI_GPU_QUERY, smi=dict(before_gpu='sleep 30')),
    'smi-hangs-on-apps-query': case(
        HUNG_SMI % ('--query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv,noheader,nounits'),
        smi=dict(before_apps='sleep 30'),
    ),
    'smi-hangs-ignoring-sigterm': case(HUNG_SMI % SMI_GPU_QUERY, smi=dict(before_gpu="trap '' TERM; sleep 30")),
    'smi-slow-within-deadline': case(
        plan_is(4096, tokens(H200_BUDGET), H200_BUDGET), smi=dict(before_gpu='sleep 1'), nvidia_smi_timeout=6
    ),
    'smi-floods-output': case(
        '{bin}/nvidia-smi %s printed more than 16777216 bytes and was killed' % SMI_GPU_QUERY,
        smi=dict(before_gpu="head -c 17000000 /dev/zero | tr '\\0' a; sleep 30"),
    ),
    'smi-killed-by-signal': case(
        '{bin}/nvidia-smi %s was killed by signal 9' % SMI_GPU_QUERY, smi=dict(before_gpu='kill -9 $$')
    ),
    'smi-not-executable': case(
        'cannot run {bin}/gpu.out: Permission denied (is the NVIDIA driver installed? set nvidia_smi_path)',
        smi=dict(),
        nvidia_smi_path='{bin}/gpu.out',
    ),
    'smi-path-is-a-directory': case(
        'cannot run {bin}: Permission denied (is the NVIDIA driver installed? set nvidia_smi_path)',
        smi=dict(),
        nvidia_smi_path='{bin}',
    ),
    'smi-memory-total-zero': case(
        "nvidia-smi printed memory.total '0' where a number of at least 1 was expected, in line: "
        '0, NVIDIA H200, 0, 0, 9.0, 580, GPU-a',
        smi=dict(gpu=b'0, NVIDIA H200, 0, 0, 9.0, 580, GPU-a\n'),
    ),
    'smi-memory-total-n/a': case(
        "nvidia-smi printed memory.total '[N/A]' where a number was expected, in line: "
        '0, NVIDIA H200, [N/A], 0, 9.0, 580, GPU-a',
        smi=dict(gpu=b'0, NVIDIA H200, [N/A], 0, 9.0, 580, GPU-a\n'),
    ),
    'smi-memory-total-overflows': case(
        "nvidia-smi printed memory.total '1e400' where a number was expected, in line: "
        '0, NVIDIA H200, 1e400, 0, 9.0, 580, GPU-a',
        smi=dict(gpu=b'0, NVIDIA H200, 1e400, 0, 9.0, 580, GPU-a\n'),
    ),
    'smi-memory-total-negative': case(
        "nvidia-smi printed memory.total '-5' where a number of at least 1 was expected, "
        'in line: 0, NVIDIA H200, -5, 0, 9.0, 580, GPU-a',
        smi=dict(gpu=b'0, NVIDIA H200, -5, 0, 9.0, 580, GPU-a\n'),
    ),
    'smi-memory-used-negative': case(
        "nvidia-smi printed memory.used '-1' where a number of at least 0 was expected, "
        'in line: 0, NVIDIA H200, 143771, -1, 9.0, 580, GPU-a',
        smi=dict(gpu=b'0, NVIDIA H200, 143771, -1, 9.0, 580, GPU-a\n'),
    ),
    'smi-memory-used-above-total': case(
        'GPU 0 (NVIDIA H200) has -0.98 GiB free, vLLM needs 0.88 GiB at '
        'gpu_memory_utilization 0.9. No available memory for the cache blocks: weights '
        '(0.00 GiB per GPU) + reserve (5.00 GiB) exceed 0.88 GiB at gpu_memory_utilization '
        '0.9. Remedies: spread the model over more GPUs (tensor_parallel_size x '
        'pipeline_parallel_size).',
        smi=dict(gpu=b'0, NVIDIA H200, 1000, 2000, 9.0, 580, GPU-a\n'),
    ),
    'smi-index-not-a-number': case(
        "nvidia-smi printed index 'abc' where a number was expected, in line: "
        'abc, NVIDIA H200, 143771, 0, 9.0, 580, GPU-a',
        smi=dict(gpu=b'abc, NVIDIA H200, 143771, 0, 9.0, 580, GPU-a\n'),
    ),
    'smi-garbage': case(
        'nvidia-smi printed 1 fields where 7 (index,name,memory.total,memory.used,compute_cap,'
        'driver_version,uuid) were expected, in line: hello world',
        smi=dict(gpu=b'hello world\n'),
    ),
    'smi-no-gpus': case(
        '0 GPU(s) found, but tensor_parallel_size 1 x pipeline_parallel_size 1 needs 1.', smi=dict(gpu=b'')
    ),
    'smi-name-not-utf8': case(
        lambda r: (r['gpus'][0]['name'], r['fits']) == ('NVIDIA \ufffd\ufffd H200', True),
        smi=dict(gpu=b'0, NVIDIA \xff\xfe H200, 143771, 0, 9.0, 580, GPU-a\n'),
    ),
    'smi-error-not-utf8': case(
        '{bin}/nvidia-smi %s failed with exit code 9: \ufffd driver gone' % SMI_GPU_QUERY,
        smi=dict(gpu=b'\xff driver gone\n', rc=9),
    ),
    'smi-app-pid-overflows': case(
        "nvidia-smi printed pid '1e400' where a number was expected, in line: 1e400, python3, 10, GPU-a",
        smi=dict(apps=b'1e400, python3, 10, GPU-a\n'),
    ),
    'smi-app-memory-overflows': case(
        lambda r: (r['fits'], r['gpus'][0]['processes'][0]['used_memory_mib']) == (True, None),
        smi=dict(apps=b'42, python3, 1e400, GPU-a\n'),
    ),
    'smi-app-name-not-utf8': case(
        lambda r: r['gpus'][0]['processes'][0]['process_name'] == 'py\ufffd', smi=dict(apps=b'42, py\xff, 10, GPU-a\n')
    ),
    # --- the gpus option and the other options -------------------------------------------------
    'gpus-memory-zero': case(
        'gpus[0].memory_total_mib must be at least 1, got 0', gpus=[dict(RTX[0], memory_total_mib=0)]
    ),
    'gpus-memory-negative': case(
        'gpus[0].memory_total_mib must be at least 1, got -1', gpus=[dict(RTX[0], memory_total_mib=-1)]
    ),
    'gpus-memory-astronomic': case(
        'gpus[0].memory_total_mib must be at most 9223372036854775807, got 1' + '0' * 400,
        gpus=[dict(RTX[0], memory_total_mib=10**400)],
    ),
    'gpus-used-negative': case(
        'gpus[0].memory_used_mib must be at least 0, got -5', gpus=[dict(RTX[0], memory_used_mib=-5)]
    ),
    'gpus-memory-bool': case(
        'gpus[0].memory_total_mib must be an integer, got True', gpus=[dict(RTX[0], memory_total_mib=True)]
    ),
    'tp-bool': case('tensor_parallel_size must be an integer, got True', tensor_parallel_size=True),
    'tp-not-a-number': case(
        Refused("argument 'tensor_parallel_size'", "'abc'", 'cannot be converted to an int'), tensor_parallel_size='abc'
    ),
    'max-model-len-infinite': case('max_model_len must be an integer or auto, got inf', max_model_len=float('inf')),
    'max-model-len-nan': case('max_model_len must be an integer or auto, got nan', max_model_len=float('nan')),
    'max-model-len-astronomic': case(
        'max_model_len must be at most 9223372036854775807, got 1' + '0' * 30, max_model_len=10**30
    ),
    'max-model-len-padded': case(plan_is(42, tokens(RTX_BUDGET)), max_model_len=' 42 '),
    'utilization-nan': case(
        'gpu_memory_utilization must be more than 0 and at most 1, got nan', gpu_memory_utilization=float('nan')
    ),
    'kv-budget-astronomic': case(
        'kv_cache_memory_bytes must be at most 9223372036854775807, got 1' + '0' * 400, kv_cache_memory_bytes=10**400
    ),
    'smi-timeout-zero': case('nvidia_smi_timeout must be at least 1, got 0', nvidia_smi_timeout=0),
    'shm-path-under-a-file': case(
        '{m}/config.json/shm does not exist: NCCL and vLLM need shared memory.', shm_path='{m}/config.json/shm'
    ),
    'weights-bool': case('weights_bytes_per_gpu must be an integer, got True', weights_bytes_per_gpu=True),
    'max-model-len-bool': case('max_model_len must be a positive integer or auto, got True', max_model_len=True),
    'gpus-without-compute-capability': case(Refused('compute_capability'), gpus=[{'name': 'x', 'memory_total_mib': 1}]),
    'shm-path-nul': case(NUL_REFUSED % 'shm_path', shm_path='/dev/shm\0x'),
    'kv-budget-zero-on-cpu': case(
        'No context length fits: the KV cache budget of 0 bytes per GPU holds not one block of '
        '16 tokens (16384 bytes).',
        accelerator='cpu',
        kv_cache_memory_bytes=0,
        max_model_len=1024,
    ),
    'kv-budget-below-one-block-auto': case(
        'No context length fits: the KV cache budget of 1 bytes per GPU holds not one '
        'block of 16 tokens (16384 bytes).',
        accelerator='cpu',
        kv_cache_memory_bytes=1,
    ),
    'nothing-fits-without-fail-on-misfit': case(
        'No context length fits: the KV cache budget of 1 bytes per GPU holds not '
        'one block of 16 tokens (16384 bytes).',
        accelerator='cpu',
        kv_cache_memory_bytes=1,
        fail_on_misfit=False,
    ),
    'block-size-astronomic': case(
        'No context length fits: the KV cache budget of %d bytes per GPU holds not one block of '
        '%d tokens (%d bytes).' % (RTX_BUDGET, 2**62, 2**72),
        block_size=2**62,
    ),
    # --- model_path and config.json ----------------------------------------------------------
    'model-path-missing': case('model_path {m}/absent does not exist', model_path='{m}/absent'),
    'model-path-is-a-file': case('model_path {m}/config.json is not a directory', model_path='{m}/config.json'),
    'config-missing': case(
        '{m}/config.json does not exist: is {m} a Hugging Face checkpoint directory?',
        files=lambda m: os.unlink(os.path.join(m, 'config.json')),
    ),
    'config-fifo': case('{m}/config.json is not a regular file', files=lambda m: fifo(os.path.join(m, 'config.json'))),
    'config-is-a-directory': case(
        '{m}/config.json is not a regular file', files=lambda m: replace_with_dir(os.path.join(m, 'config.json'))
    ),
    'config-is-dev-null': case(
        '{m}/config.json is not a regular file',
        files=lambda m: (
            os.unlink(os.path.join(m, 'config.json')),
            os.symlink('/dev/null', os.path.join(m, 'config.json')),
        ),
    ),
    'config-is-a-list': case('{m}/config.json does not hold a JSON object', config=[LLAMA]),
    'config-deeply-nested': case(
        '{m}/config.json is nested too deeply to be read as JSON',
        files=lambda m: write(os.path.join(m, 'config.json'), deep_json(100000)),
    ),
    'config-not-utf8': case(
        "{m}/config.json is not UTF-8 text: 'utf-8' codec can't decode byte 0xff in position 0: invalid start byte",
        files=lambda m: write(os.path.join(m, 'config.json'), b'\xff{}'),
    ),
    'config-empty': case(
        '{m}/config.json is not valid JSON: Expecting value: line 1 column 1 (char 0)',
        files=lambda m: write(os.path.join(m, 'config.json'), b''),
    ),
    'mla-without-kv-lora-rank': case(
        'config.json has no kv_lora_rank: cannot size the KV cache',
        config=dict(MLA, kv_lora_rank=None),
        weights_bytes_per_gpu=GIB,
    ),
    'mla-without-rope-head-dim': case(
        'config.json has no qk_rope_head_dim: cannot size the KV cache',
        config=dict(MLA, qk_rope_head_dim=None),
        weights_bytes_per_gpu=GIB,
    ),
    'mla-negative-kv-lora-rank': case(
        'config.json: kv_lora_rank is -64, where an integer of at least 1 was expected',
        config=dict(MLA, kv_lora_rank=-64),
        weights_bytes_per_gpu=GIB,
    ),
    'mla-ok': case(
        lambda r: (r['attention'], r['kv_cache_bytes_per_token'], r['fits']) == ('mla', 576, True),
        config=MLA,
        weights_bytes_per_gpu=GIB,
    ),
    'head-dim-negative': case(
        'config.json: head_dim is -64, where an integer of at least 1 was expected', config=dict(LLAMA, head_dim=-64)
    ),
    'head-dim-zero': case(
        'config.json: head_dim is 0, where an integer of at least 1 was expected', config=dict(LLAMA, head_dim=0)
    ),
    'head-dim-string': case(
        'config.json: head_dim is "abc", where an integer of at least 1 was expected',
        config=dict(LLAMA, head_dim='abc'),
    ),
    'layers-string': case(
        'config.json: num_hidden_layers is "abc", where an integer of at least 1 was expected',
        config=dict(LLAMA, num_hidden_layers='abc'),
    ),
    'layers-overflow': case(
        'config.json: num_hidden_layers is Infinity, where an integer of at least 1 was expected',
        files=lambda m: write(
            os.path.join(m, 'config.json'),
            json.dumps(LLAMA).replace('"num_hidden_layers": 2', '"num_hidden_layers": 1e400'),
        ),
    ),
    'layers-bool': case(
        'config.json: num_hidden_layers is true, where an integer of at least 1 was expected',
        config=dict(LLAMA, num_hidden_layers=True),
    ),
    'layers-fraction': case(
        'config.json: num_hidden_layers is 2.5, where an integer of at least 1 was expected',
        config=dict(LLAMA, num_hidden_layers=2.5),
    ),
    'layers-astronomic': case(
        'config.json: num_hidden_layers is 1%s, where an integer of at most 9223372036854775807 '
        'was expected' % ('0' * 400),
        config=dict(LLAMA, num_hidden_layers=10**400),
    ),
    'kv-heads-zero': case(
        'config.json: num_key_value_heads is 0, where an integer of at least 1 was expected',
        config=dict(LLAMA, num_key_value_heads=0),
    ),
    'kv-heads-string': case(
        'config.json: num_key_value_heads is "abc", where an integer of at least 1 was expected',
        config=dict(LLAMA, num_key_value_heads='abc'),
    ),
    'heads-string-derives-head-dim': case(
        'config.json: num_attention_heads is "4", where an integer of at least 1 was expected',
        config=dict(LLAMA, head_dim=None, num_attention_heads='4'),
    ),
    'hidden-size-overflow-derives-head-dim': case(
        'config.json: hidden_size is 1%s, where an integer of at most 9223372036854775807 was expected' % ('0' * 400),
        config=dict(LLAMA, head_dim=None, hidden_size=10**400),
    ),
    'max-positions-negative': case(
        'config.json: max_position_embeddings is -5, where an integer of at least 1 was expected',
        config=dict(LLAMA, max_position_embeddings=-5),
    ),
    'max-positions-string': case(
        'config.json: max_position_embeddings is "abc", where an integer of at least 1 was expected',
        config=dict(LLAMA, max_position_embeddings='abc'),
    ),
    'pp-exceeds-layers': case(
        'pipeline_parallel_size 4 exceeds the 2 layers of the model (num_hidden_layers in config.json): '
        'a pipeline stage would hold no layer',
        pipeline_parallel_size=4,
    ),
    'text-config-field-bad': case(
        'config.json: text_config.head_dim is -1, where an integer of at least 1 was expected',
        config={'model_type': 'kimi_k25', 'text_config': dict(LLAMA, head_dim=-1)},
    ),
    'text-config-a-list': case(FITS, config=dict(LLAMA, text_config=[1, 2])),
    'unrelated-field-overflows': case(
        FITS,
        files=lambda m: write(
            os.path.join(m, 'config.json'),
            json.dumps(dict(LLAMA, rope_theta=1)).replace('"rope_theta": 1', '"rope_theta": 1e400'),
        ),
    ),
    'unknown-model-dtype': case(
        'kv_cache_dtype int7: its size per element is not known to the preflight', config=dict(LLAMA, dtype='int7')
    ),
    'dtype-a-number': case(FITS, config=dict(LLAMA, dtype=5)),
    'quantization-config-a-string': case(FITS, config=dict(LLAMA, quantization_config='fp8')),
    'hf-quant-config-fifo': case(
        '{m}/hf_quant_config.json is not a regular file', files=lambda m: fifo(os.path.join(m, 'hf_quant_config.json'))
    ),
    'hf-quant-config-a-list': case(
        '{m}/hf_quant_config.json does not hold a JSON object',
        files=lambda m: write(os.path.join(m, 'hf_quant_config.json'), '[]'),
    ),
    # --- the index and the safetensors headers -----------------------------------------------
    'index-fifo': case(
        '{m}/model.safetensors.index.json is not a regular file',
        files=lambda m: (
            os.unlink(os.path.join(m, 'model.safetensors')),
            fifo(os.path.join(m, 'model.safetensors.index.json')),
        ),
    ),
    'index-deeply-nested': case(
        '{m}/model.safetensors.index.json is nested too deeply to be read as JSON',
        files=lambda m: (
            os.unlink(os.path.join(m, 'model.safetensors')),
            write(os.path.join(m, 'model.safetensors.index.json'), deep_json(100000)),
        ),
    ),
    'index-shard-a-number': case(
        '{m}/model.safetensors.index.json maps tensor "a" to 5, where a shard file name was expected',
        files=idx({'a': 5}, 100),
    ),
    'index-shard-null': case(
        '{m}/model.safetensors.index.json maps tensor "a" to null, where a shard file name was expected',
        files=idx({'a': None}, 100),
    ),
    'index-total-overflows': case(
        '{m}/model.safetensors.index.json has a metadata.total_size that is not a byte count '
        '(an integer from 0 to 2**63 - 1): Infinity',
        files=idx({'a': 'x.safetensors'}, float('inf')),
    ),
    'index-total-negative': case(
        '{m}/model.safetensors.index.json has a metadata.total_size that is not a byte count '
        '(an integer from 0 to 2**63 - 1): -1',
        files=idx({'a': 'x.safetensors'}, -1),
    ),
    'index-total-bool': case(
        '{m}/model.safetensors.index.json has a metadata.total_size that is not a byte count '
        '(an integer from 0 to 2**63 - 1): true',
        files=idx({'a': 'x.safetensors'}, True),
    ),
    'index-total-string': case(
        '{m}/model.safetensors.index.json has a metadata.total_size that is not a byte count '
        '(an integer from 0 to 2**63 - 1): "abc"',
        files=idx({'a': 'x.safetensors'}, 'abc'),
    ),
    'index-only-plans': case(
        lambda r: (r['weights_bytes_total'], r['fits']) == (GIB, True),
        files=idx({'model.layers.0.w': 'model-00001-of-00002.safetensors'}, GIB),
    ),
    'shard-fifo': case(
        '{m}/model.safetensors is not a regular file', files=lambda m: fifo(os.path.join(m, 'model.safetensors'))
    ),
    'indexed-shard-fifo': case(
        '{m}/model-00001-of-00001.safetensors is not a regular file.',
        files=lambda m: (
            idx({'model.embed_tokens.weight': 'model-00001-of-00001.safetensors'}, 262144)(m),
            fifo(os.path.join(m, 'model-00001-of-00001.safetensors')),
        ),
    ),
    'shard-is-a-directory': case(
        '{m}/model.safetensors is not a regular file',
        files=lambda m: replace_with_dir(os.path.join(m, 'model.safetensors')),
    ),
    'shard-dangling-symlink': case(
        'cannot read {m}/model.safetensors: No such file or directory',
        files=lambda m: (
            os.unlink(os.path.join(m, 'model.safetensors')),
            os.symlink('absent', os.path.join(m, 'model.safetensors')),
        ),
    ),
    'shard-empty': case(
        '{m}/model.safetensors is truncated: 0 bytes, shorter than the 8-byte header length',
        files=lambda m: write(os.path.join(m, 'model.safetensors'), b''),
    ),
    'shard-header-longer-than-file': case(
        '{m}/model.safetensors is truncated: its header length 4096 reaches beyond the end of the file (10 bytes)',
        files=lambda m: write(os.path.join(m, 'model.safetensors'), struct.pack('<Q', 4096) + b'{}'),
    ),
    'shard-header-length-max': case(
        '{m}/model.safetensors has a header length of 18446744073709551615 bytes, above the '
        '100 MB safetensors limit: not a safetensors file or corrupt',
        files=lambda m: write(os.path.join(m, 'model.safetensors'), struct.pack('<Q', 2**64 - 1) + b'{}'),
    ),
    'shard-header-a-list': case(
        '{m}/model.safetensors has an invalid header: a JSON object was expected', files=shard(b'[]', 0)
    ),
    'shard-header-deeply-nested': case(
        '{m}/model.safetensors has an invalid header (nested too deeply)', files=shard(deep_json(100000).encode(), 0)
    ),
    'shard-header-not-utf8': case(
        "{m}/model.safetensors has an invalid header (not JSON): 'utf-8' codec can't decode "
        'byte 0xff in position 0: invalid start byte',
        files=shard(b'\xff', 0),
    ),
    'shard-entry-a-string': case(ENTRY + '"x"', files=shard({'model.embed_tokens.weight': 'x'}, 0)),
    'shard-offsets-negative': case(
        ENTRY + 'data_offsets [-10, 262144] are not two integers 0 <= begin <= end < 2**64',
        files=shard(tensor(data_offsets=[-10, 262144])),
    ),
    'shard-offsets-reversed': case(
        ENTRY + 'data_offsets [262144, 0] are not two integers 0 <= begin <= end < 2**64',
        files=shard(tensor(data_offsets=[262144, 0]), 262144),
    ),
    'shard-offsets-bool': case(
        ENTRY + 'data_offsets [false, true] are not two integers 0 <= begin <= end < 2**64',
        files=shard(tensor(data_offsets=[False, True]), 1),
    ),
    'shard-offsets-overflow': case(
        ENTRY + 'data_offsets [0, Infinity] are not two integers 0 <= begin <= end < 2**64',
        files=shard(tensor(data_offsets=[0, float('inf')]), 0),
    ),
    'shard-offsets-three': case(
        ENTRY + 'data_offsets [0, 1, 2] are not two integers 0 <= begin <= end < 2**64',
        files=shard(tensor(data_offsets=[0, 1, 2]), 2),
    ),
    'shard-dtype-unknown': case(ENTRY + 'dtype "X99" is not a safetensors dtype', files=shard(tensor(dtype='X99'))),
    'shard-shape-negative': case(
        ENTRY + 'shape [-512, -256] is not a list of non-negative integers', files=shard(tensor(shape=[-512, -256]))
    ),
    'shard-shape-mismatch': case(
        ENTRY + 'shape [512, 512] of BF16 takes 524288 bytes, data_offsets [0, 262144] hold 262144',
        files=shard(tensor(shape=[512, 512])),
    ),
}


def build(tmp_path, spec):
    """The model directory, fake nvidia-smi and module arguments of one case."""
    m = tmp_path / 'model'
    m.mkdir()
    config = LLAMA if spec.config is None else spec.config
    (m / 'config.json').write_text(json.dumps(config))
    (m / 'model.safetensors').write_bytes(safetensors_bytes(EMBED))
    if spec.files:
        spec.files(str(m))
    bindir = tmp_path / 'bin'
    args = dict(model_path=str(m), max_model_len=4096, nvidia_smi_timeout=2)
    if spec.smi is not None:
        fake_nvidia_smi(bindir, **spec.smi)
        # The devices of the H200 host the nvidia-smi output was captured on, not this machine's.
        args['dev_path'] = fake_dev(tmp_path / 'dev')
    else:
        args['gpus'] = RTX
    for key, value in spec.args.items():
        args[key] = value.format(m=m, bin=bindir) if isinstance(value, str) else value
    return args, str(bindir) if spec.smi is not None else None


@pytest.mark.parametrize('spec', list(CASES.values()), ids=list(CASES))
def test_bad_input(tmp_path, verdict, spec):
    args, path_prefix = build(tmp_path, spec)
    run = harness.run_module(MODULE, tmp_path, args, path_prefix=path_prefix)
    m, bindir = str(tmp_path / 'model'), str(tmp_path / 'bin')
    if isinstance(spec.expect, Refused):
        outcome = harness.judge(run, expect_success=False, check=spec.expect)
    elif callable(spec.expect):
        outcome = harness.judge(run, expect_success=True, check=spec.expect)
    else:
        expected = spec.expect.replace('{m}', m).replace('{bin}', bindir)
        outcome = harness.judge(run, expect_success=False, check=lambda r: r['msg'] == expected)
    verdict(MODULE, outcome, '%s\n%s' % (run.result, run.stderr.decode('utf-8', 'replace')[-2000:]))


@pytest.fixture
def odd_listener():
    """(pid, port) of a process named b'py\\xff\\xfe' listening on a loopback port: a process may give itself any
    name, bytes that are not UTF-8 included (prctl PR_SET_NAME)."""
    with named_listener(b'py\xff\xfe') as listener:
        yield listener


def test_port_held_by_a_process_named_in_bytes_that_are_not_utf8(tmp_path, verdict, odd_listener):
    pid, port = odd_listener
    args, path_prefix = build(tmp_path, case(None))
    run = harness.run_module(MODULE, tmp_path, dict(args, port=port))
    expected = 'port %d is already in use by PID %d (py\ufffd\ufffd).' % (port, pid)
    verdict(MODULE, harness.judge(run, expect_success=False, check=lambda r: r['msg'] == expected), run.result)


# --- the Hub's answers: neither the token nor the endpoint's password comes back ----------------

COMMIT = '0123456789abcdef0123456789abcdef01234567'
# A token with the characters JSON escapes and a URL percent-encodes: Ansible masks its no_log value only as it is.
HUB_TOKEN = 'hf_zq7"adv\\token'
PASSWORD = 'pw-zq7-secret'
BASIC = base64.b64encode(('hub:%s' % PASSWORD).encode()).decode()
# Every secret of these cases holds it: however a message spells or cuts one, this shows.
SECRET_CORE = 'zq7'
CONFIG_PATH = '/org/model/resolve/%s/config.json' % COMMIT
SHARD_PATH = '/org/model/resolve/%s/model.safetensors' % COMMIT
# The revision's files: the one shard, sized from its header before the download.
ONE_SHARD = {
    '/api/models/org/model/revision/%s?blobs=true' % COMMIT: reply(
        200, json.dumps({'sha': COMMIT, 'siblings': [{'rfilename': 'model.safetensors'}]})
    )
}


def challenge_and_echo(handler, stop):
    """Ask for Basic credentials and quote what came as the Hub's error: urllib answers with the endpoint's
    user:password."""
    handler.send_response(401)
    handler.send_header('WWW-Authenticate', 'Basic realm="hub"')
    handler.send_header('X-Error-Message', 'you sent %s' % (handler.headers.get('Authorization') or 'nothing'))
    handler.send_header('Content-Length', '0')
    handler.end_headers()


def without(*names):
    """files(m): the model directory lacks names, so the preflight reads them from the Hub."""
    return lambda m: [os.unlink(os.path.join(m, name)) for name in names]


# (routes of the Hub, model directory changes, hub option changes, the exact failure message: {shown} is the
# endpoint without its password, {hostport} the Hub's address)
HUB_SECRET_CASES = {
    # Every message of the Hub's files and headers named the URL with the endpoint's password.
    'endpoint-password-in-a-config-error': (
        {CONFIG_PATH: reply(200, b'<html><body>Welcome to nginx!</body></html>')},
        without('config.json'),
        {},
        '{shown}' + CONFIG_PATH + ' is not valid JSON: Expecting value: line 1 column 1 (char 0)',
    ),
    'basic-credentials-echoed-by-the-hub': (
        {CONFIG_PATH: challenge_and_echo},
        without('config.json'),
        {'token': None},
        '{shown}' + CONFIG_PATH + ' answered HTTP 401: the repository is private or gated: set hub.token to a token '
        'that has access to org/model (the Hub says: you sent Basic ********)',
    ),
    'endpoint-password-in-a-header-error': (
        dict(ONE_SHARD, **{SHARD_PATH: reply(200, struct.pack('<Q', 2**40))}),
        without('model.safetensors'),
        {},
        '{shown}' + SHARD_PATH + ' has a header length of 1099511627776 bytes, above the 100 MB safetensors limit: '
        'not a safetensors file or corrupt',
    ),
    # The header's tensor names were quoted unmasked: a percent-encoded token is out of no_log's reach.
    'token-percent-encoded-in-a-tensor-name': (
        dict(
            ONE_SHARD,
            **{
                SHARD_PATH: reply(
                    200,
                    safetensors_bytes(
                        {'w-' + quote(HUB_TOKEN, safe=''): {'dtype': 'XX', 'shape': [1], 'data_offsets': [0, 2]}}, 2
                    ),
                )
            },
        ),
        without('model.safetensors'),
        {},
        '{shown}' + SHARD_PATH + ' has an invalid header entry for tensor "w-********": dtype "XX" is not a '
        'safetensors dtype',
    ),
    # A raw / in the password: urllib took what precedes it for the host, and the error quoted the rest.
    'endpoint-password-with-a-slash': (
        {},
        without('config.json'),
        {'endpoint': 'http://hub:pw/zq7-secret@{hostport}'},
        "hub: endpoint 'http://hub:********@{hostport}' has more than one @, or one after a /, ? or #: "
        'percent-encode an @, /, ? or # in its user name or password (%40, %2F, %3F, %23)',
    ),
}


@pytest.mark.parametrize('routes, files, hub, expected', list(HUB_SECRET_CASES.values()), ids=list(HUB_SECRET_CASES))
def test_no_secret_of_the_hub_comes_back(tmp_path, verdict, fake_openai, routes, files, hub, expected):
    server = fake_openai(routes)
    hostport = server.url[len('http://') :]
    args = build(tmp_path, case(None, files=files))[0]
    option = {'repo_id': 'org/model', 'revision': COMMIT, 'endpoint': 'http://hub:%s@{hostport}' % PASSWORD}
    option.update({'token': HUB_TOKEN, 'timeout': 5}, **hub)
    option['endpoint'] = option['endpoint'].replace('{hostport}', hostport)
    run = harness.run_module(MODULE, tmp_path, dict(args, hub=option))
    expected = expected.replace('{shown}', 'http://hub:********@' + hostport).replace('{hostport}', hostport)
    outcome = harness.judge(
        run, expect_success=False, check=lambda r: r['msg'] == expected, secrets=(SECRET_CORE, BASIC)
    )
    verdict(MODULE, outcome, '%s\n%s' % (run.result, run.stderr.decode('utf-8', 'replace')[-2000:]))


# The vllm_kimi role's names for the options (setting_names), as its preflight passes them.
ROLE_NAMES = {
    'max_model_len': 'vllm_kimi_max_model_len',
    'gpu_memory_utilization': 'vllm_kimi_gpu_memory_utilization',
    'gpus': 'vllm_kimi_preflight_gpus',
    'model_path': 'vllm_kimi_model_path',
}


@pytest.mark.parametrize(
    'directory',
    ['kimi for max_model_len tests', 'one of the gpus, two', "the gpus' checkpoint", 'gpu_memory_utilization'],
    ids=['an option between words', 'an option before a comma', 'a quote after an option', 'an option as the name'],
)
def test_setting_names_keep_the_users_own_path(tmp_path, verdict, directory):
    """A model directory whose name holds an option's name: the error quotes the path as it is (setting_names
    rewrote the words inside it, and the operator was told of a directory that does not exist)."""
    model = tmp_path / directory
    model.mkdir()
    (model / 'config.json').write_text('{"model_type": ')
    run = harness.run_module(
        MODULE, tmp_path, dict(model_path=str(model), gpus=RTX, max_model_len=4096, setting_names=ROLE_NAMES)
    )

    verdict(
        MODULE,
        harness.judge(run, expect_success=False, check=lambda result: str(model) in result['msg']),
        str(run.result),
    )


def test_no_remedy_sets_max_model_len_to_nothing(tmp_path, verdict):
    """Beyond the model's maximum where not one block fits: the remedy said 'set max_model_len to 0 or less'."""
    model = tmp_path / 'model'
    model.mkdir()
    (model / 'config.json').write_text(json.dumps(LLAMA))
    args = dict(model_path=str(model), gpus=RTX, max_model_len=8192, weights_bytes_per_gpu=200 * GIB)
    run = harness.run_module(MODULE, tmp_path, dict(args, setting_names=ROLE_NAMES))

    def check(result):
        remedies = result.get('remedies', [])
        return (
            "set vllm_kimi_max_model_len to the model's derived maximum 4096 or less, once the KV cache holds a block"
            in remedies
            and not any(' 0 or less' in remedy for remedy in remedies)
        )

    verdict(MODULE, harness.judge(run, expect_success=False, check=check), str(run.result))
