# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Unit tests of _hub_manifest: the model info read and refused, pinned revisions, the fetch from a Hub."""

import hashlib
import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.hub import _hub_manifest
from ansible_collections.llmserve.vllm.plugins.module_utils.hub._hub_manifest import (
    ManifestError,
    endpoint_problem,
    fetch_manifest,
    model_info_url,
    parse_manifest,
    read_manifest_file,
    repo_id_problem,
    revision_problem,
)
from ansible_collections.llmserve.vllm.tools import fake_hub

COMMIT = '0123456789abcdef0123456789abcdef01234567'
SHA256 = 'ab' * 32
BLOB = 'cd' * 20
LFS_FILE = {
    'rfilename': 'model.safetensors',
    'size': 10,
    'blobId': 'ef' * 20,
    'lfs': {'sha256': SHA256, 'size': 10, 'pointerSize': 131},
}
SMALL_FILE = {'rfilename': 'config.json', 'size': 3, 'blobId': BLOB}


def info(*siblings, **top):
    doc = {'id': 'org/model', 'sha': COMMIT, 'siblings': list(siblings)}
    doc.update(top)
    return json.dumps(doc).encode('utf-8')


def test_parse_reads_lfs_and_git_digests():
    manifest = parse_manifest(info(LFS_FILE, SMALL_FILE), 'M')
    assert manifest.revision == COMMIT
    assert sorted((f.name, f.size, f.algorithm, f.digest) for f in manifest.files.values()) == [
        ('config.json', 3, 'git-sha1', BLOB),
        ('model.safetensors', 10, 'sha256', SHA256),
    ]


def test_parse_lowercases_hex_digits():
    upper = dict(SMALL_FILE, blobId=BLOB.upper())
    manifest = parse_manifest(info(upper, sha=COMMIT.upper()), 'M')
    assert (manifest.revision, manifest.files['config.json'].digest) == (COMMIT, BLOB)


def test_parse_reads_what_fake_hub_serves(tmp_path):
    (tmp_path / 'sub').mkdir()
    (tmp_path / 'sub' / 'a.txt').write_bytes(b'hello\n')
    (tmp_path / 'w.safetensors').write_bytes(b'x' * 5)
    entries = fake_hub.describe_tree(str(tmp_path))
    doc = {'sha': fake_hub.commit_of(entries), 'siblings': [fake_hub.sibling(e, True) for e in entries]}
    manifest = parse_manifest(json.dumps(doc).encode('utf-8'), 'M')
    # git hash-object of "hello\n" and sha256sum of "xxxxx".
    assert manifest.files['sub/a.txt'].digest == 'ce013625030ba8dba906f756967f9e9ca394464a'
    assert manifest.files['w.safetensors'].digest == hashlib.sha256(b'xxxxx').hexdigest()


