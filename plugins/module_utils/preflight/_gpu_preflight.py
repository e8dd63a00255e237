# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Will this model fit these GPUs, and with how much context: vLLM's arithmetic, ahead of time.

PRIVATE to the collection: this is not a public API; it may change without notice.

The plan puts together what its parts work out, each in a file of its own: the GPUs
nvidia-smi lists (_nvidia_smi), the host's facts (_host_probes), the weights on each GPU
(_weights) and the KV cache (_kv_cache). Everything here is pure (no Ansible): the module
feeds it nvidia-smi's output, the checkpoint's headers and the host's facts, and gets back
the plan.
"""

import hashlib
import json
import math
from typing import Any, Callable, Optional

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import (
    CONFIG_NAME,
    Config,
    DtypeInfo,
    is_mla,
    kv_dtype_bytes,
    model_dtype,
    text_config,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._safetensors import INDEX_NAME, Checkpoint
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight import _decode_context
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._decode_context import (
    decode_context_parallel_size,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._host_probes import (
    DEFAULT_DEV_PATH,
    DEFAULT_SHM_PATH,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._kv_cache import (
    DEFAULT_BLOCK_SIZE,
    bytes_for,
    kv_bytes_per_token,
    misfit_message,
    tokens_for,
    utilization_for,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._mla_workspace import (
    applies as mla_workspace_applies,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._mla_workspace import decode_workspace
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._model_config import (
    config_field,
    config_int,
    derived_max_model_len,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._nvidia_smi import App, Gpu
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._preflight_common import (
    MIB,
    PreflightError,
    ceil_div,
    gib,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._reserve import estimate, version_tuple
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._tensor_layout import is_vision, sized_from_config
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._weights import (
    runtime_weight_bytes,
    weights_per_gpu,
)

# vLLM's --gpu-memory-utilization when it is not given.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# What max_model_len says when the plan is to choose the longest context that fits.
AUTO_MAX_MODEL_LEN = (None, 'auto', -1, '-1')

# What the plan adds to predicted weights: vLLM's "Model loading took" was at most this much above the prediction
# before download in every start-up log of a mixture of experts at TP >= 4 (tests/fixtures/startup_logs, judged by
# tests/unit/plugins/module_utils/test_weights_calibration.py). Only where tensor sizes are predicted (config.json's
# layout, or the index's total shared out): weights given (a measurement) get none, and neither do the safetensors
# headers (on disk or from the Hub), which give every tensor's bytes; on the H100 of tests/fixtures/gpu_run the
# headers' 55.34 GiB were 0.09 % below vLLM's 55.39, where 2 % (1.11 GiB) took 10 % off the KV cache.
PREDICTED_WEIGHTS_MARGIN = 0.02
MARGINLESS_WEIGHTS_SOURCES = ('given', 'headers', 'hub')
# The serving flag that makes vLLM capture no CUDA graphs (cudagraph_mode NONE), so it estimates none
# (v1/worker/gpu_worker.py determine_available_memory); the role's own flags come through memory_key.serve_flags.
EAGER_FLAG = '--enforce-eager'

# The options that decide vLLM's memory, beside the GPUs and the resolved KV-cache dtype: a measurement of one start
# stands for another only where all of them are the same.
MEMORY_OPTIONS = (
    'tensor_parallel_size',
    'pipeline_parallel_size',
    'gpu_memory_utilization',
    'kv_cache_memory_bytes',
    'max_num_seqs',
    'max_num_batched_tokens',
    'block_size',
    'multimodal',
)

# The module's options; the host's facts by name: 'belongs'(pid), 'name'(pid), 'shm'(path), 'port'(host, port).
Params = dict[str, Any]
Host = dict[str, Callable[..., Any]]


class Findings:
    """What the steps of a plan report, in the order they find it."""

    def __init__(self) -> None:
        self.warnings: list[str] = []
        self.problems: list[str] = []  # what would make vLLM's start fail
        self.remedies: list[str] = []  # changes that would make the plan fit


class Memory:
    """One GPU's memory as the plan divides it, in bytes."""

    def __init__(self, params: Params, total: Optional[int], weights: int, reserve: int, per_token: int) -> None:
        self.total = total  # the smallest GPU's, None without GPUs (the CPU build)
        self.weights = weights
        self.reserve = reserve
        self.per_token = per_token
        self.block = params.get('block_size') or DEFAULT_BLOCK_SIZE
        # Decode context parallelism splits each request's latent cache by token across this many ranks: a rank
        # holds ceil(tokens / dcp) of each (vllm/v1/kv_cache_interface.py, max_memory_usage_bytes).
        self.dcp = decode_context_parallel_size(params)
        self.utilization = params['gpu_memory_utilization']
        self.explicit = params.get('kv_cache_memory_bytes')
        self.budget = 0  # for the KV cache, set by size_kv_cache()
        self.tokens = 0  # the budget holds across the dcp ranks, in whole blocks; vLLM's "KV cache size"

    def bytes_for(self, tokens: int) -> int:
        """KV-cache bytes on one GPU for a request of tokens, its share under decode context parallelism."""
        return bytes_for(ceil_div(tokens, self.dcp), self.per_token, self.block)


