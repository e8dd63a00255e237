# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Unit tests of _hub_checkpoint and _hub_files: what the preflight plans from, read from the fake Hub in memory
where the model directory lacks it, and the Hub's refusals in words."""

import json
import os
import struct
from urllib.error import URLError

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._safetensors import scan
from ansible_collections.llmserve.vllm.plugins.module_utils.hub._hub_checkpoint import plan_inputs
from ansible_collections.llmserve.vllm.plugins.module_utils.hub._hub_files import HubFileError
from ansible_collections.llmserve.vllm.plugins.module_utils.hub._hub_headers import resolve_url
from ansible_collections.llmserve.vllm.tests.support import checkpoint_config
from ansible_collections.llmserve.vllm.tools import fake_hub

TOKEN = 'hub-checkpoint-secret'
CONFIG = dict(checkpoint_config('tiny-llama'), vocab_size=512, intermediate_size=512)
HF_QUANT = {
    'producer': {'name': 'modelopt', 'version': '0.29.0'},
    'quantization': {'quant_algo': 'NVFP4', 'group_size': 16, 'kv_cache_quant_algo': 'FP8', 'exclude_modules': []},
}
SHARDS = {
    'model-00001-of-00002.safetensors': {'model.embed_tokens.weight': ('BF16', [512, 256])},
    'model-00002-of-00002.safetensors': {'lm_head.weight': ('BF16', [512, 256]), 'model.norm.weight': ('F32', [256])},
}
BYTES = {'BF16': 2, 'F32': 4}


def tensor_bytes(dtype, shape):
    nbytes = BYTES[dtype]
    for d in shape:
        nbytes *= d
    return nbytes


