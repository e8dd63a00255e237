# -*- coding: utf-8 -*-
# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Run llmserve.vllm.gpu_preflight as Ansible runs it (a subprocess reading its arguments file).

nvidia-smi is a small shell script put first on PATH that prints the output captured on a
real two-GPU H200 machine (fixtures/nvidia-smi, made with capture.sh there).
"""

from __future__ import absolute_import, division, print_function
__metaclass__ = type

import json
import os
import stat
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SMI = os.path.join(HERE, '..', 'module_utils', 'fixtures', 'nvidia-smi')
MODULE = 'ansible_collections.llmserve.vllm.plugins.modules.gpu_preflight'
ROOT = os.path.abspath(os.path.join(HERE, '..', '..', '..', '..'))
GIB = 1024 ** 3


def collections_path():
    return os.path.join(ROOT, '.build', 'collections')


def run_module(tmp_path, args, path_prefix=None):
    args_file = tmp_path / 'args.json'
    args_file.write_text(json.dumps({'ANSIBLE_MODULE_ARGS': args}))
    env = dict(os.environ, PYTHONPATH=collections_path())
    if path_prefix:
        env['PATH'] = '%s:%s' % (path_prefix, env.get('PATH', ''))
    proc = subprocess.run([sys.executable, '-m', MODULE, str(args_file)], env=env, cwd=str(tmp_path),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120, check=False)
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout.decode('utf-8'))


def fake_nvidia_smi(tmp_path, gpu='query-gpu-idle', apps='query-apps-idle', rc=0):
    """A nvidia-smi that answers the two queries with the captured output."""
    bindir = tmp_path / 'bin'
    bindir.mkdir()
    script = bindir / 'nvidia-smi'
    script.write_text('#!/bin/sh\ncase "$1" in\n'
                      '  --query-gpu=*) cat "%s/%s.txt"; exit %d;;\n'
                      '  --query-compute-apps=*) cat "%s/%s.txt";;\n'
                      'esac\n' % (SMI, gpu, rc, SMI, apps))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(bindir)


def warning_texts(result):
    """The module's warnings: plain strings before ansible-core 2.19, structured summaries since."""
    return [w if isinstance(w, str) else w['event']['msg'] for w in result.get('warnings', [])]


LLAMA = {'model_type': 'llama', 'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_key_value_heads': 2,
         'head_dim': 64, 'hidden_size': 256, 'max_position_embeddings': 4096, 'dtype': 'bfloat16'}


@pytest.fixture
def model(tmp_path):
    d = tmp_path / 'model'
    d.mkdir()
    (d / 'config.json').write_text(json.dumps(LLAMA))
    header = json.dumps({'model.embed_tokens.weight': {'dtype': 'BF16', 'shape': [512, 256], 'data_offsets': [0, 262144]}})
    with open(str(d / 'model.safetensors'), 'wb') as f:
        f.write(len(header).to_bytes(8, 'little') + header.encode())
        f.truncate(8 + len(header) + 262144)
    return str(d)


