# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""llmserve.vllm.load_probe against bad input and hostile servers.

Each case runs the module as Ansible runs it and must end in a clean error that names the cause, or
in a correct success, by its deadline (duration + request_timeout + 5 s) and without the API key
anywhere in the output. The servers (tests/fake_openai.py) misbehave on purpose:
a stream without end, one trickled a byte at a time, a line of 2 MB, bytes that are not UTF-8,
events of the wrong shape, a cut connection, an HTML page, an error that quotes the key.
"""

import base64
import json
import time
from urllib.parse import quote

import pytest

from ansible_collections.llmserve.vllm.tests.adversarial import harness
from ansible_collections.llmserve.vllm.tests.support import HANG_DEADLINE, LOADED_OVERRUN, recorded

MODULE = 'load_probe'
KEY = 'sk-zq7-probe-secret'
STREAM = recorded('load_probe', 'vllm-stream.txt').encode()
# duration 1 s, request_timeout 2 s: the module's own deadline is 1 + 2 + 5 s.
FAST = {'model': 'tiny', 'duration': 1, 'request_timeout': 2, 'concurrency': 2}
WALL = 1 + 2 + 5
# The one path the probe asks.
CHAT_COMPLETIONS = '/v1/chat/completions'


def head(handler, status=200, content_type='text/event-stream', length=None):
    handler.wfile.write(b'HTTP/1.1 %d X\r\nContent-Type: %s\r\n' % (status, content_type.encode()))
    if length is not None:
        handler.wfile.write(b'Content-Length: %d\r\n' % length)
    handler.wfile.write(b'Connection: close\r\n\r\n')


def body(status, data, content_type='application/json'):
    def behave(handler, stop):
        head(handler, status, content_type, len(data))
        handler.wfile.write(data)

    return behave


def events(*lines):
    return body(200, b''.join(line + b'\n\n' for line in lines), 'text/event-stream')


def endless(handler, stop):
    head(handler)
    chunk = STREAM.split(b'\n\n')[1] + b'\n\n'
    while not stop.is_set():
        handler.wfile.write(chunk)
        handler.wfile.flush()
        time.sleep(0.01)


def trickle(handler, stop):
    head(handler)
    for byte in STREAM:
        if stop.wait(0.5):
            return
        handler.wfile.write(bytes([byte]))
        handler.wfile.flush()


def cut(handler, stop):
    head(handler)
    handler.wfile.write(STREAM[: len(STREAM) // 2])
    handler.wfile.flush()
    handler.connection.shutdown(2)


def echo_key(handler, stop):
    data = json.dumps({'error': {'message': 'bad key: %s' % handler.headers.get('Authorization')}}).encode()
    body(401, data)(handler, stop)


def run(tmp_path, args):
    started = time.monotonic()
    outcome = harness.run_module(MODULE, tmp_path, args, timeout=WALL + HANG_DEADLINE)
    outcome.wall = time.monotonic() - started
    return outcome


def says(*parts):
    return lambda result: all(part in result['msg'] for part in parts)


@pytest.mark.parametrize(
    'behave, expected',
    [
        (endless, 'still unfinished at the deadline'),
        (trickle, 'still unfinished at the deadline'),
        (events(b'data: ' + b'x' * (2 * 1024 * 1024)), 'a stream with a line over 1048576 bytes'),
        (events(b'data: {"choices": [{"delta": {"content": "\xff\xfe"}}]}'), 'the stream ended without its [DONE]'),
        (events(b'data: {"choices": "nope"}', b'data: [DONE]'), 'no tokens'),
        (events(b'data: {"usage": {"completion_tokens": "many"}}', b'data: [DONE]'), 'no tokens'),
        (
            events(b'data: {"error": {"message": "engine dead"}}'),
            'the server reported an error: {"message": "engine dead"}',
        ),
        (events(b'data: <html>'), 'an event that is not JSON: <html>'),
        (cut, 'requests of the load probe failed'),
        (body(200, b'<html><body>proxy login</body></html>', 'text/html'), 'the stream ended without its [DONE]'),
        (body(503, b'{"error": {"message": "Service Unavailable"}}'), 'answered 503: Service Unavailable'),
        (echo_key, 'answered 401: bad key: Bearer ********'),
    ],
    ids=[
        'endless',
        'trickle',
        'huge line',
        'not utf-8',
        'choices not a list',
        'usage not a number',
        'error event',
        'not json',
        'cut',
        'html',
        '503',
        'key echoed',
    ],
)
def test_a_hostile_server_is_a_clean_failure_by_the_deadline(tmp_path, fake_openai, verdict, behave, expected):
    srv = fake_openai({CHAT_COMPLETIONS: behave})
    run_ = run(tmp_path, dict(FAST, url=srv.url, api_key=KEY))
    outcome = harness.judge(run_, expect_success=False, check=says(expected), secrets=(KEY,))
    if outcome in harness.GOOD and run_.wall > WALL + 5 + LOADED_OVERRUN:
        outcome = harness.HANG
    verdict(MODULE, outcome, '%s (%.1f s)' % (run_.result, run_.wall))


def test_a_stream_without_usage_is_counted_by_its_chunks(tmp_path, fake_openai, verdict):
    without_usage = b'\n\n'.join(part for part in STREAM.split(b'\n\n') if b'"usage":{' not in part)
    srv = fake_openai({CHAT_COMPLETIONS: body(200, without_usage, 'text/event-stream')})
    run_ = run(tmp_path, dict(FAST, url=srv.url))
    outcome = harness.judge(
        run_,
        expect_success=True,
        check=lambda result: (
            result['requests'] > 0
            and result['failed_requests'] == 0
            and result['output_tokens'] < 16 * result['requests']
        ),
    )
    verdict(MODULE, outcome, str(run_.result))


@pytest.mark.parametrize(
    'args, expected',
    [
        ({'concurrency': 1025}, 'concurrency must be from 1 to 1024, got 1025'),
        ({'duration': 0}, 'duration must be from 1 to 86400, got 0'),
        ({'request_timeout': -1}, 'request_timeout must be from 1 to 86400, got -1'),
        ({'max_tokens': 0}, 'max_tokens must be at least 1, got 0'),
        ({'min_tokens_per_second': 'inf'}, 'min_tokens_per_second must be at least 0, got inf'),
        ({'baseline_tokens_per_second': -5}, 'baseline_tokens_per_second must be at least 0, got -5.0'),
        ({'max_regression_percent': 'nan'}, 'max_regression_percent must be from 0 to 100, got nan'),
        ({'url': 'ftp://127.0.0.1:1'}, "url 'ftp://127.0.0.1:1' must start with http:// or https://"),
        ({'url': 'http://127.0.0.1:99999'}, 'has a port that is not a number from 1 to 65535'),
        ({'api_key': KEY + '\n'}, 'api_key has a control character (U+000A)'),
        ({'api_key': KEY + '\u00e9'}, 'api_key has a character outside ASCII'),
        ({'extra_body': 'not a dict'}, 'extra_body'),
    ],
)
def test_bad_arguments_are_refused_at_once(tmp_path, verdict, args, expected):
    run_ = run(tmp_path, dict(dict(FAST, url='http://127.0.0.1:1'), **args))
    outcome = harness.judge(run_, expect_success=False, check=says(expected), secrets=(KEY,))
    if outcome in harness.GOOD and run_.wall > 10 + LOADED_OVERRUN:
        outcome = harness.HANG
    verdict(MODULE, outcome, '%s (%.1f s)' % (run_.result, run_.wall))


def test_nothing_listening_is_a_clean_failure(tmp_path, verdict, free_port):
    run_ = run(tmp_path, dict(FAST, url='http://127.0.0.1:%d' % free_port))
    verdict(
        MODULE,
        harness.judge(run_, expect_success=False, check=says('2 of 2 requests', 'connection refused')),
        str(run_.result),
    )


# ---------------------------------------------------------------- the key never comes back, whole or in part

# Any run of this many characters of a secret in the output counts as a leak (the module masks such runs).
PART = 8
ODD_KEY = 'sk-zq7"probe\\secret'


def exposed(*secrets):
    """How any run of PART characters of the secrets would show in the module's output (JSON): as it is,
    JSON-escaped or percent-encoded by the server, each of these once more escaped by the output's JSON."""
    found = set()
    for secret in secrets:
        for start in range(len(secret) - PART + 1):
            part = secret[start : start + PART]
            for spelled in (part, json.dumps(part)[1:-1], quote(part, safe='')):
                found.update((spelled, json.dumps(spelled)[1:-1]))
    return tuple(found)


