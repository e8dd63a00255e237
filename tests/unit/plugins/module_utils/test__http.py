# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Unit tests of _http: the endpoint's URL and key checked before the first request, what a missing answer was,
and secrets masked in every text that comes back."""

import os
import shutil
import socket
from http.client import BadStatusLine, IncompleteRead, RemoteDisconnected

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._http import (
    Unreachable,
    api_key_problem,
    ca_path_problem,
    describe_unreachable,
    is_loopback_url,
    make_transport,
    mask,
    read_limited,
    url_problem,
)
from ansible_collections.llmserve.vllm.tests.fake_openai import reply
from ansible_collections.llmserve.vllm.tests.support import Canary


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


# ---------------------------------------------------------------- https with a CA of the deployment's own

NOT_PEM = "holds no certificate that Python's ssl can load (PEM expected): "


@pytest.mark.parametrize(
    'name, content, expected',
    [
        ('missing.pem', None, "ca_path '{path}' does not exist"),
        ('dir', 'directory', "ca_path '{path}' is a directory; give a file of PEM CA certificates"),
        ('fifo', 'fifo', "ca_path '{path}' is not a regular file; give a file of PEM CA certificates"),
        (
            'empty.pem',
            b'',
            "ca_path '{path}' " + NOT_PEM + '[X509: NO_CERTIFICATE_OR_CRL_FOUND] no certificate or crl found',
        ),
        (
            'key.pem',
            'key',
            "ca_path '{path}' " + NOT_PEM + '[X509: NO_CERTIFICATE_OR_CRL_FOUND] no certificate or crl found',
        ),
        (
            'broken.pem',
            b'-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n',
            "ca_path '{path}' " + NOT_PEM + '[X509] PEM lib',
        ),
        ('file/ca.pem', 'under-a-file', "ca_path '{path}' cannot be read: Not a directory"),
        ('ca.pem', 'ca', None),
    ],
    ids=['missing', 'directory', 'fifo', 'empty', 'a-key-only', 'broken-pem', 'under-a-file', 'the-ca'],
)
def test_ca_path_problem(tmp_path, local_ca, name, content, expected):
    path = tmp_path / name
    if content == 'directory':
        path.mkdir()
    elif content == 'fifo':
        os.mkfifo(str(path))  # opened for reading, it would block until a writer came
    elif content == 'under-a-file':
        path.parent.write_bytes(b'')
    elif content == 'key':
        shutil.copyfile(local_ca.server_key, str(path))
    elif content == 'ca':
        shutil.copyfile(local_ca.ca, str(path))
    elif content is not None:
        path.write_bytes(content)
    assert ca_path_problem(str(path)) == (expected.format(path=path) if expected else None)


@pytest.mark.parametrize('ca_path', [None, '', '/no/such/ca.pem'], ids=['none', 'empty', 'missing'])
def test_ca_path_problem_without_validate_certs_checks_nothing(ca_path):
    assert ca_path_problem(ca_path, validate_certs=False) is None


@pytest.mark.skipif(os.geteuid() == 0, reason='root reads a file of mode 0')
def test_ca_path_problem_of_a_file_that_cannot_be_read(tmp_path, local_ca):
    path = tmp_path / 'ca.pem'
    shutil.copyfile(local_ca.ca, str(path))
    path.chmod(0)
    assert ca_path_problem(str(path)) == "ca_path '%s' cannot be read: Permission denied" % path


@pytest.fixture
def https_server(fake_openai, local_ca):
    """A server on 127.0.0.1 that presents local_ca's certificate and answers /health 200."""
    return fake_openai({'/health': reply(200, '{}')}, tls=local_ca)


def test_https_through_the_ca_of_ca_path(https_server, local_ca):
    http = make_transport(https_server.url, ca_path=local_ca.ca)
    assert http('GET', '/health', None, 10, 100) == (200, '{}')


@pytest.mark.parametrize('trust', ['host', 'other-ca'])
def test_https_refuses_a_certificate_that_does_not_chain_to_the_trusted_cas(https_server, other_ca, trust):
    http = make_transport(https_server.url, ca_path=other_ca.ca if trust == 'other-ca' else None)
    with pytest.raises(Unreachable) as caught:
        http('GET', '/health', None, 10, 100)
    assert caught.value.reason.startswith(
        '[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: unable to get local issuer certificate'
    )
    assert https_server.requests == []


def test_without_validate_certs_ca_path_is_not_read(https_server, tmp_path):
    http = make_transport(https_server.url, validate_certs=False, ca_path=str(tmp_path / 'missing.pem'))
    assert http('GET', '/health', None, 10, 100) == (200, '{}')


@pytest.mark.parametrize(
    'url, loopback',
    [
        ('http://127.0.0.1:8000', True),
        ('http://127.3.2.1/v1', True),
        ('http://localhost:8000', True),
        ('http://LOCALHOST:8000', True),
        ('http://api.localhost:8000', True),
        ('http://[::1]:8000', True),
        ('http://10.0.0.5:8000', False),
        ('https://kimi.example.org:8443/v1', False),
        ('http://127.0.0.1.example.org', False),
        ('http://[::ffff:10.0.0.5]:8000', False),
    ],
)
def test_is_loopback_url(url, loopback):
    assert is_loopback_url(url) is loopback


@pytest.fixture
def proxy(monkeypatch):
    """A proxy the environment names, which counts what it was asked for."""
    canary = Canary()
    address = canary.url.rsplit('/', 1)[0]
    for name in ('no_proxy', 'NO_PROXY'):
        monkeypatch.delenv(name, raising=False)
    for name in ('http_proxy', 'HTTP_PROXY'):
        monkeypatch.setenv(name, address)
    yield canary
    canary.close()


def test_a_loopback_url_never_goes_through_the_proxy(fake_openai, proxy):
    """The gates ask vLLM on 127.0.0.1 with its key: a proxy would read the key and ask its own host."""
    server = fake_openai({'/health': reply(200, '{}')})
    assert make_transport(server.url, api_key='sk-k3y')('GET', '/health', None, 10, 100) == (200, '{}')
    assert proxy.hits == [] and len(server.requests) == 1
    # Any other host does, as use_proxy says: the proxy above is the environment's.
    assert make_transport('http://llmserve-proxied.invalid')('GET', '/health', None, 10, 100)[0] == 404
    assert proxy.hits == ['http://llmserve-proxied.invalid/health']


def test_a_unix_socket_is_reached_at_its_path_and_never_through_the_proxy(fake_openai, proxy, tmp_path):
    """vLLM's --uds: the gates connect to the socket, whatever host the URL names, and no proxy carries it."""
    socket_path = str(tmp_path / 'vllm.sock')
    server = fake_openai({'/health': reply(200, '{"ok": 1}')}, unix_socket=socket_path)
    http = make_transport('http://llmserve-unix.invalid', api_key='sk-k3y', unix_socket=socket_path)
    assert http('GET', '/health', None, 10, 100) == (200, '{"ok": 1}')
    assert proxy.hits == [] and [request.path for request in server.requests] == ['/health']
    assert server.requests[0].headers['Authorization'] == 'Bearer sk-k3y'


def test_a_unix_socket_not_there_yet_is_a_server_that_does_not_answer(tmp_path):
    """The socket appears some seconds after vLLM's start: until then the gates poll, as on a closed port."""
    http = make_transport('http://localhost', unix_socket=str(tmp_path / 'not-yet.sock'))
    with pytest.raises(Unreachable, match='No such file or directory'):
        http('GET', '/health', None, 10, 100)
