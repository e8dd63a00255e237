# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Unit tests of _hub_headers: safetensors headers read from the fake Hub by byte ranges, and refused."""

import io
import json
import os
import struct
from urllib.error import URLError

import pytest
from ansible.module_utils import urls

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._safetensors import read_header
from ansible_collections.llmserve.vllm.plugins.module_utils.hub._hub_headers import (
    HeaderFetchError,
    fetch_headers,
    resolve_url,
)
from ansible_collections.llmserve.vllm.tools import fake_hub

REPO = 'org/model'
TOKEN = 'hub-secret-token'
SHARDS = {
    'model-00001-of-00002.safetensors': {
        'model.embed_tokens.weight': ('BF16', [256, 64]),
        'model.layers.0.mlp.up_proj.weight': ('U8', [128, 128]),
        'model.layers.0.mlp.up_proj.weight_scale': ('F8_E4M3', [128, 16]),
        'model.layers.0.mlp.up_proj.weight_scale_2': ('F32', []),
    },
    'model-00002-of-00002.safetensors': {'lm_head.weight': ('BF16', [256, 64])},
}
BITS = {'BF16': 16, 'U8': 8, 'F8_E4M3': 8, 'F32': 32}
# Broken files, and what fetch_headers says of each ({url} is the file's).
BROKEN = {
    'short.safetensors': (b'\x10\x00\x00', '{url} is truncated: 3 bytes, shorter than the 8-byte header length'),
    'huge-header.safetensors': (
        struct.pack('<Q', 2**40) + b'{}',
        '{url} has a header length of 1099511627776 bytes, above the 100 MB safetensors limit: '
        'not a safetensors file or corrupt',
    ),
    'truncated-header.safetensors': (
        struct.pack('<Q', 4096) + b'{"a":',
        '{url} is truncated: its header length 4096 reaches beyond the end of the file (13 bytes)',
    ),
    'truncated-data.safetensors': (
        struct.pack('<Q', 72) + b'{"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}'.ljust(72) + b'\0' * 8,
        '{url} is truncated: its header describes 16 bytes of tensor data, 8 follow it',
    ),
    'not-json.safetensors': (
        struct.pack('<Q', 5) + b'{"a":',
        '{url} has an invalid header (not JSON): Expecting value: line 1 column 6 (char 5)',
    ),
}