def error_answer(status, message, headers=b''):
    """An OpenAI-style error answer whose message is the given text."""

    def behave(handler, stop):
        data = json.dumps({'error': {'message': message}}).encode()
        handler.wfile.write(
            b'HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%sConnection: close\r\n\r\n'
            % (status, len(data), headers)
            + data
        )

    return behave


def echo_basic_credentials(handler, stop):
    """Ask for Basic credentials and quote what came: urllib answers the challenge with the URL's user:password."""
    said = handler.headers.get('Authorization') or 'nothing'
    error_answer(401, 'you sent %s' % said, b'WWW-Authenticate: Basic realm="vllm"\r\n')(handler, stop)


BASIC = base64.b64encode(b'probe:pw-zq7-secret').decode()


def at_the_cut(before, kept=10):
    """A text that puts KEY across the 300-character cut of an error that begins with `before` characters:
    `kept` of the key's characters before the cut."""
    return 'y' * (300 - before - kept) + KEY + ' tail'


NOT_JSON = 'an event that is not JSON: '
REPORTED = 'the server reported an error: "'
NOT_AN_OBJECT = 'an event that is not a JSON object: data: ["'


@pytest.mark.parametrize(
    'key, behave, expected',
    [
        # Each of these errors was cut at 300 characters with nothing masked: Ansible masks the key only whole.
        (KEY, events(b'data: ' + at_the_cut(len(NOT_JSON)).encode()), NOT_JSON + 'y' * 263 + '********'),
        (
            KEY,
            events(b'data: ' + json.dumps({'error': at_the_cut(len(REPORTED))}).encode()),
            REPORTED + 'y' * 259 + '********',
        ),
        (
            KEY,
            events(b'data: ' + json.dumps([at_the_cut(len(NOT_AN_OBJECT))]).encode()),
            NOT_AN_OBJECT + 'y' * 246 + '********',
        ),
        # An event of nearly 1 MiB that is not JSON, with bytes that are not UTF-8 and a NUL before the key.
        (
            KEY,
            events(b'data: \xff\x00' + at_the_cut(len(NOT_JSON) + 2).encode() + b'\xfe' * ((1 << 20) - 1000)),
            NOT_JSON + '\ufffd\x00' + 'y' * 261 + '********',
        ),
        # 5 characters before the cut, fewer than a run that mask finds: only masking before the cut hides them.
        (KEY, events(b'data: ' + at_the_cut(len(NOT_JSON), 5).encode()), NOT_JSON + 'y' * 268 + '*****... ('),
        # The error's own quote cuts the message at 300 characters: masked before that cut too.
        (KEY, error_answer(401, at_the_cut(len('answered 401: '))), 'answered 401: ' + 'y' * 276 + '********'),
        # A key with " and \: the error event quoted as JSON again holds it escaped, which Ansible does not mask.
        (
            ODD_KEY,
            events(b'data: ' + json.dumps({'error': {'message': 'bad key ' + ODD_KEY}}).encode()),
            'the server reported an error: {"message": "bad key ********"}',
        ),
        # Percent-encoded, as a proxy quotes a URL that carried it.
        (
            ODD_KEY,
            error_answer(403, 'refused https://llm.example/?key=%s' % quote(ODD_KEY, safe='')),
            'answered 403: refused https://llm.example/?key=********',
        ),
    ],
    ids=[
        'key-cut-in-an-event-not-json',
        'key-cut-in-an-error-event',
        'key-cut-in-an-event-not-an-object',
        'key-cut-in-1-MiB-not-utf8-with-nul',
        'key-cut-5-characters-in',
        'key-cut-by-the-error-quote',
        'odd-key-json-escaped',
        'odd-key-percent-encoded',
    ],
)
def test_no_part_of_the_key_comes_back(tmp_path, fake_openai, verdict, key, behave, expected):
    srv = fake_openai({CHAT_COMPLETIONS: behave})
    run_ = run(tmp_path, dict(FAST, url=srv.url, api_key=key, concurrency=1))
    outcome = harness.judge(run_, expect_success=False, check=says(expected), secrets=exposed(key))
    verdict(MODULE, outcome, '%s (%.1f s)' % (str(run_.result)[:3000], run_.wall))


