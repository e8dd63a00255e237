# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""How many weight bytes each GPU holds under vLLM's tensor and pipeline parallelism.

PRIVATE to the collection: this is not a public API; it may change without notice.
"""

import re
from collections.abc import Mapping
from typing import Optional

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import Config, is_mla, text_config
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._model_config import config_int
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._preflight_common import ceil_div
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._reserve import version_tuple
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._tensor_layout import Quantization

# Tensors every tensor-parallel rank holds in full in vLLM's DeepSeek-V2/V3 code
# (ReplicatedLinear / disable_tp=True): the fused q_a/kv_a down-projections, norms,
# router gates and their biases. Vision towers are counted as replicated as well, a
# conservative choice: vLLM may shard or data-parallelise them depending on the model.
_REPLICATED = re.compile(
    r'(?:^|\.)(?:q_a_proj|kv_a_proj_with_mqa|fused_qkv_a_proj|q_a_layernorm|kv_a_layernorm)\.'
    r'|(?:layernorm|_norm|\.norm|^norm)\.(?:weight|bias)$'
    r'|\.gate\.(?:weight|e_score_correction_bias)$'
    r'|(?:^|\.)(?:vision_tower|vision_model|mm_projector|multi_modal_projector|visual)\.'
)
_VISION = ('vision_tower', 'vision_model', 'visual', 'mm_projector', 'multi_modal_projector')
_KV_PROJ = re.compile(r'\.(?:k_proj|v_proj)\.')
_EMBED = re.compile(r'embed_tokens\.|(?:^|\.)wte\.')
_SKIP = re.compile(r'rotary_emb\.inv_freq$')

# Bytes of each tensor by name; None where only the index names it (not downloaded yet).
Tensors = Mapping[str, Optional[int]]


def pp_partitions(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """vLLM's get_pp_indices (vllm/distributed/utils.py) for every stage: [(start, end)]."""
    per = num_layers // pp
    parts = [per] * pp
    remaining = num_layers % pp
    for i in range(2, remaining + 2):
        parts[-i] += 1
    out = []
    start = 0
    for p in parts:
        out.append((start, start + p))
        start += p
    return out


def tensor_bytes_per_rank(name: str, nbytes: int, tp: int, num_kv_heads: Optional[int]) -> int:
    """Bytes of one tensor on one tensor-parallel rank.

    The cheap string tests come first: Kimi-K2.5 has 280,000 tensors, most of them routed experts.
    """
    if nbytes <= 4:
        return nbytes  # scalars (global scales) on every rank
    if '.experts.' in name:
        return ceil_div(nbytes, tp)  # routed experts are sharded over the TP ranks
    if _SKIP.search(name):
        return 0
    if _REPLICATED.search(name):
        return nbytes
    if num_kv_heads and _KV_PROJ.search(name):
        # GQA: ranks share KV heads when there are fewer than TP; each holds ceil(kv/TP).
        return nbytes * ceil_div(num_kv_heads, tp) // num_kv_heads
    return ceil_div(nbytes, tp)


def estimated_replicated_bytes(config: Config) -> int:
    """Bytes of the replicated tensors of an MLA model, from config.json (the index gives no sizes).

    The q_a/kv_a down-projections (BF16 in NVFP4 and FP8 checkpoints alike) and the
    router gates; norms are negligible.
    """
    if not is_mla(config):
        return 0
    hidden, layers, q_lora, kv_lora, rope, experts, dense = (
        config_int(config, key, minimum=0, missing=0)
        for key in (
            'hidden_size',
            'num_hidden_layers',
            'q_lora_rank',
            'kv_lora_rank',
            'qk_rope_head_dim',
            'n_routed_experts',
            'first_k_dense_replace',
        )
    )
    return layers * hidden * (q_lora + kv_lora + rope) * 2 + max(layers - dense, 0) * experts * hidden * 2


def _estimated_share(config: Config, unknown: int, known: int, tp: int, pp: int) -> int:
    """Bytes per GPU of the weights whose sizes the index does not give: split over all GPUs, but for
    the replicated ones (estimated when no size is known at all), which every rank of a stage holds."""
    replicated = min(estimated_replicated_bytes(config), unknown) if known == 0 else 0
    return ceil_div(unknown - replicated, tp * pp) + ceil_div(replicated, pp)


def weights_per_gpu(tensors: Tensors, total_bytes: int, config: Config, tp: int, pp: int) -> tuple[int, bool]:
    """The most weight bytes any one GPU holds under tensor x pipeline parallelism.

    tensors: {name: bytes or None (size unknown: index only)}. Tensors of layers at or
    past num_hidden_layers (DeepSeek's MTP layer) are not loaded by vLLM and not
    counted. Returns (bytes, estimated) where estimated says sizes were missing.
    """
    num_layers = config_int(config, 'num_hidden_layers', missing=0)
    kv_heads = (
        None
        if is_mla(config)
        else (config_int(config, 'num_key_value_heads') or config_int(config, 'num_attention_heads'))
    )
    if pp == 1:
        per_stage, known = _weights_one_stage(tensors, config, tp, num_layers, kv_heads)
    else:
        per_stage, known = _weights_per_stage(tensors, tp, pp, num_layers, kv_heads)
    unknown = max(total_bytes - known, 0)
    if unknown:
        extra = _estimated_share(config, unknown, known, tp, pp)
        per_stage = [b + extra for b in per_stage]
    return max(per_stage), unknown > 0


