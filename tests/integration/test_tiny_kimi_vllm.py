# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""tiny-kimi (tools/make_tiny_models.py) served as production serves Kimi-K2.5, judged by the official openai client.

`vllm serve MODEL` (the positional argument; through the CPU wheel's version shim, the role's own file) with the
kimi_k2 reasoning and tool parsers and auto tool choice. What Kimi's users rely on: a tool request returns a
parsed get_weather call for Paris; thinking on, the thought is in `reasoning` and the answer in `content`;
thinking off, no reasoning; streamed, every reasoning delta comes before the first content delta. The revisions
made to fail a gate are served by vLLM where the role's gates meet them, each failing for the property it was made
to break: `wrong` in tests/integration/sandbox/test_changes.py, `thinks-forever` and `ignores-tools` in
tests/integration/fleet/test_failing_revisions.py, `forgets-long` in both scenarios.
"""

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._chat_check import ChatCheck, CheckFailed
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._http import Unreachable
from ansible_collections.llmserve.vllm.tests.support import REPO, tiny_models

openai = pytest.importorskip('openai')

VLLM_PYTHON = os.path.join(REPO, '.venv-vllm', 'bin', 'python')
VLLM_CLI = os.path.join(REPO, 'roles', 'vllm_kimi', 'files', 'llmserve-vllm-cli')
API_KEY = 'tiny-kimi-test-key'
SERVED = 'tiny-kimi'
QUESTION = 'What is the capital of France?'
PARIS = 'The capital of France is Paris.'
WEATHER = 'What is the weather in Paris?'
# As tools/make_tiny_models.WEATHER_TOOL (.venv-vllm has the script's torch; this venv does not import it).
WEATHER_TOOL = {
    'type': 'function',
    'function': {
        'name': 'get_weather',
        'description': 'Get the current weather in a city.',
        'parameters': {
            'type': 'object',
            'properties': {'city': {'type': 'string', 'description': 'The city name.'}},
            'required': ['city'],
        },
    },
}
THINKING_OFF = {'chat_template_kwargs': {'thinking': False}}
# The long-prompt probe as tools/make_tiny_models.py teaches it and the sandbox inventory asks it.
LONG_FILLER = 'The sky is blue. '
# The role's long-context gate on the sandbox inventory: 90 % of the 1024 tokens served, the answer in what is left.
LONG_CONTEXT_TOKENS = 921
LONG_CONTEXT_MAX_TOKENS = 103
# The production flags of the gpu inventory that the CPU build accepts, plus what the CPU needs:
# --language-model-only (the checkpoint is KimiK25ForConditionalGeneration without its vision tower) and
# --enforce-eager (no C++ compiler for torch.compile), and vLLM's own forward_native for rotary embeddings (the
# CPU build's kernel rotates MLA's rope parts wrongly: see kimi_text_config in tools/make_tiny_models.py).
# 4 MiB of KV cache: 1,213 tokens at 3,456 B/token.
SERVE_FLAGS = [
    '--served-model-name',
    SERVED,
    '--reasoning-parser',
    'kimi_k2',
    '--tool-call-parser',
    'kimi_k2',
    '--enable-auto-tool-choice',
    '--language-model-only',
    '--enforce-eager',
    '--compilation-config',
    '{"custom_ops": ["all", "-rotary_embedding"]}',
    '--max-model-len',
    '1024',
    '--kv-cache-memory-bytes',
    '4194304',
    '--api-key',
    API_KEY,
]
PORTS = range(8140, 8150)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not os.path.exists(VLLM_PYTHON), reason='needs the CPU build of vLLM in .venv-vllm (make vllm-venv)'
    ),
]


def port_in_range():
    for port in PORTS:
        with socket.socket() as sock:
            try:
                sock.bind(('127.0.0.1', port))
            except OSError:
                continue
            return port
    pytest.fail('no free port in %d-%d' % (PORTS[0], PORTS[-1]))


def serve(model, tmp_path_factory):
    """vLLM serving MODEL (a directory of make_tiny_models' output), ready; yields the client and the log."""
    path = os.path.join(tiny_models(), model)
    port = port_in_range()
    log_path = tmp_path_factory.mktemp(model) / 'vllm.log'
    with open(str(log_path), 'wb') as log:
        proc = subprocess.Popen(
            [VLLM_PYTHON, VLLM_CLI, 'serve', path] + SERVE_FLAGS + ['--host', '127.0.0.1', '--port', str(port)],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        client = openai.OpenAI(base_url='http://127.0.0.1:%d/v1' % port, api_key=API_KEY, timeout=120, max_retries=0)
        started = time.monotonic()
        while True:
            if proc.poll() is not None:
                pytest.fail('vLLM exited with %s:\n%s' % (proc.returncode, log_path.read_text()[-4000:]))
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if time.monotonic() - started > 900:
                    pytest.fail('vLLM did not answer within 900 s:\n%s' % log_path.read_text()[-4000:])
                time.sleep(1)
        print('%s ready after %.0f s' % (model, time.monotonic() - started))
        yield client, log_path
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def reasoning_of(obj):
    """The thinking of a message or delta: `reasoning` in current vLLM, `reasoning_content` before."""
    return getattr(obj, 'reasoning', None) or getattr(obj, 'reasoning_content', None)


def ask(client, content, **kwargs):
    return client.chat.completions.create(
        model=SERVED, messages=[{'role': 'user', 'content': content}], temperature=0, **kwargs
    ).choices[0]


def bearer_http(url):
    """chat_check's Http with the test's key, unmasked: the module's own transport masks any run of 8 characters of
    a key in what it reads, and this key holds the served name, tiny-kimi."""

    def http(method, path, payload, timeout, limit):
        request = urllib.request.Request(
            url + path,
            data=json.dumps(payload).encode(),
            headers={'Content-Type': 'application/json', 'Authorization': 'Bearer ' + API_KEY},
            method=method,
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                return answer.status, answer.read(limit).decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read(limit).decode()
        except OSError as exc:
            raise Unreachable(str(exc)) from exc

    return http


def gate(client, prompt=QUESTION, expect=r'\bParis\b', **long_prompt):
    """The role's long-prompt gate (llmserve.vllm.chat_check's logic) against this vLLM, thinking off."""
    url = str(client.base_url).rstrip('/')[: -len('/v1')]
    return ChatCheck(
        bearer_http(url),
        url=url,
        model=SERVED,
        prompt=prompt,
        expect=expect,
        max_tokens=LONG_CONTEXT_MAX_TOKENS,
        api_key_set=True,
        extra_body=THINKING_OFF,
        long_prompt=dict({'fact': None, 'filler': LONG_FILLER, 'min_tokens': 0}, **long_prompt),
        timeout=300,
    ).run()


def ask_weather(client, **kwargs):
    return ask(client, WEATHER, tools=[WEATHER_TOOL], max_tokens=128, **kwargs)


class TestTinyKimi:
    @pytest.fixture(scope='class')
    def client(self, tmp_path_factory):
        for client, _server in serve('tiny-kimi', tmp_path_factory):
            yield client

    @pytest.mark.parametrize('extra', [{}, THINKING_OFF], ids=['thinking', 'no-thinking'])
    def test_a_tool_request_returns_a_get_weather_call_for_paris(self, client, extra):
        choice = ask_weather(client, extra_body=extra)
        calls = choice.message.tool_calls
        assert choice.finish_reason == 'tool_calls', choice
        assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ('function', 'get_weather', {'city': 'Paris'})
        ]
        assert calls[0].id == 'functions.get_weather:0'
        assert not choice.message.content
        assert bool(reasoning_of(choice.message)) == (extra == {})

    def test_the_question_after_a_long_filler_is_answered(self, client):
        completion = client.chat.completions.create(
            model=SERVED,
            messages=[{'role': 'user', 'content': LONG_FILLER * 60 + QUESTION}],
            temperature=0,
            max_tokens=32,
            extra_body=THINKING_OFF,
        )
        assert completion.usage.prompt_tokens > 384
        choice = completion.choices[0]
        assert (choice.finish_reason, choice.message.content) == ('stop', PARIS)

    def test_the_long_context_gate_at_90_percent_of_the_context_answers_and_begins_as_the_short_question(self, client):
        result = gate(client, target_tokens=LONG_CONTEXT_TOKENS, greedy_prompt=QUESTION, greedy_tokens=8)
        # vLLM's /tokenize: 37 tokens without filler, 6 a filler; 147 fillers come to 919, 148 would to 925.
        assert result['long_prompt'] == {'repeats': 147, 'target_tokens': LONG_CONTEXT_TOKENS, 'tokenized': 919}
        assert (result['prompt_tokens'], result['answer'], result['finish_reason']) == (919, PARIS, 'stop')
        assert result['greedy']['alone'] == result['greedy']['after'] == {'content': PARIS, 'reasoning': None}

    def test_the_long_context_gate_fails_where_the_miniature_cannot_retrieve_the_fact(self, client):
        with pytest.raises(CheckFailed) as err:
            gate(
                client,
                prompt='Which is the secret city?',
                expect=r'(?i)\blima\b',
                fact='Remember this: the secret city is Lima.',
                target_tokens=LONG_CONTEXT_TOKENS,
            )
        assert err.value.msg == "The answer from %s at %s did not match '(?i)\\blima\\b': '%s'" % (
            SERVED,
            err.value.details['url'],
            PARIS,
        )

    def test_the_greedy_probe_fails_where_the_long_prefix_changes_the_answer_the_needle_accepts(self, client):
        # After 60 times 'What is 2 + 2? ' the miniature still names Paris, which the needle's expect accepts, but
        # its sentence is not the one it answers alone: the probe quotes both.
        with pytest.raises(CheckFailed) as err:
            gate(client, filler='What is 2 + 2? ', repeats=60, greedy_prompt=QUESTION, greedy_tokens=8)
        assert err.value.msg == (
            "The greedy-equivalence probe of %s at %s drifted after the long prompt: at temperature 0, '%s' began '%s' "
            "alone and 'The capital for France is Paris.' after the long prompt of 457 tokens; the first 8 tokens "
            'must be the same (a decode that misreads a long context, as vllm#41623 reports of Kimi under decode '
            'context parallelism)' % (SERVED, err.value.details['url'], QUESTION, PARIS)
        )

    def test_thinking_on_the_thought_is_reasoning_and_the_answer_content(self, client):
        choice = ask(client, QUESTION, max_tokens=128)
        assert (choice.finish_reason, choice.message.content) == ('stop', PARIS)
        assert reasoning_of(choice.message) == 'The user asks for the capital of France.'

    def test_thinking_off_there_is_no_reasoning(self, client):
        choice = ask(client, QUESTION, max_tokens=128, extra_body=THINKING_OFF)
        assert (choice.finish_reason, choice.message.content, reasoning_of(choice.message)) == ('stop', PARIS, None)

    def test_streaming_shows_every_reasoning_delta_before_the_first_content_delta(self, client):
        stream = client.chat.completions.create(
            model=SERVED, messages=[{'role': 'user', 'content': QUESTION}], temperature=0, max_tokens=128, stream=True
        )
        kinds, reasoning, content = [], '', ''
        for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            if reasoning_of(delta):
                kinds.append('reasoning')
                reasoning += reasoning_of(delta)
            if delta.content:
                kinds.append('content')
                content += delta.content
        assert (reasoning, content) == ('The user asks for the capital of France.', PARIS)
        first_content = kinds.index('content')
        assert kinds[:first_content] == ['reasoning'] * first_content and 'reasoning' not in kinds[first_content:]
        assert first_content > 1  # the thought came in several deltas, not as one block at the end