@pytest.mark.parametrize(
    'data, message',
    [
        (b'{"sha": ', 'M is not valid JSON: Expecting value: line 1 column 9 (char 8)'),
        (b'\xff\xfe', "M is not UTF-8 text: 'utf-8' codec can't decode byte 0xff in position 0: invalid start byte"),
        (b'[]', "M does not hold a JSON object (the Hub's model info)"),
        (b'[' * 100000 + b']' * 100000, 'M is nested too deeply to be read as JSON'),
        (info(SMALL_FILE, sha=None), 'M has sha null, not the 40-hex commit of the revision it describes'),
        (info(SMALL_FILE, sha='main'), 'M has sha "main", not the 40-hex commit of the revision it describes'),
        (info(siblings={}), "M has siblings {}, not the list of the revision's files"),
        (info('config.json'), 'M: siblings[0] is "config.json", not an object'),
        (info(dict(SMALL_FILE, rfilename='')), 'M: siblings[0].rfilename "" is not a non-empty string'),
        (info(dict(SMALL_FILE, rfilename=7)), 'M: siblings[0].rfilename 7 is not a non-empty string'),
        (
            info(dict(SMALL_FILE, rfilename='/etc/passwd')),
            'M: siblings[0].rfilename "/etc/passwd" is not a relative path inside the checkpoint',
        ),
        (
            info(dict(SMALL_FILE, rfilename='a/../../x')),
            'M: siblings[0].rfilename "a/../../x" is not a relative path inside the checkpoint',
        ),
        (
            info(dict(SMALL_FILE, rfilename='a//b')),
            'M: siblings[0].rfilename "a//b" is not a relative path inside the checkpoint',
        ),
        (info(dict(SMALL_FILE, rfilename='a\0b')), 'M: siblings[0].rfilename "a\\u0000b" holds a NUL character'),
        (
            info({'rfilename': 'config.json'}),
            'M: config.json has no size and blobId: the manifest must be the model info with blob metadata '
            '(?blobs=true, files_metadata=True)',
        ),
        (info(dict(SMALL_FILE, size=-1)), 'M: config.json has size -1, not a byte count'),
        (info(dict(SMALL_FILE, size=True)), 'M: config.json has size true, not a byte count'),
        (info(dict(SMALL_FILE, size=3.0)), 'M: config.json has size 3.0, not a byte count'),
        (info(dict(SMALL_FILE, size='3')), 'M: config.json has size "3", not a byte count'),
        (info(dict(SMALL_FILE, size=2**63)), 'M: config.json has size 9223372036854775808, not a byte count'),
        (
            info(dict(SMALL_FILE, rfilename='\udcff.bin')),
            'M: siblings[0].rfilename "\\udcff.bin" is not valid UTF-8 text (a lone surrogate escape)',
        ),
        (
            info(SMALL_FILE, sha=COMMIT + '\n'),
            'M has sha "%s\\n", not the 40-hex commit of the revision it describes' % COMMIT,
        ),
        (info(dict(SMALL_FILE, blobId='xyz')), 'M: config.json has blobId "xyz", not a git blob id of 40 hex digits'),
        (info(dict(SMALL_FILE, blobId=None)), 'M: config.json has blobId null, not a git blob id of 40 hex digits'),
        (
            info(dict(LFS_FILE, lfs={'size': 10})),
            'M: model.safetensors has lfs {"size": 10} without a sha256 of 64 hex digits',
        ),
        (info(dict(LFS_FILE, lfs='yes')), 'M: model.safetensors has lfs "yes" without a sha256 of 64 hex digits'),
        (info(dict(LFS_FILE, lfs={'sha256': SHA256, 'size': 11})), 'M: model.safetensors has size 10 but lfs.size 11'),
        (info(SMALL_FILE, SMALL_FILE), 'M lists config.json twice'),
    ],
    ids=[
        'not-json',
        'not-utf8',
        'array',
        'deep',
        'no-sha',
        'branch-sha',
        'siblings-object',
        'sibling-string',
        'empty-name',
        'number-name',
        'absolute',
        'dot-dot',
        'empty-component',
        'nul',
        'no-blobs',
        'negative-size',
        'bool-size',
        'float-size',
        'string-size',
        'size-beyond-int64',
        'surrogate-name',
        'sha-and-newline',
        'bad-blob',
        'null-blob',
        'lfs-no-sha',
        'lfs-string',
        'lfs-size-differs',
        'duplicate',
    ],
)
def test_parse_refuses(data, message):
    with pytest.raises(ManifestError) as caught:
        parse_manifest(data, 'M')
    assert str(caught.value) == message


BRANCH_MESSAGE = (
    'revision "main" is not a commit: a branch or tag can move, and then nodes fetch different files. Give the full '
    '40-hex commit it points to now: `hf models info org/model --revision main --expand sha --json`, '
    "huggingface_hub.model_info('org/model', revision='main').sha, or the commit history on the repository's web page "
    '(Files and versions, History); allow_unpinned_revision=true accepts a branch or tag anyway'
)


@pytest.mark.parametrize(
    'revision, allow, message',
    [
        (COMMIT, False, None),
        ('main', False, BRANCH_MESSAGE),
        ('main', True, None),
        ('v1.0', True, None),
        (COMMIT[:12], False, BRANCH_MESSAGE.replace('"main"', '"%s"' % COMMIT[:12]).replace('main', COMMIT[:12])),
        (COMMIT.upper(), False, 'revision %s must be written in lowercase, as the Hub writes commits' % COMMIT.upper()),
        (' ', True, 'revision must not be empty'),
        (COMMIT + '\n', False, BRANCH_MESSAGE.replace('"main"', '"%s\\n"' % COMMIT).replace('main', 'BRANCH')),
    ],
    ids=[
        'commit',
        'branch',
        'branch-allowed',
        'tag-allowed',
        'short-commit',
        'uppercase',
        'blank',
        'commit-and-newline',
    ],
)
def test_revision_problem(revision, allow, message):
    assert revision_problem(revision, allow, 'org/model') == message


