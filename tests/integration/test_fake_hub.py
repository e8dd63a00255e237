# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The real huggingface_hub (vLLM's, in .venv-vllm) downloads the tiny model from the fake Hub; checkpoint_verify judges it.

The fake Hub (tools/fake_hub.py) runs in this process; the download runs in .venv-vllm's python
with HF_ENDPOINT pointing at it, as the role runs it on a node. Then each fault of the issue,
named exactly: a flipped byte in the middle of a shard, a truncated shard, a missing file, an
extra file, a revision given as a branch name, and a Hub that drops the connection mid-file
(the download resumes with a Range request, and the result verifies).
"""

import filecmp
import functools
import json
import os
import random
import shutil
import struct
import subprocess

import pytest

from ansible_collections.llmserve.vllm.tests import support
from ansible_collections.llmserve.vllm.tools import fake_hub

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..'))
VLLM_PYTHON = os.path.join(REPO, '.venv-vllm', 'bin', 'python')
TOKEN = 'hf_fake-hub-integration-token'
# huggingface_hub hands the body on in 10 MiB chunks (constants.DOWNLOAD_CHUNK_SIZE): a resume
# from a Range needs a file of more than that, cut after more than that.
LARGE_BYTES = 24 << 20

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not os.path.exists(VLLM_PYTHON), reason='needs the CPU build of vLLM in .venv-vllm (make vllm-venv)'
    ),
]

run_module = functools.partial(support.module_result, 'checkpoint_verify')

DOWNLOAD = """
import json, sys
import huggingface_hub
repo_id, revision, local_dir = sys.argv[1:4]
path = huggingface_hub.snapshot_download(repo_id, revision=revision, local_dir=local_dir)
info = huggingface_hub.model_info(repo_id, revision=revision, files_metadata=True)
print(json.dumps({"path": path, "sha": info.sha, "siblings": sorted(
    [s.rfilename, s.size, s.blob_id, s.lfs.sha256 if s.lfs else None] for s in info.siblings)}))
