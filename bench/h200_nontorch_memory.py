# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""GPU memory that PyTorch's allocator does not see, measured the way vLLM accounts it.

vLLM's worker (vllm/utils/mem_utils.py, MemorySnapshot) calls GPU memory that is in use
but not reserved by PyTorch's caching allocator 'non-torch memory':

    non_torch = (total - free from torch.cuda.mem_get_info()) - torch.cuda.memory_reserved()

and takes it after gc.collect() and torch.cuda.empty_cache(). This script takes the same
snapshot (plus NVML's and nvidia-smi's memory.used) at each step of a fresh process, and
reports what each step adds:

  TP 1 (one process on GPU 0, no NCCL):
    - the CUDA context (torch.cuda.init), then a first tiny tensor;
    - the first bf16 matmul (cuBLAS handle and workspace), the first bf16 linear with
      bias (cuBLASLt), the first fp8 torch._scaled_mm (if it runs), a larger bf16
      matmul, the first scaled_dot_product_attention;
    - CUDA graphs: one graph of 2000 kernel nodes, then 50 graphs of 20 nodes.
  TP 2 (two processes, one per GPU, torch.distributed with the nccl backend), for each
  NCCL environment variant (NCCL's defaults; NCCL_CUMEM_ENABLE=0; NCCL_PROTO=LL;
  NCCL_P2P_LEVEL=SYS):
    - init_process_group(device_id=...) (eager communicator), a first small and a first
      large bf16 all_reduce, a second communicator (new_group) with its first
      all_reduces, destroy_process_group.

Each measured process starts bare (multiprocessing 'spawn'), and the parent never
creates a CUDA context, so device-wide readings hold only what the measured processes
add. NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 are forced in every process).

Needs PyTorch with CUDA and an NVIDIA GPU (two for the TP 2 part); without them it stops
with exit status 2 and says why. vLLM is not needed. Prints a table and writes JSON:

    python3 bench/h200_nontorch_memory.py --json OUT.json [--skip-tp2]
        [--variants nccl-default,cumem-off,proto-ll,p2p-level-sys]
        [--large-mib 256] [--nccl-debug-dir DIR] [--timeout 240]
"""

import argparse
import datetime
import gc
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
import traceback

GIB = 1024**3
MIB = 1024**2

# Kept on in every process this script starts (the lending workplace's rule, and vLLM's
# own choice for all_reduce inputs).
FORCED_ENV = {
    'NCCL_NVLS_ENABLE': '0',
    'TORCH_SYMM_MEM_DISABLE_MULTICAST': '1',
    'NVSHMEM_DISABLE_NVLS': '1',
    'TORCH_NCCL_AVOID_RECORD_STREAMS': '1',
    'CUDA_DEVICE_ORDER': 'PCI_BUS_ID',
    'PYTORCH_NVML_BASED_CUDA_CHECK': '1',
}

VARIANTS = {
    'nccl-default': {},
    'cumem-off': {'NCCL_CUMEM_ENABLE': '0'},
    'proto-ll': {'NCCL_PROTO': 'LL'},
    'p2p-level-sys': {'NCCL_P2P_LEVEL': 'SYS'},
}

ENV_RECORDED = (
    'CUDA_MODULE_LOADING',
    'CUBLAS_WORKSPACE_CONFIG',
    'CUBLASLT_WORKSPACE_SIZE',
    'PYTORCH_CUDA_ALLOC_CONF',
    'NCCL_CUMEM_ENABLE',
    'NCCL_PROTO',
    'NCCL_P2P_LEVEL',
    'NCCL_BUFFSIZE',
    'NCCL_NCHANNELS_PER_PEER',
    'NCCL_MIN_NCHANNELS',
    'NCCL_MAX_NCHANNELS',
) + tuple(sorted(FORCED_ENV))


class Unavailable(Exception):
    """No CUDA GPU (or no PyTorch) to measure on."""


# --- readings that need no CUDA context ------------------------------------------------


def _nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # noqa: BLE001 - NVML is optional; nvidia-smi is read as well
        return None


def nvml_memory(nvml, index):
    """NVML's memory of one GPU (bytes), without creating a CUDA context."""
    if nvml is None:
        return {}
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    try:
        info = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
        return {
            'nvml_total': int(info.total),
            'nvml_used': int(info.used),
            'nvml_free': int(info.free),
            'nvml_reserved': int(info.reserved),
        }
    except Exception:  # noqa: BLE001 - older bindings: v1 has no 'reserved'
        info = nvml.nvmlDeviceGetMemoryInfo(handle)
        return {'nvml_total': int(info.total), 'nvml_used': int(info.used), 'nvml_free': int(info.free)}


