# -*- coding: utf-8 -*-
# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Will this model fit these GPUs, and with how much context: vLLM's arithmetic, ahead of time.

PRIVATE to the collection: this is not a public API; it may change without notice.

Everything here is pure (no Ansible): the module feeds it nvidia-smi's output, the
checkpoint's headers and the host's facts, and gets back the plan.
"""

from __future__ import absolute_import, division, print_function
__metaclass__ = type

import errno
import json
import math
import os
import re
import socket

from ansible_collections.llmserve.vllm.plugins.module_utils._checkpoint import (
    CONFIG_NAME,
    is_mla,
    kv_dtype_bytes,
    model_dtype,
    text_config,
)
from ansible_collections.llmserve.vllm.plugins.module_utils._command import CommandTimeout

GIB = 1024 ** 3
MIB = 1024 ** 2

# Activations, non-torch memory and CUDA graphs per GPU, outside the weights and the KV
# cache. vLLM measures these in determine_available_memory (v1/worker/gpu_worker.py):
# the transient peak of a profile run at max_num_batched_tokens (8192 for `vllm serve`
# on GPUs of 70 GiB or more, engine/arg_utils.py), which includes the sampler's dummy
# run over max_num_seqs (1024 there) x vocabulary float32 logits (1024 x 163840 x 4 B =
# 0.63 GiB per copy for Kimi-K2.5); non-torch memory grown since start (NCCL and custom
# all-reduce buffers, cuBLAS workspaces: about 0.5-1 GiB at TP 8); and, since
# VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS defaults to 1, the CUDA-graph pool estimate
# (1-2 GiB for a 61-layer model). That sums to about 4-6 GiB; 5 GiB is the default.
DEFAULT_RESERVE_BYTES = 5 * GIB

# NCCL's shared-memory transport and vLLM's shared-memory message queues need /dev/shm
# space per rank pair: 8 ranks = 56 directed pairs x a few MiB of NCCL buffers each,
# plus vLLM's broadcast queues and PyTorch's tensor passing between worker processes.
# Docker's default 64 MiB /dev/shm is known to break NCCL; 1 GiB is ample for TP 8.
DEFAULT_SHM_MIN_BYTES = 1 * GIB

DEFAULT_BLOCK_SIZE = 16

# Config fields are int64 in vLLM (torch); larger ones are corrupt and would overflow the float arithmetic.
MAX_CONFIG_INT = 2 ** 63 - 1

NVIDIA_SMI_GPU_FIELDS = 'index,name,memory.total,memory.used,compute_cap,driver_version,uuid'
NVIDIA_SMI_APP_FIELDS = 'pid,process_name,used_memory,gpu_uuid'
# Larger figures are no GPU's (2**43 MiB is 8 EiB) and would overflow the float arithmetic of the plan.
MAX_SMI_NUMBER = 2 ** 43

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
_LAYER = re.compile(r'(?:^|\.)layers\.(\d+)\.')
_EMBED = re.compile(r'embed_tokens\.|(?:^|\.)wte\.')
_SKIP = re.compile(r'rotary_emb\.inv_freq$')


class PreflightError(Exception):
    """The preflight cannot answer (nvidia-smi missing, malformed input); the message says why."""


def config_int(config, key, minimum=1, maximum=MAX_CONFIG_INT, missing=None):
    """The integer field key of the language model's config (text_config of a multimodal one), or missing when
    absent or null. Anything but a JSON integer from minimum to maximum raises PreflightError naming the field."""
    value = text_config(config).get(key)
    if value is None:
        return missing
    return checked_int(value, config_field(config, key), minimum, maximum)


def checked_int(value, field, minimum=1, maximum=MAX_CONFIG_INT):
    """value, the config.json field named field, when it is a JSON integer from minimum to maximum."""
    # JSON true is no layer count, though bool is an int in Python.
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if not is_int or not minimum <= value <= maximum:
        bound = 'at most %d' % maximum if is_int and value > maximum else 'at least %d' % minimum
        raise PreflightError('%s: %s is %s, where an integer of %s was expected'
                             % (CONFIG_NAME, field, json.dumps(value)[:500], bound))
    return value


def config_field(config, key):
    """How a message names the field key: text_config.key where the language model's config is text_config."""
    return key if text_config(config) is config else 'text_config.' + key


