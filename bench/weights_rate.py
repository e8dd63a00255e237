# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The weights phase beside the disk's own read rate, on a model whose start loading dominates (make bench-weights-rate).

1. Builds tiny-kimi-384-experts once (.cache/bench/): tiny-kimi with Kimi K2's 384 routed experts, sized to about
   --gigabytes (default 10) in shards of 2 GiB, nearly all of it in experts that a token reads a few of, as Kimi's
   checkpoint is (BUILD_BULK says how the answers stay the same).
2. For each round and each of vLLM's --safetensors-load-strategy values (lazy, vLLM's own default, and prefetch,
   the sandbox's), with the checkpoint's pages dropped from the page cache first (posix_fadvise DONTNEED, each
   file):
   - the disk: the checkpoint read sequentially in 16 MiB blocks, timed;
   - vLLM: the model served as the sandbox serves it (bench/served_vllm.py), its start's figures read from its log
     by the collection's own reader (plugins/module_utils/endpoint/_startup_log.py), the one the role's ledger uses.
Prints, per strategy, the weights phase (GiB/s) beside the disk's GiB/s, their ratio and the weights' share of the
start, and writes the figures as JSON (default .cache/bench/weights_rate.json). Run from the repo with .venv/bin on
PATH and ANSIBLE_COLLECTIONS_PATH set (the Makefile does both).
"""

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from served_vllm import REPO, VLLM_PYTHON, Vllm, tiny_models

sys.path.insert(0, os.path.join(REPO, '.build', 'collections'))
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._startup_log import startup_figures  # noqa: E402

BLOCK = 16 << 20
GIB = 1 << 30
SHARD_BYTES = 2 << 30
# Kimi K2's routed experts per MoE layer.
KIMI_EXPERTS = 384
# tiny-kimi grown to KIMI_EXPERTS routed experts, as Kimi's checkpoint holds its bytes: nearly all in experts, of which
# each token reads a few. The four trained experts and the shared one are zero-padded to the new intermediate size
# (zero rows add nothing); the new experts are zeros that the router never picks (their selection bias is -1e4, and
# DeepSeek-V3's noaux_tc router adds the bias only to choose): the same answers, gigabytes of weights, and a start
# whose other phases stay as they were (padding the few experts instead multiplies every token's work, and the
# start's profiling run with it). Written shard by shard, as checkpoints of this size are published: a whole-model
# build would hold the model, and safetensors' save_file a second copy, which half this machine's memory does not
# survive.
BUILD_BULK = r"""
import json, os, re, shutil, sys
import torch
from safetensors.torch import load_file, save_file

source, target = sys.argv[1], sys.argv[2]
experts, moe_size, shard_bytes = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
with open(os.path.join(source, 'config.json')) as handle:
    config = json.load(handle)
text = config['text_config']
trained = text['n_routed_experts']
expert_name = re.compile(r'^(.*\.mlp\.)experts\.(\d+)\.(\w+)\.weight$')


def padded(name, tensor):
    if '.mlp.experts.' in name or '.mlp.shared_experts.' in name:
        # The shared expert is n_shared_experts experts wide.
        width = text['n_shared_experts'] if 'shared_experts' in name else 1
        old, new = text['moe_intermediate_size'] * width, moe_size * width
        if name.endswith('down_proj.weight'):
            grown = torch.zeros(tensor.shape[0], new, dtype=tensor.dtype)
            grown[:, :old] = tensor
        else:
            grown = torch.zeros(new, tensor.shape[1], dtype=tensor.dtype)
            grown[:old] = tensor
        return grown
    if name.endswith('.mlp.gate.weight'):
        grown = torch.zeros(experts, tensor.shape[1], dtype=tensor.dtype)
        grown[:trained] = tensor
        return grown
    if name.endswith('.mlp.gate.e_score_correction_bias'):
        grown = torch.full((experts,), -1e4, dtype=tensor.dtype)
        grown[:trained] = tensor
        return grown
    return tensor


def tensors():
    source_tensors = load_file(os.path.join(source, 'model.safetensors'))
    for name in sorted(source_tensors):
        yield name, padded(name, source_tensors[name])
        found = expert_name.match(name)
        # After the last trained expert's projections: the new experts of its layer.
        if found and int(found.group(2)) == trained - 1 and found.group(3) == 'up_proj':
            hidden = source_tensors[name].shape[1]
            for number in range(trained, experts):
                for projection, shape in (('down_proj', (hidden, moe_size)), ('gate_proj', (moe_size, hidden)),
                                          ('up_proj', (moe_size, hidden))):
                    yield '%sexperts.%d.%s.weight' % (found.group(1), number, projection), torch.zeros(
                        shape, dtype=source_tensors[name].dtype)


