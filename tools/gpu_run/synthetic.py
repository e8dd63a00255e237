# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A DeepSeek-V3-shaped checkpoint with random weights, sized to fill most of a GPU: the preflight's hard case.

Kimi-K2.5's language model (its text_config: hidden 7168, 64 heads, MLA with a latent of 512 + 64, q_lora 1536,
experts of 2048, the first layer dense, vocabulary 163840) with fewer layers and experts, in bf16. Deterministic:
the same arguments give the same config, tensor names, shapes and safetensors headers, so that

    python3 tools/gpu_run/synthetic.py headers --out DIR      # header-only shards (sparse files): what the preflight reads
    python3 tools/gpu_run/synthetic.py generate --out DIR     # the same shards with data (on the device, ~56 GiB)
    python3 tools/gpu_run/synthetic.py describe > FILE.json   # config and headers, the fixture the tests read

agree, and the preflight plans here from exactly the headers vLLM loads there. The data are slices of one pool of
normal(0, 0.02) values: no NaN, no Inf, written as fast as the disk takes them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

LAYERS = 4
EXPERTS = 200
TEXT_CONFIG: dict[str, Any] = {
    'architectures': ['DeepseekV3ForCausalLM'],
    'model_type': 'deepseek_v3',
    'hidden_size': 7168,
    'intermediate_size': 18432,
    'moe_intermediate_size': 2048,
    'num_attention_heads': 64,
    'num_key_value_heads': 64,
    'n_shared_experts': 1,
    'num_experts_per_tok': 8,
    'first_k_dense_replace': 1,
    'moe_layer_freq': 1,
    'n_group': 1,
    'topk_group': 1,
    # transformers writes e_score_correction_bias for every MoE layer; vLLM has it only under noaux_tc.
    'topk_method': 'noaux_tc',
    'scoring_func': 'sigmoid',
    'norm_topk_prob': True,
    'routed_scaling_factor': 2.827,
    'q_lora_rank': 1536,
    'kv_lora_rank': 512,
    'qk_nope_head_dim': 128,
    'qk_rope_head_dim': 64,
    'v_head_dim': 128,
    'vocab_size': 163840,
    'max_position_embeddings': 131072,
    'rope_theta': 50000.0,
    'rms_norm_eps': 1e-05,
    'hidden_act': 'silu',
    'tie_word_embeddings': False,
    'torch_dtype': 'bfloat16',
    'attention_bias': False,
}
DTYPE_BYTES = {'BF16': 2, 'F32': 4}


def config(layers: int, experts: int) -> dict[str, Any]:
    return dict(TEXT_CONFIG, num_hidden_layers=layers, n_routed_experts=experts)


def attention(prefix: str, c: dict[str, Any]) -> list[tuple[str, list[int], str]]:
    h, heads = c['hidden_size'], c['num_attention_heads']
    qk = c['qk_nope_head_dim'] + c['qk_rope_head_dim']
    return [
        (f'{prefix}.q_a_proj.weight', [c['q_lora_rank'], h], 'BF16'),
        (f'{prefix}.q_a_layernorm.weight', [c['q_lora_rank']], 'BF16'),
        (f'{prefix}.q_b_proj.weight', [heads * qk, c['q_lora_rank']], 'BF16'),
        (f'{prefix}.kv_a_proj_with_mqa.weight', [c['kv_lora_rank'] + c['qk_rope_head_dim'], h], 'BF16'),
        (f'{prefix}.kv_a_layernorm.weight', [c['kv_lora_rank']], 'BF16'),
        (f'{prefix}.kv_b_proj.weight', [heads * (c['qk_nope_head_dim'] + c['v_head_dim']), c['kv_lora_rank']], 'BF16'),
        (f'{prefix}.o_proj.weight', [h, heads * c['v_head_dim']], 'BF16'),
    ]


def mlp(prefix: str, hidden: int, inner: int) -> list[tuple[str, list[int], str]]:
    return [
        (f'{prefix}.gate_proj.weight', [inner, hidden], 'BF16'),
        (f'{prefix}.up_proj.weight', [inner, hidden], 'BF16'),
        (f'{prefix}.down_proj.weight', [hidden, inner], 'BF16'),
    ]


def layer(i: int, c: dict[str, Any]) -> list[tuple[str, list[int], str]]:
    p, h = f'model.layers.{i}', c['hidden_size']
    tensors = [(f'{p}.input_layernorm.weight', [h], 'BF16'), (f'{p}.post_attention_layernorm.weight', [h], 'BF16')]
    tensors += attention(f'{p}.self_attn', c)
    if i < c['first_k_dense_replace']:
        return tensors + mlp(f'{p}.mlp', h, c['intermediate_size'])
    experts, inner = c['n_routed_experts'], c['moe_intermediate_size']
    tensors += [
        (f'{p}.mlp.gate.weight', [experts, h], 'BF16'),
        (f'{p}.mlp.gate.e_score_correction_bias', [experts], 'F32'),
    ]
    for e in range(experts):
        tensors += mlp(f'{p}.mlp.experts.{e}', h, inner)
    return tensors + mlp(f'{p}.mlp.shared_experts', h, inner * c['n_shared_experts'])


