# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""gpu_preflight's KV-cache prediction against a real vLLM (the CPU build in .venv-vllm).

Builds two tiny random-weight checkpoints with transformers, a grouped-query Llama and
an MLA DeepseekV3 (whose config also carries head_dim and num_key_value_heads, which
MLA must ignore), starts vLLM on each with --kv-cache-memory-bytes, and compares the
module's kv_cache_tokens with vLLM's logged "CPU KV cache size: N tokens" (within 1%).
"""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..'))
VLLM_PY = os.path.join(ROOT, '.venv-vllm', 'bin', 'python')
ANSIBLE = os.path.join(ROOT, '.venv', 'bin', 'ansible')
COLLECTIONS = os.path.join(ROOT, '.build', 'collections')

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not os.path.exists(VLLM_PY), reason='needs the vLLM CPU venv (make vllm-venv)'),
]

BUILD = r"""
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM
kind, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
if kind == 'llama':
    # GQA: 4 query heads share 2 KV heads; head_dim 64 (CPU attention rejects 16).
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=4096)
    m = LlamaForCausalLM(cfg)
else:
    cfg = DeepseekV3Config(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                           num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=64,
                           kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, head_dim=32,
                           max_position_embeddings=4096, rope_scaling=None)
    m = DeepseekV3ForCausalLM(cfg)
    # vLLM creates the router's e_score_correction_bias (which transformers saves) only for noaux_tc routing.
    m.config.topk_method = 'noaux_tc'
m.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
"""

SERVE = r"""
import sys


def main():
    from vllm import LLM
    path, kv_bytes, mml, kv_dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    # One process (the engine in-process, VLLM_ENABLE_V1_MULTIPROCESSING=0, and its worker with it): the KV cache is
    # sized by the same worker and engine code, without two more processes each importing vLLM (some 30 s here).
    LLM(model=path, skip_tokenizer_init=True, kv_cache_memory_bytes=kv_bytes, enforce_eager=True,
        max_model_len=mml, kv_cache_dtype=kv_dtype, max_num_seqs=4, max_num_batched_tokens=mml,
        distributed_executor_backend='uni')
    print('ENGINE-READY', flush=True)


if __name__ == '__main__':
    main()
"""

KV_SIZE = re.compile(r'CPU KV cache size: ([\d,]+) tokens')


def vllm_kv_tokens(model, kv_bytes, max_model_len, kv_dtype, tmp_path):
    script = tmp_path / 'serve.py'
    script.write_text(SERVE)
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND='nobind', HF_HUB_OFFLINE='1', VLLM_ENABLE_V1_MULTIPROCESSING='0')
    proc = subprocess.run(
        [VLLM_PY, str(script), str(model), str(kv_bytes), str(max_model_len), kv_dtype],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        timeout=600,
        text=True,
        check=False,
    )
    m = KV_SIZE.search(proc.stdout)
    assert m, 'vLLM printed no "CPU KV cache size" (rc %d):\n%s' % (proc.returncode, proc.stdout[-4000:])
    return int(m.group(1).replace(',', ''))


def preflight(model, kv_bytes, max_model_len, kv_dtype):
    env = dict(
        os.environ,
        ANSIBLE_COLLECTIONS_PATH=COLLECTIONS,
        ANSIBLE_LOCALHOST_WARNING='0',
        ANSIBLE_INVENTORY_UNPARSED_WARNING='0',
    )
    args = 'model_path=%s accelerator=cpu kv_cache_memory_bytes=%d max_model_len=%d kv_cache_dtype=%s' % (
        model,
        kv_bytes,
        max_model_len,
        kv_dtype,
    )
    proc = subprocess.run(
        [
            ANSIBLE,
            'localhost',
            '-c',
            'local',
            '-e',
            'ansible_python_interpreter=' + sys.executable,
            '-o',
            '-m',
            'llmserve.vllm.gpu_preflight',
            '-a',
            args,
        ],
        capture_output=True,
        env=env,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # One line: "localhost | SUCCESS => {...}"
    return json.loads(proc.stdout.split('=>', 1)[1])


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp('ckpt')
    script = base / 'build.py'
    script.write_text(BUILD)
    out = {}
    for kind in ('llama', 'mla'):
        subprocess.run(
            [VLLM_PY, str(script), kind, str(base / kind)], check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        out[kind] = base / kind
    return out


# (checkpoint, KV budget, max_model_len, --kv-cache-dtype, resolved dtype, bytes per token from the formula, attention)
CASES = [
    # 2 x 2 KV heads x 64 x 2 B x 2 layers
    ('llama', 50000000, 2048, 'auto', 'bfloat16', 1024, 'standard'),
    # fp8 halves it
    ('llama', 50000000, 2048, 'fp8', 'fp8', 512, 'standard'),
    # 3 layers x (kv_lora_rank 64 + qk_rope_head_dim 32) x 2 B: not 2 x 4 heads x 32 x 2 x 3 = 1536
    ('mla', 50000000, 2048, 'auto', 'bfloat16', 576, 'mla'),
]


@pytest.mark.parametrize('kind, kv_bytes, max_model_len, kv_dtype, resolved, per_token, attention', CASES)
def test_kv_cache_tokens_match_vllm(
    checkpoints, tmp_path, kind, kv_bytes, max_model_len, kv_dtype, resolved, per_token, attention
):
    predicted = preflight(checkpoints[kind], kv_bytes, max_model_len, kv_dtype)
    actual = vllm_kv_tokens(checkpoints[kind], kv_bytes, max_model_len, kv_dtype, tmp_path)
    error = abs(predicted['kv_cache_tokens'] - actual) / float(actual)
    print(
        '%s %s: predicted %d tokens, vLLM %d tokens, error %.4f%%'
        % (kind, kv_dtype, predicted['kv_cache_tokens'], actual, error * 100)
    )
    assert predicted['attention'] == attention
    assert predicted['kv_cache_bytes_per_token'] == per_token
    assert predicted['kv_cache_dtype'] == resolved
    assert predicted['fits'] is True
    assert error <= 0.01