def _number(text):
    """The integer nvidia-smi printed, or None for "[N/A]" and anything else that is no finite number."""
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if math.isfinite(value) else None


def _int(text, what, line, minimum=0):
    value = _number(text)
    if value is None:
        raise PreflightError('nvidia-smi printed %s %r where a number was expected, in line: %s' % (what, text, line))
    if not minimum <= value <= MAX_SMI_NUMBER:
        bound = 'at least %d' % minimum if value < minimum else 'at most %d' % MAX_SMI_NUMBER
        raise PreflightError('nvidia-smi printed %s %r where a number of %s was expected, in line: %s' % (what, text, bound, line))
    return value


def parse_gpus(text):
    """nvidia-smi --query-gpu=NVIDIA_SMI_GPU_FIELDS --format=csv,noheader,nounits -> list of dicts."""
    gpus = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        cols = [c.strip() for c in line.split(',')]
        if len(cols) != 7:
            raise PreflightError('nvidia-smi printed %d fields where 7 (%s) were expected, in line: %s'
                                 % (len(cols), NVIDIA_SMI_GPU_FIELDS, line))
        gpus.append({
            'index': _int(cols[0], 'index', line),
            'name': cols[1],
            'memory_total_mib': _int(cols[2], 'memory.total', line, minimum=1),
            'memory_used_mib': _int(cols[3], 'memory.used', line),
            'compute_capability': cols[4],
            'driver_version': cols[5],
            'uuid': cols[6],
        })
    return gpus


def parse_apps(text):
    """nvidia-smi --query-compute-apps=NVIDIA_SMI_APP_FIELDS --format=csv,noheader,nounits -> list of dicts."""
    apps = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith('No running'):
            continue
        cols = [c.strip() for c in line.split(',')]
        if len(cols) != 4:
            raise PreflightError('nvidia-smi printed %d fields where 4 (%s) were expected, in line: %s'
                                 % (len(cols), NVIDIA_SMI_APP_FIELDS, line))
        used = _number(cols[2])  # None for "[N/A]" or "[Insufficient Permissions]"
        if used is not None and not 0 <= used <= MAX_SMI_NUMBER:
            used = None
        apps.append({'pid': _int(cols[0], 'pid', line), 'process_name': cols[1],
                     'used_memory_mib': used, 'gpu_uuid': cols[3]})
    return apps


def query_nvidia_smi(run, nvidia_smi):
    """Run nvidia-smi twice through run(argv) -> (rc, stdout, stderr), _command.run with a deadline; return (gpus, apps)."""
    results = []
    for query in ('--query-gpu=' + NVIDIA_SMI_GPU_FIELDS, '--query-compute-apps=' + NVIDIA_SMI_APP_FIELDS):
        argv = [nvidia_smi, query, '--format=csv,noheader,nounits']
        try:
            rc, out, err = run(argv)
        except OSError as exc:
            raise PreflightError('cannot run %s: %s (is the NVIDIA driver installed? set nvidia_smi_path)'
                                 % (nvidia_smi, exc.strerror or exc))
        except CommandTimeout as exc:
            raise PreflightError('%s: is the NVIDIA driver hung? (nvidia_smi_timeout sets the deadline)' % exc)
        if rc < 0:
            raise PreflightError('%s was killed by signal %d' % (' '.join(argv), -rc))
        if rc != 0:
            said = (err or '').strip() or (out or '').strip() or 'no output'
            raise PreflightError('%s failed with exit code %d: %s' % (' '.join(argv), rc, said))
        results.append(out)
    return parse_gpus(results[0]), parse_apps(results[1])


# --- weights --------------------------------------------------------------------


def pp_partitions(num_layers, pp):
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