def smi_memory(index):
    """nvidia-smi's memory.used / reserved / total of one GPU, MiB."""
    if not shutil.which('nvidia-smi'):
        return {}
    out = subprocess.run(
        [
            'nvidia-smi',
            '-i',
            str(index),
            '--query-gpu=memory.used,memory.reserved,memory.total',
            '--format=csv,noheader,nounits',
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if out.returncode != 0:
        return {'smi_error': out.stderr.strip()[:200]}
    used, reserved, total = [v.strip() for v in out.stdout.strip().split(',')]
    return {'smi_used_mib': _int_or(used), 'smi_reserved_mib': _int_or(reserved), 'smi_total_mib': _int_or(total)}


def _int_or(text):
    try:
        return int(text)
    except ValueError:
        return text


def smi_text(*args):
    if not shutil.which('nvidia-smi'):
        return None
    out = subprocess.run(['nvidia-smi'] + list(args), capture_output=True, text=True, timeout=60)
    return (out.stdout if out.returncode == 0 else out.stderr).strip()


# --- one snapshot, as vLLM's MemorySnapshot takes it ----------------------------------


def snapshot(name, index, nvml, torch=None, extra=None):
    """Memory readings of GPU `index` after step `name`.

    With `torch` given, the step has a CUDA context: synchronize, gc.collect() and
    torch.cuda.empty_cache() first, as vLLM's memory_profiling does before measuring.
    """
    snap = {'step': name, 'time': time.time()}
    if torch is not None:
        torch.cuda.synchronize(index)
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(index)
        stats = torch.cuda.memory_stats(index)
        reserved = int(torch.cuda.memory_reserved(index))
        snap.update(
            {
                'cuda_free': int(free),
                'cuda_total': int(total),
                'cuda_used': int(total - free),
                'torch_reserved': reserved,
                'torch_allocated': int(stats.get('allocated_bytes.all.current', 0)),
                'torch_peak': int(stats.get('allocated_bytes.all.peak', 0)),
                'non_torch': int(total - free) - reserved,
            }
        )
    snap.update(nvml_memory(nvml, index))
    snap.update(smi_memory(index))
    if extra:
        snap.update(extra)
    return snap


DELTA_KEYS = ('cuda_used', 'torch_reserved', 'torch_allocated', 'non_torch', 'nvml_used')


def delta(before, after):
    """What `after` adds to `before`, per reading (None where either lacks it)."""
    out = {'from': before['step'], 'to': after['step']}
    for key in DELTA_KEYS:
        a, b = after.get(key), before.get(key)
        out[key] = (a - b) if isinstance(a, int) and isinstance(b, int) else None
    su, sb = after.get('smi_used_mib'), before.get('smi_used_mib')
    out['smi_used_mib'] = (su - sb) if isinstance(su, int) and isinstance(sb, int) else None
    return out


def step(stages, name):
    for snap in stages:
        if snap['step'] == name:
            return snap
    return None


# --- TP 1: one process on GPU 0 --------------------------------------------------------


def _apply_env(env):
    for key, value in FORCED_ENV.items():
        os.environ[key] = value
    for key, value in (env or {}).items():
        os.environ[key] = value


def tp1_worker(index, queue):
    """Child process: the steps of TP 1 on GPU `index`; puts {'stages', 'stack', ...}."""
    try:
        _apply_env({})
        nvml = _nvml()
        stages = [snapshot('process start (no CUDA context)', index, nvml)]
        import torch
        import torch.nn.functional as F

        dev = torch.device('cuda', index)

        torch.cuda.set_device(dev)
        torch.cuda.init()
        torch.cuda.synchronize(dev)
        stages.append(snapshot('CUDA context (set_device, init)', index, nvml, torch))

        keep = [torch.zeros(1, device=dev)]
        stages.append(snapshot('first tiny tensor', index, nvml, torch))

        a = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16)
        b = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16)
        keep += [a, b]
        stages.append(snapshot('inputs for matmuls (1024x1024 bf16 x2)', index, nvml, torch))
        c = a @ b
        del c
        stages.append(snapshot('first bf16 matmul (cuBLAS)', index, nvml, torch))

        bias = torch.randn(1024, device=dev, dtype=torch.bfloat16)
        keep.append(bias)
        c = F.linear(a, b, bias)
        del c
        stages.append(snapshot('first bf16 linear+bias (cuBLASLt)', index, nvml, torch))

        fp8 = {'ran': False}
        try:
            a8 = a.to(torch.float8_e4m3fn)
            b8 = b.to(torch.float8_e4m3fn).t()  # column-major second operand
            one = torch.ones((), device=dev, dtype=torch.float32)
            c = torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            del c
            keep += [a8, b8, one]
            fp8['ran'] = True
        except Exception as exc:  # noqa: BLE001 - recorded, not fatal
            fp8['error'] = '%s: %s' % (type(exc).__name__, str(exc)[:300])
        stages.append(snapshot('first fp8 _scaled_mm', index, nvml, torch, {'fp8': fp8}))

        x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        y = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        c = x @ y
        del x, y, c
        stages.append(snapshot('bf16 matmul 8192^3 (larger problem)', index, nvml, torch))

        sdpa = {'ran': False}
        try:
            q = torch.randn(1, 8, 1024, 128, device=dev, dtype=torch.bfloat16)
            o = F.scaled_dot_product_attention(q, q, q, is_causal=True)
            del q, o
            sdpa['ran'] = True
        except Exception as exc:  # noqa: BLE001
            sdpa['error'] = '%s: %s' % (type(exc).__name__, str(exc)[:300])
        stages.append(snapshot('first scaled_dot_product_attention', index, nvml, torch, {'sdpa': sdpa}))

        graphs = []
        static = torch.zeros(4096, device=dev, dtype=torch.float32)
        keep.append(static)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm the kernel up outside capture
            static.add_(1.0)
        torch.cuda.current_stream(dev).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(2000):
                static.add_(1.0)
        g.replay()
        graphs.append(g)
        stages.append(snapshot('CUDA graph: 1 graph x 2000 kernel nodes', index, nvml, torch))
        for _ in range(50):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(20):
                    static.add_(1.0)
            g.replay()
            graphs.append(g)
        stages.append(snapshot('CUDA graphs: +50 graphs x 20 kernel nodes', index, nvml, torch))

        queue.put({'stages': stages, 'stack': torch_stack(torch, index)})
    except Exception:  # noqa: BLE001 - the parent reports it
        queue.put({'error': traceback.format_exc()})