@pytest.mark.parametrize(
    'repo_id, good',
    [
        ('moonshotai/Kimi-K2.5', True),
        ('gpt2', True),
        ('org/a_b.c-d', True),
        ('org/../x', False),
        ('org/a--b', False),
        ('org/name/extra', False),
        ('/name', False),
        ('org/', False),
        ('org/name.', False),
        ('org name', False),
        ('org/%s' % ('n' * 97), False),
        ('org/näme', False),
        ('org/model\n', False),
    ],
    ids=[
        'kimi',
        'no-namespace',
        'punctuation',
        'dot-dot',
        'double-dash',
        'three-parts',
        'leading-slash',
        'no-name',
        'trailing-dot',
        'space',
        'too-long',
        'non-ascii',
        'trailing-newline',
    ],
)
def test_repo_id_problem(repo_id, good):
    message = repo_id_problem(repo_id)
    assert (message is None) == good
    if not good:
        assert message.startswith('repo_id %s is not a Hub repository id' % json.dumps(repo_id))


@pytest.mark.parametrize(
    'endpoint, good',
    [
        ('https://huggingface.co', True),
        ('http://mirror.internal:8080/hf', True),
        ('ftp://hub', False),
        ('http://hub\n', False),
        ('http://', False),
        ('https://hub/a b', False),
    ],
    ids=['hub', 'mirror-with-path', 'ftp', 'trailing-newline', 'no-host', 'space'],
)
def test_endpoint_problem(endpoint, good):
    assert (endpoint_problem(endpoint) is None) == good


def test_model_info_url_quotes_the_revision():
    assert (
        model_info_url('https://hub.example/', 'org/m', 'refs/pr/1')
        == 'https://hub.example/api/models/org/m/revision/refs%2Fpr%2F1?blobs=true'
    )


def test_read_manifest_file_refuses_a_fifo_without_blocking(tmp_path):
    fifo = tmp_path / 'manifest.json'
    os.mkfifo(str(fifo))
    with pytest.raises(ManifestError) as caught:
        read_manifest_file(str(fifo))
    assert str(caught.value) == 'manifest %s is not a regular file' % fifo


@pytest.mark.parametrize(
    'make, message',
    [
        (lambda p: None, 'cannot read manifest {p}: No such file or directory'),
        (lambda p: p.mkdir(), 'manifest {p} is not a regular file'),
        (
            lambda p: p.write_bytes(b'{'),
            'manifest {p} is not valid JSON: Expecting property name enclosed in double quotes: '
            'line 1 column 2 (char 1)',
        ),
        (lambda p: p.write_bytes(b' ' * 65), 'manifest {p} is larger than 64 bytes: not a model info'),
    ],
    ids=['missing', 'directory', 'not-json', 'too-large'],
)
def test_read_manifest_file_refuses(tmp_path, monkeypatch, make, message):
    monkeypatch.setattr(_hub_manifest, 'MAX_MANIFEST_BYTES', 64)
    path = tmp_path / 'manifest.json'
    make(path)
    with pytest.raises(ManifestError) as caught:
        read_manifest_file(str(path))
    assert str(caught.value) == message.format(p=path)


# ---------------------------------------------------------------- fetching from a Hub


@pytest.fixture(scope='module')
def hub(tmp_path_factory):
    """The fake Hub with one small repository, guarded by a token."""
    model = tmp_path_factory.mktemp('model')
    (model / 'config.json').write_text('{"model_type": "llama"}\n')
    (model / 'model.safetensors').write_bytes(b'\0' * 64)
    root = tmp_path_factory.mktemp('hub')
    commit = fake_hub.publish(str(root), 'org/model', str(model))
    server = fake_hub.FakeHub(str(root), token='hub-secret-token').start()
    yield server, commit
    server.stop()


def test_fetch_reads_the_model_info(hub):
    server, commit = hub
    manifest = fetch_manifest(server.url, 'org/model', commit, token='hub-secret-token', timeout=5)
    assert manifest.revision == commit
    assert sorted(manifest.files) == ['config.json', 'model.safetensors']
    assert manifest.files['model.safetensors'].algorithm == 'sha256'


def test_fetch_of_a_branch_gives_its_commit(hub):
    server, commit = hub
    assert fetch_manifest(server.url, 'org/model', 'main', token='hub-secret-token', timeout=5).revision == commit