@pytest.mark.parametrize(
    'url, behave, expected',
    [
        # A raw / in the password: urlsplit sees no password there, so Ansible never masked it.
        (
            'http://probe:pw/zq7-secret@127.0.0.1:1',
            None,
            "url 'http://probe:********@127.0.0.1:1' has more than one @, or one after a /, ? or #",
        ),
        (
            'http://probe:pw-zq7@secret@127.0.0.1:1',
            None,
            "url 'http://probe:********@127.0.0.1:1' has more than one @, or one after a /, ? or #",
        ),
        # The server asks for Basic credentials and quotes them: base64 of user:password.
        ('{creds}', echo_basic_credentials, 'answered 401: you sent Basic ********'),
    ],
    ids=['password-with-a-slash', 'password-with-an-at', 'basic-credentials-echoed'],
)
def test_no_part_of_the_urls_password_comes_back(tmp_path, fake_openai, verdict, url, behave, expected):
    srv = fake_openai({CHAT_COMPLETIONS: behave})
    url = url.replace('{creds}', srv.url.replace('http://', 'http://probe:pw-zq7-secret@'))
    run_ = run(tmp_path, dict(FAST, url=url, concurrency=1))
    secrets = exposed('pw/zq7-secret', 'pw-zq7@secret', 'pw-zq7-secret', BASIC)
    outcome = harness.judge(run_, expect_success=False, check=says(expected), secrets=secrets)
    verdict(MODULE, outcome, '%s (%.1f s)' % (run_.result, run_.wall))