partial = target + '.partial'
shutil.rmtree(partial, ignore_errors=True)  # what an interrupted build left
os.makedirs(partial)
# Each shard is written as soon as it is full, and only its tensors' names and sizes are kept.
shards, shard, size = [], {}, 0


def write_shard():
    shards.append({name: tensor.numel() * tensor.element_size() for name, tensor in shard.items()})
    save_file(shard, os.path.join(partial, 'shard-%05d' % len(shards)), metadata={'format': 'pt'})
    shard.clear()


for name, tensor in tensors():
    shard[name] = tensor.contiguous()
    size += shard[name].numel() * shard[name].element_size()
    if size >= shard_bytes:
        write_shard()
        size = 0
if shard:
    write_shard()
weight_map, total = {}, 0
for number, sizes in enumerate(shards, 1):
    file_name = 'model-%05d-of-%05d.safetensors' % (number, len(shards))
    os.rename(os.path.join(partial, 'shard-%05d' % number), os.path.join(partial, file_name))
    weight_map.update(dict.fromkeys(sizes, file_name))
    total += sum(sizes.values())
with open(os.path.join(partial, 'model.safetensors.index.json'), 'w') as handle:
    json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, handle, indent=2, sort_keys=True)
for name in os.listdir(source):
    if name not in ('model.safetensors', 'config.json'):
        shutil.copy(os.path.join(source, name), partial)
text.update(n_routed_experts=experts, moe_intermediate_size=moe_size)
with open(os.path.join(partial, 'config.json'), 'w') as handle:
    json.dump(config, handle, indent=2, sort_keys=True)
os.rename(partial, target)
"""


def expert_size(config, gigabytes, experts):
    """The expert intermediate size that makes tiny-kimi with experts routed experts about gigabytes of bf16 weights,
    nearly all of them in the experts, as Kimi's are."""
    text = config['text_config']
    moe_layers = text['num_hidden_layers'] - text['first_k_dense_replace']
    per_row = 3 * text['hidden_size'] * 2  # gate, up and down projections, bf16
    return int(gigabytes * 1e9 / (moe_layers * (experts + text['n_shared_experts']) * per_row))


def bulk_model(gigabytes):
    source = os.path.join(tiny_models(), 'tiny-kimi')
    target = os.path.join(REPO, '.cache', 'bench', 'tiny-kimi-%d-experts-%g' % (KIMI_EXPERTS, gigabytes))
    if not os.path.isdir(target):
        with open(os.path.join(source, 'config.json')) as handle:
            moe = expert_size(json.load(handle), gigabytes, KIMI_EXPERTS)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        subprocess.run(
            [VLLM_PYTHON, '-c', BUILD_BULK, source, target, str(KIMI_EXPERTS), str(moe), str(SHARD_BYTES)],
            check=True,
        )
    return target


def weight_files(model):
    return sorted(os.path.join(model, name) for name in os.listdir(model) if name.endswith('.safetensors'))


def drop_from_page_cache(paths):
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_read(paths):
    """(bytes, seconds) of reading paths sequentially in BLOCK reads, from the disk."""
    drop_from_page_cache(paths)
    read, started = 0, time.monotonic()
    for path in paths:
        with open(path, 'rb', buffering=0) as handle:
            while True:
                chunk = handle.read(BLOCK)
                if not chunk:
                    break
                read += len(chunk)
    return read, time.monotonic() - started


# vLLM's log lines: "(Worker pid=1) INFO 12-06 08:19:26 [cpu_model_runner.py:68] Starting to load model ...".
LOG_TIME = re.compile(r' (\d\d-\d\d \d\d:\d\d:\d\d) \[')
LOAD_STARTED = 'Starting to load model'
ENGINE_INIT = re.compile(r'init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s')


def model_load_seconds(lines):
    """Seconds from vLLM's "Starting to load model" to the end of the model's load: the engine's set-up report less
    the set-up's own seconds. It holds the weights' reading and what vLLM then does to them (the CPU build repacks
    its experts), which "Loading weights took" leaves out; to the log's whole seconds."""
    started = ended = None
    for line in lines:
        stamp = LOG_TIME.search(line)
        if stamp is None:
            continue
        when = datetime.datetime.strptime(stamp.group(1), '%m-%d %H:%M:%S')
        if LOAD_STARTED in line and started is None:
            started = when
        engine = ENGINE_INIT.search(line)
        if engine:
            ended = when - datetime.timedelta(seconds=float(engine.group(1)))
    return round((ended - started).total_seconds(), 1) if started and ended else None


