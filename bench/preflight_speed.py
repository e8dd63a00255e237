# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""How long gpu_preflight takes on a Kimi-K2.5-NVFP4-sized checkpoint.

Builds, in a temporary directory, 119 sparse safetensors shards with valid headers that
name the tensors of a 61-layer DeepSeek-V3 model with 384 NVFP4 experts per layer
(packed U8 weights, F8_E4M3 block scales, F32 global scales; BF16 attention, norms,
router, embeddings), about 540 GB in all, plus config.json, hf_quant_config.json and
model.safetensors.index.json. No tensor data is written: the files are sparse. Then
times reading the headers and computing the plan (the module's work), and the index-only
plan (before a download).

    .venv/bin/python bench/preflight_speed.py [--runs 5] [--keep DIR]
"""

import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..'))
sys.path.insert(0, os.path.join(ROOT, '.build', 'collections'))

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import resolve_kv_cache_dtype  # noqa: E402
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._safetensors import scan  # noqa: E402
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._gpu_preflight import plan  # noqa: E402

SHARDS = 119
TEXT = {
    'model_type': 'deepseek_v3',
    'num_hidden_layers': 61,
    'hidden_size': 7168,
    'intermediate_size': 18432,
    'moe_intermediate_size': 2048,
    'n_routed_experts': 384,
    'n_shared_experts': 1,
    'first_k_dense_replace': 1,
    'num_attention_heads': 64,
    'num_key_value_heads': 64,
    'head_dim': 112,
    'q_lora_rank': 1536,
    'kv_lora_rank': 512,
    'qk_rope_head_dim': 64,
    'qk_nope_head_dim': 128,
    'v_head_dim': 128,
    'vocab_size': 163840,
    'max_position_embeddings': 262144,
    'torch_dtype': 'bfloat16',
}
CONFIG = {'architectures': ['KimiK25ForConditionalGeneration'], 'model_type': 'kimi_k25', 'text_config': TEXT}
HF_QUANT = {
    'producer': {'name': 'modelopt', 'version': '0.29.0'},
    'quantization': {'quant_algo': 'NVFP4', 'group_size': 16, 'kv_cache_quant_algo': 'FP8', 'exclude_modules': []},
}


def bf16(name, *shape):
    n = 1
    for d in shape:
        n *= d
    return name, 'BF16', list(shape), 2 * n


def nvfp4(prefix, out_dim, in_dim):
    """ModelOpt NVFP4 linear: packed U8 [out, in/2], F8_E4M3 scales [out, in/16], F32 scalars."""
    return [
        (prefix + '.weight', 'U8', [out_dim, in_dim // 2], out_dim * in_dim // 2),
        (prefix + '.weight_scale', 'F8_E4M3', [out_dim, in_dim // 16], out_dim * in_dim // 16),
        (prefix + '.weight_scale_2', 'F32', [], 4),
        (prefix + '.input_scale', 'F32', [], 4),
    ]


def tensors():
    t = TEXT
    h, moe, dense = t['hidden_size'], t['moe_intermediate_size'], t['intermediate_size']
    out = [bf16('language_model.model.embed_tokens.weight', t['vocab_size'], h)]
    for i in range(t['num_hidden_layers']):
        p = 'language_model.model.layers.%d.' % i
        out += [
            bf16(p + 'input_layernorm.weight', h),
            bf16(p + 'post_attention_layernorm.weight', h),
            bf16(p + 'self_attn.q_a_proj.weight', t['q_lora_rank'], h),
            bf16(p + 'self_attn.q_a_layernorm.weight', t['q_lora_rank']),
            bf16(p + 'self_attn.q_b_proj.weight', 64 * 192, t['q_lora_rank']),
            bf16(p + 'self_attn.kv_a_proj_with_mqa.weight', t['kv_lora_rank'] + t['qk_rope_head_dim'], h),
            bf16(p + 'self_attn.kv_a_layernorm.weight', t['kv_lora_rank']),
            bf16(p + 'self_attn.kv_b_proj.weight', 64 * 256, t['kv_lora_rank']),
            bf16(p + 'self_attn.o_proj.weight', h, 64 * 128),
        ]
        if i < t['first_k_dense_replace']:
            for name, o, n in (('gate_proj', dense, h), ('up_proj', dense, h), ('down_proj', h, dense)):
                out += nvfp4(p + 'mlp.' + name, o, n)
            continue
        out += [
            bf16(p + 'mlp.gate.weight', t['n_routed_experts'], h),
            (p + 'mlp.gate.e_score_correction_bias', 'F32', [t['n_routed_experts']], 4 * t['n_routed_experts']),
        ]
        for name, o, n in (('gate_proj', moe, h), ('up_proj', moe, h), ('down_proj', h, moe)):
            out += nvfp4(p + 'mlp.shared_experts.' + name, o, n)
        for e in range(t['n_routed_experts']):
            for name, o, n in (('gate_proj', moe, h), ('up_proj', moe, h), ('down_proj', h, moe)):
                out += nvfp4(p + 'mlp.experts.%d.%s' % (e, name), o, n)
    out += [bf16('language_model.model.norm.weight', h), bf16('language_model.lm_head.weight', t['vocab_size'], h)]
    # The MoonViT vision tower and projector, about 0.9 GB in BF16.
    for i in range(27):
        out += [
            bf16('vision_tower.encoder.blocks.%d.attn.qkv.weight' % i, 3 * 1152, 1152),
            bf16('vision_tower.encoder.blocks.%d.mlp.fc1.weight' % i, 4304, 1152),
            bf16('vision_tower.encoder.blocks.%d.mlp.fc0.weight' % i, 1152, 4304),
        ]
    out.append(bf16('mm_projector.proj.0.weight', 4608, 4608))
    return out


def build(dest):
    all_t = tensors()
    total = sum(t[3] for t in all_t)
    per_shard = total // SHARDS + 1
    shards, current, size = [], [], 0
    for t in all_t:
        if size + t[3] > per_shard and current and len(shards) < SHARDS - 1:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += t[3]
    shards.append(current)
    weight_map = {}
    for n, shard in enumerate(shards):
        fname = 'model-%05d-of-%05d.safetensors' % (n + 1, len(shards))
        header, offset = {'__metadata__': {'format': 'pt'}}, 0
        for name, dtype, shape, nbytes in shard:
            header[name] = {'dtype': dtype, 'shape': shape, 'data_offsets': [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = fname
        raw = json.dumps(header, separators=(',', ':')).encode('utf-8')
        raw += b' ' * (-len(raw) % 8)
        with open(os.path.join(dest, fname), 'wb') as f:
            f.write(struct.pack('<Q', len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)
    with open(os.path.join(dest, 'model.safetensors.index.json'), 'w') as f:
        json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f)
    with open(os.path.join(dest, 'config.json'), 'w') as f:
        json.dump(CONFIG, f)
    with open(os.path.join(dest, 'hf_quant_config.json'), 'w') as f:
        json.dump(HF_QUANT, f)
    return len(shards), len(all_t), total


def preflight(path, max_model_len=131072, util=0.95):
    import json as _json

    with open(os.path.join(path, 'config.json')) as f:
        config = _json.load(f)
    gpus = [
        {
            'index': i,
            'name': 'NVIDIA RTX PRO 6000 Blackwell Server Edition',
            'memory_total_mib': 97887,
            'memory_used_mib': 0,
            'compute_capability': '12.0',
            'uuid': 'u%d' % i,
        }
        for i in range(8)
    ]
    params = dict(
        tensor_parallel_size=8,
        pipeline_parallel_size=1,
        gpu_memory_utilization=util,
        max_model_len=max_model_len,
        kv_cache_dtype='auto',
        kv_cache_memory_bytes=None,
        weights_bytes_per_gpu=None,
        fail_on_misfit=True,
        accelerator='nvidia',
        reserve_bytes_per_gpu=5 * 1024**3,
        block_size=16,
        shm_min_bytes=0,
    )
    return plan(params, config, scan(path), gpus, [], resolve_kv_cache_dtype('auto', path, config))


def timed(fn, runs):
    """(result, wall seconds per run, CPU seconds per run): on a shared machine the CPU time is the fair figure."""
    walls, cpus, result = [], [], None
    for dummy in range(runs):
        t0, c0 = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return result, walls, cpus


def figures(walls, cpus):
    return 'wall first %.3f s, best %.3f s, median %.3f s; CPU best %.3f s, median %.3f s (%d runs)' % (
        walls[0],
        min(walls),
        sorted(walls)[len(walls) // 2],
        min(cpus),
        sorted(cpus)[len(cpus) // 2],
        len(walls),
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n', 1)[0])
    ap.add_argument('--runs', type=int, default=5)
    ap.add_argument('--keep', help='build into this directory and keep it')
    args = ap.parse_args()
    dest = args.keep or tempfile.mkdtemp(prefix='preflight-bench-')
    os.makedirs(dest, exist_ok=True)
    try:
        t0 = time.perf_counter()
        n_shards, n_tensors, total = build(dest)
        print('load average %.2f %.2f %.2f on %d CPUs' % (os.getloadavg() + (os.cpu_count(),)))
        print(
            'built %d sparse shards, %d tensors, %.1f GB (%.2f GiB) in %.1f s; on disk: %.1f MB'
            % (
                n_shards,
                n_tensors,
                total / 1e9,
                total / 1024.0**3,
                time.perf_counter() - t0,
                sum(os.stat(os.path.join(dest, f)).st_blocks * 512 for f in os.listdir(dest)) / 1e6,
            )
        )
        r, walls, cpus = timed(lambda: preflight(dest), args.runs)
        print('headers + plan (limit 1 s): ' + figures(walls, cpus))
        print(
            '  weights %.2f GB total, %.2f GiB per GPU; KV %d B/token (%s); budget %.2f GiB = %d tokens; '
            'max_model_len_fit %d; 131072 at 0.95 fits: %s'
            % (
                r['weights_bytes_total'] / 1e9,
                r['weights_bytes_per_gpu'] / 1024.0**3,
                r['kv_cache_bytes_per_token'],
                r['kv_cache_dtype'],
                r['kv_cache_bytes'] / 1024.0**3,
                r['kv_cache_tokens'],
                r['max_model_len_fit'],
                r['fits'],
            )
        )
        r2 = preflight(dest, 262144, 0.9)
        print('  262144 at 0.90 fits: %s (%s)' % (r2['fits'], (r2['problems'] or [''])[0][:160]))
        shards = [f for f in os.listdir(dest) if f.endswith('.safetensors')]
        hidden = os.path.join(dest, 'shards')
        os.mkdir(hidden)
        for f in shards:
            os.rename(os.path.join(dest, f), os.path.join(hidden, f))
        r3, walls, cpus = timed(lambda: preflight(dest), args.runs)
        print('index only (before the download): ' + figures(walls, cpus))
        print(
            '  weights per GPU estimated %.2f GiB (from the headers: %.2f GiB, %+.2f%%)'
            % (
                r3['weights_bytes_per_gpu'] / 1024.0**3,
                r['weights_bytes_per_gpu'] / 1024.0**3,
                100.0 * (r3['weights_bytes_per_gpu'] - r['weights_bytes_per_gpu']) / r['weights_bytes_per_gpu'],
            )
        )
    finally:
        if not args.keep:
            shutil.rmtree(dest)


if __name__ == '__main__':
    main()