def memory_key(params: Params, gpus_used: list[Gpu], dtype: str, cpu: bool) -> dict[str, Any]:
    """What decides vLLM's memory at start: the GPUs (model and count), the memory options, the KV-cache dtype, and
    what the caller adds in memory_key (the model revision, the vLLM release, its other serving flags)."""
    key = {name: params.get(name) for name in MEMORY_OPTIONS}
    key.update(
        accelerator='cpu' if cpu else 'gpu',
        gpus=[] if cpu else [str(gpu.get('name') or '') for gpu in gpus_used],
        kv_cache_dtype=dtype,
        given=dict(params.get('memory_key') or {}),
    )
    return key


def plan_memory_key(params: Params, figures: dict[str, Any], memory: Memory, cpu: bool) -> dict[str, Any]:
    """memory_key with what this plan adds where it applies: TRITON_MLA's split count and the dcp size."""
    key = memory_key(params, figures['gpus'], figures['kv_cache_dtype'], cpu)
    splits = figures['reserve'].get('mla_decode_splits')
    if splits:
        # TRITON_MLA's workspace grows with max_model_len by its split count: lengths of one count size alike.
        key['mla_decode_splits'] = splits
    if memory.dcp > 1:
        # Only where it is on, so that the keys (and measurements) of plans without it stay as they were.
        key['decode_context_parallel_size'] = memory.dcp
    return key


def memory_key_id(key: dict[str, Any]) -> str:
    """A short stable name for a memory key: the file name of its measurement."""
    text = json.dumps(key, sort_keys=True, separators=(',', ':'), default=str)
    return hashlib.sha256(text.encode('utf-8')).hexdigest()[:16]


