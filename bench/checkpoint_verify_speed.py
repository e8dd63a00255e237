# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""How fast checkpoint_verify reads a checkpoint, and how fast it does not.

1. Digest throughput per core against coreutils' sha256sum on the same files (random data,
   in the page cache, so that both measure hashing and not the disk): bytes per CPU second,
   and their ratio. Then the wall-clock speed-up with 2 threads over 1.
2. A cached rerun over the 119 sparse shards of a Kimi-K2.5-NVFP4-sized checkpoint (about
   540 GB, built by bench/preflight_speed.py's builder): the first run's digests are planted
   in the cache, since 540 GB cannot be hashed here; its header and index checks run for real.
   The rerun loads the cache, stats every file and writes nothing: target under 1 s. The same
   as a module run (python startup and Ansible's argument handling included).

    .venv/bin/python bench/checkpoint_verify_speed.py [--mib 512] [--files 4] [--runs 3]
"""

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, '.build', 'collections'))
sys.path.insert(0, HERE)

import preflight_speed  # noqa: E402  the builder of the sparse Kimi-sized shards

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint import _checkpoint_verify  # noqa: E402
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._digest import DigestCache, hash_file  # noqa: E402
from ansible_collections.llmserve.vllm.plugins.module_utils.hub._hub_manifest import parse_manifest  # noqa: E402
from ansible_collections.llmserve.vllm.tools import fake_hub  # noqa: E402

MIB = 1 << 20


def write_random_files(dest, count, mib):
    names = []
    for i in range(count):
        name = os.path.join(dest, 'shard-%d.bin' % i)
        with open(name, 'wb') as f:
            for dummy in range(mib):
                f.write(os.urandom(MIB))
        names.append(name)
    return names


def child_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_sha256sum(names):
    """(wall s, CPU s, digests) of one sha256sum process over the files."""
    c0, t0 = child_cpu(), time.perf_counter()
    out = subprocess.run(['sha256sum'] + names, stdout=subprocess.PIPE, check=True).stdout.decode('ascii')
    wall, cpu = time.perf_counter() - t0, child_cpu() - c0
    return wall, cpu, dict((line.split()[1], line.split()[0]) for line in out.splitlines())


def time_threads(names, threads):
    """(wall s, CPU s, digests) of hashing the files as checkpoint_verify does, with a pool of threads."""
    from concurrent.futures import ThreadPoolExecutor

    c0, t0 = time.process_time(), time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        digests = list(pool.map(lambda n: hash_file(n, ['sha256'])[0]['sha256'], names))
    return time.perf_counter() - t0, time.process_time() - c0, dict(zip(names, digests))


def best(runs):
    """The run with the least wall time (the least disturbed on a shared machine)."""
    return min(runs, key=lambda r: r[0])


def throughput(args, dest):
    names = write_random_files(dest, args.files, args.mib)
    total = args.files * args.mib * MIB
    for name in names:  # into the page cache
        with open(name, 'rb') as f:
            while f.read(64 * MIB):
                pass
    coreutils = best([time_sha256sum(names) for dummy in range(args.runs)])
    one = best([time_threads(names, 1) for dummy in range(args.runs)])
    two = best([time_threads(names, 2) for dummy in range(args.runs)])
    assert coreutils[2] == one[2] == two[2], 'the digests differ'
    gb = total / 1e9
    print('throughput over %d files, %.2f GB (in the page cache), best of %d:' % (args.files, gb, args.runs))
    print(
        '  sha256sum (coreutils):       wall %.2f s, CPU %.2f s: %.2f GB per CPU second'
        % (coreutils[0], coreutils[1], gb / coreutils[1])
    )
    print(
        '  checkpoint_verify, 1 thread: wall %.2f s, CPU %.2f s: %.2f GB per CPU second' % (one[0], one[1], gb / one[1])
    )
    print('  ratio per core (checkpoint_verify / sha256sum): %.2f' % (coreutils[1] / one[1]))
    print(
        '  checkpoint_verify, 2 threads: wall %.2f s, CPU %.2f s: speed-up %.2fx over 1 thread (wall)'
        % (two[0], two[1], one[0] / two[0])
    )


def kimi_manifest(dest):
    """The model info of the sparse checkpoint: real digests for the small files, planted ones for the shards."""
    siblings = []
    for name in sorted(os.listdir(dest)):
        full = os.path.join(dest, name)
        if name.endswith('.safetensors'):
            size = os.path.getsize(full)
            siblings.append(
                {
                    'rfilename': name,
                    'size': size,
                    'blobId': '0' * 40,
                    'lfs': {'sha256': hashlib.sha256(name.encode()).hexdigest(), 'size': size, 'pointerSize': 134},
                }
            )
        else:
            siblings.append(fake_hub.sibling(fake_hub.describe_file(full, name), True))
    return {'id': 'nvidia/Kimi-K2.5-NVFP4', 'sha': 'a' * 40, 'siblings': siblings}


def cached_rerun(args, dest, cache_dir):
    t0 = time.perf_counter()
    n_shards, n_tensors, total = preflight_speed.build(dest)
    print(
        'built %d sparse shards, %d tensors, %.1f GB, in %.1f s'
        % (n_shards, n_tensors, total / 1e9, time.perf_counter() - t0)
    )
    doc = kimi_manifest(dest)
    manifest_file = os.path.join(os.path.dirname(dest), 'manifest.json')
    with open(manifest_file, 'w') as f:
        json.dump(doc, f)
    manifest = parse_manifest(json.dumps(doc).encode(), 'manifest')
    planted = dict((s['rfilename'], s['lfs']['sha256']) for s in doc['siblings'] if s.get('lfs'))
    real_hash_file = _checkpoint_verify.hash_file

    def first_read(path, algorithms):
        name = os.path.basename(path)
        if name in planted:
            return {'sha256': planted[name]}, os.stat(path)
        return real_hash_file(path, algorithms)

    _checkpoint_verify.hash_file = first_read
    try:
        t0 = time.perf_counter()
        cache = DigestCache(cache_dir)
        first = _checkpoint_verify.verify(dest, manifest, threads=2, cache=cache)
        cache.save(dest)
        print(
            'first run (shard digests planted, headers and index read): %.2f s, ok %s'
            % (time.perf_counter() - t0, first.ok)
        )
    finally:
        _checkpoint_verify.hash_file = real_hash_file
    walls = []
    for dummy in range(args.runs):
        t0 = time.perf_counter()
        cache = DigestCache(cache_dir)
        cache.load()
        report = _checkpoint_verify.verify(dest, manifest, threads=2, cache=cache)
        cache.save(dest)
        walls.append(time.perf_counter() - t0)
        assert report.ok and report.hashed_bytes == 0 and report.cache_hits == report.files, report.problems
    print(
        'cached rerun over %d files, %.1f GB (target under 1 s): best %.3f s, median %.3f s; %d bytes read for digests'
        % (report.files, report.bytes / 1e9, min(walls), sorted(walls)[len(walls) // 2], report.hashed_bytes)
    )
    module_args = os.path.join(os.path.dirname(dest), 'args.json')
    with open(module_args, 'w') as f:
        json.dump({'ANSIBLE_MODULE_ARGS': {'path': dest, 'manifest': manifest_file, 'cache_dir': cache_dir}}, f)
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, '.build', 'collections'))
    walls = []
    for dummy in range(args.runs):
        t0 = time.perf_counter()
        out = subprocess.run(
            [sys.executable, '-m', 'ansible_collections.llmserve.vllm.plugins.modules.checkpoint_verify', module_args],
            env=env,
            stdout=subprocess.PIPE,
            check=True,
        ).stdout
        walls.append(time.perf_counter() - t0)
        result = json.loads(out.decode('utf-8'))
        assert result['ok'] and result['hashed_bytes'] == 0, result
    print(
        '  as a module run (python and Ansible start-up included): best %.3f s, median %.3f s; the module says elapsed %.3f s'
        % (min(walls), sorted(walls)[len(walls) // 2], result['elapsed'])
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n', 1)[0])
    parser.add_argument('--mib', type=int, default=128, help='MiB per file for the throughput part')
    parser.add_argument('--files', type=int, default=4)
    parser.add_argument('--runs', type=int, default=3)
    args = parser.parse_args()
    dest = tempfile.mkdtemp(prefix='verify-bench-')
    try:
        print(
            'load average %.2f %.2f %.2f on %d CPUs; Python %s, %s'
            % (os.getloadavg() + (os.cpu_count(), sys.version.split()[0], __import__('ssl').OPENSSL_VERSION))
        )
        throughput(args, dest)
        shutil.rmtree(dest)
        os.mkdir(dest)
        kimi = os.path.join(dest, 'Kimi-K2.5-NVFP4')
        os.mkdir(kimi)
        cached_rerun(args, kimi, os.path.join(dest, 'cache'))
    finally:
        shutil.rmtree(dest)


if __name__ == '__main__':
    main()