def safetensors_bytes(tensors):
    """A safetensors file, written by hand: the 8-byte length, the JSON header, then the data (not zeros)."""
    header, offset = {'__metadata__': {'format': 'pt'}}, 0
    for name, (dtype, shape) in tensors.items():
        nbytes = BITS[dtype] // 8
        for d in shape:
            nbytes *= d
        header[name] = {'dtype': dtype, 'shape': shape, 'data_offsets': [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode('utf-8')
    return struct.pack('<Q', len(raw)) + raw + bytes(i % 251 for i in range(offset))


@pytest.fixture(scope='module')
def model(tmp_path_factory):
    model = tmp_path_factory.mktemp('model')
    (model / 'config.json').write_text('{"model_type": "llama"}\n')
    for name, tensors in SHARDS.items():
        (model / name).write_bytes(safetensors_bytes(tensors))
    for name, (content, _message) in BROKEN.items():
        (model / name).write_bytes(content)
    return model


@pytest.fixture(scope='module')
def published(model, tmp_path_factory):
    root = tmp_path_factory.mktemp('hub')
    return str(root), fake_hub.publish(str(root), REPO, str(model))


@pytest.fixture
def hub(published):
    """A fresh fake Hub (its requests recorded from empty) over the published model, guarded by TOKEN."""
    server = fake_hub.FakeHub(published[0], token=TOKEN).start()
    yield server, published[1]
    server.stop()


class Counted:
    """open_url that counts the body bytes read from each answer; ``strip_range`` drops the Range header."""

    def __init__(self, strip_range=False):
        self.read = 0
        self.strip_range = strip_range

    def __call__(self, url, headers, **kwargs):
        if self.strip_range:
            headers = dict((k, v) for k, v in headers.items() if k != 'Range')
        response = urls.open_url(url, headers=headers, **kwargs)
        read = response.read

        def counted(amt=None):
            data = read(amt)
            self.read += len(data)
            return data

        response.read = counted
        return response


def header_length(model, name):
    with open(os.path.join(str(model), name), 'rb') as f:
        return struct.unpack('<Q', f.read(8))[0]


def test_fetch_sizes_every_tensor_as_read_header_does(hub, model):
    server, commit = hub
    found = fetch_headers(server.url, REPO, commit, sorted(SHARDS), token=TOKEN, timeout=5)
    assert found == dict((name, read_header(os.path.join(str(model), name)).tensors) for name in SHARDS)
    assert found['model-00002-of-00002.safetensors'] == {'lm_head.weight': 256 * 64 * 2}


def test_fetch_makes_two_ranged_gets_per_file(hub, model):
    server, commit = hub
    fetch_headers(server.url, REPO, commit, sorted(SHARDS), token=TOKEN, timeout=5)
    expected = []
    for name in sorted(SHARDS):
        path = '/%s/resolve/%s/%s' % (REPO, commit, name)
        n = header_length(model, name)
        expected += [('GET', path, 'bytes=0-7'), ('GET', path, 'bytes=8-%d' % (8 + n - 1))]
    assert server.requests == expected
    assert [answer[2] for answer in server.answers] == [206] * 4


def test_fetch_transfers_only_the_header_bytes(hub, model):
    server, commit = hub
    opener = Counted()
    fetch_headers(server.url, REPO, commit, sorted(SHARDS), token=TOKEN, timeout=5, open_url=opener)
    headers = sum(8 + header_length(model, name) for name in SHARDS)
    assert opener.read == headers
    assert headers * 10 < sum(os.path.getsize(os.path.join(str(model), name)) for name in SHARDS)


def test_fetch_reads_a_whole_file_answer_only_as_far_as_the_header(hub, model):
    server, commit = hub
    name = 'model-00001-of-00002.safetensors'
    opener = Counted(strip_range=True)
    found = fetch_headers(server.url, REPO, commit, [name], token=TOKEN, timeout=5, open_url=opener)
    assert found[name] == read_header(os.path.join(str(model), name)).tensors
    assert (server.answers, opener.read) == (
        [('GET', '/%s/resolve/%s/%s' % (REPO, commit, name), 200)],
        8 + header_length(model, name),
    )


def test_fetch_of_a_branch(hub, model):
    server = hub[0]
    name = 'model-00002-of-00002.safetensors'
    assert fetch_headers(server.url, REPO, 'main', [name], token=TOKEN, timeout=5) == {
        name: read_header(os.path.join(str(model), name)).tensors
    }


@pytest.mark.parametrize('name', sorted(BROKEN))
def test_fetch_refuses_a_broken_file(hub, name):
    server, commit = hub
    with pytest.raises(HeaderFetchError) as caught:
        fetch_headers(server.url, REPO, commit, [name], token=TOKEN, timeout=5)
    assert str(caught.value) == BROKEN[name][1].format(url=resolve_url(server.url, REPO, commit, name))


@pytest.mark.parametrize(
    'name, token, message',
    [
        (
            'missing.safetensors',
            TOKEN,
            '{url} answered HTTP 404: no such file in org/model at revision {commit} '
            '(the Hub says: missing.safetensors does not exist on "{commit}")',
        ),
        (
            'model-00001-of-00002.safetensors',
            'wrong-token',
            '{url} answered HTTP 401: the token was refused (the Hub says: Invalid credentials in Authorization header)',
        ),
        (
            'model-00001-of-00002.safetensors',
            None,
            '{url} answered HTTP 401: the repository is private or gated and needs a token (token, or HF_TOKEN on '
            'the host) (the Hub says: Invalid credentials in Authorization header)',
        ),
    ],
    ids=['missing-file', 'wrong-token', 'no-token'],
)
def test_fetch_names_the_hub_answer(hub, name, token, message):
    server, commit = hub
    with pytest.raises(HeaderFetchError) as caught:
        fetch_headers(server.url, REPO, commit, [name], token=token, timeout=5)
    assert str(caught.value) == message.format(url=resolve_url(server.url, REPO, commit, name), commit=commit)
    assert TOKEN not in str(caught.value) and (token is None or token not in str(caught.value))


def test_fetch_names_a_connection_cut_short(published):
    name = 'model-00001-of-00002.safetensors'
    server = fake_hub.FakeHub(published[0], drop_once=[name]).start()
    try:
        with pytest.raises(HeaderFetchError) as caught:
            fetch_headers(server.url, REPO, published[1], [name], timeout=5)
    finally:
        server.stop()
    assert str(caught.value) == (
        'cannot fetch %s: the answer ended after 4 of its 8 bytes (the connection was cut)'
        % resolve_url(server.url, REPO, published[1], name)
    )


class Answer:
    """A canned 206 answer of open_url."""

    def __init__(self, body, content_range):
        self.body = io.BytesIO(body)
        self.headers = {'Content-Range': content_range}

    def getcode(self):
        return 206

    def read(self, amt=None):
        return self.body.read(amt)

    def close(self):
        pass


def test_fetch_names_a_header_shorter_than_its_length_when_the_size_is_unknown():
    answers = [Answer(struct.pack('<Q', 64), 'bytes 0-7/*'), Answer(b'{"a": ', 'bytes 8-71/*')]

    def opener(url, **kwargs):
        return answers.pop(0)

    with pytest.raises(HeaderFetchError) as caught:
        fetch_headers('https://hub.example', REPO, 'main', ['m.safetensors'], open_url=opener)
    assert str(caught.value) == (
        'https://hub.example/org/model/resolve/main/m.safetensors is truncated: '
        'its header length is 64, the answer ended after 6 header bytes'
    )


def test_fetch_masks_the_token_in_a_network_error():
    def opener(url, **kwargs):
        raise URLError('proxy refused Bearer %s' % TOKEN)

    with pytest.raises(HeaderFetchError) as caught:
        fetch_headers('https://hub.example', REPO, 'main', ['m.safetensors'], token=TOKEN, open_url=opener)
    assert str(caught.value) == (
        'cannot fetch https://hub.example/org/model/resolve/main/m.safetensors: proxy refused Bearer ********'
    )


def test_fetch_sends_the_token_to_the_hub_only():
    seen = []

    def opener(url, headers, **kwargs):
        seen.append((headers, kwargs['unredirected_headers'], kwargs['follow_redirects']))
        return Answer(struct.pack('<Q', 2), 'bytes 0-7/10') if len(seen) == 1 else Answer(b'{}', 'bytes 8-9/10')

    assert fetch_headers('https://hub.example', REPO, 'main', ['m.safetensors'], token=TOKEN, open_url=opener) == {
        'm.safetensors': {}
    }
    assert seen == [
        ({'Range': 'bytes=0-7', 'Authorization': 'Bearer %s' % TOKEN}, ['Authorization'], 'safe'),
        ({'Range': 'bytes=8-9', 'Authorization': 'Bearer %s' % TOKEN}, ['Authorization'], 'safe'),
    ]


@pytest.mark.parametrize(
    'endpoint, repo_id, revision, name, message',
    [
        ('ftp://hub', REPO, 'main', 'm.safetensors', 'endpoint "ftp://hub" is not an http:// or https:// URL'),
        ('https://hub', 'org/../x', 'main', 'm.safetensors', 'repo_id "org/../x" is not a Hub repository id'),
        ('https://hub', REPO, 'A' * 40, 'm.safetensors', 'revision %s must be written in lowercase' % ('A' * 40)),
        ('https://hub', REPO, 'main', '../m.safetensors', "file name '../m.safetensors' is not a relative path"),
    ],
    ids=['endpoint', 'repo-id', 'revision', 'file-name'],
)
def test_fetch_refuses_bad_arguments(endpoint, repo_id, revision, name, message):
    def opener(url, **kwargs):
        raise AssertionError('no request may be made')

    with pytest.raises(HeaderFetchError) as caught:
        fetch_headers(endpoint, repo_id, revision, [name], open_url=opener)
    assert str(caught.value).startswith(message)