@pytest.mark.parametrize(
    'repo_id, revision, token, message',
    [
        (
            'org/model',
            None,
            None,
            '{url}/api/models/org/model/revision/{commit}?blobs=true answered HTTP 401: the repository '
            'is private or gated and needs a token (token, or HF_TOKEN on the host) (the Hub says: Invalid credentials in '
            'Authorization header)',
        ),
        (
            'org/model',
            None,
            'wrong-token',
            '{url}/api/models/org/model/revision/{commit}?blobs=true answered HTTP 401: '
            'the token was refused (the Hub says: Invalid credentials in Authorization header)',
        ),
        (
            'org/other',
            None,
            'hub-secret-token',
            '{url}/api/models/org/other/revision/{commit}?blobs=true answered HTTP 404: '
            'no repository org/other, or no revision {commit} in it (the Hub says: Repository not found)',
        ),
        (
            'org/model',
            'f' * 40,
            'hub-secret-token',
            '{url}/api/models/org/model/revision/{rev}?blobs=true answered HTTP 404: '
            'no repository org/model, or no revision {rev} in it (the Hub says: Invalid rev id: {rev})',
        ),
    ],
    ids=['no-token', 'wrong-token', 'no-repo', 'no-revision'],
)
def test_fetch_names_the_hub_answer(hub, repo_id, revision, token, message):
    server, commit = hub
    with pytest.raises(ManifestError) as caught:
        fetch_manifest(server.url, repo_id, revision or commit, token=token, timeout=5)
    assert str(caught.value) == message.format(url=server.url, commit=commit, rev=revision)


class Canned(BaseHTTPRequestHandler):
    """Answers every GET with the server's canned (status, headers, body), or never when body is None."""

    protocol_version = 'HTTP/1.1'

    def log_message(self, *args):
        pass

    def do_GET(self):
        status, headers, body = self.server.canned
        if body is None:
            self.server.release.wait(10)
            return
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def canned():
    server = ThreadingHTTPServer(('127.0.0.1', 0), Canned)
    server.daemon_threads = True
    server.release = threading.Event()
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.mark.parametrize(
    'status, headers, body, message',
    [
        (200, {}, b'<html>hi</html>', '{where} is not valid JSON: Expecting value: line 1 column 1 (char 0)'),
        (200, {}, info(SMALL_FILE, sha='f' * 40), '{where} describes commit %s, not %s' % ('f' * 40, COMMIT)),
        (200, {}, b' ' * 1025, '{where} answered more than 1024 bytes: not a model info'),
        (
            307,
            {'Location': 'https://elsewhere.example/x'},
            b'',
            '{where} answered HTTP 307: a redirect to https://elsewhere.example/x, which is not followed (the token would go '
            'along): was the repository renamed? Use its new name',
        ),
        (
            403,
            {},
            b'Access to model org/m is restricted',
            '{where} answered HTTP 403: the token has no access to org/m (a gated repository: accept its conditions on the Hub '
            'with this account) (the Hub says: Access to model org/m is restricted)',
        ),
        (
            500,
            {},
            b'echo sekrit-token back',
            '{where} answered HTTP 500: the Hub did not give the model info (the Hub says: echo ******** back)',
        ),
    ],
    ids=['html', 'other-commit', 'too-large', 'redirect', 'gated', 'server-error-masks-token'],
)
def test_fetch_refuses_bad_answers(canned, monkeypatch, status, headers, body, message):
    monkeypatch.setattr(_hub_manifest, 'MAX_MANIFEST_BYTES', 1024)
    canned.canned = (status, headers, body)
    url = 'http://127.0.0.1:%d' % canned.server_address[1]
    with pytest.raises(ManifestError) as caught:
        fetch_manifest(url, 'org/m', COMMIT, token='sekrit-token', timeout=5)
    assert str(caught.value) == message.format(where=model_info_url(url, 'org/m', COMMIT))


def test_fetch_gives_up_on_a_silent_hub(canned):
    canned.canned = (200, {}, None)
    url = 'http://127.0.0.1:%d' % canned.server_address[1]
    with pytest.raises(ManifestError) as caught:
        fetch_manifest(url, 'org/m', COMMIT, timeout=1)
    assert str(caught.value) == '%s gave no complete answer within 1 s' % model_info_url(url, 'org/m', COMMIT)


def test_fetch_names_a_refused_connection():
    sock = socket.socket()
    sock.bind(('127.0.0.1', 0))
    port = sock.getsockname()[1]
    sock.close()
    url = 'http://127.0.0.1:%d' % port
    with pytest.raises(ManifestError) as caught:
        fetch_manifest(url, 'org/m', COMMIT, timeout=5)
    assert str(caught.value).startswith(
        'cannot fetch %s: [Errno 111] Connection refused (after ' % model_info_url(url, 'org/m', COMMIT)
    )