TEXT = b'data: {"choices": [{"delta": {"content": "x"}}]}'


def usage(count):
    return events(TEXT, b'data: {"choices": [], "usage": {"completion_tokens": %s}}' % count, b'data: [DONE]')


@pytest.mark.parametrize(
    'behave, expected',
    [
        # Hundreds of digits: the throughput overflowed a float, a traceback.
        (
            usage(b'1' + b'0' * 400),
            'usage.completion_tokens is 10000000000000000000... (401 digits), not a count from 0 to 128 '
            '(the most the request allows)',
        ),
        # More than max_tokens: a server that lies about its output passed the gate with any throughput.
        (usage(b'1000000'), 'usage.completion_tokens is 1000000, not a count from 0 to 128'),
        (usage(b'-5'), 'usage.completion_tokens is -5, not a count from 0 to 128'),
        # An event nested 100,000 deep, and one that is a list holding bytes that are not UTF-8.
        (events(b'data: ' + b'[' * 100000), 'an event nested too deeply to be read as JSON: [[[['),
        (events(b'data: ["\xff"]'), 'an event that is not a JSON object: data: ["\ufffd"]'),
    ],
    ids=['usage-400-digits', 'usage-over-max-tokens', 'usage-negative', 'event-deep', 'event-list-not-utf8'],
)
def test_a_server_that_miscounts_or_nests_is_a_clean_failure(tmp_path, fake_openai, verdict, behave, expected):
    srv = fake_openai({CHAT_COMPLETIONS: behave})
    run_ = run(tmp_path, dict(FAST, url=srv.url, api_key=KEY, concurrency=1))
    outcome = harness.judge(run_, expect_success=False, check=says(expected), secrets=exposed(KEY))
    verdict(MODULE, outcome, '%s (%.1f s)' % (str(run_.result)[:2000], run_.wall))
