# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Reading a Hugging Face checkpoint's config the way vLLM does.

PRIVATE to the collection: this is not a public API; it may change without notice.
Only the Python standard library is used.
"""

import os
import stat
from typing import IO, Any, Optional

from ansible_collections.llmserve.vllm.plugins.module_utils._json_text import decode_json

CONFIG_NAME = 'config.json'
HF_QUANT_CONFIG_NAME = 'hf_quant_config.json'

# vllm/utils/torch_utils.py MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP
MODELOPT_TO_VLLM_KV_CACHE_DTYPE = {'fp8': 'fp8_e4m3', 'nvfp4': 'nvfp4'}

# Bytes per KV-cache element for the cache dtypes vLLM accepts in --kv-cache-dtype.
KV_CACHE_DTYPE_BYTES = {
    'bfloat16': 2,
    'float16': 2,
    'half': 2,
    'float32': 4,
    'float': 4,
    'fp8': 1,
    'fp8_e4m3': 1,
    'fp8_e5m2': 1,
    'fp8_inc': 1,
}

# The model types whose attention vLLM 0.32.0 runs as multi-head latent attention
# (vllm/transformers_utils/model_arch_config_convertor.py is_deepseek_mla).
MLA_MODEL_TYPES = (
    'axk1',
    'deepseek_v2',
    'deepseek_v3',
    'deepseek_v32',
    'deepseek_v4',
    'deepseek_v41',
    'dots3_note',
    'deepseek_mtp',
    'k3_dspark',
    'glm5_next',
    'glm5_next_text',
    'glm_moe_dsa',
    'glm4_moe_lite',
    'glm4_moe_lite_mtp',
    'kimi_k2',
    'kimi_linear',
    'longcat_flash',
    'pangu_ultra_moe',
    'pangu_ultra_moe_mtp',
    'bailing_hybrid',
    'bailing_hybrid_mtp',
    'bailing_hybrid_v3_mtp',
    'hy_v4',
    'hy_v4_mtp',
)


# A config.json or hf_quant_config.json as parsed: any JSON object.
Config = dict[str, Any]
# resolve_kv_cache_dtype's answer: the dtype, where it comes from, and a warning or None.
DtypeInfo = tuple[str, str, Optional[str]]


class CheckpointError(Exception):
    """A checkpoint file is missing or malformed; the message names file and cause."""


def open_regular(path: str) -> IO[bytes]:
    """Open path for reading in binary, refusing anything but a regular file.

    A FIFO would block the open or the read for ever, a device can be endless; the
    non-blocking open returns at once whatever path is, and fstat judges what was opened.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError('%s is not a regular file' % path)
    return os.fdopen(fd, 'rb')


def read_json(path: str) -> Config:
    """Return the parsed JSON object in path, or raise CheckpointError naming it."""
    try:
        with open_regular(path) as f:
            data = f.read()
    except OSError as exc:
        raise CheckpointError('cannot read %s: %s' % (path, exc.strerror or exc)) from exc
    obj = decode_json(data, path, CheckpointError)
    if not isinstance(obj, dict):
        raise CheckpointError('%s does not hold a JSON object' % path)
    return obj


def load_config(model_path: str) -> Config:
    """The checkpoint's config.json as a dict."""
    path = os.path.join(model_path, CONFIG_NAME)
    if not os.path.exists(path):
        raise CheckpointError('%s does not exist: is %s a Hugging Face checkpoint directory?' % (path, model_path))
    return read_json(path)


def text_config(config: Config) -> Config:
    """The language model's config: ``text_config`` of a multimodal checkpoint, else the config itself."""
    sub = config.get('text_config')
    if isinstance(sub, dict):
        return sub
    return config


def read_hf_quant_config(model_path: Optional[str], config: Config) -> Optional[Config]:
    """hf_quant_config.json (ModelOpt <= 0.29) when vLLM reads it: config.json has no quantization_config."""
    path = os.path.join(model_path, HF_QUANT_CONFIG_NAME) if model_path else None
    if config.get('quantization_config') is None and path and os.path.exists(path):
        return read_json(path)
    return None