def measurement_for(key_id: str, measurements: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The newest measurement of this key that gives the KV tokens (a start that logged them), or None."""
    usable = [
        m
        for m in measurements
        if isinstance(m, dict)
        and m.get('memory_key_id') == key_id
        and isinstance((m.get('startup') or {}).get('kv_tokens'), int)
        and m['startup']['kv_tokens'] > 0
    ]
    return max(usable, key=lambda m: str(m.get('recorded_at') or '')) if usable else None


def plan(
    params: Params,
    config: Config,
    checkpoint: Optional[Checkpoint],
    gpus: list[Gpu],
    apps: list[App],
    dtype_info: DtypeInfo,
    host: Optional[Host] = None,
    measurements: Optional[list[dict[str, Any]]] = None,
    hf_quant_config: Optional[Config] = None,
) -> dict[str, Any]:
    """Compute the whole preflight answer (plan_at's arguments), with decode context parallelism where the asked
    context needs it: with decode_context_parallel_size auto, a max_model_len that plain tensor parallelism cannot
    hold is planned with the smallest dcp (and, where max_num_seqs is not set, the largest planned max_num_seqs)
    that holds one request of it; with 1, the refusal says which dcp would."""
    option = _decode_context.parse_option(params.get('decode_context_parallel_size'))
    cpu = params.get('accelerator') == 'cpu'
    _decode_context.check_size(
        decode_context_parallel_size({'decode_context_parallel_size': option}),
        params['tensor_parallel_size'],
        config,
        cpu,
    )

    def plan_with(dcp: Any, **changes: Any) -> dict[str, Any]:
        trial = dict(params, decode_context_parallel_size=dcp, **changes)
        return plan_at(trial, config, checkpoint, gpus, apps, dtype_info, host, measurements, hf_quant_config)

    answer = plan_with(option)
    found = (
        plan_decode_context(params, option, config, answer, plan_with) if option in (_decode_context.AUTO, 1) else None
    )
    return describe_decode_context(
        params, option, found or answer, found is not None and option == _decode_context.AUTO
    )


def plan_decode_context(
    params: Params, option: Any, config: Config, answer: dict[str, Any], plan_with: Callable[..., dict[str, Any]]
) -> Optional[dict[str, Any]]:
    """The first plan of _decode_context.candidates that holds one request of the asked max_model_len, where plain
    tensor parallelism holds none; with option 1 its size becomes a remedy of the answer instead. None without one."""
    requested = params.get('max_model_len')
    if (
        requested in AUTO_MAX_MODEL_LEN
        or answer['fits']
        or answer['max_model_len_fit'] >= int(requested)
        or params.get('accelerator') == 'cpu'
        or not is_mla(config)
    ):
        return None
    # None where the reserve is given: no term of it then depends on the sequences, and none is planned.
    default_seqs = (answer.get('reserve') or {}).get('max_num_seqs')
    for dcp, seqs in _decode_context.candidates(
        params['tensor_parallel_size'], params.get('max_num_seqs'), default_seqs
    ):
        trial = plan_with(dcp, max_num_seqs=seqs)
        if not trial['fits']:
            continue
        if option == _decode_context.AUTO:
            return trial
        answer['remedies'].append(
            "set decode_context_parallel_size to %d%s (or auto): each rank then holds 1/%d of a request's cache, "
            'and max_model_len %s fits'
            % (dcp, ' with max_num_seqs %d' % seqs if seqs != params.get('max_num_seqs') else '', dcp, requested)
        )
        return None
    return None


def describe_decode_context(params: Params, option: Any, answer: dict[str, Any], planned: bool) -> dict[str, Any]:
    """Add decode_context_parallel_size and what it costs to the answer."""
    dcp = int(answer['memory_key'].get('decode_context_parallel_size') or 1)
    reserve = answer.get('reserve') or {}
    requested = answer['max_model_len']
    answer['decode_context_parallel_size'] = dcp
    answer['decode_context_parallel'] = {
        'size': dcp,
        'source': 'planned' if planned else 'given' if option != _decode_context.AUTO else 'not needed',
        'max_num_seqs': reserve.get('max_num_seqs'),
        'max_num_seqs_source': 'given'
        if params.get('max_num_seqs')
        else 'planned'
        if planned and reserve.get('max_num_seqs')
        else 'default',
        'full_length_requests': round(answer['kv_cache_tokens'] / requested, 2) if requested else 0,
        'mla_decode_workspace_bytes': reserve.get('mla_decode_workspace', 0),
    }
    if dcp > 1:
        answer['warnings'].append(
            'decode_context_parallel_size %d (%s): %s'
            % (dcp, answer['decode_context_parallel']['source'], _decode_context.DECODE_SPEED_NOTE)
        )
        if _decode_context.speculative((params.get('memory_key') or {}).get('serve_flags')):
            answer['warnings'].append(
                "speculative decoding with decode_context_parallel_size %d takes vLLM's slower draft path "
                '(triton_mla.py: no in-place draft decode metadata under dcp)' % dcp
            )
    return answer


def plan_at(
    params: Params,
    config: Config,
    checkpoint: Optional[Checkpoint],
    gpus: list[Gpu],
    apps: list[App],
    dtype_info: DtypeInfo,
    host: Optional[Host] = None,
    measurements: Optional[list[dict[str, Any]]] = None,
    hf_quant_config: Optional[Config] = None,
) -> dict[str, Any]:
    """Compute the preflight answer at one decode_context_parallel_size (params' int, 1 for auto).

    params: the module's options (dict). config: config.json. checkpoint: a
    _safetensors.Checkpoint or None when weights_bytes_per_gpu is given. gpus/apps:
    parsed nvidia-smi (or the gpus option; apps []). dtype_info: resolve_kv_cache_dtype's (dtype, source, warning).
    host: optional callables for host facts {'belongs': f(pid), 'name': f(pid),
    'shm': f(path), 'port': f(host, port)}. measurements: vLLM's figures of earlier starts, each
    {'memory_key_id', 'startup': chat_check's startup, 'recorded_at', 'host'}; one of this plan's memory key sets
    the KV cache exactly (its tokens as vLLM logged them), the prediction is returned beside it. hf_quant_config:
    the checkpoint's hf_quant_config.json where vLLM reads it (it says which tensors are quantized before download).
    Returns the result dict (without changed).
    """
    host = host or {}
    cpu = params.get('accelerator') == 'cpu'
    found = Findings()
    memory, figures = memory_inputs(params, config, checkpoint, gpus, apps, dtype_info, host, hf_quant_config, found)
    # figures['gpus'] is the GPUs used: none on the CPU build.
    key = plan_memory_key(params, figures, memory, cpu)
    key_id = memory_key_id(key)
    measured = measurement_for(key_id, measurements or [])
    predicted = size_or_measure(memory, figures, measured, found)
    fit, chosen, requested_fits = choose_context_length(params, config, memory, found)
    if cpu and memory.explicit is None:
        found.problems.append('accelerator cpu needs kv_cache_memory_bytes')
    check_host(params, host, found)
    if not cpu:
        check_nvidia_devices(params, figures['gpus'], host, found)
    figures.update(
        kv_cache_bytes=max(memory.budget, 0),
        kv_cache_tokens=memory.tokens,
        kv_cache_tokens_source='measured' if measured is not None else 'predicted',
        predicted=predicted,
        measured=measured or {},
        memory_key=key,
        memory_key_id=key_id,
        max_model_len_fit=fit,
        max_model_len=chosen,
        fits=bool(requested_fits and memory.budget > 0 and not found.problems),
        unified_vision_chunk=unified_vision_chunk(config),
        problems=found.problems,
        remedies=found.remedies,
        warnings=found.warnings,
    )
    return figures


def size_or_measure(
    memory: Memory, figures: dict[str, Any], measured: Optional[dict[str, Any]], found: Findings
) -> dict[str, Any]:
    """Size the KV cache: by the prediction, whose findings then count, or, where a start of this memory key
    measured it, by vLLM's own count. Returns the prediction's figures either way."""
    sizing = Findings()
    size_kv_cache(memory, sizing)
    predicted = {
        'kv_cache_tokens': memory.tokens,
        'kv_cache_bytes': max(memory.budget, 0),
        'weights_bytes_per_gpu': figures['weights_bytes_per_gpu'],
        'weights_margin_bytes_per_gpu': figures['weights_margin_bytes_per_gpu'],
        'reserve_bytes_per_gpu': figures['reserve_bytes_per_gpu'],
    }
    if measured is None:
        for name in ('warnings', 'problems', 'remedies'):
            getattr(found, name).extend(getattr(sizing, name))
    else:
        # vLLM's own count of this key's cache: what it holds, whatever the prediction said.
        memory.tokens = measured['startup']['kv_tokens']
        memory.budget = memory.bytes_for(memory.tokens)
    return predicted


def memory_inputs(
    params: Params,
    config: Config,
    checkpoint: Optional[Checkpoint],
    gpus: list[Gpu],
    apps: list[App],
    dtype_info: DtypeInfo,
    host: Host,
    hf_quant_config: Optional[Config],
    found: Findings,
) -> tuple[Memory, dict[str, Any]]:
    """What sizes the KV cache on one GPU: (the Memory that the KV-cache dtype, the weights with their margin and
    the reserve leave, those figures as the plan reports them)."""
    tp = params['tensor_parallel_size']
    pp = params['pipeline_parallel_size']
    cpu = params.get('accelerator') == 'cpu'
    gpus_used = gpus[: tp * pp]
    dtype, source, strip, stripped = kv_cache_dtype(params, config, gpus_used, dtype_info, cpu, found)
    dtype_bytes = kv_dtype_bytes(dtype)
    if dtype_bytes is None:
        raise PreflightError('kv_cache_dtype %s: its size per element is not known to the preflight' % dtype)
    per_token, attention = kv_bytes_per_token(config, dtype_bytes, tp)
    check_pipeline_stages(config, pp)
    weights_total, weights, weights_source = weights_on_a_gpu(
        params, config, checkpoint, tp, pp, found, hf_quant_config
    )
    weights_margin = (
        0 if weights_source in MARGINLESS_WEIGHTS_SOURCES else int(math.ceil(weights * PREDICTED_WEIGHTS_MARGIN))
    )
    total = None if cpu else gpu_memory(params, gpus, gpus_used, apps, host, found)
    gpu = gpus_used[0] if gpus_used and not cpu else {}
    quantized = is_quantized(config, hf_quant_config)
    reserve_parts = reserve_per_gpu(params, config, total, cpu, found, str(gpu.get('name') or ''), quantized)
    if reserve_parts['source'] != 'given' and not cpu:
        add_mla_decode_workspace(reserve_parts, params, config, gpu, found)
    reserve = int(reserve_parts['total'])  # type: ignore[call-overload]
    figures = {
        'gpus': gpus_used if not cpu else [],
        'weights_bytes_total': weights_total,
        'weights_bytes_per_gpu': weights,
        'weights_margin_bytes_per_gpu': weights_margin,
        'weights_source': weights_source,
        'reserve_bytes_per_gpu': reserve,
        'reserve': reserve_parts,
        'kv_cache_dtype': dtype,
        'kv_cache_dtype_source': source,
        'attention': attention,
        'kv_cache_bytes_per_token': per_token,
        'strip_fp8_kv_cache': bool(strip),
        'fp8_kv_cache_stripped': bool(stripped),
    }
    return Memory(params, total, weights + weights_margin, reserve, per_token), figures


def unified_vision_chunk(config: Config) -> bool:
    """Whether vLLM's processor takes this checkpoint's images and videos as one modality, vision_chunk (Kimi-K2.5's
    use_unified_vision_chunk): --limit-mm-per-prompt must then name vision_chunk, as a limit on image or video binds
    nothing."""
    return isinstance(config.get('vision_config'), dict) and config.get('use_unified_vision_chunk') is True


def kv_cache_dtype(
    params: Params, config: Config, gpus_used: list[Gpu], dtype_info: DtypeInfo, cpu: bool, found: Findings
) -> tuple[str, str, bool, bool]:
    """The KV-cache dtype the plan uses once the checkpoint's FP8 KV cache is kept or stripped.

    Returns (dtype, where it comes from, whether these GPUs need the strip, whether the deploy strips).
    """
    dtype, source, note = dtype_info
    majors = [str(g.get('compute_capability', '')).split('.', 1)[0] for g in gpus_used]
    mla_on_12 = not cpu and is_mla(config) and '12' in majors
    policy = params.get('fp8_kv_cache_policy') or 'auto'
    fp8_from_checkpoint = dtype.startswith('fp8') and params.get('kv_cache_dtype') == 'auto'
    strip = mla_on_12 and fp8_from_checkpoint
    stripped = fp8_from_checkpoint and (policy == 'strip' or (policy == 'auto' and strip))
    if note:
        found.warnings.append(note)
    if stripped:
        planned = model_dtype(config)
        if strip:
            found.warnings.append(
                'the checkpoint asks for an %s KV cache, which vLLM cannot use with MLA on compute '
                'capability 12.x: it must be stripped (strip_fp8_kv_cache); planned with %s' % (dtype, planned)
            )
        reason = 'for MLA on compute capability 12.x' if strip else '(fp8_kv_cache_policy strip)'
        return planned, '%s; stripped %s, so %s' % (source, reason, planned), strip, stripped
    if mla_on_12 and dtype.startswith('fp8'):
        found.warnings.append(
            'kv_cache_dtype %s with MLA on compute capability 12.x needs a vLLM whose Triton MLA '
            'backend supports an FP8 KV cache' % dtype
        )
    return dtype, source, strip, stripped


def serves_images(params: Params, config: Config) -> bool:
    """Whether vLLM profiles a vision encoder: the checkpoint has one and multimodal is not text_only."""
    return isinstance(config.get('vision_config'), dict) and params.get('multimodal') != 'text_only'


def is_quantized(config: Config, hf_quant_config: Optional[Config]) -> bool:
    """Whether vLLM loads this checkpoint quantized: config.json (or its text_config) has a quantization_config,
    or vLLM reads hf_quant_config.json."""
    return bool(config.get('quantization_config') or text_config(config).get('quantization_config') or hf_quant_config)


def runs_eager(params: Params) -> bool:
    """Whether the serving flags (memory_key.serve_flags, the role's vllm_kimi_extra_args) ask for --enforce-eager."""
    return EAGER_FLAG in ((params.get('memory_key') or {}).get('serve_flags') or [])


def reserve_per_gpu(
    params: Params,
    config: Config,
    total: Optional[int],
    cpu: bool,
    found: Findings,
    gpu_name: str = '',
    quantized: bool = False,
) -> dict[str, object]:
    """The reserve beside weights and KV cache and where it comes from: reserve_bytes_per_gpu as given, 0 on the
    CPU build (its KV space is fixed), else _reserve's estimate from config.json and vLLM's batching."""
    given = params.get('reserve_bytes_per_gpu')
    if given is not None:
        return {'source': 'given', 'total': given}
    if cpu:
        return {'source': 'cpu', 'total': 0}
    parts = estimate(
        config,
        params['tensor_parallel_size'],
        params['gpu_memory_utilization'],
        total or 0,
        params.get('max_num_seqs'),
        params.get('max_num_batched_tokens'),
        vllm_version=params.get('vllm_version'),
        gpu_name=gpu_name,
        serves_images=serves_images(params, config),
        eager=runs_eager(params),
        quantized=quantized,
    )
    if not parts['estimated']:
        found.warnings.append(
            '%s lacks hidden_size or vocab_size: the reserve is the constant %s GiB, not an estimate; set '
            'reserve_bytes_per_gpu for an exact plan' % (CONFIG_NAME, gib(int(parts['total'])))  # type: ignore[call-overload]
        )
    parts['source'] = 'estimated' if parts.pop('estimated') else 'fallback'
    return parts


def add_mla_decode_workspace(
    parts: dict[str, object], params: Params, config: Config, gpu: Gpu, found: Findings
) -> None:
    """Add TRITON_MLA's decode workspace (_mla_workspace) to the reserve where this release runs it on this GPU.

    Its split count follows the max_model_len vLLM starts with: the requested one, or for auto the model's own
    limit (the plan's fit is never longer, so the workspace planned is never the smaller)."""
    parts.update(mla_decode_workspace=0, mla_decode_splits=0)
    version = version_tuple(params.get('vllm_version'))
    if not mla_workspace_applies(config, str(gpu.get('compute_capability') or ''), version):
        return
    requested = params.get('max_model_len')
    length = derived_max_model_len(config) if requested in AUTO_MAX_MODEL_LEN else int(requested)
    if length is None:
        found.warnings.append(
            "max_model_len auto and no model maximum in %s: TRITON_MLA's decode workspace, which grows with the "
            'context length, is not planned' % CONFIG_NAME
        )
        return
    seqs = int(parts['max_num_seqs'])  # type: ignore[call-overload]
    name = str(gpu.get('name') or '')
    workspace = decode_workspace(
        config,
        params['tensor_parallel_size'],
        seqs,
        length,
        name,
        params.get('gpu_sm_count'),
        decode_context_parallel_size(params),
    )
    if workspace['sm_count_source'] == 'unknown':
        found.warnings.append(
            "the SM count of %s is not known to the preflight: TRITON_MLA's decode workspace is planned with %d "
            'splits, not capped at twice the SM count as vLLM caps them; set gpu_sm_count (nvidia-smi does not '
            'print it; CUDA\'s multiProcessorCount, deviceQuery\'s "Multiprocessors") for the exact figure'
            % (name or 'this GPU', workspace['splits'])
        )
    parts.update(mla_decode_workspace=workspace['bytes'], mla_decode_splits=workspace['splits'])
    parts['mla_decode'] = dict(workspace, max_num_seqs=seqs, max_model_len=length)
    parts['total'] = int(parts['total']) + int(workspace['bytes'])  # type: ignore[call-overload]


def check_pipeline_stages(config: Config, pp: int) -> None:
    """Each pipeline stage must hold a layer."""
    # kv_bytes_per_token() has refused a config without num_hidden_layers already.
    layers = config_int(config, 'num_hidden_layers', missing=0)
    if pp > layers:
        raise PreflightError(
            'pipeline_parallel_size %d exceeds the %d layers of the model (%s in %s): a pipeline stage '
            'would hold no layer' % (pp, layers, config_field(config, 'num_hidden_layers'), CONFIG_NAME)
        )


def weights_on_a_gpu(
    params: Params,
    config: Config,
    checkpoint: Optional[Checkpoint],
    tp: int,
    pp: int,
    found: Findings,
    hf_quant_config: Optional[Config] = None,
) -> tuple[int, int, str]:
    """(bytes of all weights, bytes on the most loaded GPU, where that figure comes from): weights_bytes_per_gpu as
    given, or from the checkpoint: its headers, or before the download config.json's dimensions for the tensors
    the index names (the index's total where the family is not modelled)."""
    given = params.get('weights_bytes_per_gpu')
    if checkpoint is not None:
        found.problems.extend(checkpoint.problems)
    if given is not None or checkpoint is None:
        weights = given or 0
        return (checkpoint.total_bytes if checkpoint is not None else weights * tp * pp), weights, 'given'
    tensors, source = sized_tensors(checkpoint, config, hf_quant_config)
    loaded_total = max(checkpoint.total_bytes, sum(b for b in tensors.values() if b))
    if not serves_images(params, config):
        # --language-model-only: vLLM never builds the vision tower and its projector.
        vision = [name for name in tensors if is_vision(name)]
        loaded_total -= sum(tensors.pop(name) or 0 for name in vision)
    weights, estimated = weights_per_gpu(tensors, loaded_total, config, tp, pp)
    weights += runtime_weight_bytes(config, tp, hf_quant_config, params.get('vllm_version'))
    if estimated:
        index = checkpoint.source == 'index'
        found.warnings.append(
            'per-GPU weights estimated from %s without per-tensor sizes (%s); '
            'set weights_bytes_per_gpu from vLLM\'s "Model loading took" for an exact plan'
            % (
                'model.safetensors.index.json' if index else 'an incomplete checkpoint',
                'shards not downloaded' if index else 'shards missing or broken',
            )
        )
        source = 'index'
    elif source == 'config':
        found.warnings.append(
            "per-GPU weights predicted from %s's dimensions for the tensors %s names (shards not downloaded), "
            'with a margin of %d %%' % (CONFIG_NAME, INDEX_NAME, round(100 * PREDICTED_WEIGHTS_MARGIN))
        )
    return max(checkpoint.total_bytes, loaded_total), weights, source


def sized_tensors(
    checkpoint: Checkpoint, config: Config, hf_quant_config: Optional[Config]
) -> tuple[dict[str, Optional[int]], str]:
    """The checkpoint's tensors, sized: from the headers (on disk, or read from the Hub), else from config.json's
    dimensions where its family is modelled (_tensor_layout), else as they are (the index's total is then shared
    out by weights_per_gpu)."""
    unsized = [name for name, nbytes in checkpoint.tensors.items() if nbytes is None]
    if not unsized:
        return dict(checkpoint.tensors), 'hub' if checkpoint.source == 'hub' else 'headers'
    sized = sized_by_config(checkpoint, config, hf_quant_config)
    if not sized:
        return dict(checkpoint.tensors), 'index'
    tensors = dict(checkpoint.tensors)
    tensors.update((name, sized[name]) for name in unsized if name in sized)
    return tensors, 'config'


def sized_by_config(
    checkpoint: Checkpoint, config: Config, hf_quant_config: Optional[Config]
) -> Optional[dict[str, int]]:
    """sized_from_config of the checkpoint's tensors, worked out once per checkpoint and config: a plan that tries
    several decode context parallel sizes sizes Kimi's 278,964 tensors once (about 1.5 s a time), not at each try."""
    kept = checkpoint.sized_by_config
    if kept is not None and kept[0] is config and kept[1] is hf_quant_config:
        return kept[2]
    sized = sized_from_config(checkpoint.tensors, config, hf_quant_config)
    checkpoint.sized_by_config = (config, hf_quant_config, sized)
    return sized


def gpu_memory(
    params: Params, gpus: list[Gpu], gpus_used: list[Gpu], apps: list[App], host: Host, found: Findings
) -> Optional[int]:
    """The smallest GPU's memory in bytes, None without GPUs; too few GPUs, or memory other processes hold,
    are problems."""
    tp = params['tensor_parallel_size']
    pp = params['pipeline_parallel_size']
    if len(gpus) < tp * pp:
        found.problems.append(
            '%d GPU(s) found, but tensor_parallel_size %d x pipeline_parallel_size %d needs %d'
            % (len(gpus), tp, pp, tp * pp)
        )
    belongs = host.get('belongs') or (lambda pid: False)
    for gpu in gpus_used:
        check_gpu_holders(gpu, apps, belongs, host.get('name'), params['gpu_memory_utilization'], found)
    return min(g['memory_total_mib'] for g in gpus_used) * MIB if gpus_used else None


def check_gpu_holders(
    gpu: Gpu,
    apps: list[App],
    belongs: Callable[[int], bool],
    name_of: Optional[Callable[[int], Optional[str]]],
    util: float,
    found: Findings,
) -> None:
    """Whether one GPU has the memory vLLM asks for; what our own service holds counts as free."""
    mine = [a for a in apps if a['gpu_uuid'] == gpu.get('uuid') and belongs(a['pid'])]
    foreign = [a for a in apps if a['gpu_uuid'] == gpu.get('uuid') and not belongs(a['pid'])]
    own_mib = sum(a['used_memory_mib'] or 0 for a in mine)
    free = (gpu['memory_total_mib'] - gpu.get('memory_used_mib', 0) + own_mib) * MIB
    requested = int(math.ceil(gpu['memory_total_mib'] * MIB * util))
    if foreign:
        who = ', '.join(
            'PID %d (%s, %s MiB)'
            % (
                a['pid'],
                (name_of and name_of(a['pid'])) or a['process_name'],
                a['used_memory_mib'] if a['used_memory_mib'] is not None else '?',
            )
            for a in foreign
        )
        text = 'GPU %s (%s) memory is held by %s' % (gpu['index'], gpu['name'], who)
        if free < requested:
            found.problems.append(
                '%s: %s GiB free, vLLM needs %s GiB at gpu_memory_utilization %s; stop them '
                '(stale vLLM workers?)' % (text, gib(free), gib(requested), util)
            )
        else:
            found.warnings.append(text)
    elif free < requested:
        found.problems.append(
            'GPU %s (%s) has %s GiB free, vLLM needs %s GiB at gpu_memory_utilization %s'
            % (gpu['index'], gpu['name'], gib(free), gib(requested), util)
        )


def size_kv_cache(memory: Memory, found: Findings) -> None:
    """The KV-cache budget per GPU and the tokens it holds: kv_cache_memory_bytes as given, else what
    gpu_memory_utilization leaves beside the weights and the reserve."""
    util = memory.utilization
    if memory.explicit is not None:
        memory.budget = memory.explicit
        if memory.total is not None and memory.weights + memory.reserve + memory.budget > memory.total:
            found.warnings.append(
                "weights (%s GiB) + reserve (%s GiB) + kv_cache_memory_bytes (%s GiB) exceed the GPU's "
                '%s GiB: expect out-of-memory'
                % (gib(memory.weights), gib(memory.reserve), gib(memory.budget), gib(memory.total))
            )
    elif memory.total is not None:
        memory.budget = int(math.ceil(memory.total * util)) - memory.weights - memory.reserve
        if memory.budget <= 0:
            found.problems.append(
                'No available memory for the cache blocks: weights (%s GiB per GPU) + reserve (%s GiB) '
                'exceed %s GiB at gpu_memory_utilization %s'
                % (gib(memory.weights), gib(memory.reserve), gib(memory.total * util), util)
            )
            least = utilization_for(memory.per_token * memory.block, memory.weights, memory.reserve, memory.total)
            if least <= 1.0:
                found.remedies.append('set gpu_memory_utilization to at least %.2f' % least)
            found.remedies.append('spread the model over more GPUs (tensor_parallel_size x pipeline_parallel_size)')
    memory.tokens = tokens_for(memory.budget, memory.per_token, memory.block) * memory.dcp
    if memory.tokens == 0 and (memory.explicit is not None or memory.budget > 0):
        # Without this, a budget short of one block would "fit" a context of 0 tokens.
        found.problems.append(
            'No context length fits: the KV cache budget of %d bytes per GPU holds not one block of '
            '%d tokens (%d bytes)' % (memory.budget, memory.block, memory.per_token * memory.block)
        )


def choose_context_length(params: Params, config: Config, memory: Memory, found: Findings) -> tuple[int, int, bool]:
    """(the longest context that fits, the max_model_len to start vLLM with, whether the requested one fits)."""
    model_max = derived_max_model_len(config)
    fit = memory.tokens if model_max is None else min(memory.tokens, model_max)
    requested = params.get('max_model_len')
    if requested in AUTO_MAX_MODEL_LEN:
        if model_max is not None and fit < model_max:
            found.warnings.append("max_model_len auto: %d tokens fit, below the model's %d" % (fit, model_max))
        return fit, fit, fit > 0
    requested = int(requested)
    if model_max is not None and requested > model_max:
        found.problems.append(
            "max_model_len %d is greater than the model's derived maximum %d (max_position_embeddings "
            'in config.json)' % (requested, model_max)
        )
        # Where no length fits the KV cache (fit 0), the problems say why; the model's maximum is the bound.
        found.remedies.append(
            'set max_model_len to %d or less' % min(model_max, fit)
            if fit > 0
            else "set max_model_len to the model's derived maximum %d or less, once the KV cache holds a block"
            % model_max
        )
    needed = memory.bytes_for(requested)
    if needed <= memory.budget or memory.tokens == 0:
        return fit, requested, True
    remedy_misfit(requested, needed, fit, memory, found)
    message = misfit_message(requested, needed, memory.budget, fit).strip()
    if params.get('fail_on_misfit', True):
        found.problems.append(message)
        return fit, requested, False
    # The role starts vLLM with the length that fits instead.
    found.warnings.append(message + ' Using max_model_len %d.' % fit)
    return fit, fit, False


def remedy_misfit(requested: int, needed: int, fit: int, memory: Memory, found: Findings) -> None:
    """What would make a requested context length of needed KV-cache bytes fit."""
    if fit > 0:
        found.remedies.append(
            'set max_model_len to %d (fits at gpu_memory_utilization %s)' % (fit, memory.utilization)
            if memory.explicit is None
            else 'set max_model_len to %d (fits in kv_cache_memory_bytes %d)' % (fit, memory.explicit)
        )
    if memory.explicit is not None:
        found.remedies.append('set kv_cache_memory_bytes to at least %d (fits max_model_len %d)' % (needed, requested))
    elif memory.total is not None:
        util = utilization_for(needed, memory.weights, memory.reserve, memory.total)
        if util <= 0.99:
            found.remedies.append('set gpu_memory_utilization to %.2f (fits max_model_len %d)' % (util, requested))
        else:
            short = needed + memory.weights + memory.reserve - int(memory.total * 0.99)
            found.remedies.append(
                'no gpu_memory_utilization fits max_model_len %d: it needs %s GiB more per GPU; '
                'use more GPUs or an fp8 KV cache' % (requested, gib(short))
            )


def check_host(params: Params, host: Host, found: Findings) -> None:
    """/dev/shm large enough, the port free: what else breaks a start."""
    shm_path = params.get('shm_path') or DEFAULT_SHM_PATH
    if params.get('shm_min_bytes') and host.get('shm'):
        size = host['shm'](shm_path)
        if size is None:
            found.problems.append('%s does not exist: NCCL and vLLM need shared memory' % params.get('shm_path'))
        elif size < params['shm_min_bytes']:
            found.problems.append(
                "%s is %s GiB, smaller than shm_min_bytes (%s GiB): NCCL and vLLM's shared-memory "
                'queues need more' % (params.get('shm_path'), gib(size), gib(params['shm_min_bytes']))
            )
            found.remedies.append(
                'enlarge %s (mount -o remount,size=... or docker --shm-size / --ipc=host)' % params.get('shm_path')
            )
    if params.get('port') and host.get('port'):
        conflict = host['port'](params.get('host') or '127.0.0.1', params['port'])
        if conflict:
            found.problems.append(conflict)


def check_nvidia_devices(params: Params, gpus_used: list[Gpu], host: Host, found: Findings) -> None:
    """/dev/nvidia-uvm present (a problem when not), persistence mode on (a warning when not).

    Only nvidia-smi's GPUs are judged: the gpus option plans for hardware not at hand, and host['device'] is
    given only where the devices are this host's.
    """
    dev_path = params.get('dev_path') or DEFAULT_DEV_PATH
    if host.get('device') and not host['device'](dev_path, 'nvidia-uvm'):
        uvm = dev_path.rstrip('/') + '/nvidia-uvm'
        found.problems.append(
            '%s does not exist: CUDA needs the nvidia_uvm kernel module and its device node, and the service '
            '(NoNewPrivileges, no capabilities) cannot create them' % uvm
        )
        found.remedies.append(
            'run nvidia-modprobe -u -c=0 as root, or load the nvidia_uvm module (modprobe nvidia_uvm, and list '
            'it in /etc/modules-load.d to have it at boot)'
        )
    off = [g for g in gpus_used if g.get('persistence_mode') == 'Disabled']
    if off:
        found.warnings.append(
            'persistence mode is off on GPU %s: the driver tears a GPU down whenever no process holds it and sets '
            'it up again at the next start, which slows every start; enable nvidia-persistenced (or '
            'nvidia-smi -pm 1)' % ', '.join(str(g.get('index')) for g in off)
        )
