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

What a client sees through a restart is the front door's (test_front_door.py).
"""

import json
import ssl

import httpx2
import openai
import pytest
from sandbox_helpers import CA, WEATHER_TOOL

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