def normalize_quant_method(quant_cfg: Config) -> str:
    """The quant_method vLLM gives this config (model_arch_config_convertor._normalize_quantization_config)."""
    producer = quant_cfg.get('producer')
    producer_name = producer.get('name') if isinstance(producer, dict) else None
    inner = quant_cfg.get('quantization')
    inner = inner if isinstance(inner, dict) else {}
    method = quant_cfg.get('quant_method') or ''
    if producer_name == 'modelopt' or 'modelopt_quant_config' in inner:
        algo = inner.get('quant_algo')
        if algo is not None:
            algo = str(algo).upper()
            if algo in ('FP8', 'FP8_PER_CHANNEL_PER_TOKEN', 'FP8_PB_WO'):
                method = 'modelopt'
            elif algo == 'NVFP4':
                method = 'modelopt_fp4'
    return str(method).lower().replace('compressed_tensors', 'compressed-tensors')


def kv_cache_quant_algo_string(quant_cfg: Config) -> Optional[str]:
    """Mirror of vLLM's get_kv_cache_quant_algo_string (vllm/utils/torch_utils.py).

    None when the checkpoint asks for no KV-cache quantization, ``auto`` when it asks
    for one vLLM does not recognise, else the vLLM cache dtype (``fp8_e4m3``, ``nvfp4``).
    """
    method = normalize_quant_method(quant_cfg)
    if not method.startswith('modelopt'):
        return None
    inner = quant_cfg.get('quantization', quant_cfg)
    if not isinstance(inner, dict):
        inner = quant_cfg
    kv_algo = (
        inner.get('kv_cache_scheme')
        or quant_cfg.get('kv_cache_scheme')
        or inner.get('kv_cache_quant_algo')
        or quant_cfg.get('kv_cache_quant_algo')
    )
    if isinstance(kv_algo, dict):
        if kv_algo.get('dynamic') is False and kv_algo.get('num_bits') == 8 and kv_algo.get('type') == 'float':
            kv_algo = 'fp8'
        elif kv_algo.get('num_bits') == 4 and kv_algo.get('type') == 'float':
            kv_algo = 'nvfp4'
        else:
            return 'auto'
    if isinstance(kv_algo, str):
        return MODELOPT_TO_VLLM_KV_CACHE_DTYPE.get(kv_algo.lower(), 'auto')
    return None


def model_dtype(config: Config) -> str:
    """The dtype vLLM runs the model in with --dtype auto, as a string.

    float32 checkpoints are downcast to the platform's first 16-bit type (bfloat16 on
    the GPUs and CPUs this collection targets); config.json calls the key
    ``torch_dtype`` (older) or ``dtype`` (transformers >= 4.56).
    """
    tc = text_config(config)
    for cfg in (tc, config):
        for key in ('torch_dtype', 'dtype'):
            value = cfg.get(key)
            if isinstance(value, str) and value:
                value = value.replace('torch.', '')
                if value in ('float32', 'float'):
                    return 'bfloat16'
                if value == 'half':
                    return 'float16'
                return value
    return 'bfloat16'


def is_mla(config: Config) -> bool:
    """Whether vLLM 0.32.0 runs the language model's attention as MLA (ModelConfig.use_mla).

    As vLLM decides it for its own model implementations: the text config's model_type is one
    of MLA_MODEL_TYPES and the model is causal; a DeepSeek-V4-style config (compress_ratios)
    needs a head_dim. vLLM also wants kv_lora_rank not null, but transformers fills it in when
    config.json leaves it out, and with it set to null vLLM cannot build the model at all: the
    model_type decides here, and whoever sizes the cache reports the missing kv_lora_rank.
    """
    tc = text_config(config)
    if tc.get('model_type') not in MLA_MODEL_TYPES or not tc.get('is_causal', True):
        return False
    if 'compress_ratios' in tc:
        return tc.get('head_dim') is not None
    return True


