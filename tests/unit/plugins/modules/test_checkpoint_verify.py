# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Run llmserve.vllm.checkpoint_verify as Ansible runs it, against a manifest file or the fake Hub."""

import json
import os
import struct

import pytest

from ansible_collections.llmserve.vllm.tools import fake_hub

# What the argument spec says of a NUL in a path option (the nul_free_path type).
NUL_REFUSED = (
    "argument '%s' is of type str and we were unable to convert to nul_free_path: a path cannot hold a NUL character"
)

TOKEN = 'hf_unit-test-token-never-shown'
HF_QUANT = '{\n  "producer": {"name": "modelopt"},\n  "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8"}\n}\n'


def shard(tensors):
    header, offset = {}, 0
    for name, nbytes in sorted(tensors.items()):
        header[name] = {'dtype': 'U8', 'shape': [nbytes], 'data_offsets': [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode('utf-8')
    return struct.pack('<Q', len(raw)) + raw + bytes(range(256)) * (offset // 256) + b'\x01' * (offset % 256)


@pytest.fixture
def model(tmp_path):
    """A checkpoint published on a fake Hub root: (checkpoint dir, hub root, commit, manifest file)."""
    source = tmp_path / 'source'
    source.mkdir()
    (source / 'config.json').write_text('{"model_type": "llama"}\n')
    (source / 'hf_quant_config.json').write_text(HF_QUANT)
    (source / 'model-00001-of-00002.safetensors').write_bytes(shard({'a': 3000, 'b': 10}))
    (source / 'model-00002-of-00002.safetensors').write_bytes(shard({'c': 2000}))
    root = tmp_path / 'hub'
    commit = fake_hub.publish(str(root), 'org/model', str(source))
    entries = fake_hub.describe_tree(str(source))
    manifest = tmp_path / 'manifest.json'
    manifest.write_text(
        json.dumps({'id': 'org/model', 'sha': commit, 'siblings': [fake_hub.sibling(e, True) for e in entries]})
    )
    checkpoint = tmp_path / 'checkpoint'
    os.rename(str(source), str(checkpoint))
    return str(checkpoint), str(root), commit, str(manifest)


@pytest.fixture
def hub(model):
    server = fake_hub.FakeHub(model[1], token=TOKEN).start()
    yield server
    server.stop()


def test_a_matching_checkpoint_passes(tmp_path, model, module_result):
    path, root, commit, manifest = model
    rc, result = module_result('checkpoint_verify', {'path': path, 'manifest': manifest, 'revision': commit})
    assert rc == 0, result
    assert (result['changed'], result['ok'], result['problems'], result['files'], result['revision']) == (
        False,
        True,
        [],
        4,
        commit,
    )
    assert result['bytes'] == sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    assert result['hashed_bytes'] == result['bytes'] and result['cache_hits'] == 0
    assert len(result['fingerprint']) == 64 and result['rewritten_by_kv_cache_quant'] == []


def test_the_manifest_comes_from_the_hub_with_the_token_unseen(tmp_path, model, hub, monkeypatch, module_result):
    path, root, commit, manifest = model
    monkeypatch.setenv('HF_ENDPOINT', hub.url)
    monkeypatch.setenv('HF_TOKEN', TOKEN)
    rc, result = module_result('checkpoint_verify', {'path': path, 'repo_id': 'org/model', 'revision': commit})
    assert (rc, result['ok'], result['revision']) == (0, True, commit), result
    assert TOKEN not in json.dumps(result)
    assert ('GET', '/api/models/org/model/revision/%s?blobs=true' % commit, None) in hub.requests


def test_a_branch_is_taken_only_when_allowed(tmp_path, model, hub, module_result):
    path, root, commit, manifest = model
    args = {'path': path, 'repo_id': 'org/model', 'revision': 'main', 'endpoint': hub.url, 'token': TOKEN}
    rc, result = module_result('checkpoint_verify', args)
    assert (rc, result['msg']) == (
        1,
        (
            'revision "main" is not a commit: a branch or tag can move, and then nodes fetch different files. Give the full '
            '40-hex commit it points to now: `hf models info org/model --revision main --expand sha --json`, '
            "huggingface_hub.model_info('org/model', revision='main').sha, or the commit history on the repository's web "
            'page (Files and versions, History); allow_unpinned_revision=true accepts a branch or tag anyway'
        ),
    )
    assert hub.requests == []
    rc, result = module_result('checkpoint_verify', dict(args, allow_unpinned_revision=True))
    assert (rc, result['ok'], result['revision']) == (0, True, commit)


def test_the_first_problems_are_named_in_the_message(tmp_path, model, module_result):
    path, root, commit, manifest = model
    os.unlink(os.path.join(path, 'config.json'))
    with open(os.path.join(path, 'model-00002-of-00002.safetensors'), 'r+b') as f:
        f.truncate(100)
    open(os.path.join(path, 'a.txt'), 'w').close()
    open(os.path.join(path, 'b.txt'), 'w').close()
    rc, result = module_result('checkpoint_verify', {'path': path, 'manifest': manifest})
    assert rc == 1
    assert result['msg'] == (
        'checkpoint %s does not match revision %s of manifest %s: 4 problems: a.txt: extra_file (in the checkpoint but '
        'not in the manifest of revision %s); b.txt: extra_file (in the checkpoint but not in the manifest of revision '
        '%s); config.json: missing (not in the checkpoint); and 1 more in problems'
        % (path, commit, manifest, commit, commit)
    )
    assert [(p['file'], p['kind']) for p in result['problems']] == [
        ('a.txt', 'extra_file'),
        ('b.txt', 'extra_file'),
        ('config.json', 'missing'),
        ('model-00002-of-00002.safetensors', 'truncated'),
    ]
    assert (result['ok'], result['changed'], result['files']) == (False, False, 4)
    assert 'fingerprint' not in result


def test_a_single_problem_is_named_alone(tmp_path, model, module_result):
    path, root, commit, manifest = model
    open(os.path.join(path, 'a.txt'), 'w').close()
    rc, result = module_result('checkpoint_verify', {'path': path, 'manifest': manifest})
    assert result['msg'].endswith(
        ': 1 problem: a.txt: extra_file (in the checkpoint but not in the manifest of revision %s)' % commit
    )


@pytest.mark.parametrize(
    'args, message',
    [
        ({'threads': 0}, 'threads must be at least 1, got 0'),
        ({'timeout': 0}, 'timeout must be from 1 to 86400 seconds, got 0'),
        ({'timeout': 86401}, 'timeout must be from 1 to 86400 seconds, got 86401'),
        (
            {'manifest': None, 'repo_id': 'org/model', 'revision': 'f' * 40, 'token': 'hf_abc\n'},
            'token must be printable ASCII, without spaces or control characters (a line break from a YAML block scalar?)',
        ),
        ({'path': '{tmp}/x\0y'}, NUL_REFUSED % 'path'),
        ({'ignore': ['*']}, 'the ignore patterns leave none of the 4 files of manifest {manifest} to check'),
        ({'repo_id': 'org/model', 'revision': 'f' * 40}, 'parameters are mutually exclusive: manifest|repo_id'),
        ({'manifest': None}, 'one of the following is required: manifest, repo_id'),
        ({'manifest': None, 'repo_id': 'org/model'}, "missing parameter(s) required by 'repo_id': revision"),
        (
            {'manifest': None, 'repo_id': 'org/../x', 'revision': 'f' * 40},
            "repo_id \"org/../x\" is not a Hub repository id: NAMESPACE/NAME of letters, digits, '_', '-' and '.' "
            '(for example moonshotai/Kimi-K2.5)',
        ),
        (
            {'manifest': None, 'repo_id': 'org/model', 'revision': 'f' * 40, 'endpoint': 'ftp://hub'},
            'endpoint "ftp://hub" is not an http:// or https:// URL',
        ),
        (
            {
                'manifest': None,
                'repo_id': 'org/model',
                'revision': 'f' * 40,
                'endpoint': 'http://127.0.0.1:{port}',
                'timeout': 5,
            },
            'cannot fetch http://127.0.0.1:{port}/api/models/org/model/revision/ffffffffffffffffffffffffffffffffffffffff'
            '?blobs=true: [Errno 111] Connection refused',
        ),
        ({'revision': 'f' * 40}, 'manifest {manifest} describes commit {commit}, not revision ' + 'f' * 40),
        ({'revision': 'F' * 40}, 'revision %s must be written in lowercase, as the Hub writes commits' % ('F' * 40)),
        ({'path': '{tmp}/nowhere'}, 'checkpoint directory {tmp}/nowhere does not exist'),
        ({'path': '{manifest}'}, 'checkpoint path {manifest} is a regular file, not a directory'),
        (
            {'manifest': '{tmp}/bad.json'},
            'manifest {tmp}/bad.json is not valid JSON: Expecting value: line 1 column 1 (char 0)',
        ),
        ({'manifest': '{tmp}/fifo'}, 'manifest {tmp}/fifo is not a regular file'),
        ({'manifest': '{tmp}/missing.json'}, 'cannot read manifest {tmp}/missing.json: No such file or directory'),
    ],
    ids=[
        'threads',
        'timeout',
        'timeout-above-a-day',
        'token-with-newline',
        'path-nul',
        'ignore-everything',
        'both-sources',
        'no-source',
        'repo-without-revision',
        'bad-repo-id',
        'bad-endpoint',
        'hub-down',
        'other-commit',
        'uppercase',
        'no-directory',
        'file-not-directory',
        'manifest-not-json',
        'manifest-fifo',
        'manifest-missing',
    ],
)
def test_bad_input_messages(tmp_path, model, args, message, module_result, free_port):
    path, root, commit, manifest = model
    (tmp_path / 'bad.json').write_text('<html>')
    os.mkfifo(str(tmp_path / 'fifo'))
    fill = dict(tmp=tmp_path, manifest=manifest, commit=commit, port=free_port)
    full = dict({'path': path, 'manifest': manifest}, **args)
    full = dict((k, v.format(**fill) if isinstance(v, str) else v) for k, v in full.items() if v is not None)
    rc, result = module_result('checkpoint_verify', full)
    assert rc == 1, result
    assert result['msg'].startswith(message.format(**fill))
    assert 'exception' not in result


def test_check_mode_reads_the_cache_but_writes_none(tmp_path, model, module_result):
    path, root, commit, manifest = model
    cache = tmp_path / 'cache'
    args = {'path': path, 'manifest': manifest, 'cache_dir': str(cache), '_ansible_check_mode': True}
    rc, result = module_result('checkpoint_verify', args)
    assert (rc, result['ok'], os.path.exists(str(cache))) == (0, True, False)
    rc, first = module_result('checkpoint_verify', dict(args, _ansible_check_mode=False))
    assert (first['cache_hits'], oct(os.stat(str(cache / 'checkpoint-digests.json')).st_mode & 0o777)) == (0, '0o600')
    rc, again = module_result('checkpoint_verify', dict(args, _ansible_check_mode=True))
    assert (again['cache_hits'], again['hashed_bytes'], again['fingerprint']) == (4, 0, first['fingerprint'])


def test_a_checkpoint_kv_cache_quant_stripped_passes(tmp_path, model, module_result):
    path, root, commit, manifest = model
    rc, stripped = module_result('kv_cache_quant', {'path': path, 'state': 'absent'})
    assert (rc, stripped['changed']) == (0, True), stripped
    rc, result = module_result('checkpoint_verify', {'path': path, 'manifest': manifest})
    assert (rc, result['ok'], result['rewritten_by_kv_cache_quant']) == (0, True, ['hf_quant_config.json']), result


def test_without_fail_on_mismatch_a_mismatch_is_reported_not_failed(tmp_path, model, module_result):
    path, root, commit, manifest = model
    with open(os.path.join(path, 'model-00002-of-00002.safetensors'), 'r+b') as f:
        f.truncate(100)
    rc, result = module_result('checkpoint_verify', {'path': path, 'manifest': manifest, 'fail_on_mismatch': False})
    assert rc == 0, result
    assert not result.get('failed') and result['ok'] is False
    assert [(p['file'], p['kind']) for p in result['problems']] == [('model-00002-of-00002.safetensors', 'truncated')]
    assert result['msg'].startswith(
        'checkpoint %s does not match revision %s of manifest %s: 1 problem: ' % (path, commit, manifest)
    ), result['msg']
    assert 'fingerprint' not in result


def test_without_fail_on_mismatch_a_checkpoint_still_to_fetch_is_reported(tmp_path, model, module_result):
    path, root, commit, manifest = model
    missing = str(tmp_path / 'not-fetched-yet')
    rc, result = module_result('checkpoint_verify', {'path': missing, 'manifest': manifest, 'fail_on_mismatch': False})
    assert rc == 0, result
    assert (result['ok'], result['problems'], result['revision']) == (
        False,
        [{'file': '.', 'kind': 'missing', 'detail': 'the checkpoint directory does not exist'}],
        commit,
    )
    assert result['msg'] == 'checkpoint %s does not exist yet: nothing of revision %s of manifest %s is fetched' % (
        missing,
        commit,
        manifest,
    )
    # The whole revision is still to come: the totals the fetch's progress lines count against.
    checked = module_result('checkpoint_verify', {'path': path, 'manifest': manifest})[1]
    assert (result['files'], result['bytes']) == (checked['files'], checked['bytes'])
    assert result['files'] > 0 and result['bytes'] > 0


def test_without_fail_on_mismatch_what_prevents_the_check_still_fails(tmp_path, model, module_result):
    path, root, commit, manifest = model
    (tmp_path / 'bad.json').write_text('<html>')
    rc, result = module_result(
        'checkpoint_verify', {'path': path, 'manifest': str(tmp_path / 'bad.json'), 'fail_on_mismatch': False}
    )
    assert rc == 1 and result['failed'], result


def test_a_config_linked_from_outside_fails_unless_links_outside_are_allowed(tmp_path, model, module_result):
    """The same bytes through a link that leaves the checkpoint: refused by default, named with where it leads."""
    path, root, commit, manifest = model
    outside = str(tmp_path / 'outside-config.json')
    os.rename(os.path.join(path, 'config.json'), outside)
    os.symlink(outside, os.path.join(path, 'config.json'))
    rc, result = module_result('checkpoint_verify', {'path': path, 'manifest': manifest})
    assert rc == 1 and result['failed'], result
    assert result['problems'] == [
        {
            'file': 'config.json',
            'kind': 'link_outside',
            'detail': 'a link that leads outside the checkpoint, to %s' % outside,
        }
    ]
    rc, result = module_result('checkpoint_verify', {'path': path, 'manifest': manifest, 'allow_links_outside': True})
    assert rc == 0 and result['ok'], result
