# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The weights phase beside the disk's own read rate, on a model whose start loading dominates (make bench-weights-rate).

1. Builds tiny-kimi-bulk once (.cache/bench/): tiny-kimi with its dense MLP and experts zero-padded, as the heavy
   revision is (tools/make_tiny_models.py, make_kimi_heavy), to about --gigabytes: the same answers, gigabytes of
   weights.
2. For each round, with the checkpoint's pages dropped from the page cache first (posix_fadvise DONTNEED, each
   file):
   - the disk: the checkpoint read sequentially in 16 MiB blocks, timed;
   - vLLM: the model served as the sandbox serves it (bench/served_vllm.py), its start's figures read from its log
     by the collection's own reader (plugins/module_utils/endpoint/_startup_log.py), the one the role's ledger uses.
Prints the weights phase (GiB, seconds, GiB/s) beside the disk's GiB/s and their ratio, and writes the figures as
JSON (default .cache/bench/weights_rate.json). Run from the repo with .venv/bin on PATH and ANSIBLE_COLLECTIONS_PATH
set (the Makefile does both).
"""

import argparse
import json
import os
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
# make_kimi_heavy pads to its module's sizes: the bulk model sets them first. The script is left as it is, since its
# hash keys the trained models' cache.
BUILD_BULK = r"""
import sys
sys.path.insert(0, sys.argv[1])
import make_tiny_models as tiny
tiny.KIMI_HEAVY_INTERMEDIATE_SIZE = int(sys.argv[4])
tiny.KIMI_HEAVY_MOE_INTERMEDIATE_SIZE = int(sys.argv[5])
tiny.make_kimi_heavy(sys.argv[2], sys.argv[3])
"""


def padded_sizes(config, gigabytes):
    """The dense and expert intermediate sizes that make tiny-kimi about gigabytes of bf16 weights, a quarter of it in
    the dense layers' MLP and the rest in the experts."""
    text = config['text_config']
    dense_layers = text['first_k_dense_replace']
    moe_layers = text['num_hidden_layers'] - dense_layers
    experts = text['n_routed_experts'] + text['n_shared_experts']
    per_row = 3 * text['hidden_size'] * 2  # gate, up and down projections, bf16
    total = gigabytes * 1e9
    dense = int(total / 4 / (dense_layers * per_row))
    moe = int(total * 3 / 4 / (moe_layers * experts * per_row))
    return dense, moe


def bulk_model(gigabytes):
    source = os.path.join(tiny_models(), 'tiny-kimi')
    target = os.path.join(REPO, '.cache', 'bench', 'tiny-kimi-bulk-%g' % gigabytes)
    if not os.path.isdir(target):
        with open(os.path.join(source, 'config.json')) as handle:
            dense, moe = padded_sizes(json.load(handle), gigabytes)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        subprocess.run(
            [VLLM_PYTHON, '-c', BUILD_BULK, os.path.join(REPO, 'tools'), source, target, str(dense), str(moe)],
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


def vllm_load(model, cpus):
    """The start's figures, as the role's ledger reads them from vLLM's log."""
    drop_from_page_cache(weight_files(model))
    with tempfile.NamedTemporaryFile(prefix='weights-rate-', suffix='.log', delete=False) as log:
        log_path = log.name
    server = Vllm(model, cpus, log_path)
    try:
        with open(log_path, errors='replace') as handle:
            figures = startup_figures(handle.read().splitlines())
    finally:
        server.stop()
    figures['api_ready_seconds'] = round(server.ready_after, 2)
    os.unlink(log_path)
    return figures


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--gigabytes', type=float, default=2.0)
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--cpus', default='0-%d' % (os.cpu_count() - 1))
    parser.add_argument('--out', default=os.path.join(REPO, '.cache', 'bench', 'weights_rate.json'))
    args = parser.parse_args()
    model = bulk_model(args.gigabytes)
    paths = weight_files(model)
    rounds = []
    for number in range(args.rounds):
        size, seconds = disk_read(paths)
        figures = vllm_load(model, args.cpus)
        rounds.append(
            {
                'disk_gib': round(size / GIB, 3),
                'disk_seconds': round(seconds, 3),
                'disk_gib_per_second': round(size / GIB / seconds, 3),
                'weights_gib': figures.get('weights_gib'),
                'weights_seconds': figures.get('weights_seconds'),
                'weights_read_seconds': figures.get('weights_read_seconds'),
                # vLLM's own rate, where it logs the weights' GiB (GPU builds: "Model loading took ... GiB").
                'weights_gib_per_second': figures.get('weights_gib_per_second'),
                # The checkpoint's bytes over vLLM's "Loading weights took": what the CPU build's log allows.
                'checkpoint_gib_per_weights_second': (
                    round(size / GIB / figures['weights_read_seconds'], 3)
                    if figures.get('weights_read_seconds')
                    else None
                ),
                'api_ready_seconds': figures['api_ready_seconds'],
            }
        )
        print('round %d: %s' % (number + 1, json.dumps(rounds[-1], sort_keys=True)), flush=True)
    disk = statistics.median(r['disk_gib_per_second'] for r in rounds)
    rates = [r['checkpoint_gib_per_weights_second'] for r in rounds if r['checkpoint_gib_per_weights_second']]
    weights = statistics.median(rates) if rates else None
    print('checkpoint %s: %.2f GiB in %d file(s)' % (model, sum(os.path.getsize(p) for p in paths) / GIB, len(paths)))
    print('disk read: %.3f GiB/s median of %d' % (disk, len(rounds)))
    if weights is None:
        print('weights phase: vLLM logged no "Loading weights took" (see the rounds above)')
    else:
        print(
            'weights phase (the checkpoint over vLLM\'s "Loading weights took"): %.3f GiB/s median of %d, %.2f of the '
            'disk rate' % (weights, len(rates), weights / disk)
        )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, 'w') as handle:
        json.dump(
            {'model': model, 'rounds': rounds, 'disk_gib_per_second': disk, 'weights_gib_per_second': weights},
            handle,
            indent=2,
            sort_keys=True,
        )
    print('written to %s' % args.out)


if __name__ == '__main__':
    sys.exit(main())
