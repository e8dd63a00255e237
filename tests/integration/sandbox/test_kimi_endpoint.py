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
4. streamed, every reasoning delta comes before the first content delta;
5. a stream in flight when the service restarts ends with its last token: the stop drains it.
"""

import json
import time

import openai
import pytest
from sandbox_helpers import WEATHER_TOOL

THINKING_OFF = {'chat_template_kwargs': {'thinking': False}}


@pytest.fixture(scope='module')
def client(sandbox):
    return openai.OpenAI(
        base_url='http://127.0.0.1:%s/v1' % sandbox.vars['vllm_kimi_port'],
        api_key=sandbox.vars['vllm_kimi_api_key'],
        timeout=120,
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


# Within the miniature's context (max_model_len 1024 in inventories/sandbox): some seconds of generation here.
DRAINED_TOKENS = 900


def test_a_stream_in_flight_at_a_restart_ends_with_its_last_token(client, sandbox):
    """The stop's SIGTERM reaches the API server alone (KillMode=mixed), which drains the engine for up to
    --shutdown-timeout while it keeps generating. With vLLM's default (0) the engine is aborted and the stream ends
    without its tokens; with KillMode=control-group every process is killed at once."""
    before = sandbox.show('MainPID')['MainPID']
    cursor = sandbox.sh('journalctl --quiet --lines=0 --show-cursor').strip().split('cursor: ', 1)[1]
    stream = client.chat.completions.create(
        model=sandbox.vars['vllm_kimi_served_model_name'],
        temperature=0,
        messages=[{'role': 'user', 'content': sandbox.vars['vllm_kimi_coherence_prompt']}],
        max_tokens=DRAINED_TOKENS,
        stream=True,
        stream_options={'include_usage': True},
        extra_body={'ignore_eos': True, 'min_tokens': DRAINED_TOKENS},
    )
    chunks = iter(stream)
    next(chunks)
    sandbox.sh('systemctl restart --no-block %s' % sandbox.unit)
    finish, usage, last_chunk_at = None, None, None
    for chunk in chunks:
        last_chunk_at = time.time()
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage:
            usage = chunk.usage
    assert finish == 'length' and usage is not None and usage.completion_tokens == DRAINED_TOKENS, (finish, usage)
    # The stop drained, and began while the stream was still coming: vLLM logged it before the stream's last chunk.
    stopping = sandbox.host.run(
        "journalctl --after-cursor '%s' -u %s -o short-unix --no-pager | grep -m1 'stopping engine client mode='",
        cursor,
        sandbox.unit,
    ).stdout
    assert 'mode=drain' in stopping, 'the stop did not drain the requests in flight: %r' % stopping
    assert float(stopping.split()[0]) < last_chunk_at, (stopping, last_chunk_at)
    sandbox.wait_for('the restart', lambda: sandbox.show('MainPID', 'ActiveState')['MainPID'] not in ('0', before), 300)
    gate = sandbox.gate()
    assert not gate.get('failed'), gate.get('msg')