def _ceil_div(a, b):
    return -(-a // b)


def tensor_bytes_per_rank(name, nbytes, tp, num_kv_heads):
    """Bytes of one tensor on one tensor-parallel rank."""
    if nbytes <= 4 or _REPLICATED.search(name):
        return nbytes
    if num_kv_heads and _KV_PROJ.search(name):
        # GQA: ranks share KV heads when there are fewer than TP; each holds ceil(kv/TP).
        return nbytes * _ceil_div(num_kv_heads, tp) // num_kv_heads
    return _ceil_div(nbytes, tp)


def estimated_replicated_bytes(config):
    """Bytes of the replicated tensors of an MLA model, from config.json (the index gives no sizes).

    The q_a/kv_a down-projections (BF16 in NVFP4 and FP8 checkpoints alike) and the
    router gates; norms are negligible.
    """
    if not is_mla(config):
        return 0
    hidden, layers, q_lora, kv_lora, rope, experts, dense = (
        config_int(config, key, minimum=0, missing=0) for key in (
            'hidden_size', 'num_hidden_layers', 'q_lora_rank', 'kv_lora_rank', 'qk_rope_head_dim', 'n_routed_experts',
            'first_k_dense_replace'))
    return layers * hidden * (q_lora + kv_lora + rope) * 2 + max(layers - dense, 0) * experts * hidden * 2


def weights_per_gpu(tensors, total_bytes, config, tp, pp):
    """The most weight bytes any one GPU holds under tensor x pipeline parallelism.

    tensors: {name: bytes or None (size unknown: index only)}. Tensors of layers at or
    past num_hidden_layers (DeepSeek's MTP layer) are not loaded by vLLM and not
    counted. Returns (bytes, estimated) where estimated says sizes were missing.
    """
    num_layers = config_int(config, 'num_hidden_layers', missing=0)
    kv_heads = None if is_mla(config) else (config_int(config, 'num_key_value_heads')
                                            or config_int(config, 'num_attention_heads'))
    if pp == 1:
        return _weights_one_stage(tensors, total_bytes, config, tp, num_layers, kv_heads)
    stages = pp_partitions(num_layers, pp) if num_layers and pp > 1 else [(0, num_layers or 10 ** 9)]
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
        # Hot loop (280,000 tensors for Kimi-K2.5): string operations, a regex only off the expert path.
        layer = None
        at = name.find('layers.')
        if at >= 0 and (at == 0 or name[at - 1] == '.') and not name.startswith(_VISION):
            digits = name[at + 7:name.find('.', at + 7)]
            if digits.isdigit():
                layer = int(digits)
        if layer is not None:
            if num_layers and layer >= num_layers:
                continue  # DeepSeek's MTP layer: vLLM does not load it
            stage = stage_of.get(layer, last)
        elif _EMBED.search(name) or last == 0:
            stage = 0
        elif name.startswith('lm_head') or '.lm_head.' in name or name.endswith('norm.weight'):
            stage = last
        else:
            stage = 0
        if nbytes <= 4:
            per_stage[stage] += nbytes
        elif '.experts.' in name:
            per_stage[stage] += -(-nbytes // tp)  # routed experts are sharded over the TP ranks
        elif not _SKIP.search(name):
            per_stage[stage] += tensor_bytes_per_rank(name, nbytes, tp, kv_heads)
    unknown = max(total_bytes - known, 0)
    estimated = unknown > 0
    if estimated:
        replicated = min(estimated_replicated_bytes(config), unknown) if known == 0 else 0
        extra = _ceil_div(unknown - replicated, tp * pp) + _ceil_div(replicated, pp)
        per_stage = [b + extra for b in per_stage]
    return max(per_stage), estimated


def _weights_one_stage(tensors, total_bytes, config, tp, num_layers, kv_heads):
    """weights_per_gpu without pipeline parallelism: the hot path, string tests only."""
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
        if nbytes <= 4:
            per_gpu += nbytes
        elif '.experts.' in name:
            per_gpu += -(-nbytes // tp)  # routed experts are sharded over the TP ranks
        elif not _SKIP.search(name):
            per_gpu += tensor_bytes_per_rank(name, nbytes, tp, kv_heads)
    unknown = max(total_bytes - known, 0)
    if unknown:
        replicated = min(estimated_replicated_bytes(config), unknown) if known == 0 else 0
        per_gpu += _ceil_div(unknown - replicated, tp) + replicated
    return per_gpu, unknown > 0


# --- KV cache --------------------------------------------------------------------


def kv_bytes_per_token(config, dtype_bytes, tp):
    """KV-cache bytes one token takes on one GPU, and the attention kind.

    MLA caches one latent (kv_lora_rank + qk_rope_head_dim) per layer, on every rank
    (vLLM's MLAAttention: num_kv_heads = 1, head_size = kv_lora_rank + rope); standard
    and grouped-query attention split KV heads across ranks, each holding ceil(kv/TP).
    DeepSeek configs carry head_dim and num_key_value_heads too: MLA wins.
    """
    def required(key):
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
        raise PreflightError('%s lacks num_attention_heads/num_key_value_heads/head_dim: cannot size the KV cache' % CONFIG_NAME)
    return 2 * _ceil_div(kv, tp) * head_dim * dtype_bytes * layers, 'standard'


def derived_max_model_len(config):
    """The longest context the model's config allows (vLLM's derived max_model_len, simplified)."""
    for key in ('max_position_embeddings', 'n_positions', 'max_seq_len', 'seq_length', 'max_sequence_length'):
        value = config_int(config, key)
        if value is None and config.get(key) is not None:
            value = checked_int(config[key], key)
        if value is not None:
            return value
    return None


def tokens_for(budget, per_token, block_size):
    """Tokens a KV budget holds, in whole blocks (vLLM allocates num_blocks = budget // page bytes)."""
    if budget <= 0 or per_token <= 0:
        return 0
    return (budget // (per_token * block_size)) * block_size


def gib(n):
    return '%.2f' % (n / float(GIB))


def misfit_message(max_model_len, needed, available, fit):
    """vLLM's own words (kv_cache_utils._check_enough_kv_cache_memory)."""
    msg = ("To serve at least one request with the model's max seq len (%d), (%s GiB KV cache is needed, "
           "which is larger than the available KV cache memory (%s GiB). " % (max_model_len, gib(needed), gib(available)))
    if fit > 0:
        msg += 'Based on the available memory, the estimated maximum model length is %d. ' % fit
    return msg


def utilization_for(needed_kv, weights, reserve, total):
    """Smallest gpu_memory_utilization (in hundredths, rounded up) that leaves needed_kv for the cache."""
    need = needed_kv + weights + reserve
    return _ceil_div(need * 100, total) / 100.0


# --- host checks ----------------------------------------------------------------


def read_proc(path):
    """The text of a /proc file, or None when it cannot be read; bytes that are not UTF-8 (a process may give
    itself any name) are replaced, so that they can be returned as JSON."""
    try:
        with open(path, 'rb') as f:
            return f.read().decode('utf-8', 'replace')
    except (IOError, OSError):
        return None


def proc_cgroup(pid, proc='/proc'):
    return read_proc(os.path.join(proc, str(pid), 'cgroup')) or ''


def belongs_to_service(pid, service_name, proc='/proc'):
    """Whether pid runs in the systemd unit service_name (its cgroup path names the unit)."""
    if not service_name:
        return False
    unit = service_name if '.' in service_name else service_name + '.service'
    for line in proc_cgroup(pid, proc).splitlines():
        path = line.split(':', 2)[-1].strip()
        if path.endswith('/' + unit) or ('/' + unit + '/') in path:
            return True
    return False


def listening_inodes(port, proc='/proc'):
    """Inodes of TCP sockets listening on port (any local address), from /proc/net/tcp{,6}."""
    inodes = set()
    found_table = False
    for table in ('tcp', 'tcp6'):
        text = read_proc(os.path.join(proc, 'net', table))
        if text is None:
            continue
        found_table = True
        for line in text.splitlines()[1:]:
            cols = line.split()
            if len(cols) < 10 or cols[3] != '0A':
                continue
            if int(cols[1].rsplit(':', 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes if found_table else None


def socket_owners(inodes, proc='/proc'):
    """PIDs whose file descriptors hold one of these socket inodes."""
    wanted = set('socket:[%s]' % i for i in inodes)
    owners = set()
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return owners
    for pid in pids:
        fd_dir = os.path.join(proc, pid, 'fd')
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(os.path.join(fd_dir, fd)) in wanted:
                    owners.add(int(pid))
                    break
            except OSError:
                continue
    return owners


def process_name(pid, proc='/proc'):
    """The command name of pid, or None when it cannot be read (another PID namespace, gone)."""
    name = read_proc(os.path.join(proc, str(pid), 'comm'))
    return name.strip() if name is not None else None


def port_conflict(host, port, service_name, proc='/proc'):
    """None if host:port is free (or held by our own service), else a problem string."""
    inodes = listening_inodes(port, proc)
    if inodes is None:
        # No /proc/net: try to connect.
        s = socket.socket(socket.AF_INET6 if ':' in host else socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(1.0)
        try:
            s.connect((host, port))
        except (socket.error, OSError):
            return None
        finally:
            s.close()
        return 'port %d on %s is already in use by another process' % (port, host)
    if not inodes:
        return None
    owners = socket_owners(inodes, proc)
    if owners and all(belongs_to_service(p, service_name, proc) for p in owners):
        return None
    if owners:
        who = ', '.join('PID %d (%s)' % (p, process_name(p, proc) or '?') for p in sorted(owners))
        return 'port %d is already in use by %s' % (port, who)
    return 'port %d is already in use by another process' % port


def shm_size(path):
    """Total bytes of the filesystem at path (tmpfs /dev/shm)."""
    try:
        st = os.statvfs(path)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        raise PreflightError('cannot read the size of %s: %s' % (path, exc.strerror or exc))
    return st.f_blocks * st.f_frsize


# --- the plan ----------------------------------------------------------------------


def plan(params, config, checkpoint, gpus, apps, dtype_info, host=None):
    """Compute the whole preflight answer.

    params: the module's options (dict). config: config.json. checkpoint: a
    _safetensors.Checkpoint or None when weights_bytes_per_gpu is given. gpus/apps:
    parsed nvidia-smi (or the gpus option; apps []). dtype_info: resolve_kv_cache_dtype's (dtype, source, warning).
    host: optional callables for host facts {'belongs': f(pid), 'name': f(pid),
    'shm': f(path), 'port': f(host, port)}.
    Returns the result dict (without changed).
    """
    host = host or {}
    tp = params['tensor_parallel_size']
    pp = params['pipeline_parallel_size']
    util = params['gpu_memory_utilization']
    block = params.get('block_size') or DEFAULT_BLOCK_SIZE
    cpu = params.get('accelerator') == 'cpu'
    warnings = []
    problems = []
    remedies = []

    resolved, source, note = dtype_info
    attention = 'mla' if is_mla(config) else 'standard'
    gpus_used = gpus[:tp * pp]
    majors = [str(g.get('compute_capability', '')).split('.', 1)[0] for g in gpus_used]
    policy = params.get('fp8_kv_cache_policy') or 'auto'
    fp8_from_checkpoint = resolved.startswith('fp8') and params.get('kv_cache_dtype') == 'auto'
    strip = not cpu and attention == 'mla' and fp8_from_checkpoint and '12' in majors
    stripped = fp8_from_checkpoint and (policy == 'strip' or (policy == 'auto' and strip))
    if note:
        warnings.append(note)
    if stripped:
        planned = model_dtype(config)
        if strip:
            warnings.append('the checkpoint asks for an %s KV cache, which vLLM cannot use with MLA on compute capability 12.x: '
                            'it must be stripped (strip_fp8_kv_cache); planned with %s' % (resolved, planned))
        resolved = planned
        reason = 'for MLA on compute capability 12.x' if strip else '(fp8_kv_cache_policy strip)'
        source = '%s; stripped %s, so %s' % (source, reason, planned)
    elif not cpu and attention == 'mla' and resolved.startswith('fp8') and '12' in majors:
        warnings.append('kv_cache_dtype %s with MLA on compute capability 12.x needs a vLLM whose Triton MLA backend '
                        'supports an FP8 KV cache' % resolved)
    dtype_bytes = kv_dtype_bytes(resolved)
    if dtype_bytes is None:
        raise PreflightError('kv_cache_dtype %s: its size per element is not known to the preflight' % resolved)

    per_token, attention = kv_bytes_per_token(config, dtype_bytes, tp)
    layers = config_int(config, 'num_hidden_layers')
    if pp > layers:
        raise PreflightError('pipeline_parallel_size %d exceeds the %d layers of the model (%s in %s): a pipeline stage '
                             'would hold no layer' % (pp, layers, config_field(config, 'num_hidden_layers'), CONFIG_NAME))

    # Weights.
    if params.get('weights_bytes_per_gpu') is not None or checkpoint is None:
        w_gpu = params.get('weights_bytes_per_gpu') or 0
        w_total = checkpoint.total_bytes if checkpoint is not None else w_gpu * tp * pp
    else:
        w_total = checkpoint.total_bytes
        w_gpu, estimated = weights_per_gpu(checkpoint.tensors, checkpoint.total_bytes, config, tp, pp)
        if estimated:
            warnings.append('per-GPU weights estimated from %s without per-tensor sizes (%s); '
                            'set weights_bytes_per_gpu from vLLM\'s "Model loading took" for an exact plan'
                            % ('model.safetensors.index.json' if checkpoint.source == 'index' else 'an incomplete checkpoint',
                               'shards not downloaded' if checkpoint.source == 'index' else 'shards missing or broken'))
    if checkpoint is not None:
        problems.extend(checkpoint.problems)

    reserve = params.get('reserve_bytes_per_gpu')
    if reserve is None:
        reserve = 0 if cpu else DEFAULT_RESERVE_BYTES

    # GPUs.
    total = None
    if not cpu:
        if len(gpus) < tp * pp:
            problems.append('%d GPU(s) found, but tensor_parallel_size %d x pipeline_parallel_size %d needs %d'
                            % (len(gpus), tp, pp, tp * pp))
        if gpus_used:
            total = min(g['memory_total_mib'] for g in gpus_used) * MIB
        belongs = host.get('belongs') or (lambda pid: False)
        pname = host.get('name')
        for g in gpus_used:
            mine = [a for a in apps if a['gpu_uuid'] == g.get('uuid') and belongs(a['pid'])]
            foreign = [a for a in apps if a['gpu_uuid'] == g.get('uuid') and not belongs(a['pid'])]
            own_mib = sum(a['used_memory_mib'] or 0 for a in mine)
            free = (g['memory_total_mib'] - g.get('memory_used_mib', 0) + own_mib) * MIB
            requested = int(math.ceil(g['memory_total_mib'] * MIB * util))
            if foreign:
                who = ', '.join(
                    'PID %d (%s, %s MiB)' % (a['pid'], (pname and pname(a['pid'])) or a['process_name'],
                                             a['used_memory_mib'] if a['used_memory_mib'] is not None else '?')
                    for a in foreign)
                text = 'GPU %s (%s) memory is held by %s' % (g['index'], g['name'], who)
                if free < requested:
                    problems.append('%s: %s GiB free, vLLM needs %s GiB at gpu_memory_utilization %s; stop them (stale vLLM workers?)'
                                    % (text, gib(free), gib(requested), util))
                else:
                    warnings.append(text)
            elif free < requested:
                problems.append('GPU %s (%s) has %s GiB free, vLLM needs %s GiB at gpu_memory_utilization %s'
                                % (g['index'], g['name'], gib(free), gib(requested), util))

    # KV budget.
    explicit = params.get('kv_cache_memory_bytes')
    if explicit is not None:
        budget = explicit
        if total is not None and w_gpu + reserve + budget > total:
            warnings.append('weights (%s GiB) + reserve (%s GiB) + kv_cache_memory_bytes (%s GiB) exceed the GPU\'s %s GiB: '
                            'expect out-of-memory' % (gib(w_gpu), gib(reserve), gib(budget), gib(total)))
    elif total is not None:
        budget = int(math.ceil(total * util)) - w_gpu - reserve
    else:
        budget = 0
    if explicit is None and total is not None and budget <= 0:
        problems.append('No available memory for the cache blocks: weights (%s GiB per GPU) + reserve (%s GiB) exceed '
                        '%s GiB at gpu_memory_utilization %s' % (gib(w_gpu), gib(reserve), gib(total * util), util))
        u = utilization_for(per_token * block, w_gpu, reserve, total)
        if u <= 1.0:
            remedies.append('set gpu_memory_utilization to at least %.2f' % u)
        remedies.append('spread the model over more GPUs (tensor_parallel_size x pipeline_parallel_size)')
    tokens = tokens_for(budget, per_token, block)
    if tokens == 0 and (explicit is not None or budget > 0):
        # Without this, a budget short of one block would "fit" a context of 0 tokens.
        problems.append('No context length fits: the KV cache budget of %d bytes per GPU holds not one block of %d tokens '
                        '(%d bytes)' % (budget, block, per_token * block))

    # Context length.
    model_max = derived_max_model_len(config)
    fit = tokens if model_max is None else min(tokens, model_max)
    requested_len = params.get('max_model_len')
    requested_fits = fit > 0
    if requested_len in (None, 'auto', -1, '-1'):
        chosen = fit
        if fit < (model_max or 0):
            warnings.append('max_model_len auto: %d tokens fit, below the model\'s %d' % (fit, model_max))
    else:
        requested_len = int(requested_len)
        chosen = requested_len
        requested_fits = True
        if model_max is not None and requested_len > model_max:
            problems.append('max_model_len %d is greater than the model\'s derived maximum %d (max_position_embeddings in config.json)'
                            % (requested_len, model_max))
            remedies.append('set max_model_len to %d or less' % min(model_max, fit))
        needed = _ceil_div(requested_len, block) * block * per_token
        if needed > budget and tokens > 0:
            requested_fits = False
            msg = misfit_message(requested_len, needed, budget, fit).strip()
            if fit > 0:
                remedies.append('set max_model_len to %d (fits at gpu_memory_utilization %s)' % (fit, util) if explicit is None
                                else 'set max_model_len to %d (fits in kv_cache_memory_bytes %d)' % (fit, explicit))
            if explicit is not None:
                remedies.append('set kv_cache_memory_bytes to at least %d (fits max_model_len %d)' % (needed, requested_len))
            elif total is not None:
                u = utilization_for(needed, w_gpu, reserve, total)
                if u <= 0.99:
                    remedies.append('set gpu_memory_utilization to %.2f (fits max_model_len %d)' % (u, requested_len))
                else:
                    remedies.append('no gpu_memory_utilization fits max_model_len %d: it needs %s GiB more per GPU; '
                                    'use more GPUs or an fp8 KV cache'
                                    % (requested_len, gib(needed + w_gpu + reserve - int(total * 0.99))))
            if params.get('fail_on_misfit', True):
                problems.append(msg)
            else:
                # The role starts vLLM with the length that fits instead.
                chosen = fit
                warnings.append(msg + ' Using max_model_len %d.' % fit)

    if cpu and explicit is None:
        problems.append('accelerator cpu needs kv_cache_memory_bytes')

    # Host.
    if params.get('shm_min_bytes') and host.get('shm'):
        size = host['shm'](params.get('shm_path') or '/dev/shm')
        if size is None:
            problems.append('%s does not exist: NCCL and vLLM need shared memory' % params.get('shm_path'))
        elif size < params['shm_min_bytes']:
            problems.append('%s is %s GiB, smaller than shm_min_bytes (%s GiB): NCCL and vLLM\'s shared-memory queues need more'
                            % (params.get('shm_path'), gib(size), gib(params['shm_min_bytes'])))
            remedies.append('enlarge %s (mount -o remount,size=... or docker --shm-size / --ipc=host)' % params.get('shm_path'))
    if params.get('port') and host.get('port'):
        conflict = host['port'](params.get('host') or '127.0.0.1', params['port'])
        if conflict:
            problems.append(conflict)

    fits = bool(requested_fits and budget > 0 and not problems)
    return {
        'gpus': gpus_used if not cpu else [],
        'weights_bytes_total': w_total,
        'weights_bytes_per_gpu': w_gpu,
        'reserve_bytes_per_gpu': reserve,
        'kv_cache_dtype': resolved,
        'kv_cache_dtype_source': source,
        'attention': attention,
        'kv_cache_bytes_per_token': per_token,
        'kv_cache_bytes': max(budget, 0),
        'kv_cache_tokens': tokens,
        'max_model_len_fit': fit,
        'max_model_len': chosen,
        'fits': fits,
        'strip_fp8_kv_cache': bool(strip),
        'fp8_kv_cache_stripped': bool(stripped),
        'problems': problems,
        'remedies': remedies,
        'warnings': warnings,
    }