def auto_kv_cache_dtype(config: Config, hf_quant_config: Optional[Config]) -> tuple[Optional[str], Optional[str]]:
    """What vLLM 0.32.0 makes of ``--kv-cache-dtype auto``: (cache dtype, where it comes from).

    The dtype is None when the KV cache keeps the model's dtype. The one answer every module
    uses; tests/integration/test_kv_cache_dtype_vllm.py checks it against vLLM's own code.

    1. The top-level quantization config is config.json's ``quantization_config`` or, when that
       is absent, ``hf_quant_config.json`` (vllm/transformers_utils/config.py); for ModelOpt its
       kv_cache_scheme / kv_cache_quant_algo decide (get_kv_cache_quant_algo_string in
       resolve_kv_cache_dtype_string). A ModelOpt config only under text_config is not read.
    2. The layers load that config or, without one, text_config's (weight_utils.get_quant_config);
       a compressed-tensors kv_cache_scheme there turns a dtype still auto into fp8 in standard
       attention layers (attention.py); MLA layers keep it.
    """
    quant_cfg, source = config.get('quantization_config'), CONFIG_NAME
    if quant_cfg is None:
        quant_cfg, source = hf_quant_config, HF_QUANT_CONFIG_NAME
    if isinstance(quant_cfg, dict):
        algo = kv_cache_quant_algo_string(quant_cfg)
        if algo is not None:
            if algo == 'auto':
                return None, source
            return algo, '%s (quant_method %s)' % (source, normalize_quant_method(quant_cfg))
    elif quant_cfg is None and isinstance(config.get('text_config'), dict):
        quant_cfg, source = config['text_config'].get('quantization_config'), 'text_config of ' + CONFIG_NAME
    if (
        isinstance(quant_cfg, dict)
        and normalize_quant_method(quant_cfg) == 'compressed-tensors'
        and quant_cfg.get('kv_cache_scheme') is not None
        and not is_mla(config)
    ):
        return 'fp8', 'the kv_cache_scheme in %s (compressed-tensors)' % source
    return None, None


def resolve_kv_cache_dtype(
    requested: str, model_path: Optional[str], config: Config, hf_quant_config: Optional[Config] = None
) -> DtypeInfo:
    """The KV-cache dtype vLLM ends up with for ``--kv-cache-dtype requested``: auto_kv_cache_dtype's answer.

    hf_quant_config.json is read from model_path; with model_path None, hf_quant_config is that file as read
    elsewhere (from the Hub), or None where vLLM reads none.
    Returns (dtype, source, warning): where the dtype came from, and a warning or None. The
    warning says when a quantization config found only under text_config asks for a quantized
    KV cache that vLLM's auto resolution does not read.
    """
    if requested != 'auto':
        return requested, 'kv_cache_dtype %s as requested' % requested, None
    if model_path is not None:
        hf_quant_config = read_hf_quant_config(model_path, config)
    dtype, source = auto_kv_cache_dtype(config, hf_quant_config)
    if dtype is not None:
        return dtype, 'kv_cache_dtype auto resolves to %s from %s, as in vLLM' % (dtype, source), None
    note = None
    sub = text_config(config).get('quantization_config')
    if (
        source is None
        and sub is not config.get('quantization_config')
        and isinstance(sub, dict)
        and kv_cache_quant_algo_string(sub) not in (None, 'auto')
    ):
        note = (
            'text_config.quantization_config asks for a quantized KV cache, but vLLM resolves '
            '--kv-cache-dtype auto from the top-level quantization_config only'
        )
    dtype = model_dtype(config)
    if source is not None:
        return (
            dtype,
            (
                'kv_cache_dtype auto resolves to the model dtype %s: vLLM does not know the KV-cache '
                'quantization %s asks for' % (dtype, source)
            ),
            note,
        )
    return (
        dtype,
        'kv_cache_dtype auto resolves to the model dtype %s: the checkpoint asks for no KV-cache quantization' % dtype,
        note,
    )


def kv_dtype_bytes(dtype: str) -> Optional[int]:
    """Bytes per KV-cache element of a resolved vLLM cache dtype, or None if unknown."""
    if dtype in KV_CACHE_DTYPE_BYTES:
        return KV_CACHE_DTYPE_BYTES[dtype]
    if dtype.startswith('fp8'):
        return 1
    return None