def test_reads_nvidia_smi_and_fits(tmp_path, model):
    rc, r = run_module(tmp_path, dict(model_path=model, tensor_parallel_size=2, max_model_len=4096,
                                      _ansible_check_mode=True), fake_nvidia_smi(tmp_path))
    assert rc == 0, r
    assert r['changed'] is False
    assert [(g['index'], g['name'], g['memory_total_mib'], g['processes']) for g in r['gpus']] == [
        (0, 'NVIDIA H200', 143771, []), (1, 'NVIDIA H200', 143771, [])]
    assert r['driver_version'] == '580.159.04'
    assert r['weights_bytes_total'] == 262144
    assert r['weights_bytes_per_gpu'] == 131072
    assert r['kv_cache_bytes_per_token'] == 512
    assert r['kv_cache_bytes'] == -(-143771 * 1024 * 1024 * 9 // 10) - 131072 - 5 * GIB
    assert (r['max_model_len'], r['fits'], r['problems'], r['strip_fp8_kv_cache']) == (4096, True, [], False)


def test_stale_processes_fail_with_their_pids(tmp_path, model):
    rc, r = run_module(tmp_path, dict(model_path=model, tensor_parallel_size=2, max_model_len=4096),
                       fake_nvidia_smi(tmp_path, 'query-gpu-busy', 'query-apps-busy'))
    assert rc == 1
    assert r['msg'] == ('GPU 1 (NVIDIA H200) memory is held by PID 579 (%s, 20998 MiB): 119.89 GiB free, vLLM needs 126.36 GiB '
                        'at gpu_memory_utilization 0.9; stop them (stale vLLM workers?).' % 'python3')
    assert [p['pid'] for g in r['gpus'] for p in g['processes']] == [578, 579]


@pytest.mark.parametrize('args, message', [
    (dict(nvidia_smi_path='/nonexistent/nvidia-smi'),
     '/nonexistent/nvidia-smi not found: is the NVIDIA driver installed? (set nvidia_smi_path, or gpus to plan without GPUs)'),
    (dict(nvidia_smi_path='no-such-nvidia-smi'),
     'no-such-nvidia-smi not found on PATH: is the NVIDIA driver installed? (set nvidia_smi_path, or gpus to plan without GPUs)'),
    (dict(tensor_parallel_size=0), 'tensor_parallel_size must be at least 1, got 0'),
    (dict(gpu_memory_utilization=1.5), 'gpu_memory_utilization must be in (0, 1], got 1.5'),
    (dict(max_model_len='long'), "max_model_len must be an integer or auto, got 'long'"),
    (dict(max_model_len=0), 'max_model_len must be a positive integer or auto, got 0'),
    (dict(accelerator='cpu'), 'accelerator is cpu but all of the following are missing: kv_cache_memory_bytes'),
])
def test_bad_input_messages(tmp_path, model, args, message):
    rc, r = run_module(tmp_path, dict(args, model_path=model))
    assert rc == 1
    assert r['msg'] == message


def test_failing_nvidia_smi(tmp_path, model):
    rc, r = run_module(tmp_path, dict(model_path=model), fake_nvidia_smi(tmp_path, gpu='query-bad-field', rc=2))
    assert rc == 1
    assert r['msg'] == ('%s/nvidia-smi --query-gpu=index,name,memory.total,memory.used,compute_cap,driver_version,uuid '
                        '--format=csv,noheader,nounits failed with exit code 2: Field "no_such_field" is not a valid field '
                        'to query.' % (tmp_path / 'bin'))


RTX = [{'name': 'NVIDIA RTX PRO 6000 Blackwell Server Edition', 'memory_total_mib': 97887, 'compute_capability': '12.0'}]
# ceil(0.9 x 97887 MiB) - 5 GiB reserve - 1 MiB: leaves exactly 1 MiB of KV budget, 1024 tokens of 1024 B.
TIGHT = -(-97887 * 1024 * 1024 * 9 // 10) - 5 * GIB - 1048576


@pytest.mark.parametrize('args, rc, message', [
    (dict(weights_bytes_per_gpu=TIGHT, max_model_len=1024), 0, None),
    (dict(weights_bytes_per_gpu=TIGHT, max_model_len=4096), 1,
     "To serve at least one request with the model's max seq len (4096), (0.00 GiB KV cache is needed, which is larger than "
     "the available KV cache memory (0.00 GiB). Based on the available memory, the estimated maximum model length is 1024. "
     "Remedies: set max_model_len to 1024 (fits at gpu_memory_utilization 0.9); set gpu_memory_utilization to 0.91 "
     "(fits max_model_len 4096)."),
    (dict(kv_cache_memory_bytes=1048576, max_model_len=4096), 1,
     "To serve at least one request with the model's max seq len (4096), (0.00 GiB KV cache is needed, which is larger than "
     "the available KV cache memory (0.00 GiB). Based on the available memory, the estimated maximum model length is 1024. "
     "Remedies: set max_model_len to 1024 (fits in kv_cache_memory_bytes 1048576); set kv_cache_memory_bytes to at least "
     "4194304 (fits max_model_len 4096)."),
    (dict(weights_bytes_per_gpu=84 * GIB, max_model_len=4096), 1,
     'No available memory for the cache blocks: weights (84.00 GiB per GPU) + reserve (5.00 GiB) exceed 86.03 GiB at '
     'gpu_memory_utilization 0.9. Remedies: set gpu_memory_utilization to at least 0.94; spread the model over more GPUs '
     '(tensor_parallel_size x pipeline_parallel_size).'),
])
def test_misfit_in_vllm_words_with_remedies(tmp_path, model, args, rc, message):
    result_rc, r = run_module(tmp_path, dict(args, model_path=model, gpus=RTX))
    assert result_rc == rc
    assert r.get('msg') == message
    assert r['fits'] is (rc == 0)
    assert r['gpus'][0]['name'] == 'NVIDIA RTX PRO 6000 Blackwell Server Edition'


def test_misfit_without_failing_picks_the_length_that_fits(tmp_path, model):
    rc, r = run_module(tmp_path, dict(model_path=model, gpus=RTX, weights_bytes_per_gpu=TIGHT, max_model_len=4096,
                                      fail_on_misfit=False))
    assert rc == 0
    assert (r['max_model_len'], r['max_model_len_fit'], r['fits'], r['problems']) == (1024, 1024, False, [])


def test_cpu_accelerator(tmp_path, model):
    rc, r = run_module(tmp_path, dict(model_path=model, accelerator='cpu', kv_cache_memory_bytes=1048576, max_model_len='auto'))
    assert rc == 0, r
    assert (r['gpus'], r['kv_cache_tokens'], r['max_model_len'], r['max_model_len_fit']) == ([], 1024, 1024, 1024)
    assert warning_texts(r) == ["max_model_len auto: 1024 tokens fit, below the model's 4096"]
