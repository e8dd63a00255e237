# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""A checkpoint's tensors and their bytes from config.json's dimensions and quantization config.

PRIVATE to the collection: this is not a public API; it may change without notice.

Before the download the preflight has config.json and the weights index, which names every tensor but gives no
size. The names and shapes here follow the Hugging Face checkpoints of the families vLLM serves (Llama, Mistral,
Qwen2/3 and their mixtures of experts, Mixtral, DeepSeek-V2/V3, Kimi-K2 and Kimi-K2.5), so the bytes of each named
tensor can be computed, and a checkpoint is sized exactly where its headers would say the same. A family outside
these gives None: the caller falls back to the index's total.
"""

import fnmatch
import re
from typing import Any, Optional

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import Config, text_config
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._model_config import config_int
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._preflight_common import ceil_div

MLA_FAMILY = ('deepseek_v2', 'deepseek_v3', 'kimi_k2')
MOE_GQA_FAMILY = ('qwen2_moe', 'qwen3_moe', 'mixtral')
DENSE_FAMILY = ('llama', 'mistral', 'qwen2', 'qwen3')
# Multimodal checkpoints whose language model is one of the families above, and the prefix of its tensors.
LANGUAGE_MODEL = 'language_model.'
LANGUAGE_MODEL_PREFIX = {'kimi_k25': LANGUAGE_MODEL}

# Where multimodal checkpoints keep the vision tower and its projector.
VISION_PREFIXES = ('vision_tower.', 'vision_model.', 'visual.', 'mm_projector.', 'multi_modal_projector.')

DTYPE_BYTES = {'bfloat16': 2, 'float16': 2, 'float32': 4}
# Linear layers no quantizer of these checkpoints quantizes: vLLM builds the routers with quant_config=None.
_NEVER_QUANTIZED = ('lm_head', '.mlp.gate', '.block_sparse_moe.gate', '.shared_expert_gate')

# The share of an index's names the layout must know for its sizes to stand for the checkpoint's: the rest are
# tensors vLLM does not load (multi-token-prediction layers) or buffers, never a family's main weights.
MIN_MATCHED = 0.9
# The tensors beside a quantized weight that only quantized checkpoints hold.
_SCALE_SUFFIXES = ('.weight_scale', '.weight_scale_inv', '.weight_scale_2', '.weight_packed')

# {tensor name: bytes}
Tensors = dict[str, int]
# {linear module name: (output features, input features)}
Linears = dict[str, tuple[int, int]]


def _dim(config: Config, key: str, missing: int = 0) -> int:
    return config_int(config, key, minimum=0, missing=missing)


def _attention_gqa(prefix: str, cfg: Config, linears: Linears, others: dict[str, int]) -> None:
    hidden = _dim(cfg, 'hidden_size')
    heads = _dim(cfg, 'num_attention_heads')
    kv_heads = _dim(cfg, 'num_key_value_heads') or heads
    head_dim = _dim(cfg, 'head_dim') or (hidden // heads if heads else 0)
    linears[prefix + 'q_proj'] = (heads * head_dim, hidden)
    linears[prefix + 'k_proj'] = (kv_heads * head_dim, hidden)
    linears[prefix + 'v_proj'] = (kv_heads * head_dim, hidden)
    linears[prefix + 'o_proj'] = (hidden, heads * head_dim)
    model_type = cfg.get('model_type')
    if model_type in ('qwen2', 'qwen2_moe') or cfg.get('attention_bias'):
        for name, width in (('q_proj', heads), ('k_proj', kv_heads), ('v_proj', kv_heads)):
            others[prefix + name + '.bias'] = width * head_dim
    if model_type in ('qwen3', 'qwen3_moe'):
        others[prefix + 'q_norm.weight'] = head_dim
        others[prefix + 'k_norm.weight'] = head_dim


def _attention_mla(prefix: str, cfg: Config, linears: Linears, others: dict[str, int]) -> None:
    hidden = _dim(cfg, 'hidden_size')
    heads = _dim(cfg, 'num_attention_heads')
    q_lora = _dim(cfg, 'q_lora_rank')
    kv_lora = _dim(cfg, 'kv_lora_rank')
    rope = _dim(cfg, 'qk_rope_head_dim')
    nope = _dim(cfg, 'qk_nope_head_dim')
    v_dim = _dim(cfg, 'v_head_dim')
    if q_lora:
        linears[prefix + 'q_a_proj'] = (q_lora, hidden)
        others[prefix + 'q_a_layernorm.weight'] = q_lora
        linears[prefix + 'q_b_proj'] = (heads * (nope + rope), q_lora)
    else:
        linears[prefix + 'q_proj'] = (heads * (nope + rope), hidden)
    linears[prefix + 'kv_a_proj_with_mqa'] = (kv_lora + rope, hidden)
    others[prefix + 'kv_a_layernorm.weight'] = kv_lora
    linears[prefix + 'kv_b_proj'] = (heads * (nope + v_dim), kv_lora)
    linears[prefix + 'o_proj'] = (hidden, heads * v_dim)


def _mlp(prefix: str, hidden: int, inter: int, linears: Linears, names: tuple[str, str, str]) -> None:
    gate, up, down = names
    linears[prefix + gate] = (inter, hidden)
    linears[prefix + up] = (inter, hidden)
    linears[prefix + down] = (hidden, inter)


def _is_moe_layer(cfg: Config, layer: int) -> bool:
    model_type = cfg.get('model_type')
    if model_type in MLA_FAMILY:
        freq = _dim(cfg, 'moe_layer_freq', missing=1) or 1
        return bool(_dim(cfg, 'n_routed_experts')) and layer >= _dim(cfg, 'first_k_dense_replace') and layer % freq == 0
    if model_type == 'mixtral':
        return True
    mlp_only = cfg.get('mlp_only_layers') or []
    step = _dim(cfg, 'decoder_sparse_step', missing=1) or 1
    return layer not in mlp_only and (layer + 1) % step == 0


def _moe(prefix: str, cfg: Config, linears: Linears, others: dict[str, int], float_params: dict[str, int]) -> None:
    hidden = _dim(cfg, 'hidden_size')
    model_type = cfg.get('model_type')
    if model_type == 'mixtral':
        experts = _dim(cfg, 'num_local_experts')
        linears[prefix + 'block_sparse_moe.gate'] = (experts, hidden)
        for e in range(experts):
            _mlp(
                '%sblock_sparse_moe.experts.%d.' % (prefix, e),
                hidden,
                _dim(cfg, 'intermediate_size'),
                linears,
                ('w1', 'w3', 'w2'),
            )
        return
    inter = _dim(cfg, 'moe_intermediate_size')
    experts = _dim(cfg, 'n_routed_experts') if model_type in MLA_FAMILY else _dim(cfg, 'num_experts')
    linears[prefix + 'mlp.gate'] = (experts, hidden)
    for e in range(experts):
        _mlp('%smlp.experts.%d.' % (prefix, e), hidden, inter, linears, ('gate_proj', 'up_proj', 'down_proj'))
    if model_type in MLA_FAMILY:
        if cfg.get('topk_method') == 'noaux_tc' or model_type != 'deepseek_v2':
            float_params[prefix + 'mlp.gate.e_score_correction_bias'] = experts
        shared = _dim(cfg, 'n_shared_experts')
        if shared:
            _mlp(prefix + 'mlp.shared_experts.', hidden, inter * shared, linears, ('gate_proj', 'up_proj', 'down_proj'))
    elif model_type == 'qwen2_moe':
        _mlp(
            prefix + 'mlp.shared_expert.',
            hidden,
            _dim(cfg, 'shared_expert_intermediate_size'),
            linears,
            ('gate_proj', 'up_proj', 'down_proj'),
        )
        linears[prefix + 'mlp.shared_expert_gate'] = (1, hidden)


def _language_model(cfg: Config, prefix: str) -> tuple[Linears, dict[str, int], dict[str, int]]:
    """(linears, other tensors in the model's dtype {name: elements}, float32 tensors {name: elements})."""
    linears: Linears = {}
    others: dict[str, int] = {}
    float_params: dict[str, int] = {}
    model_type = cfg.get('model_type')
    hidden = _dim(cfg, 'hidden_size')
    vocab = _dim(cfg, 'vocab_size')
    layers = _dim(cfg, 'num_hidden_layers')
    others[prefix + 'model.embed_tokens.weight'] = vocab * hidden
    others[prefix + 'model.norm.weight'] = hidden
    if not cfg.get('tie_word_embeddings', False):
        linears[prefix + 'lm_head'] = (vocab, hidden)
    for layer in range(layers):
        p = '%smodel.layers.%d.' % (prefix, layer)
        others[p + 'input_layernorm.weight'] = hidden
        others[p + 'post_attention_layernorm.weight'] = hidden
        if model_type in MLA_FAMILY:
            _attention_mla(p + 'self_attn.', cfg, linears, others)
        else:
            _attention_gqa(p + 'self_attn.', cfg, linears, others)
        if model_type in DENSE_FAMILY or not _is_moe_layer(cfg, layer):
            _mlp(p + 'mlp.', hidden, _dim(cfg, 'intermediate_size'), linears, ('gate_proj', 'up_proj', 'down_proj'))
        else:
            _moe(p, cfg, linears, others, float_params)
    return linears, others, float_params


def _vision_tower(vision: Config, text_hidden: int) -> tuple[Linears, dict[str, int]]:
    """Kimi-K2.5's MoonViT and its patch-merger projector, bf16 (ModelOpt leaves them unquantized)."""
    hidden = _dim(vision, 'hidden_size')
    inter = _dim(vision, 'intermediate_size')
    patch = _dim(vision, 'patch_size')
    merge = vision.get('merge_kernel_size') or [2, 2]
    merged = hidden * int(merge[0]) * int(merge[1])
    linears: Linears = {}
    others: dict[str, int] = {'vision_tower.patch_embed.proj.weight': hidden * 3 * patch * patch}
    for layer in range(_dim(vision, 'num_hidden_layers')):
        p = 'vision_tower.encoder.blocks.%d.' % layer
        linears[p + 'wqkv'] = (3 * hidden, hidden)
        linears[p + 'wo'] = (hidden, hidden)
        linears[p + 'mlp.fc0'] = (inter, hidden)
        linears[p + 'mlp.fc1'] = (hidden, inter)
        others[p + 'norm0.weight'] = hidden
        others[p + 'norm1.weight'] = hidden
    linears['mm_projector.proj.0'] = (merged, merged)
    linears['mm_projector.proj.2'] = (_dim(vision, 'text_hidden_size') or text_hidden, merged)
    return linears, others


class Quantization:
    """Which linear layers a checkpoint quantizes and how many bytes their weights and scales take."""

    def __init__(self, config: Config, hf_quant_config: Optional[Config], stored: Optional[set[str]] = None) -> None:
        """stored: the tensor names the checkpoint's index lists (without a language_model. prefix), where known: a
        module is quantized there when its weight has a scale beside it, whatever the exclusions say."""
        self.stored = stored
        quant = config.get('quantization_config') or text_config(config).get('quantization_config')
        if quant is None and hf_quant_config is not None:
            inner = hf_quant_config.get('quantization') or {}
            quant = {
                'quant_method': 'modelopt',
                'quant_algo': inner.get('quant_algo'),
                'group_size': inner.get('group_size'),
                'exclude_modules': inner.get('exclude_modules'),
            }
        self.method = ''
        self.excluded: list[str] = []
        self.block: Optional[tuple[int, int]] = None
        self.group = 16
        self.bits = 4
        if not isinstance(quant, dict):
            return
        method = str(quant.get('quant_method') or '').lower()
        algo = str(quant.get('quant_algo') or '').upper()
        if method == 'modelopt' and algo == 'NVFP4':
            self.method = 'nvfp4'
            self.group = int(quant.get('group_size') or 16)
        elif method == 'compressed-tensors' and quant.get('format') == 'pack-quantized':
            weights = _pack_quantized_weights(quant)
            if weights is not None:
                self.method = 'pack-quantized'
                self.bits, self.group = weights
        elif method in ('fp8', 'modelopt'):
            self.method = 'fp8'
            block = quant.get('weight_block_size')
            if isinstance(block, list) and len(block) == 2:
                self.block = (int(block[0]), int(block[1]))
        else:
            self.method = method or 'unknown'
        self.excluded = [
            str(m)
            for m in (quant.get('exclude_modules') or quant.get('modules_to_not_convert') or quant.get('ignore') or [])
        ]

    def quantizes(self, module: str) -> bool:
        """Whether a linear module's weight is stored quantized."""
        if self.method not in ('fp8', 'nvfp4', 'pack-quantized'):
            return False
        if self.stored is not None:
            bare = _strip_known_prefix(module)
            return any(bare + suffix in self.stored for suffix in _SCALE_SUFFIXES)
        if any(module.endswith(n) or (n + '.') in module for n in _NEVER_QUANTIZED):
            return False
        if is_vision(module):
            return False
        bare = module.split('language_model.', 1)[-1]
        return not any(_matches(m, pattern) for m in (module, bare) for pattern in self.excluded)

    def tensors(self, module: str, out_features: int, in_features: int, dtype_bytes: int) -> Tensors:
        """The tensors of one linear module's weight as the checkpoint stores them."""
        elements = out_features * in_features
        if not self.quantizes(module):
            return {module + '.weight': elements * dtype_bytes}
        if self.method == 'pack-quantized':
            # compressed-tensors: int32 words of 32 / bits values, a bf16 scale per group, the unpacked shape.
            return {
                module + '.weight_packed': out_features * ceil_div(in_features * self.bits, 32) * 4,
                module + '.weight_scale': out_features * ceil_div(in_features, self.group) * 2,
                module + '.weight_shape': 16,
            }
        if self.method == 'nvfp4':
            return {
                module + '.weight': elements // 2,
                module + '.weight_scale': ceil_div(elements, self.group),
                module + '.weight_scale_2': 4,
                module + '.input_scale': 4,
            }
        if self.block is not None:
            blocks = ceil_div(out_features, self.block[0]) * ceil_div(in_features, self.block[1])
            return {module + '.weight': elements, module + '.weight_scale_inv': blocks * 4}
        return {module + '.weight': elements, module + '.weight_scale': 4, module + '.input_scale': 4}


def _pack_quantized_weights(quant: Config) -> Optional[tuple[int, int]]:
    """(bits, group size) of a compressed-tensors config whose one group quantizes Linear weights to integers in
    groups; None for any other scheme (its sizes are not modelled)."""
    groups = quant.get('config_groups')
    if not isinstance(groups, dict) or len(groups) != 1:
        return None
    weights = next(iter(groups.values())).get('weights') or {}
    if weights.get('type') != 'int' or weights.get('strategy') != 'group' or not weights.get('group_size'):
        return None
    return int(weights.get('num_bits') or 4), int(weights['group_size'])


def _matches(module: str, pattern: str) -> bool:
    """Whether a module is one an exclusion names: compressed-tensors' re: patterns, ModelOpt's globs, or a name
    (which also excludes the modules under it)."""
    if pattern.startswith('re:'):
        return re.match(pattern[3:], module) is not None
    return fnmatch.fnmatchcase(module, pattern) or module == pattern or module.startswith(pattern + '.')


def supported(config: Config) -> bool:
    """Whether the family's tensors are modelled here."""
    model_type = config.get('model_type')
    if model_type in LANGUAGE_MODEL_PREFIX:
        model_type = text_config(config).get('model_type')
    return model_type in MLA_FAMILY + MOE_GQA_FAMILY + DENSE_FAMILY


def checkpoint_tensors(
    config: Config, hf_quant_config: Optional[Config] = None, stored: Optional[set[str]] = None
) -> Optional[Tensors]:
    """Every tensor vLLM loads from the checkpoint, with its bytes; None for a family not modelled here.

    DeepSeek's multi-token-prediction layers (at num_hidden_layers and beyond) are left out: vLLM does not load them.
    """
    if not supported(config):
        return None
    text = text_config(config)
    prefix = LANGUAGE_MODEL_PREFIX.get(str(config.get('model_type')), '')
    dtype_bytes = DTYPE_BYTES.get(str(text.get('torch_dtype') or text.get('dtype') or 'bfloat16'), 2)
    quant = Quantization(config, hf_quant_config, stored)
    linears, others, float_params = _language_model(text, prefix)
    vision = config.get('vision_config')
    if isinstance(vision, dict) and prefix:
        vision_linears, vision_others = _vision_tower(vision, _dim(text, 'hidden_size'))
        linears.update(vision_linears)
        others.update(vision_others)
    tensors: Tensors = {}
    for module, (out_features, in_features) in linears.items():
        tensors.update(quant.tensors(module, out_features, in_features, dtype_bytes))
    for name, elements in others.items():
        tensors[name] = elements * dtype_bytes
    for name, elements in float_params.items():
        tensors[name] = elements * 4
    return tensors


def is_vision(name: str) -> bool:
    """Whether a tensor belongs to the vision tower or its projector, which --language-model-only never builds."""
    return name.startswith(VISION_PREFIXES)


def _strip_known_prefix(name: str) -> str:
    return name[len(LANGUAGE_MODEL) :] if name.startswith(LANGUAGE_MODEL) else name


def sized_from_config(names: Any, config: Config, hf_quant_config: Optional[Config] = None) -> Optional[Tensors]:
    """The bytes config.json gives the tensors an index names ({name: bytes}), or None where the family is not
    modelled here or the index names its tensors otherwise (fewer than MIN_MATCHED of them known).

    Which linear layers are quantized comes from the names themselves: a weight with a scale beside it."""
    # Inline, not _strip_known_prefix: this runs for each of Kimi-K2.5's 280,000 names, three times.
    cut = len(LANGUAGE_MODEL)
    bare_of = dict((n, n[cut:] if n.startswith(LANGUAGE_MODEL) else n) for n in names)
    generated = checkpoint_tensors(config, hf_quant_config, set(bare_of.values()))
    if generated is None or not bare_of:
        return None
    by_bare_name = dict((n[cut:] if n.startswith(LANGUAGE_MODEL) else n, b) for n, b in generated.items())
    sized = dict((name, by_bare_name[bare]) for name, bare in bare_of.items() if bare in by_bare_name)
    return sized if len(sized) >= MIN_MATCHED * len(bare_of) else None