def safetensors_bytes(tensors):
    """A safetensors file: the 8-byte length, the JSON header, then zeros for the data."""
    header, offset = {}, 0
    for name, (dtype, shape) in sorted(tensors.items()):
        nbytes = tensor_bytes(dtype, shape)
        header[name] = {'dtype': dtype, 'shape': shape, 'data_offsets': [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode('utf-8')
    return struct.pack('<Q', len(raw)) + raw + bytes(offset)


def write_checkpoint(directory, files):
    directory.mkdir()
    for name, content in files.items():
        (directory / name).write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    return directory


@pytest.fixture(scope='module')
def sources(tmp_path_factory):
    """Three revisions as checkpoint directories: sharded with an index (and hf_quant_config.json), a single
    model.safetensors (as the sandbox's tiny-kimi), and one without config.json."""
    base = tmp_path_factory.mktemp('sources')
    weight_map = dict((tensor, shard) for shard, tensors in SHARDS.items() for tensor in tensors)
    total = sum(tensor_bytes(*spec) for tensors in SHARDS.values() for spec in tensors.values())
    indexed = dict((name, safetensors_bytes(tensors)) for name, tensors in SHARDS.items())
    indexed.update(
        {
            'config.json': CONFIG,
            'hf_quant_config.json': HF_QUANT,
            'model.safetensors.index.json': {'metadata': {'total_size': total}, 'weight_map': weight_map},
            'tokenizer.json': {'version': '1.0'},
        }
    )
    single = {'config.json': CONFIG, 'model.safetensors': safetensors_bytes(SHARDS['model-00002-of-00002.safetensors'])}
    return {
        'org/indexed': write_checkpoint(base / 'indexed', indexed),
        'org/single': write_checkpoint(base / 'single', single),
        'org/noconfig': write_checkpoint(base / 'noconfig', {'model.safetensors': single['model.safetensors']}),
    }


@pytest.fixture(scope='module')
def published(sources, tmp_path_factory):
    root = str(tmp_path_factory.mktemp('hub'))
    return root, dict((repo, fake_hub.publish(root, repo, str(source))) for repo, source in sources.items())


@pytest.fixture
def hub(published):
    """A fresh fake Hub (requests recorded from empty) over the published revisions, guarded by TOKEN."""
    server = fake_hub.FakeHub(published[0], token=TOKEN).start()
    yield server
    server.stop()


def hub_option(server, published, repo, token=TOKEN, revision=None):
    return dict(repo_id=repo, revision=revision or published[1][repo], endpoint=server.url, token=token, timeout=5)


def test_an_indexed_revision_is_planned_from_the_hub_as_from_its_files(tmp_path, sources, published, hub):
    absent = tmp_path / 'models' / 'rev'
    inputs = plan_inputs(str(absent), hub_option(hub, published, 'org/indexed'), True)
    local = scan(str(sources['org/indexed']))
    assert (inputs.config, inputs.hf_quant_config, inputs.config_source, inputs.warnings) == (
        CONFIG,
        HF_QUANT,
        'hub',
        [],
    )
    assert (inputs.checkpoint.source, inputs.checkpoint.tensors, inputs.checkpoint.total_bytes) == (
        'hub',
        local.tensors,
        local.total_bytes,
    )
    commit = published[1]['org/indexed']
    # The small files the plan reads, the list of files, two byte ranges per shard: no tokenizer, no weights.
    assert sorted(path for method, path, ranged in hub.requests if ranged is None) == sorted(
        [
            '/api/models/org/indexed/revision/%s?blobs=true' % commit,
            '/org/indexed/resolve/%s/config.json' % commit,
            '/org/indexed/resolve/%s/hf_quant_config.json' % commit,
            '/org/indexed/resolve/%s/model.safetensors.index.json' % commit,
        ]
    )
    assert len([ranged for method, path, ranged in hub.requests if ranged]) == 2 * len(SHARDS)
    assert not (tmp_path / 'models').exists()


def test_a_single_file_revision_is_sized_from_its_header(tmp_path, sources, published, hub):
    absent = tmp_path / 'rev'
    inputs = plan_inputs(str(absent), hub_option(hub, published, 'org/single'), True)
    local = scan(str(sources['org/single']))
    assert (inputs.config, inputs.hf_quant_config, inputs.config_source) == (CONFIG, None, 'hub')
    assert (inputs.checkpoint.source, inputs.checkpoint.tensors, inputs.checkpoint.total_bytes) == (
        'hub',
        local.tensors,
        local.total_bytes,
    )
    assert not absent.exists()


def test_local_files_are_read_where_they_are(tmp_path, sources, published, hub):
    """config.json in the directory: the config is local; without weights there, they alone come from the Hub."""
    model = write_checkpoint(tmp_path / 'model', {'config.json': dict(CONFIG, hidden_size=256)})
    inputs = plan_inputs(str(model), hub_option(hub, published, 'org/single'), True)
    assert (inputs.config['hidden_size'], inputs.config_source, inputs.checkpoint.source) == (256, 'local', 'hub')
    assert [path for method, path, ranged in hub.requests if 'config.json' in path] == []
    assert sorted(os.listdir(str(model))) == ['config.json']


def test_without_weights_asked_for_only_the_config_is_read(tmp_path, published, hub):
    inputs = plan_inputs(str(tmp_path / 'rev'), hub_option(hub, published, 'org/single'), False)
    assert (inputs.checkpoint, inputs.config_source) == (None, 'hub')
    assert not [path for method, path, ranged in hub.requests if ranged]


GATED = 'the repository is private or gated: set hub.token to a token that has access to {repo}'


@pytest.mark.parametrize(
    'repo, token, revision, message',
    [
        (
            'org/indexed',
            None,
            None,
            '{url} answered HTTP 401: ' + GATED + ' (the Hub says: Invalid credentials in Authorization header)',
        ),
        (
            'org/indexed',
            'wrong-token',
            None,
            '{url} answered HTTP 401: the token in hub.token was refused '
            '(the Hub says: Invalid credentials in Authorization header)',
        ),
        (
            'org/indexed',
            TOKEN,
            '0' * 40,
            '{url} answered HTTP 404: no revision {revision} in {repo} (the Hub says: Invalid rev id: {revision})',
        ),
        (
            'org/nothing',
            TOKEN,
            '0' * 40,
            '{url} answered HTTP 404: no repository {repo} (the Hub says: Repository not found)',
        ),
        (
            'org/noconfig',
            TOKEN,
            None,
            '{url} answered HTTP 404: {repo} has no file config.json at revision {revision} '
            '(the Hub says: config.json does not exist on "{revision}")',
        ),
    ],
    ids=['gated-without-token', 'token-refused', 'no-revision', 'no-repository', 'no-config'],
)
def test_a_config_the_hub_does_not_give_names_url_and_cause(tmp_path, published, hub, repo, token, revision, message):
    option = hub_option(hub, published, repo, token, revision)
    absent = tmp_path / 'rev'
    with pytest.raises(HubFileError) as caught:
        plan_inputs(str(absent), option, True)
    url = resolve_url(hub.url, repo, option['revision'], 'config.json')
    assert str(caught.value) == message.format(url=url, repo=repo, revision=option['revision'])
    assert TOKEN not in str(caught.value) and 'wrong-token' not in str(caught.value)
    assert not absent.exists()


def test_a_hub_that_does_not_answer_is_named(tmp_path, published):
    server = fake_hub.FakeHub(published[0]).start()
    server.stop()  # its port is closed now
    option = hub_option(server, published, 'org/single')
    with pytest.raises(HubFileError) as caught:
        plan_inputs(str(tmp_path / 'rev'), option, True)
    assert str(caught.value) == 'cannot fetch %s: connection refused' % resolve_url(
        server.url, 'org/single', option['revision'], 'config.json'
    )


def test_the_token_is_masked_in_a_network_error(tmp_path):
    def opener(url, **kwargs):
        raise URLError('proxy refused Bearer %s' % TOKEN)

    option = dict(repo_id='org/x', revision='main', endpoint='https://hub.example', token=TOKEN, timeout=5)
    with pytest.raises(HubFileError) as caught:
        plan_inputs(str(tmp_path / 'rev'), option, True, open_url=opener)
    assert str(caught.value) == (
        'cannot fetch https://hub.example/org/x/resolve/main/config.json: proxy refused Bearer ********'
    )


def test_the_token_goes_to_the_hub_only(tmp_path):
    seen = []

    def opener(url, headers, **kwargs):
        seen.append((url, headers, kwargs['follow_redirects'], kwargs['unredirected_headers']))
        raise URLError('stop here')

    option = dict(repo_id='org/x', revision='main', endpoint='https://hub.example', token=TOKEN, timeout=5)
    with pytest.raises(HubFileError):
        plan_inputs(str(tmp_path / 'rev'), option, True, open_url=opener)
    assert seen == [
        (
            'https://hub.example/org/x/resolve/main/config.json',
            {'Authorization': 'Bearer %s' % TOKEN},
            'safe',
            ['Authorization'],
        )
    ]


@pytest.mark.parametrize(
    'option, message',
    [
        (dict(endpoint='ftp://hub'), 'hub: endpoint "ftp://hub" is not an http:// or https:// URL'),
        (dict(repo_id='org/../x'), 'hub: repo_id "org/../x" is not a Hub repository id'),
        (dict(revision='A' * 40), 'hub: revision %s must be written in lowercase' % ('A' * 40)),
    ],
    ids=['endpoint', 'repo-id', 'revision'],
)
def test_bad_hub_options_are_refused_before_any_request(tmp_path, option, message):
    def opener(url, **kwargs):
        raise AssertionError('no request may be made')

    option = dict(dict(repo_id='org/x', revision='main', endpoint='https://hub.example', timeout=5), **option)
    with pytest.raises(HubFileError) as caught:
        plan_inputs(str(tmp_path / 'rev'), option, True, open_url=opener)
    assert str(caught.value).startswith(message)