def shards(c: dict[str, Any]) -> dict[str, list[tuple[str, list[int], str]]]:
    """One shard per layer, and one for the embeddings, the final norm and the head."""
    layers = c['num_hidden_layers']
    total = layers + 1
    out = {f'model-{i + 1:05d}-of-{total:05d}.safetensors': layer(i, c) for i in range(layers)}
    out[f'model-{total:05d}-of-{total:05d}.safetensors'] = [
        ('model.embed_tokens.weight', [c['vocab_size'], c['hidden_size']], 'BF16'),
        ('model.norm.weight', [c['hidden_size']], 'BF16'),
        ('lm_head.weight', [c['vocab_size'], c['hidden_size']], 'BF16'),
    ]
    return out


def header(tensors: list[tuple[str, list[int], str]]) -> tuple[bytes, int]:
    """The safetensors header (length-prefixed JSON) and the data's size."""
    entries: dict[str, Any] = {}
    offset = 0
    for name, shape, dtype in tensors:
        size = DTYPE_BYTES[dtype]
        for dim in shape:
            size *= dim
        entries[name] = {'dtype': dtype, 'shape': shape, 'data_offsets': [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(',', ':')).encode()
    text += b' ' * (-len(text) % 8)
    return struct.pack('<Q', len(text)) + text, offset


def write_meta(out: Path, c: dict[str, Any], layout: dict[str, list[tuple[str, list[int], str]]]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / 'config.json').write_text(json.dumps(c, indent=2) + '\n')
    weight_map = {name: shard for shard, tensors in layout.items() for name, _, _ in tensors}
    total = sum(header(tensors)[1] for tensors in layout.values())
    index = {'metadata': {'total_size': total}, 'weight_map': weight_map}
    (out / 'model.safetensors.index.json').write_text(json.dumps(index, indent=1) + '\n')
    return total


def write_headers(out: Path, c: dict[str, Any]) -> None:
    layout = shards(c)
    write_meta(out, c, layout)
    for shard, tensors in layout.items():
        head, size = header(tensors)
        with (out / shard).open('wb') as sink:
            sink.write(head)
            sink.truncate(len(head) + size)


def generate(out: Path, c: dict[str, Any], tokenizer_from: Path) -> None:
    """The shards with data, from a pool of random bf16 values (torch on the GPU makes it)."""
    import torch  # the device's; not needed for the headers

    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    generator = torch.Generator(device).manual_seed(0)
    pool = torch.randn(64 * 2**20, device=device, generator=generator) * 0.02
    pool_bytes = memoryview(pool.to(torch.bfloat16).cpu().view(torch.int16).numpy().tobytes())
    layout = shards(c)
    total = write_meta(out, c, layout)
    free = shutil.disk_usage(out).free
    if free < total * 1.02:
        sys.exit(f'{out} has {free / 2**30:.1f} GiB free, the synthetic checkpoint needs {total / 2**30:.1f} GiB')
    for shard, tensors in layout.items():
        head, size = header(tensors)
        with (out / shard).open('wb') as sink:
            sink.write(head)
            while size > 0:
                chunk = pool_bytes[: min(size, len(pool_bytes))]
                sink.write(chunk)
                size -= len(chunk)
    for item in tokenizer_from.iterdir():
        if item.name.startswith('tokenizer') or item.name in ('special_tokens_map.json', 'chat_template.jinja'):
            shutil.copy2(item, out / item.name)


def describe(c: dict[str, Any]) -> dict[str, Any]:
    layout = shards(c)
    return {
        'config': c,
        'shards': {
            shard: {'tensors': [[n, s, d] for n, s, d in tensors], 'data_bytes': header(tensors)[1]}
            for shard, tensors in layout.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('action', choices=['headers', 'generate', 'describe'])
    parser.add_argument('--out', type=Path)
    parser.add_argument('--layers', type=int, default=LAYERS)
    parser.add_argument('--experts', type=int, default=EXPERTS)
    parser.add_argument('--tokenizer-from', type=Path, help='a checkpoint whose tokenizer files are copied (generate)')
    args = parser.parse_args()
    c = config(args.layers, args.experts)
    if args.action == 'describe':
        json.dump(describe(c), sys.stdout, indent=1)
        print()
        return
    if args.out is None:
        parser.error(f'{args.action} needs --out')
    if args.action == 'headers':
        write_headers(args.out, c)
    else:
        if args.tokenizer_from is None:
            parser.error('generate needs --tokenizer-from')
        generate(args.out, c, args.tokenizer_from)
    os.sync()


if __name__ == '__main__':
    main()