def vllm_load(model, cpus, strategy):
    """The start's figures, as the role's ledger reads them from vLLM's log."""
    drop_from_page_cache(weight_files(model))
    with tempfile.NamedTemporaryFile(prefix='weights-rate-', suffix='.log', delete=False) as log:
        log_path = log.name
    server = Vllm(model, cpus, log_path, ['--safetensors-load-strategy', strategy])
    try:
        with open(log_path, errors='replace') as handle:
            lines = handle.read().splitlines()
        figures = startup_figures(lines)
        figures['model_load_seconds'] = model_load_seconds(lines)
    finally:
        server.stop()
    figures['api_ready_seconds'] = round(server.ready_after, 2)
    os.unlink(log_path)
    return figures


def round_figures(strategy, size, seconds, figures):
    weights_seconds = figures.get('weights_read_seconds')
    return {
        'strategy': strategy,
        'disk_gib': round(size / GIB, 3),
        'disk_seconds': round(seconds, 3),
        'disk_gib_per_second': round(size / GIB / seconds, 3),
        'weights_gib': figures.get('weights_gib'),
        'weights_seconds': figures.get('weights_seconds'),
        'weights_read_seconds': weights_seconds,
        # vLLM's own rate, where it logs the weights' GiB (GPU builds: "Model loading took ... GiB").
        'weights_gib_per_second': figures.get('weights_gib_per_second'),
        # The checkpoint's bytes over vLLM's "Loading weights took": what the CPU build's log allows.
        'checkpoint_gib_per_weights_second': round(size / GIB / weights_seconds, 3) if weights_seconds else None,
        # The model's whole load: the weights' reading and what vLLM then does to them.
        'model_load_seconds': figures['model_load_seconds'],
        # vLLM's engine set-up after the load (profiling, KV cache, warm-up).
        'engine_init_seconds': figures.get('engine_init_seconds'),
        'api_ready_seconds': figures['api_ready_seconds'],
        # How much of the start, from the process's launch to the API's first answer, the weights and the whole
        # load took.
        'weights_share_of_start': round(weights_seconds / figures['api_ready_seconds'], 3) if weights_seconds else None,
        'load_share_of_start': (
            round(figures['model_load_seconds'] / figures['api_ready_seconds'], 3)
            if figures['model_load_seconds']
            else None
        ),
    }


def summary(rounds, strategy):
    mine = [r for r in rounds if r['strategy'] == strategy]
    disk = statistics.median(r['disk_gib_per_second'] for r in mine)
    rates = [r['checkpoint_gib_per_weights_second'] for r in mine if r['checkpoint_gib_per_weights_second']]
    shares = [r['weights_share_of_start'] for r in mine if r['weights_share_of_start']]
    load_shares = [r['load_share_of_start'] for r in mine if r['load_share_of_start']]
    weights = statistics.median(rates) if rates else None
    if weights is None:
        print('%s: disk %.3f GiB/s; vLLM logged no "Loading weights took" (see the rounds above)' % (strategy, disk))
    else:
        print(
            '%s: disk %.3f GiB/s, weights phase (the checkpoint over vLLM\'s "Loading weights took") %.3f GiB/s, '
            '%.2f of the disk rate; of the start, the weights were %.0f %% and the whole load %s (medians of %d)'
            % (
                strategy,
                disk,
                weights,
                weights / disk,
                100 * statistics.median(shares),
                '%.0f %%' % (100 * statistics.median(load_shares)) if load_shares else 'unknown',
                len(mine),
            )
        )
    return {'disk_gib_per_second': disk, 'weights_gib_per_second': weights}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--gigabytes', type=float, default=10.0)
    parser.add_argument('--rounds', type=int, default=2)
    parser.add_argument(
        '--strategies',
        default='lazy,prefetch',
        help="vLLM's --safetensors-load-strategy values to load with, each round (default: %(default)s)",
    )
    parser.add_argument('--cpus', default='0-%d' % (os.cpu_count() - 1))
    parser.add_argument('--out', default=os.path.join(REPO, '.cache', 'bench', 'weights_rate.json'))
    args = parser.parse_args()
    model = bulk_model(args.gigabytes)
    paths = weight_files(model)
    strategies = args.strategies.split(',')
    rounds = []
    for number in range(args.rounds):
        for strategy in strategies:
            size, seconds = disk_read(paths)
            rounds.append(round_figures(strategy, size, seconds, vllm_load(model, args.cpus, strategy)))
            print('round %d: %s' % (number + 1, json.dumps(rounds[-1], sort_keys=True)), flush=True)
    print('checkpoint %s: %.2f GiB in %d file(s)' % (model, sum(os.path.getsize(p) for p in paths) / GIB, len(paths)))
    summaries = {strategy: summary(rounds, strategy) for strategy in strategies}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, 'w') as handle:
        json.dump({'model': model, 'rounds': rounds, 'strategies': summaries}, handle, indent=2, sort_keys=True)
    print('written to %s' % args.out)


if __name__ == '__main__':
    sys.exit(main())