"""


def download(hub, repo_id, revision, dest, token=None):
    env = dict(
        os.environ,
        HF_ENDPOINT=hub.url,
        HF_HUB_DISABLE_TELEMETRY='1',
        HF_HUB_ETAG_TIMEOUT='5',
        HF_HUB_DOWNLOAD_TIMEOUT='10',
        HF_HUB_DISABLE_PROGRESS_BARS='1',
        HF_HOME=os.path.join(dest + '.hf-home'),
        no_proxy='127.0.0.1,localhost',
        NO_PROXY='127.0.0.1,localhost',
    )
    env.pop('HF_TOKEN', None)
    if token:
        env['HF_TOKEN'] = token
    proc = subprocess.run(
        [VLLM_PYTHON, '-c', DOWNLOAD, repo_id, revision, dest],
        env=env,
        capture_output=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode('utf-8', 'replace')[-3000:]
    return json.loads(proc.stdout.decode('utf-8').strip().splitlines()[-1]), proc.stderr.decode('utf-8', 'replace')


@pytest.fixture(scope='module')
def tiny_chat():
    return os.path.join(support.tiny_models(), 'tiny-chat')


def large_shard(path):
    """A valid safetensors file of LARGE_BYTES of pseudo-random data (a misplaced resume shows in its digest)."""
    header = json.dumps({'blob': {'dtype': 'U8', 'shape': [LARGE_BYTES], 'data_offsets': [0, LARGE_BYTES]}}).encode(
        'utf-8'
    )
    with open(path, 'wb') as f:
        f.write(struct.pack('<Q', len(header)) + header + random.Random(7).randbytes(LARGE_BYTES))


@pytest.fixture(scope='module')
def hub_root(tmp_path_factory, tiny_chat):
    """A hub with llmserve/tiny-chat and llmserve/tiny-chat-large (the same plus a 24 MiB shard): (root, commits)."""
    root = str(tmp_path_factory.mktemp('hub'))
    large = str(tmp_path_factory.mktemp('large') / 'model')
    shutil.copytree(tiny_chat, large)
    large_shard(os.path.join(large, 'extra.safetensors'))
    return root, {
        'llmserve/tiny-chat': fake_hub.publish(root, 'llmserve/tiny-chat', tiny_chat),
        'llmserve/tiny-chat-large': fake_hub.publish(root, 'llmserve/tiny-chat-large', large),
    }


@pytest.fixture(scope='module')
def snapshot(tmp_path_factory, hub_root, tiny_chat):
    """tiny-chat as the real client downloads it from the hub (which wants a token): (hub, commit, dir, client view)."""
    root, commits = hub_root
    hub = fake_hub.FakeHub(root, token=TOKEN).start()
    dest = str(tmp_path_factory.mktemp('download') / 'tiny-chat')
    seen, dummy = download(hub, 'llmserve/tiny-chat', commits['llmserve/tiny-chat'], dest, token=TOKEN)
    yield hub, commits['llmserve/tiny-chat'], dest, seen
    hub.stop()


def verify_args(hub, commit, path, **more):
    args = {
        'path': path,
        'repo_id': 'llmserve/tiny-chat',
        'revision': commit,
        'endpoint': hub.url,
        'token': TOKEN,
        'timeout': 10,
    }
    args.update(more)
    return args


def test_the_download_is_the_model_and_verifies(tmp_path, snapshot, tiny_chat):
    hub, commit, path, seen = snapshot
    names = sorted(os.listdir(tiny_chat))
    assert filecmp.cmpfiles(tiny_chat, path, names, shallow=False) == (names, [], [])
    # The real client reads the fake Hub's model info as the module does.
    assert seen['sha'] == commit
    assert [s[0] for s in seen['siblings']] == names
    assert dict((s[0], s[3]) for s in seen['siblings'])['model.safetensors'] is not None
    cache = str(tmp_path / 'cache')
    rc, result = run_module(tmp_path, verify_args(hub, commit, path, cache_dir=cache))
    assert (rc, result['ok'], result['files'], result['revision']) == (0, True, len(names), commit), result
    assert TOKEN not in json.dumps(result)
    rc, again = run_module(tmp_path, verify_args(hub, commit, path, cache_dir=cache))
    assert (again['ok'], again['cache_hits'], again['hashed_bytes'], again['fingerprint']) == (
        True,
        len(names),
        0,
        result['fingerprint'],
    )


def flip_a_byte_in_the_middle(path):
    with open(path, 'r+b') as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))


def truncate_by_half(path):
    with open(path, 'r+b') as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize(
    'spoil, file, kind',
    [
        (
            lambda d: flip_a_byte_in_the_middle(os.path.join(d, 'model.safetensors')),
            'model.safetensors',
            'digest_mismatch',
        ),
        (lambda d: truncate_by_half(os.path.join(d, 'model.safetensors')), 'model.safetensors', 'truncated'),
        (lambda d: os.unlink(os.path.join(d, 'tokenizer.json')), 'tokenizer.json', 'missing'),
        (lambda d: open(os.path.join(d, 'notes.txt'), 'w').close(), 'notes.txt', 'extra_file'),
    ],
    ids=['flipped-byte-mid-shard', 'truncated-shard', 'missing-file', 'extra-file'],
)
def test_each_fault_is_named(tmp_path, snapshot, spoil, file, kind):
    hub, commit, path, seen = snapshot
    copy = str(tmp_path / 'copy')
    shutil.copytree(path, copy)
    spoil(copy)
    rc, result = run_module(tmp_path, verify_args(hub, commit, copy))
    assert rc == 1
    assert [(p['file'], p['kind']) for p in result['problems']] == [(file, kind)]
    assert result['msg'].startswith(
        'checkpoint %s does not match revision %s of llmserve/tiny-chat: 1 problem: %s: %s ('
        % (copy, commit, file, kind)
    )


def test_a_branch_name_is_refused_before_any_request(tmp_path, snapshot):
    hub, commit, path, seen = snapshot
    before = len(hub.requests)
    rc, result = run_module(tmp_path, verify_args(hub, commit, path, revision='main'))
    assert rc == 1
    assert result['msg'].startswith('revision "main" is not a commit: a branch or tag can move')
    assert '`hf models info llmserve/tiny-chat --revision main --expand sha --json`' in result['msg']
    assert len(hub.requests) == before


def test_a_dropped_connection_resumes_and_the_result_verifies(tmp_path, hub_root):
    root, commits = hub_root
    commit = commits['llmserve/tiny-chat-large']
    hub = fake_hub.FakeHub(root, drop_once=['extra.safetensors']).start()
    try:
        dest = str(tmp_path / 'large')
        seen, log = download(hub, 'llmserve/tiny-chat-large', commit, dest)
        resumed = [r for m, p, r in hub.requests if m == 'GET' and p.endswith('/extra.safetensors') and r]
        answered = [s for m, p, s in hub.answers if m == 'GET' and p.endswith('/extra.safetensors')]
        rc, result = run_module(
            tmp_path, {'path': dest, 'repo_id': 'llmserve/tiny-chat-large', 'revision': commit, 'endpoint': hub.url}
        )
    finally:
        hub.stop()
    assert 'Trying to resume download' in log
    assert (resumed, answered) == (['bytes=%d-' % (10 << 20)], [200, 206])
    assert (rc, result['ok'], result['files']) == (0, True, 7), result


FETCHER = os.path.join(REPO, 'roles', 'vllm_kimi', 'files', 'llmserve-fetch-model')


def fetch(hub, repo_id, revision, dest, *more):
    """The role's fetcher (llmserve-fetch-model) with the release's interpreter, as the role runs it."""
    env = dict(
        os.environ,
        HF_ENDPOINT=hub.url,
        HF_HUB_DISABLE_TELEMETRY='1',
        HF_HUB_DISABLE_PROGRESS_BARS='1',
        HF_HOME=dest + '.hf-home',
        no_proxy='127.0.0.1,localhost',
        NO_PROXY='127.0.0.1,localhost',
    )
    env.pop('HF_TOKEN', None)
    return subprocess.run(
        [VLLM_PYTHON, FETCHER, repo_id, revision, dest] + list(more),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope='module')
def open_hub(hub_root):
    hub = fake_hub.FakeHub(hub_root[0]).start()
    yield hub, hub_root[1]
    hub.stop()


def test_the_fetcher_fetches_what_is_missing_and_then_nothing(tmp_path, open_hub, tiny_chat):
    hub, commits = open_hub
    dest = str(tmp_path / 'tiny-chat')
    first = fetch(hub, 'llmserve/tiny-chat', commits['llmserve/tiny-chat'], dest)
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    names = sorted(os.listdir(tiny_chat))
    assert report['revision'] == commits['llmserve/tiny-chat']
    assert sorted(report['fetched']) == names
    assert report['missing_bytes'] == sum(os.path.getsize(os.path.join(tiny_chat, name)) for name in names)
    assert all(filecmp.cmp(os.path.join(tiny_chat, n), os.path.join(dest, n), shallow=False) for n in names)
    again = json.loads(fetch(hub, 'llmserve/tiny-chat', commits['llmserve/tiny-chat'], dest).stdout)
    assert (again['fetched'], again['missing_bytes']) == ([], 0)


def test_the_fetcher_refuses_a_filesystem_without_the_room_and_writes_nothing(tmp_path, open_hub):
    hub, commits = open_hub
    dest = str(tmp_path / 'revisions' / 'tiny-chat-large')
    free = shutil.disk_usage(str(tmp_path)).free
    result = fetch(
        hub, 'llmserve/tiny-chat-large', commits['llmserve/tiny-chat-large'], dest, '--margin-bytes', str(free)
    )
    assert result.returncode == 1
    message = result.stderr.strip()
    assert message.startswith('llmserve/tiny-chat-large at %s needs ' % commits['llmserve/tiny-chat-large']), message
    assert ('in %s, plus a margin of %d bytes, but its filesystem has ' % (dest, free)) in message, message
    assert not os.path.exists(str(tmp_path / 'revisions'))
