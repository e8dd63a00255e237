# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""tiny-kimi-gpu: tiny-kimi with DeepSeek-V3's attention head sizes, for vLLM's CUDA build on an H100/H200.

tiny-kimi's heads (qk_nope 64, rope 64, v 64) find no MLA prefill backend in vLLM 0.26.0 on SM90 without FlashInfer
(tests/fixtures/gpu_run/tiny-kimi-start.log): FlashAttention's MLA prefill takes DeepSeek's qk_nope 128, rope 64,
v 128. This miniature has those, the same latent (kv_lora_rank 512 + rope 64 = 576) and tiny-kimi's answers: its
weights are tiny-kimi's, zero-padded, so it computes the same function without being trained again (training
tiny-kimi takes ~18 min on two cores). The padded query and key halves add 0 to each score; the softmax scale
goes from 1/sqrt(128) to 1/sqrt(192), so q_b_proj is scaled by sqrt(192/128); each head's padded value half is 0,
and o_proj's columns for it are 0. make_tiny_models.check_kimi then holds it to tiny-kimi's answers (in bfloat16,
whose rounding of the scaled weights is the only difference), and teaches it more, as train_kimi does, only where
it misses one.

Only the GPU run builds it (mk/gpu_run.mk), into its own cache keyed by this script and make_tiny_models's key, so
that CI's models and their keys stay as they are.

    python3 tools/gpu_run/miniature.py          # prints the directory of tiny-kimi-gpu
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import make_tiny_models as tiny  # noqa: E402

NAME = 'tiny-kimi-gpu'
# DeepSeek-V3's (and Kimi-K2's) head sizes: what FlashAttention's MLA prefill takes on SM90.
QK_NOPE_HEAD_DIM = 128
V_HEAD_DIM = 128
# Taught at most this many steps where the padded weights' bfloat16 rounding loses one of tiny-kimi's answers.
MOST_STEPS = 100


def cache_key() -> str:
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(tiny.script_hash().encode())
    return digest.hexdigest()[:12]


def pad_rows(weight, heads: int, old: list[int], new: list[int], scale: float = 1.0):
    """WEIGHT's rows as HEADS groups of parts of sizes OLD, each part zero-padded to its size in NEW."""
    import torch

    parts = weight.float().view(heads, sum(old), -1).split(old, dim=1)
    padded = [
        torch.cat([part, part.new_zeros(heads, size - part.shape[1], part.shape[2])], 1)
        for part, size in zip(parts, new)
    ]
    return (torch.cat(padded, 1) * scale).reshape(heads * sum(new), -1).to(weight.dtype).contiguous()


def pad_checkpoint(source: Path, target: Path) -> None:
    """tiny-kimi at SOURCE, padded to DeepSeek's head sizes, written to TARGET."""
    from safetensors.torch import load_file, save_file

    config = json.loads((source / 'config.json').read_text())
    text = config['text_config']
    heads, nope, rope, v = (
        text[k] for k in ('num_attention_heads', 'qk_nope_head_dim', 'qk_rope_head_dim', 'v_head_dim')
    )
    # vLLM (deepseek_v2.py, DeepseekV2MLAAttention.__init__) and transformers both scale scores by qk_head_dim ** -0.5.
    scale = math.sqrt((QK_NOPE_HEAD_DIM + rope) / (nope + rope))
    tensors = {}
    for name, weight in load_file(str(source / 'model.safetensors')).items():
        if name.endswith('self_attn.q_b_proj.weight'):
            weight = pad_rows(weight, heads, [nope, rope], [QK_NOPE_HEAD_DIM, rope], scale)
        elif name.endswith('self_attn.kv_b_proj.weight'):
            weight = pad_rows(weight, heads, [nope, v], [QK_NOPE_HEAD_DIM, V_HEAD_DIM])
        elif name.endswith('self_attn.o_proj.weight'):
            weight = pad_rows(weight.t(), heads, [v], [V_HEAD_DIM]).t().contiguous()
        tensors[name] = weight
    target.mkdir(parents=True)
    for path in source.iterdir():
        if path.name not in ('model.safetensors', 'config.json'):
            shutil.copy(path, target)
    text.update(qk_nope_head_dim=QK_NOPE_HEAD_DIM, v_head_dim=V_HEAD_DIM, qk_head_dim=QK_NOPE_HEAD_DIM + rope)
    (target / 'config.json').write_text(json.dumps(config, indent=2, sort_keys=True) + '\n')
    save_file(tensors, str(target / 'model.safetensors'), metadata={'format': 'pt'})


def checked(work: Path) -> dict:
    """Holds the padded miniature in WORK to tiny-kimi's answers, teaching it where it misses one; its report."""
    tokenizer = tiny.build_kimi_tokenizer()
    model = tiny.load_kimi_language_model(str(work / NAME))
    if tiny.passes(model, tokenizer, 'tiny-kimi'):
        return {'taught_steps': 0, 'answers': tiny.check_kimi(model, tokenizer, 'tiny-kimi')}
    padded_config = tiny.kimi_text_config

    def gpu_config(tok):
        config = padded_config(tok)
        config.qk_nope_head_dim, config.v_head_dim = QK_NOPE_HEAD_DIM, V_HEAD_DIM
        config.qk_head_dim = QK_NOPE_HEAD_DIM + config.qk_rope_head_dim
        return config

    tiny.kimi_text_config = gpu_config
    model, loss, _rows = tiny.train_kimi(tokenizer, 'tiny-kimi', tiny.KIMI_SEED, model, 0, MOST_STEPS)
    answers = tiny.check_kimi(model, tokenizer, 'tiny-kimi')
    shutil.rmtree(work / NAME)
    tiny.save_kimi(model, tokenizer, str(work / NAME))
    return {'taught_steps': 'up to %d' % MOST_STEPS, 'final_loss': round(loss, 6), 'answers': answers}


def make(root: Path) -> Path:
    """ROOT/<key>/tiny-kimi-gpu, made from the core tiny-kimi unless already there."""
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    target = root / cache_key()
    if (target / 'DONE').exists():
        return target / NAME
    core, _made = tiny.make(os.path.join(tiny.cache_root(), 'models'), core_only=True)
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix='.tmp-', dir=root))
    pad_checkpoint(Path(core) / 'tiny-kimi', work / NAME)
    report = checked(work)
    (work / 'DONE').write_text(json.dumps(report, indent=2, sort_keys=True) + '\n')
    for path in [work, *work.rglob('*')]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    shutil.rmtree(target, ignore_errors=True)
    work.rename(target)
    return target / NAME


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--out', type=Path, default=Path(tiny.cache_root()) / 'gpu_run' / 'models')
    print(make(parser.parse_args().out.resolve()))


if __name__ == '__main__':
    main()
