# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What Kimi-K2.5's users rely on, asked of the deployed sandbox with the official `openai` client.

The sandbox serves the Kimi-K2.5 miniature (tools/make_tiny_models.py) with the real case's flags:
`vllm serve MODEL --reasoning-parser kimi_k2 --tool-call-parser kimi_k2 --enable-auto-tool-choice`.
A client program sees what a user's agent would:

1. offered get_weather, the model calls it for Paris, parsed by vLLM into `tool_calls`;
2. thinking on (the chat template's default), `reasoning` holds the thought and `content` the answer;
3. thinking off (`chat_template_kwargs: {"thinking": false}`), there is no reasoning;
4. streamed, every reasoning delta comes before the first content delta.

What a client sees through a restart is the front door's (test_front_door.py). The examples of docs/clients.md run
here too, each as a user's program against the front door, with the sandbox's host, CA and model name.
"""

import json
import os
import re
import ssl
import subprocess
import sys

import httpx2
import openai
import pytest
from sandbox_helpers import CA, REPO, WEATHER_TOOL

THINKING_OFF = {'chat_template_kwargs': {'thinking': False}}


@pytest.fixture(scope='module')
def client(sandbox):
    # Through the front door, as users reach it: vLLM itself serves on its Unix socket.
    return openai.OpenAI(
        base_url='https://127.0.0.1:%s/v1' % sandbox.vars['vllm_kimi_front_port'],
        api_key=sandbox.vars['vllm_kimi_api_key'],
        http_client=httpx2.Client(verify=ssl.create_default_context(cafile=CA), timeout=120),
        max_retries=0,
    )


def reasoning_of(message):
    """vLLM's reasoning field: `reasoning` today, `reasoning_content` before vLLM renamed it."""
    extra = message.model_extra or {}
    return extra.get('reasoning') or extra.get('reasoning_content')


def ask(client, sandbox, prompt, **kwargs):
    return client.chat.completions.create(
        model=sandbox.vars['vllm_kimi_served_model_name'],
        temperature=0,
        max_tokens=256,
        messages=[{'role': 'user', 'content': prompt}],
        **kwargs,
    )


def test_the_model_calls_the_tool_it_is_offered(client, sandbox):
    reply = ask(client, sandbox, 'What is the weather in Paris?', tools=[WEATHER_TOOL])
    choice = reply.choices[0]
    assert choice.finish_reason == 'tool_calls', choice
    calls = choice.message.tool_calls
    assert [call.function.name for call in calls] == ['get_weather'], calls
    assert json.loads(calls[0].function.arguments) == {'city': 'Paris'}
    assert '<|tool_call' not in (choice.message.content or '')


def test_thinking_on_reasons_then_answers_in_content(client, sandbox):
    reply = ask(client, sandbox, sandbox.vars['vllm_kimi_coherence_prompt'])
    choice = reply.choices[0]
    assert choice.finish_reason == 'stop', choice
    assert reasoning_of(choice.message), choice.message
    assert 'Paris' in choice.message.content
    assert '<think>' not in choice.message.content and '</think>' not in choice.message.content


def test_thinking_off_answers_without_reasoning(client, sandbox):
    reply = ask(client, sandbox, sandbox.vars['vllm_kimi_coherence_prompt'], extra_body=THINKING_OFF)
    choice = reply.choices[0]
    assert choice.finish_reason == 'stop', choice
    assert not reasoning_of(choice.message), choice.message
    assert 'Paris' in choice.message.content


def test_streaming_sends_the_reasoning_before_the_content(client, sandbox):
    kinds = []
    text = {'reasoning': '', 'content': ''}
    for chunk in ask(client, sandbox, sandbox.vars['vllm_kimi_coherence_prompt'], stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning = reasoning_of(delta)
        if reasoning:
            kinds.append('reasoning')
            text['reasoning'] += reasoning
        if delta.content:
            kinds.append('content')
            text['content'] += delta.content
    assert 'reasoning' in kinds and 'content' in kinds, kinds
    assert kinds.index('content') > max(i for i, kind in enumerate(kinds) if kind == 'reasoning'), kinds
    assert 'Paris' in text['content'], text


CLIENTS_DOC = os.path.join(REPO, 'docs', 'clients.md')
# What the examples name for the real case, each in every example that talks to the door.
DOC_HOST, DOC_CA, DOC_MODEL = 'https://gpu-node-01.example.com:8443', 'internal-ca.pem', '"kimi-k2.5"'
ANSWER = 'The capital of France is Paris.'
# Each example of docs/clients.md, by its heading, and what its program prints against the sandbox.
EXAMPLES = {
    'curl': None,  # JSON: judged below
    'Chat': r'thought: (?!None).+\nanswer: %s\n' % re.escape(ANSWER),
    'Thinking off': r'answer: %s\n' % re.escape(ANSWER),
    'Streaming': r'^%s\n$' % re.escape(ANSWER),
    'Tools': r"^get_weather \{'city': 'Paris'\}\n$",
    'Responses API': r'^%s\n$' % re.escape(ANSWER),
    'The anthropic client': r'^thinking .+\ntext %s\n$' % re.escape(ANSWER),
}


def doc_examples():
    """docs/clients.md's code blocks by their heading: the openai client's setup is the block under its own heading,
    which every example under it (###) runs first."""
    with open(CLIENTS_DOC) as handle:
        text = handle.read()
    blocks, setup = {}, ''
    for level, heading, body in re.findall(r'^(#+) (.+?)\n(.*?)(?=^#+ |\Z)', text, flags=re.MULTILINE | re.DOTALL):
        code = re.findall(r'```(?:bash|python)\n(.*?)```', body, flags=re.DOTALL)
        if heading == 'The openai client':
            setup = code[0]
        elif code:
            blocks[heading] = (setup if len(level) == 3 else '') + code[-1]
    return blocks


def run_example(sandbox, code):
    """An example as a user runs it, with the sandbox's front door, CA and model name for the real case's."""
    for placeholder in (DOC_HOST, DOC_CA, DOC_MODEL):
        assert placeholder in code, (placeholder, code)
    code = (
        code.replace(DOC_HOST, 'https://127.0.0.1:%s' % sandbox.vars['vllm_kimi_front_port'])
        .replace(DOC_CA, CA)
        .replace(DOC_MODEL, json.dumps(sandbox.vars['vllm_kimi_served_model_name']))
    )
    # The sandbox's context is 1,024 tokens, and its tiny model answers what it learnt greedily: the examples' budget
    # is the real case's, and they leave sampling at the model's defaults.
    # (anthropic's client takes no temperature argument for the Messages API: it goes in the body.)
    greedy = "extra_body={'temperature': 0}," if 'anthropic.Anthropic(' in code else 'temperature=0,'
    code = re.sub(r'(max_(?:output_)?tokens)=4096,', r'\1=256, ' + greedy, code)
    code = code.replace('"max_tokens": 4096,', '"max_tokens": 256, "temperature": 0,')
    assert 'temperature' in code and '4096' not in code, code
    argv = ['bash', '-c', code] if code.startswith('curl') else [sys.executable, '-c', code]
    env = dict(os.environ, KIMI_API_KEY=sandbox.vars['vllm_kimi_api_key'])
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_the_docs_have_each_client_example():
    assert sorted(doc_examples()) == sorted(EXAMPLES)


@pytest.mark.parametrize('heading', sorted(set(EXAMPLES) - {'curl'}))
def test_each_client_example_of_the_docs_answers_through_the_front_door(sandbox, heading):
    out = run_example(sandbox, doc_examples()[heading])
    assert re.search(EXAMPLES[heading], out, flags=re.MULTILINE | re.DOTALL), out


def test_the_docs_curl_example_answers_with_thinking_off(sandbox):
    reply = json.loads(run_example(sandbox, doc_examples()['curl']))
    message = reply['choices'][0]['message']
    assert (message['content'], reasoning_of_json(message)) == (ANSWER, None), message


def reasoning_of_json(message):
    return message.get('reasoning') or message.get('reasoning_content')