def _weights_one_stage(
    tensors: Tensors, config: Config, tp: int, num_layers: int, kv_heads: Optional[int]
) -> tuple[list[int], int]:
    """([bytes per GPU], bytes of known size) without pipeline parallelism: the hot path, string tests only."""
    # Layers past num_hidden_layers are DeepSeek's MTP layers (num_nextn_predict_layers, 1 when unset; more MTP
    # layers than decoder layers is no config, and a tuple that long would not fit in memory).
    nextn = max(config_int(config, 'num_nextn_predict_layers', minimum=0, maximum=num_layers, missing=0), 1)
    mtp = tuple('.layers.%d.' % i for i in range(num_layers, num_layers + nextn)) if num_layers else ()
    per_gpu = 0
    known = 0
    for name, nbytes in tensors.items():
        if nbytes is None:
            continue
        known += nbytes
        if mtp and any(m in name for m in mtp):
            continue  # DeepSeek's MTP layer: vLLM does not load it
        per_gpu += tensor_bytes_per_rank(name, nbytes, tp, kv_heads)
    return [per_gpu], known


def _weights_per_stage(
    tensors: Tensors, tp: int, pp: int, num_layers: int, kv_heads: Optional[int]
) -> tuple[list[int], int]:
    """([bytes per GPU of each pipeline stage], bytes of known size)."""
    stages = pp_partitions(num_layers, pp) if num_layers and pp > 1 else [(0, num_layers or 10**9)]
    stage_of = {}
    for i, (s, e) in enumerate(stages):
        for layer in range(s, min(e, s + 100000)):
            stage_of[layer] = i
    last = len(stages) - 1
    per_stage = [0] * len(stages)
    known = 0
    for name, nbytes in tensors.items():
        if nbytes is None:
            continue
        known += nbytes
        stage = _pipeline_stage(name, num_layers, stage_of, last)
        if stage is not None:
            per_stage[stage] += tensor_bytes_per_rank(name, nbytes, tp, kv_heads)
    return per_stage, known


def _pipeline_stage(name: str, num_layers: int, stage_of: dict[int, int], last: int) -> Optional[int]:
    """The pipeline stage that loads tensor name; None for a layer vLLM does not load (DeepSeek's MTP layer)."""
    layer = _layer_number(name)
    if layer is not None:
        if num_layers and layer >= num_layers:
            return None
        return stage_of.get(layer, last)
    if _EMBED.search(name) or last == 0:
        return 0
    if name.startswith('lm_head') or '.lm_head.' in name or name.endswith('norm.weight'):
        return last
    return 0


def _layer_number(name: str) -> Optional[int]:
    """The decoder layer of a tensor ('model.layers.12.mlp...' is 12); None outside the decoder layers."""
    # String operations, not a regex: this runs once for each of 280,000 tensors.
    at = name.find('layers.')
    if at >= 0 and (at == 0 or name[at - 1] == '.') and not name.startswith(_VISION):
        digits = name[at + 7 : name.find('.', at + 7)]
        if digits.isdigit():
            return int(digits)
    return None


def runtime_weight_bytes(
    config: Config, tp: int, hf_quant_config: Optional[Config] = None, vllm_version: Optional[str] = None
) -> int:
    """Bytes per GPU that vLLM adds to the loaded weights of an MLA model before it reports "Model loading took"
    (MLACommonImpl.process_weights_after_loading; every original is kept, prefill uses them).

    - Since 0.8: a quantized kv_b_proj is dequantized into a bfloat16 copy of this rank's heads, which W_UK_T and
      W_UV view; an unquantized one is only viewed.
    - 0.7 (VLLM_MLA_PERFORM_MATRIX_ABSORPTION, on by default): also W_QR, the rope part of the query projection in
      bfloat16, and the absorbed W_Q_UK (query input x heads x kv_lora_rank) and W_UV_O (heads x kv_lora_rank x
      hidden), requantized to FP8 with per-block float32 scales where the checkpoint is FP8, else bfloat16.
    """
    if not is_mla(config):
        return 0
    text = text_config(config)
    prefix = 'language_model.' if text is not config else ''
    quant = Quantization(config, hf_quant_config)
    layers, heads, hidden, q_lora, nope, rope, v_dim, kv_lora = (
        config_int(text, key, minimum=0, missing=0)
        for key in (
            'num_hidden_layers',
            'num_attention_heads',
            'hidden_size',
            'q_lora_rank',
            'qk_nope_head_dim',
            'qk_rope_head_dim',
            'v_head_dim',
            'kv_lora_rank',
        )
    )
    heads = ceil_div(heads, tp)
    attention = prefix + 'model.layers.0.self_attn.'
    per_layer = 0
    if quant.quantizes(attention + 'kv_b_proj'):
        per_layer += kv_lora * heads * (nope + v_dim) * 2
    version = version_tuple(vllm_version)
    if version is not None and version < (0, 8):
        query_input = q_lora or hidden
        absorbed = (query_input, heads * kv_lora), (heads * kv_lora, hidden)
        per_layer += query_input * heads * rope * 2
        if quant.quantizes(attention + 'o_proj') and quant.block is not None:
            block_rows, block_columns = quant.block
            per_layer += sum(r * c + ceil_div(r, block_rows) * ceil_div(c, block_columns) * 4 for r, c in absorbed)
        else:
            per_layer += sum(r * c * 2 for r, c in absorbed)
    return layers * per_layer