def torch_stack(torch, index):
    props = torch.cuda.get_device_properties(index)
    stack = {
        'torch': torch.__version__,
        'torch_cuda': torch.version.cuda,
        'cudnn': torch.backends.cudnn.version(),
        'gpu_name': props.name,
        'gpu_total_memory_torch': int(props.total_memory),
        'multi_processor_count': props.multi_processor_count,
        'compute_capability': '%d.%d' % (props.major, props.minor),
        'allocator_backend': torch.cuda.get_allocator_backend(),
    }
    for attr in ('uuid', 'pci_bus_id', 'L2_cache_size'):
        if hasattr(props, attr):
            stack['gpu_' + attr.lower()] = str(getattr(props, attr))
    try:
        stack['nccl'] = '.'.join(str(v) for v in torch.cuda.nccl.version())
    except Exception as exc:  # noqa: BLE001
        stack['nccl'] = 'unknown (%s)' % exc
    try:
        stack['preferred_blas_library'] = str(torch.backends.cuda.preferred_blas_library())
    except Exception:  # noqa: BLE001
        pass
    try:
        from importlib import metadata

        for dist in (
            'nvidia-cublas',
            'nvidia-nccl-cu13',
            'nvidia-nccl-cu12',
            'nvidia-cuda-runtime',
            'nvidia-cublas-cu12',
            'triton',
        ):
            try:
                stack['pkg_' + dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                pass
    except ImportError:
        pass
    return stack


# --- TP 2: one process per GPU, NCCL ---------------------------------------------------


def tp2_worker(rank, world, port, env, large_mib, barrier, queue):
    """Child process: rank `rank` of a TP `world` group on GPU `rank`."""
    try:
        _apply_env(env)
        nvml = _nvml()
        stages = []

        def mark(name, torch=None, extra=None):
            if torch is not None:
                torch.cuda.synchronize(rank)
            barrier.wait(timeout=120)  # both ranks have done the step
            stages.append(snapshot(name, rank, nvml, torch, extra))
            barrier.wait(timeout=120)  # both ranks have measured

        mark('process start (no CUDA context)')
        import torch
        import torch.distributed as dist

        dev = torch.device('cuda', rank)
        torch.cuda.set_device(dev)
        torch.cuda.init()
        keep = [torch.zeros(1, device=dev)]
        mark('CUDA context + first tiny tensor', torch)

        dist.init_process_group(
            backend='nccl', init_method='tcp://127.0.0.1:%d' % port, rank=rank, world_size=world, device_id=dev
        )
        mark('init_process_group(nccl, device_id)', torch)

        small = torch.full((1024,), float(rank + 1), device=dev, dtype=torch.bfloat16)
        dist.all_reduce(small)
        want = float(sum(range(1, world + 1)))
        ok_small = bool((small == want).all().item())
        keep.append(small)
        mark('first all_reduce, 1024 bf16 (2 KiB)', torch, {'sum_ok': ok_small})

        n = large_mib * MIB // 2
        large = torch.full((n,), float(rank + 1), device=dev, dtype=torch.bfloat16)
        dist.all_reduce(large)
        ok_large = bool((large == want).all().item())
        del large
        mark('first all_reduce, %d MiB bf16' % large_mib, torch, {'sum_ok': ok_large})

        group = dist.new_group(list(range(world)))
        s2 = torch.ones(1024, device=dev, dtype=torch.bfloat16)
        dist.all_reduce(s2, group=group)
        big2 = torch.ones(n, device=dev, dtype=torch.bfloat16)
        dist.all_reduce(big2, group=group)
        del big2
        keep.append(s2)
        mark('second communicator (new_group) + its first all_reduces', torch)

        dist.destroy_process_group()
        mark('destroy_process_group', torch)

        queue.put({'rank': rank, 'stages': stages, 'env': {k: os.environ.get(k) for k in ENV_RECORDED}})
    except Exception:  # noqa: BLE001 - the parent reports it
        try:
            barrier.abort()
        except Exception:  # noqa: BLE001
            pass
        queue.put({'rank': rank, 'error': traceback.format_exc()})


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def run_children(ctx, targets, timeout):
    """Start (target, args) pairs with a shared queue; return their results."""
    queue = ctx.Queue()
    procs = [ctx.Process(target=t, args=tuple(a) + (queue,)) for t, a in targets]
    for proc in procs:
        proc.start()
    results, deadline = [], time.time() + timeout
    while len(results) < len(procs) and time.time() < deadline:
        try:
            results.append(queue.get(timeout=max(0.1, min(5.0, deadline - time.time()))))
        except Exception:  # noqa: BLE001 - queue.Empty: see whether a child died
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
    for proc in procs:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
    if len(results) < len(procs):
        results.append(
            {
                'error': 'timed out or died: %d of %d children answered; exit codes %s'
                % (len(results), len(procs), [p.exitcode for p in procs])
            }
        )
    return results


# --- summary ---------------------------------------------------------------------------


def summarize_tp1(stages):
    rows = []
    start = step(stages, 'process start (no CUDA context)')
    ctx = step(stages, 'CUDA context (set_device, init)')
    if start and ctx:
        row = {
            'item': 'CUDA context alone',
            'non_torch': ctx.get('non_torch'),
            'nvml_used_before': start.get('nvml_used'),
            'nvml_used_after': ctx.get('nvml_used'),
            'smi_used_mib_before': start.get('smi_used_mib'),
            'smi_used_mib_after': ctx.get('smi_used_mib'),
        }
        if isinstance(start.get('nvml_used'), int) and isinstance(ctx.get('nvml_used'), int):
            row['nvml_used_delta'] = ctx['nvml_used'] - start['nvml_used']
        rows.append(row)
    for prev, cur in zip(stages[1:], stages[2:]):
        d = delta(prev, cur)
        rows.append(
            {
                'item': cur['step'],
                'non_torch': d['non_torch'],
                'cuda_used_delta': d['cuda_used'],
                'torch_allocated_delta': d['torch_allocated'],
                'torch_reserved_delta': d['torch_reserved'],
                'nvml_used_delta': d['nvml_used'],
                'smi_used_mib_delta': d['smi_used_mib'],
            }
        )
    last = stages[-1] if stages else None
    if ctx and last:
        d = delta(ctx, last)
        rows.append(
            {
                'item': 'TP1 total after context (all steps above)',
                'non_torch': d['non_torch'],
                'cuda_used_delta': d['cuda_used'],
                'torch_allocated_delta': d['torch_allocated'],
                'torch_reserved_delta': d['torch_reserved'],
                'nvml_used_delta': d['nvml_used'],
                'smi_used_mib_delta': d['smi_used_mib'],
            }
        )
    return rows


def summarize_tp2(ranks):
    """Per rank: the non-torch memory each NCCL step adds (from the context step)."""
    out = []
    for res in sorted(ranks, key=lambda r: r.get('rank', 99)):
        stages = res.get('stages') or []
        if len(stages) < 2:
            out.append({'rank': res.get('rank'), 'error': res.get('error', 'no stages')})
            continue
        base = stages[1]
        steps = []
        for prev, cur in zip(stages[1:], stages[2:]):
            d = delta(prev, cur)
            steps.append(
                {
                    'item': cur['step'],
                    'non_torch': d['non_torch'],
                    'cuda_used_delta': d['cuda_used'],
                    'torch_reserved_delta': d['torch_reserved'],
                    'nvml_used_delta': d['nvml_used'],
                    'sum_ok': cur.get('sum_ok'),
                }
            )
        large = [s for s in stages if s['step'].startswith('first all_reduce, ') and 'MiB' in s['step']]
        comm1 = large[-1] if large else None
        entry = {'rank': res['rank'], 'context_non_torch': base.get('non_torch'), 'steps': steps}
        if comm1:
            entry['first_communicator_non_torch'] = delta(base, comm1)['non_torch']
        out.append(entry)
    return out


def gib(value):
    return '%.3f' % (value / GIB) if isinstance(value, int) else '-'


def mib(value):
    return '%.1f' % (value / MIB) if isinstance(value, int) else '-'


def render(report):
    lines = []
    stack = report.get('stack', {})
    lines.append(
        'Stack: %s'
        % ', '.join(
            '%s=%s' % (k, stack[k])
            for k in (
                'gpu_name',
                'driver',
                'cuda_driver',
                'torch',
                'torch_cuda',
                'nccl',
                'gpu_total_memory_torch',
                'smi_total_mib',
            )
            if k in stack
        )
    )
    lines.append('')
    lines.append("TP 1 (GPU %s): non-torch = cuda used - torch reserved, vLLM's way" % report.get('tp1', {}).get('gpu'))
    fmt = '  %-52s %14s %9s %9s %10s %10s'
    lines.append(fmt % ('step', 'non-torch B', 'GiB', 'MiB', 'used MiB', 'torchalloc'))
    for row in report.get('tp1', {}).get('summary', []):
        used = row.get('cuda_used_delta', row.get('nvml_used_delta'))
        lines.append(
            fmt
            % (
                row['item'][:52],
                row.get('non_torch'),
                gib(row.get('non_torch')),
                mib(row.get('non_torch')),
                mib(used),
                mib(row.get('torch_allocated_delta')),
            )
        )
    if report.get('tp1', {}).get('error'):
        lines.append('  ERROR: ' + report['tp1']['error'].strip().splitlines()[-1])
    for name, var in (report.get('tp2') or {}).items():
        lines.append('')
        lines.append('TP 2, variant %s %s' % (name, json.dumps(var.get('env_delta', {}))))
        for entry in var.get('summary', []):
            if 'error' in entry:
                lines.append('  rank %s ERROR: %s' % (entry.get('rank'), str(entry['error']).strip().splitlines()[-1]))
                continue
            lines.append(
                '  rank %s: context non-torch %s B (%s GiB); first communicator '
                '(init + first all_reduces) %s B (%s GiB)'
                % (
                    entry['rank'],
                    entry['context_non_torch'],
                    gib(entry['context_non_torch']),
                    entry.get('first_communicator_non_torch'),
                    gib(entry.get('first_communicator_non_torch')),
                )
            )
            for row in entry['steps']:
                lines.append(
                    fmt
                    % (
                        '  ' + row['item'][:50],
                        row['non_torch'],
                        gib(row['non_torch']),
                        mib(row['non_torch']),
                        mib(row['cuda_used_delta']),
                        '' if row.get('sum_ok') is None else ('sum ok' if row['sum_ok'] else 'SUM BAD'),
                    )
                )
        for err in var.get('errors', []):
            lines.append('  ERROR: ' + str(err).strip().splitlines()[-1])
    return '\n'.join(lines)


# --- parent ----------------------------------------------------------------------------


def host_stack():
    stack = {'python': platform.python_version(), 'kernel': platform.release(), 'machine': platform.machine()}
    q = smi_text('--query-gpu=index,name,driver_version,memory.total,pci.bus_id', '--format=csv,noheader')
    if q:
        stack['smi_gpus'] = q.splitlines()
        parts = [p.strip() for p in stack['smi_gpus'][0].split(',')]
        if len(parts) >= 4:
            stack['driver'] = parts[2]
            stack['smi_total_mib'] = _int_or(parts[3].split()[0])
    header = smi_text()
    if header:
        for line in header.splitlines():
            if 'CUDA Version' in line:
                stack['cuda_driver'] = line.split('CUDA Version:')[1].split('|')[0].strip()
    stack['smi_topo'] = smi_text('topo', '-m')
    return stack


def preflight():
    """Stop with a clear message where there is nothing to measure on."""
    try:
        import torch
    except ImportError as exc:
        raise Unavailable('PyTorch is not importable here (%s); run this on a GPU machine' % exc) from None
    if not torch.cuda.is_available():  # NVML-based check: creates no context
        raise Unavailable(
            'torch.cuda.is_available() is False (torch %s, built for CUDA %s): '
            'no usable NVIDIA GPU here' % (torch.__version__, torch.version.cuda)
        )
    return torch.cuda.device_count()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--json', required=True, help='where to write the JSON report')
    parser.add_argument('--skip-tp2', action='store_true')
    parser.add_argument(
        '--variants', default=','.join(VARIANTS), help='comma-separated TP 2 NCCL variants: %s' % ', '.join(VARIANTS)
    )
    parser.add_argument('--large-mib', type=int, default=256, help='size of the large all_reduce, MiB (default 256)')
    parser.add_argument(
        '--nccl-debug-dir', default=None, help='write NCCL_DEBUG=INFO logs of the first TP 2 variant here'
    )
    parser.add_argument('--timeout', type=int, default=240, help='seconds allowed to each group of child processes')
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(',') if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error('unknown variants: %s' % ', '.join(unknown))

    _apply_env({})
    try:
        count = preflight()
    except Unavailable as exc:
        print('h200_nontorch_memory: cannot measure: %s' % exc, file=sys.stderr)
        return 2

    import multiprocessing

    ctx = multiprocessing.get_context('spawn')
    report = {
        'what': "GPU memory outside PyTorch's allocator (vLLM's non_torch_memory = "
        '(total - free from torch.cuda.mem_get_info) - torch.cuda.memory_reserved(), '
        'after gc.collect + empty_cache), per step of fresh processes',
        'script': 'bench/h200_nontorch_memory.py',
        'recorded_utc': datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ'),
        'argv': sys.argv[1:],
        'stack': host_stack(),
        'device_count': count,
        'env': {k: os.environ.get(k) for k in ENV_RECORDED},
    }

    t0 = time.time()
    res = run_children(ctx, [(tp1_worker, (0,))], args.timeout)[0]
    tp1 = {'gpu': 0, 'seconds': round(time.time() - t0, 1)}
    if 'error' in res:
        tp1['error'] = res['error']
    else:
        tp1['stages'] = res['stages']
        tp1['summary'] = summarize_tp1(res['stages'])
        report['stack'].update(res['stack'])
    report['tp1'] = tp1

    if not args.skip_tp2:
        if count < 2:
            report['tp2_skipped'] = 'only %d GPU visible' % count
        else:
            report['tp2'] = {}
            for i, name in enumerate(variants):
                env = dict(VARIANTS[name])
                if args.nccl_debug_dir and i == 0:
                    os.makedirs(args.nccl_debug_dir, exist_ok=True)
                    env.update({'NCCL_DEBUG': 'INFO', 'NCCL_DEBUG_SUBSYS': 'INIT,ALLOC,ENV'})
                t0 = time.time()
                barrier = ctx.Barrier(2)
                port = free_port()
                targets = []
                for rank in range(2):
                    renv = dict(env)
                    if 'NCCL_DEBUG' in renv:
                        renv['NCCL_DEBUG_FILE'] = os.path.join(args.nccl_debug_dir, 'nccl-%s-rank%d.log' % (name, rank))
                    targets.append((tp2_worker, (rank, 2, port, renv, args.large_mib, barrier)))
                results = run_children(ctx, targets, args.timeout)
                ranks = [r for r in results if 'stages' in r]
                report['tp2'][name] = {
                    'env_delta': env,
                    'seconds': round(time.time() - t0, 1),
                    'ranks': ranks,
                    'summary': summarize_tp2(ranks),
                    'errors': [r['error'] for r in results if 'error' in r],
                }

    text = render(report)
    print(text)
    with open(args.json, 'w') as handle:
        json.dump(report, handle, indent=1, sort_keys=True, default=str)
        handle.write('\n')
    print('\nwrote %s' % args.json)
    failed = bool(tp1.get('error')) or any(v.get('errors') for v in (report.get('tp2') or {}).values())
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
