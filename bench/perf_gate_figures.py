# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The performance gate's figures (make bench-perf-gate): what llmserve.vllm.load_probe measures on the
CPU build of vLLM serving the sandbox's miniature (tiny-kimi, with the sandbox's flags, every process on the
cores of --cpus as the default scenario's unit has them), how much it varies, and how far a heavier revision falls.

1. Concurrency 1, 4 and 8, RUNS probes each: output tokens/s, time to first token p50/p95,
   time per output token p50.
2. The spread of REPEAT probes at the role's sandbox settings (concurrency 4, 10 s): the noise that
   vllm_kimi_perf_max_regression_percent must stand above.
3. The heavy revision (tools/make_tiny_models.py's tiny-kimi-heavy: the same answers, its MLPs and
   experts zero-padded), the change the sandbox test makes the performance gate reject: the drop it must catch.

The module runs through `ansible localhost`, as the role runs it. Prints a table and writes JSON
(default .cache/bench/perf_gate.json). Run as root from the repo with .venv/bin on PATH and
ANSIBLE_COLLECTIONS_PATH set (the Makefile does both), after `make models`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

from served_vllm import REPO, Vllm, tiny_models

LOG = os.path.join(REPO, '.cache', 'bench', 'perf_gate_vllm.log')


def probe(port, concurrency, duration):
    args = {
        'url': 'http://127.0.0.1:%d' % port,
        'model': 'tiny',
        'concurrency': concurrency,
        'duration': duration,
        'max_tokens': 128,
    }
    proc = subprocess.run(
        [
            'ansible',
            'localhost',
            '-m',
            'llmserve.vllm.load_probe',
            '-a',
            json.dumps(args),
            '-o',
            '-e',
            json.dumps({'ansible_python_interpreter': sys.executable}),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        check=False,
    )
    out = proc.stdout.decode()
    result = json.loads(out[out.index('{') :])
    if proc.returncode != 0:
        raise SystemExit('the probe failed: %s' % result.get('msg'))
    return result


def summary(results):
    tps = [r['output_tokens_per_second'] for r in results]
    return {
        'runs': len(results),
        'tokens_per_second_median': round(statistics.median(tps), 1),
        'tokens_per_second_min': round(min(tps), 1),
        'tokens_per_second_max': round(max(tps), 1),
        'spread_percent': round(100.0 * (max(tps) - min(tps)) / statistics.median(tps), 1),
        'ttft_p50': statistics.median(r['time_to_first_token']['p50'] for r in results),
        'ttft_p95': statistics.median(r['time_to_first_token']['p95'] for r in results),
        'tpot_p50': statistics.median(r['time_per_output_token']['p50'] for r in results),
        'requests_median': statistics.median(r['requests'] for r in results),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--runs', type=int, default=3)
    parser.add_argument('--repeat', type=int, default=5)
    parser.add_argument('--duration', type=int, default=10)
    parser.add_argument('--cpus', default='0', help="taskset's list for every vLLM process (default: 0)")
    parser.add_argument('--json', default=os.path.join(REPO, '.cache', 'bench', 'perf_gate.json'))
    options = parser.parse_args()
    os.makedirs(os.path.dirname(options.json), exist_ok=True)
    models = tiny_models()
    figures = {'cpus': options.cpus, 'duration': options.duration, 'max_tokens': 128}

    server = Vllm(os.path.join(models, 'tiny-kimi'), options.cpus, LOG)
    try:
        figures['ready_after_seconds'] = round(server.ready_after, 1)
        figures['by_concurrency'] = {}
        for concurrency in (1, 4, 8):
            results = [probe(server.port, concurrency, options.duration) for run in range(options.runs)]
            figures['by_concurrency'][concurrency] = summary(results)
        figures['repeat_at_4'] = summary([probe(server.port, 4, options.duration) for run in range(options.repeat)])
    finally:
        server.stop()

    heavy = Vllm(os.path.join(models, 'tiny-kimi-heavy'), options.cpus, LOG)
    try:
        figures['heavy_ready_after_seconds'] = round(heavy.ready_after, 1)
        figures['heavy_at_4'] = summary([probe(heavy.port, 4, options.duration) for run in range(options.runs)])
    finally:
        heavy.stop()
    base = figures['repeat_at_4']['tokens_per_second_median']
    figures['heavy_drop_percent'] = round(100.0 * (base - figures['heavy_at_4']['tokens_per_second_median']) / base, 1)

    with open(options.json, 'w') as f:
        json.dump(figures, f, indent=2)
    print(
        '| Probe (%d s, 128 tokens per request) | tokens/s median (min-max) | spread | TTFT p50 / p95 | TPOT p50 |'
        % options.duration
    )
    print('| --- | --- | --- | --- | --- |')
    rows = [('concurrency %s, %d runs' % (c, s['runs']), s) for c, s in figures['by_concurrency'].items()]
    rows.append(('concurrency 4, %d runs (sandbox settings)' % figures['repeat_at_4']['runs'], figures['repeat_at_4']))
    rows.append(('concurrency 4, the heavy revision, %d runs' % figures['heavy_at_4']['runs'], figures['heavy_at_4']))
    for name, s in rows:
        print(
            '| %s | %.1f (%.1f-%.1f) | %.1f %% | %.3f / %.3f s | %.4f s |'
            % (
                name,
                s['tokens_per_second_median'],
                s['tokens_per_second_min'],
                s['tokens_per_second_max'],
                s['spread_percent'],
                s['ttft_p50'],
                s['ttft_p95'],
                s['tpot_p50'],
            )
        )
    print(
        "heavy revision: %.1f %% below tiny-kimi's median (vLLM ready after %.0f s instead of %.0f s)"
        % (figures['heavy_drop_percent'], figures['heavy_ready_after_seconds'], figures['ready_after_seconds'])
    )
    print('figures written to %s' % options.json)


if __name__ == '__main__':
    main()
