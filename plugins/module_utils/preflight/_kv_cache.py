# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""vLLM's KV-cache arithmetic: bytes a token takes, tokens a budget holds, and its words when they do not fit.

PRIVATE to the collection: this is not a public API; it may change without notice.
"""

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import CONFIG_NAME, Config, is_mla
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._model_config import config_field, config_int
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._preflight_common import (
    PreflightError,
    ceil_div,
    gib,
)

# vLLM's KV-cache block on GPUs, in tokens; the cache is allocated in whole blocks.
DEFAULT_BLOCK_SIZE = 16


def kv_bytes_per_token(config: Config, dtype_bytes: int, tp: int) -> tuple[int, str]:
    """KV-cache bytes one token takes on one GPU, and the attention kind.

    MLA caches one latent (kv_lora_rank + qk_rope_head_dim) per layer, on every rank
    (vLLM's MLAAttention: num_kv_heads = 1, head_size = kv_lora_rank + rope); standard
    and grouped-query attention split KV heads across ranks, each holding ceil(kv/TP).
    DeepSeek configs carry head_dim and num_key_value_heads too: MLA wins.
    """

    def required(key: str) -> int:
        value = config_int(config, key)
        if value is None:
            raise PreflightError('%s has no %s: cannot size the KV cache' % (CONFIG_NAME, config_field(config, key)))
        return value

    layers = required('num_hidden_layers')
    if is_mla(config):
        return layers * (required('kv_lora_rank') + required('qk_rope_head_dim')) * dtype_bytes, 'mla'
    heads = config_int(config, 'num_attention_heads')
    kv = config_int(config, 'num_key_value_heads', missing=heads)
    head_dim = config_int(config, 'head_dim')
    if head_dim is None:
        hidden = config_int(config, 'hidden_size')
        head_dim = hidden // heads if hidden and heads else None
    if not kv or not head_dim:
        raise PreflightError(
            '%s lacks num_attention_heads/num_key_value_heads/head_dim: cannot size the KV cache' % CONFIG_NAME
        )
    return 2 * ceil_div(kv, tp) * head_dim * dtype_bytes * layers, 'standard'


def tokens_for(budget: int, per_token: int, block_size: int) -> int:
    """Tokens a KV budget holds, in whole blocks (vLLM allocates num_blocks = budget // page bytes)."""
    if budget <= 0 or per_token <= 0:
        return 0
    return (budget // (per_token * block_size)) * block_size


def bytes_for(tokens: int, per_token: int, block_size: int) -> int:
    """KV-cache bytes a context of tokens needs, in whole blocks."""
    return ceil_div(tokens, block_size) * block_size * per_token


def utilization_for(needed_kv: int, weights: int, reserve: int, total: int) -> float:
    """Smallest gpu_memory_utilization (in hundredths, rounded up) that leaves needed_kv for the cache."""
    need = needed_kv + weights + reserve
    return ceil_div(need * 100, total) / 100.0


def misfit_message(max_model_len: int, needed: int, available: int, fit: int) -> str:
    """vLLM's own words (kv_cache_utils._check_enough_kv_cache_memory)."""
    msg = (
        "To serve at least one request with the model's max seq len (%d), (%s GiB KV cache is needed, "
        'which is larger than the available KV cache memory (%s GiB). ' % (max_model_len, gib(needed), gib(available))
    )
    if fit > 0:
        msg += 'Based on the available memory, the estimated maximum model length is %d. ' % fit
    return msg
