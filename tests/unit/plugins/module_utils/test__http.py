# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Unit tests of _http: the endpoint's URL and key checked before the first request, what a missing answer was,
and secrets masked in every text that comes back."""

import socket
from http.client import BadStatusLine, IncompleteRead, RemoteDisconnected

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils._http import (
    api_key_problem,
    describe_unreachable,
    mask,
    read_limited,
    url_problem,
)


class _Reason(Exception):
    def __init__(self, reason):
        super().__init__('wrapped')
        self.reason = reason


CONTROL = (
    "api_key has a control character (U+%s) at position %d; a Bearer token cannot carry one. A YAML '|' "
    "block scalar ends with a newline: use '|-' or a quoted string"
)


@pytest.mark.parametrize(
    'exc, expected',
    [
        (_Reason(ConnectionRefusedError(111, 'Connection refused')), 'connection refused'),
        (ConnectionRefusedError(111, 'Connection refused'), 'connection refused'),
        (socket.timeout('timed out'), 'no complete answer within 30 s'),
        (_Reason('timed out'), 'no complete answer within 30 s'),
        (ConnectionResetError(104, 'Connection reset by peer'), 'connection reset'),
        (RemoteDisconnected('Remote end closed connection without response'), 'connection reset'),
        (
            IncompleteRead(b'{"cho', 995),
            'connection closed in the middle of the answer (5 bytes read, 995 more expected)',
        ),
        (IncompleteRead(b'{"cho'), 'connection closed in the middle of the answer (5 bytes read)'),
        (BadStatusLine('HELLO\r\n'), "an answer that is not HTTP: 'HELLO\\r\\n'"),
        (
            _Reason(socket.gaierror(-2, 'Name or service not known')),
            'host name not resolved ([Errno -2] Name or service not known)',
        ),
        (
            _Reason('[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed'),
            '[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed',
        ),
    ],
)
def test_describe_unreachable(exc, expected):
    assert describe_unreachable(exc, 30) == expected


@pytest.mark.parametrize(
    'api_key, expected',
    [
        ('sk-abc123', None),
        ('', None),
        ('sk-"odd\\\'', None),
        ('sk-abc123\n', CONTROL % ('000A', 10)),
        ('\tsk', CONTROL % ('0009', 1)),
        ('sk\x00', CONTROL % ('0000', 3)),
        ('sk\x7f', CONTROL % ('007F', 3)),
        ('sk\x9b', CONTROL % ('009B', 3)),
        ('sk-\u00e9', 'api_key has a character outside ASCII at position 4; a Bearer token cannot carry one'),
        ('sk-\u2028', 'api_key has a character outside ASCII at position 4; a Bearer token cannot carry one'),
    ],
    ids=['plain', 'empty', 'quotes-and-backslash', 'newline', 'tab', 'nul', 'del', 'c1', 'latin-1', 'line-separator'],
)
def test_api_key_problem(api_key, expected):
    assert api_key_problem(api_key) == expected


@pytest.mark.parametrize(
    'url, expected',
    [
        ('http://127.0.0.1:8000', None),
        ('https://llm.example.com/', None),
        ('http://[::1]:8000', None),
        ('https://user:pw@llm.example.com/vllm', None),
        ('http://vllm.local.', None),
        ('HTTP://x', "url 'HTTP://x' must start with http:// or https://"),
        ('unix:///run/vllm.sock', "url 'unix:///run/vllm.sock' must start with http:// or https://"),
        ('http://a\tb', "url 'http://a\tb' has a space or a control character in it"),
        ('http://[::1', "url 'http://[::1' is not a valid URL: Invalid IPv6 URL"),
        ('http://x#top', "url 'http://x#top' has a query or a fragment; give the server's base URL"),
        ('http://x/v1/', "url 'http://x/v1/' ends with /v1; give the server's base URL, without /v1"),
        ('http://', "url 'http://' has no host name"),
        ('http://x:-1', "url 'http://x:-1' has a port that is not a number from 1 to 65535"),
        ('http://x:65536', "url 'http://x:65536' has a port that is not a number from 1 to 65535"),
        ('http://.x', "url 'http://.x' has a host name with an empty or too long label: '.x'"),
        ('http://%s' % ('a.' * 127 + 'aa'), None),
    ],
    ids=[
        'ip-port',
        'https-slash',
        'ipv6',
        'credentials-path',
        'trailing-dot',
        'upper-case-scheme',
        'unix',
        'tab',
        'broken-ipv6',
        'fragment',
        'v1',
        'no-host',
        'negative-port',
        'port-65536',
        'leading-dot',
        'long-host',
    ],
)
def test_url_problem(url, expected):
    assert url_problem(url) == expected


@pytest.mark.parametrize(
    'text, secret, expected',
    [
        ('Bearer sk-1 refused', 'sk-1', 'Bearer ******** refused'),
        ('no secret here', 'sk-1', 'no secret here'),
        ('anything', None, 'anything'),
        ('anything', '', 'anything'),
        # As JSON and Python's repr escape it.
        ('{"key": "sk-\\"a\\\\b"}', 'sk-"a\\b', '{"key": "********"}'),
        ("b'Bearer sk-a\\\\b'", 'sk-a\\b', "b'Bearer ********'"),
    ],
)
def test_mask(text, secret, expected):
    assert mask(text, secret) == expected


class Chunks:
    """A response body that arrives in the chunks given."""

    def __init__(self, *chunks):
        self.chunks = list(chunks)

    def read(self, amount):
        return self.chunks.pop(0) if self.chunks else b''


@pytest.mark.parametrize(
    'chunks, limit, expected',
    [
        ((b'ab', b'cd'), 4, b'abcd'),
        ((b'ab', b'cd', b'e'), 4, None),
        ((), 4, b''),
    ],
    ids=['at-the-limit', 'above-it', 'empty'],
)
def test_read_limited_reads_as_it_comes_and_stops_above_the_limit(chunks, limit, expected):
    assert read_limited(Chunks(*chunks), limit) == expected
