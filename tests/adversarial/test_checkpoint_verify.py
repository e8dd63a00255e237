# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""checkpoint_verify against bad input: hostile manifests and checkpoints, a Hub that stalls or lies, a forged cache.

Every case runs the module as Ansible does and must end in a clean error that names the file
or value and the cause, or in a success whose result is right. Manifests are the fake Hub's
model info of the checkpoint; servers are the fake Hub or a socket server that misbehaves.
"""

import base64
import collections
import gzip
import json
import os
import socket
import struct
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._digest import identity
from ansible_collections.llmserve.vllm.tests.adversarial import harness
from ansible_collections.llmserve.vllm.tools import fake_hub

# What the argument spec says of a NUL in a path option (the nul_free_path type).
NUL_REFUSED = (
    "argument '%s' is of type str and we were unable to convert to nul_free_path: a path cannot hold a NUL character"
)

MODULE = 'checkpoint_verify'
TOKEN = 'hf_adversarial-token'
REPO = 'org/model'


def safetensors_bytes(header, data_bytes):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode('utf-8')
    return struct.pack('<Q', len(raw)) + raw + bytes(range(256)) * (data_bytes // 256) + b'\x07' * (data_bytes % 256)


SHARD = safetensors_bytes({'w': {'dtype': 'U8', 'shape': [1000], 'data_offsets': [0, 1000]}}, 1000)
CONFIG = b'{"model_type": "llama"}\n'
HF_QUANT = (
    b'{"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8"}}\n'
)


def write(path, content):
    if os.path.lexists(path):
        os.unlink(path)
    with open(path, 'wb') as f:
        f.write(content if isinstance(content, bytes) else content.encode('utf-8'))


def fifo(path):
    if os.path.lexists(path):
        os.unlink(path)
    os.mkfifo(path)


def link(path, target):
    if os.path.lexists(path):
        os.unlink(path)
    os.symlink(target, path)


def deep(depth):
    return '{"a": ' + '[' * depth + ']' * depth + '}'


def edit_manifest(change):
    """files(): the manifest rewritten by change(doc)."""

    def files(c, m, t):
        with open(m) as f:
            doc = json.load(f)
        change(doc)
        with open(m, 'w') as f:
            json.dump(doc, f)

    return files


def sibling_of(doc, name):
    return next(s for s in doc['siblings'] if s['rfilename'] == name)


# --- servers that misbehave --------------------------------------------------------------------


class Misbehaving:
    """A socket server on loopback: each connection gets behaviour(conn, request) in a thread, until stop()."""

    def __init__(self, behaviour):
        self.behaviour = behaviour
        self.stopped = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(('127.0.0.1', 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.url = 'http://127.0.0.1:%d' % self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self.serve)
        self.thread.start()

    def serve(self):
        while not self.stopped.is_set():
            try:
                conn, dummy = self.sock.accept()
            except socket.timeout:
                continue
            threading.Thread(target=self.answer, args=(conn,), daemon=True).start()

    def answer(self, conn):
        try:
            request = conn.recv(65536)
            self.behaviour(self, conn, request)
        except OSError:
            pass
        finally:
            conn.close()

    def stop(self):
        self.stopped.set()
        self.thread.join()
        self.sock.close()


def respond(status, body, headers=()):
    def behaviour(server, conn, request):
        head = 'HTTP/1.1 %s\r\nContent-Length: %d\r\nConnection: close\r\n' % (status, len(body))
        head += ''.join('%s: %s\r\n' % h for h in headers)
        conn.sendall(head.encode('latin-1') + b'\r\n' + body)

    return behaviour


def silent(server, conn, request):
    server.stopped.wait(30)


def trickle(prefix):
    def behaviour(server, conn, request):
        conn.sendall(prefix)
        while not server.stopped.wait(0.3):
            conn.sendall(b'x')

    return behaviour


def endless(server, conn, request):
    conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n')
    chunk = b' ' * 65536
    while not server.stopped.is_set():
        conn.sendall(chunk)


def echo_authorization(server, conn, request):
    line = next((header for header in request.split(b'\r\n') if header.lower().startswith(b'authorization:')), b'')
    respond('500 Internal Server Error', b'you sent ' + line)(server, conn, request)


SERVERS = {
    'silent': silent,
    'trickled-headers': trickle(b'HTTP/1.1 200 OK\r\n'),
    'trickled-body': trickle(b'HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\n\r\n{'),
    'endless-body': endless,
    'html': respond('200 OK', b'<html><body>Welcome to nginx!</body></html>'),
    'gzip': respond('200 OK', gzip.compress(b'{"sha": "x"}'), [('Content-Encoding', 'gzip')]),
    'echo-token': echo_authorization,
    'redirect-elsewhere': respond('302 Found', b'', [('Location', 'http://127.0.0.2:1/steal')]),
    'error-not-utf8': respond('404 Not Found', b'\xff\xfe', [('X-Error-Message', 'R\xe9po introuvable')]),
}


# --- the cases ---------------------------------------------------------------------------------

Case = collections.namedtuple('Case', 'expect files args server secrets')
Case.__new__.__defaults__ = (None, None, None, None, ())


class Refused:
    """A failure whose message (AnsibleModule's own, worded per ansible-core version) holds all of parts."""

    def __init__(self, *parts):
        self.parts = parts

    def __call__(self, result):
        return all(part in result['msg'] for part in self.parts)


def case(expect, files=None, server=None, secrets=(), **args):
    """expect: the exact failure message ({c} checkpoint, {m} manifest, {t} tmp dir, {url} server, {commit}),
    Refused, or a callable that checks a success. files(c, m, t): changes on disk. server: a SERVERS key or 'hub'
    (the fake Hub, which wants TOKEN); with a server the manifest is fetched from it (repo_id, revision)."""
    return Case(expect, files, args, server, secrets)


def passes(**expected):
    """A success with these result values; check(result, fmt), fmt filling the case's placeholders."""

    def check(result, fmt):
        return result['ok'] is True and all(result[k] == v for k, v in expected.items())

    return check


def warned(text, **expected):
    """passes(), with a warning that holds text."""

    def check(result, fmt):
        warnings = [w if isinstance(w, str) else w['event']['msg'] for w in result.get('warnings', [])]
        return passes(**expected)(result, fmt) and any(fmt(text) in w for w in warnings)

    return check


TOKEN_REFUSED = (
    'token must be printable ASCII, without spaces or control characters (a line break from a YAML block scalar?)'
)
FETCH = '{url}/api/models/org/model/revision/{commit}?blobs=true'
ONE_PROBLEM = 'checkpoint {c} does not match revision {commit} of manifest {m}: 1 problem: '
HUB_PROBLEM = 'checkpoint {c} does not match revision {commit} of org/model: 1 problem: '


def planted_cache(mode):
    """A cache file that vouches for a corrupted shard, with the given mode."""

    def files(c, m, t):
        shard = os.path.join(c, 'model.safetensors')
        with open(m) as f:
            digest = sibling_of(json.load(f), 'model.safetensors')['lfs']['sha256']
        write(shard, SHARD[:-1] + b'\0')
        info = os.stat(shard)
        os.mkdir(os.path.join(t, 'cache'), 0o700)
        cache = os.path.join(t, 'cache', 'checkpoint-digests.json')
        with open(cache, 'w') as f:
            json.dump(
                {
                    'format': 1,
                    'entries': {
                        shard: {
                            'identity': identity(info),
                            'sha256': digest,
                            'safetensors_header_problem': '',
                        }
                    },
                },
                f,
            )
        os.chmod(cache, mode)

    return files


def corrupt_digest(c):
    import hashlib

    with open(os.path.join(c, 'model.safetensors'), 'rb') as f:
        return hashlib.sha256(f.read()).hexdigest()


CASES = {
    # --- option values ------------------------------------------------------------------------
    'threads-zero': case('threads must be at least 1, got 0', threads=0),
    'threads-negative': case('threads must be at least 1, got -3', threads=-3),
    'threads-not-a-number': case(
        Refused("argument 'threads'", "'many'", 'cannot be converted to an int'), threads='many'
    ),
    'threads-a-million': case(passes(files=4), threads=10**6),
    'timeout-zero': case('timeout must be from 1 to 86400 seconds, got 0', timeout=0),
    'timeout-astronomic': case('timeout must be from 1 to 86400 seconds, got 1' + '0' * 400, timeout=10**400),
    'path-nul': case(NUL_REFUSED % 'path', path='{c}\0x'),
    'manifest-path-nul': case(NUL_REFUSED % 'manifest', manifest='{m}\0x'),
    'cache-dir-nul': case(NUL_REFUSED % 'cache_dir', cache_dir='{t}/cache\0x'),
    'ignore-everything': case('the ignore patterns leave none of the 4 files of manifest {m} to check', ignore=['*']),
    'ignore-empty-pattern': case(passes(files=4), ignore=['']),
    'revision-branch': case(Refused('revision "main" is not a commit', 'hf models info'), revision='main'),
    'revision-commit-and-newline': case(Refused('is not a commit'), revision='{commit}\n'),
    'revision-uppercase': case(
        'revision {COMMIT} must be written in lowercase, as the Hub writes commits', revision='{COMMIT}'
    ),
    'revision-other-commit': case(
        'manifest {m} describes commit {commit}, not revision ' + 'f' * 40, revision='f' * 40
    ),
    'repo-id-traversal': case(
        Refused('repo_id "../../etc" is not a Hub repository id'), server='hub', repo_id='../../etc'
    ),
    'repo-id-newline': case(
        Refused('repo_id "org/model\\n" is not a Hub repository id'), server='hub', repo_id='org/model\n'
    ),
    'endpoint-ftp': case('endpoint "ftp://hub" is not an http:// or https:// URL', server='hub', endpoint='ftp://hub'),
    'endpoint-newline': case(
        'endpoint "http://hub\\n" is not an http:// or https:// URL', server='hub', endpoint='http://hub\n'
    ),
    'endpoint-empty-label': case(
        Refused('cannot fetch http://hub..local/api/models/org/model/revision/'),
        server='hub',
        endpoint='http://hub..local',
    ),
    'endpoint-port-not-a-number': case(
        Refused('cannot fetch http://127.0.0.1:port/api/models/org/model/revision/', "nonnumeric port: 'port'"),
        server='hub',
        endpoint='http://127.0.0.1:port',
    ),
    'token-with-newline': case(TOKEN_REFUSED, server='hub', token=TOKEN + '\n', secrets=(TOKEN,)),
    'token-with-nul': case(TOKEN_REFUSED, server='hub', token=TOKEN + '\0', secrets=(TOKEN,)),
    'token-wrong-not-shown': case(
        FETCH + ' answered HTTP 401: the token was refused (the Hub says: Invalid credentials in Authorization header)',
        server='hub',
        token='hf_wrong-token',
        secrets=('hf_wrong-token',),
    ),
    # --- the manifest file --------------------------------------------------------------------
    'manifest-missing': case('cannot read manifest {t}/none.json: No such file or directory', manifest='{t}/none.json'),
    'manifest-fifo': case('manifest {m} is not a regular file', files=lambda c, m, t: fifo(m)),
    'manifest-directory': case('manifest {t} is not a regular file', manifest='{t}'),
    'manifest-dev-zero': case('manifest {m} is not a regular file', files=lambda c, m, t: link(m, '/dev/zero')),
    'manifest-not-utf8': case(
        "manifest {m} is not UTF-8 text: 'utf-8' codec can't decode byte 0xff in position 0: invalid start byte",
        files=lambda c, m, t: write(m, b'\xff{}'),
    ),
    'manifest-deep': case(
        'manifest {m} is nested too deeply to be read as JSON', files=lambda c, m, t: write(m, deep(100000))
    ),
    'manifest-huge': case(
        'manifest {m} is larger than 67108864 bytes: not a model info',
        files=lambda c, m, t: os.truncate(m, (64 << 20) + 10),
    ),
    'manifest-empty': case(
        'manifest {m} is not valid JSON: Expecting value: line 1 column 1 (char 0)', files=lambda c, m, t: write(m, b'')
    ),
    'manifest-size-float': case(
        'manifest {m}: config.json has size 24.0, not a byte count',
        files=edit_manifest(lambda d: sibling_of(d, 'config.json').update(size=24.0)),
    ),
    'manifest-size-astronomic': case(
        'manifest {m}: config.json has size 1' + '0' * 30 + ', not a byte count',
        files=edit_manifest(lambda d: sibling_of(d, 'config.json').update(size=10**30)),
    ),
    'manifest-traversal': case(
        'manifest {m}: siblings[0].rfilename "../../etc/passwd" is not a relative path inside the checkpoint',
        files=edit_manifest(lambda d: d['siblings'][0].update(rfilename='../../etc/passwd')),
    ),
    'manifest-absolute': case(
        'manifest {m}: siblings[0].rfilename "/etc/passwd" is not a relative path inside the checkpoint',
        files=edit_manifest(lambda d: d['siblings'][0].update(rfilename='/etc/passwd')),
    ),
    'manifest-lfs-sha-short': case(
        'manifest {m}: model.safetensors has lfs {"sha256": "abc"} without a sha256 of 64 hex digits',
        files=edit_manifest(lambda d: sibling_of(d, 'model.safetensors').update(lfs={'sha256': 'abc'})),
    ),
    'manifest-no-sha': case(
        'manifest {m} has sha null, not the 40-hex commit of the revision it describes',
        files=edit_manifest(lambda d: d.pop('sha')),
    ),
    'manifest-siblings-null': case(
        "manifest {m} has siblings null, not the list of the revision's files",
        files=edit_manifest(lambda d: d.update(siblings=None)),
    ),
    'manifest-names-a-directory': case(
        ONE_PROBLEM + 'sub: unreadable (a directory, not a regular file)',
        files=lambda c, m, t: (
            os.mkdir(os.path.join(c, 'sub')),
            edit_manifest(
                lambda d: d['siblings'].append(
                    {'rfilename': 'sub', 'size': 0, 'blobId': 'e69de29bb2d1d6434b8b29ae775ad8c2e48c5391'}
                )
            )(c, m, t),
        ),
    ),
    # --- the checkpoint -----------------------------------------------------------------------
    'path-missing': case('checkpoint directory {t}/none does not exist', path='{t}/none'),
    'path-fifo': case(
        'checkpoint path {t}/pipe is a FIFO, not a directory',
        files=lambda c, m, t: fifo(os.path.join(t, 'pipe')),
        path='{t}/pipe',
    ),
    'shard-fifo': case(
        ONE_PROBLEM + 'model.safetensors: unreadable (a FIFO, not a regular file)',
        files=lambda c, m, t: fifo(os.path.join(c, 'model.safetensors')),
    ),
    # A link that leaves the checkpoint, to a device: both, each named.
    'shard-dev-zero': case(
        ONE_PROBLEM.replace('1 problem', '2 problems')
        + 'model.safetensors: link_outside (a link that leads outside the checkpoint, to /dev/zero); '
        'model.safetensors: unreadable (a character device, not a regular file)',
        files=lambda c, m, t: link(os.path.join(c, 'model.safetensors'), '/dev/zero'),
    ),
    'shard-header-deep': case(
        Refused(
            '1 problem: model.safetensors: bad_safetensors_header (',
            'model.safetensors has an invalid header (nested too deeply)',
        ),
        files=lambda c, m, t: (
            write(os.path.join(c, 'model.safetensors'), safetensors_bytes(deep(100000).encode(), 0)),
            fake_hub_manifest(c, m),
        ),
    ),
    'extra-name-not-utf8': case(
        ONE_PROBLEM + '\\xff\\xfe.bin: extra_file (in the checkpoint but not in the manifest of revision {commit})',
        files=lambda c, m, t: write(os.path.join(c.encode(), b'\xff\xfe.bin'), b''),
    ),
    'extra-socket': case(
        ONE_PROBLEM + 'sock: extra_file (in the checkpoint (a socket) but not in the manifest of revision {commit})',
        files=lambda c, m, t: bind_socket(os.path.join(c, 'sock')),
    ),
    'link-loop': case(passes(files=4), files=lambda c, m, t: os.symlink('.', os.path.join(c, 'loop'))),
    'record-fifo': case(
        Refused(
            '.llmserve-kv-cache-quant.json: unreadable (.llmserve-kv-cache-quant.json in {c} is not a regular file'
        ),
        files=lambda c, m, t: fifo(os.path.join(c, '.llmserve-kv-cache-quant.json')),
    ),
    'record-deep': case(
        Refused(
            '.llmserve-kv-cache-quant.json: unreadable (.llmserve-kv-cache-quant.json in {c} nests '
            'arrays and objects more than 64 levels deep'
        ),
        files=lambda c, m, t: write(os.path.join(c, '.llmserve-kv-cache-quant.json'), deep(100000)),
    ),
    # --- the cache ----------------------------------------------------------------------------
    'cache-dir-is-a-file': case(
        warned('digest cache {m}/checkpoint-digests.json not written: {m} is a regular file, not a directory', files=4),
        cache_dir='{m}',
    ),
    'cache-forged-world-writable': case(
        ONE_PROBLEM + 'model.safetensors: digest_mismatch (sha256 {corrupt}, the manifest says {lfs})',
        files=planted_cache(0o666),
        cache_dir='{t}/cache',
    ),
    'cache-forged-trusted': case(passes(cache_hits=1), files=planted_cache(0o600), cache_dir='{t}/cache'),
    'cache-garbage': case(
        warned('not used: unreadable', files=4),
        cache_dir='{t}/cache',
        files=lambda c, m, t: (
            os.mkdir(os.path.join(t, 'cache'), 0o700),
            write(os.path.join(t, 'cache', 'checkpoint-digests.json'), b'\xff'),
        ),
    ),
    'cache-wrong-types': case(
        passes(files=4, cache_hits=0), cache_dir='{t}/cache', files=lambda c, m, t: wrong_type_cache(c, t)
    ),
    'cache-symlink': case(
        warned('not used: Too many levels of symbolic links', files=4),
        cache_dir='{t}/cache',
        files=lambda c, m, t: (
            os.mkdir(os.path.join(t, 'cache'), 0o700),
            link(os.path.join(t, 'cache', 'checkpoint-digests.json'), '/etc/hostname'),
        ),
    ),
    # --- a Hub that stalls or lies --------------------------------------------------------------
    'hub-silent': case(FETCH + ' gave no complete answer within 2 s', server='silent', timeout=2),
    'hub-trickles-headers': case(FETCH + ' gave no complete answer within 2 s', server='trickled-headers', timeout=2),
    'hub-trickles-body': case(FETCH + ' gave no complete answer within 2 s', server='trickled-body', timeout=2),
    'hub-endless-body': case(
        FETCH + ' answered more than 67108864 bytes: not a model info', server='endless-body', timeout=20
    ),
    'hub-html': case(FETCH + ' is not valid JSON: Expecting value: line 1 column 1 (char 0)', server='html'),
    'hub-gzip': case(Refused(FETCH + ' is not UTF-8 text'), server='gzip'),
    'hub-echoes-the-token': case(
        FETCH + ' answered HTTP 500: the Hub did not give the model info (the Hub says: you sent '
        'Authorization: Bearer ********)',
        server='echo-token',
        secrets=(TOKEN,),
    ),
    'hub-redirects-elsewhere': case(
        FETCH + ' answered HTTP 302: a redirect to http://127.0.0.2:1/steal, which is not '
        'followed (the token would go along): was the repository renamed? Use its new name',
        server='redirect-elsewhere',
        secrets=(TOKEN,),
    ),
    'hub-error-not-utf8': case(
        FETCH + ' answered HTTP 404: no repository org/model, or no revision {commit} in it '
        '(the Hub says: R\xe9po introuvable)',
        server='error-not-utf8',
    ),
    'hub-lost-the-revision': case(
        FETCH + ' answered HTTP 404: no repository org/model, or no revision {commit} in it '
        '(the Hub says: Invalid rev id: {commit})',
        server='hub',
        files=lambda c, m, t: os.rename(
            os.path.join(t, 'hub', 'org', 'model', read_commit(m)), os.path.join(t, 'hub', 'org', 'model', 'f' * 40)
        ),
    ),
    'hub-good': case(passes(files=4), server='hub'),
}


def read_commit(m):
    with open(m) as f:
        return json.load(f)['sha']


def fake_hub_manifest(c, m):
    """The manifest rewritten for the checkpoint as it now is (the Hub has these very bytes)."""
    entries = fake_hub.describe_tree(c)
    with open(m) as f:
        commit = json.load(f)['sha']
    with open(m, 'w') as f:
        json.dump({'sha': commit, 'siblings': [fake_hub.sibling(e, True) for e in entries]}, f)


def bind_socket(path):
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(path)
    sock.close()


def wrong_type_cache(c, t):
    """A trusted cache whose entries hold numbers and lists where digests belong."""
    os.mkdir(os.path.join(t, 'cache'), 0o700)
    entries = {}
    for name in os.listdir(c):
        info = os.stat(os.path.join(c, name))
        entries[os.path.join(c, name)] = {
            'identity': identity(info),
            'sha256': 5,
            'git-sha1': ['x'],
            'safetensors_header_problem': {},
        }
    with open(os.path.join(t, 'cache', 'checkpoint-digests.json'), 'w') as f:
        json.dump({'format': 1, 'entries': entries}, f)
    os.chmod(os.path.join(t, 'cache', 'checkpoint-digests.json'), 0o600)


@pytest.fixture
def model(tmp_path):
    """(checkpoint, manifest file, commit), the checkpoint also published on a hub root in tmp_path/hub."""
    c = tmp_path / 'checkpoint'
    c.mkdir()
    for name, data in (
        ('config.json', CONFIG),
        ('hf_quant_config.json', HF_QUANT),
        ('model.safetensors', SHARD),
        ('tokenizer.json', b'{"version": "1.0"}\n'),
    ):
        (c / name).write_bytes(data)
    commit = fake_hub.publish(str(tmp_path / 'hub'), REPO, str(c))
    m = tmp_path / 'manifest.json'
    m.write_text(
        json.dumps({'sha': commit, 'siblings': [fake_hub.sibling(e, True) for e in fake_hub.describe_tree(str(c))]})
    )
    return str(c), str(m), commit


def fill(text, c, m, t, url, commit, lfs=''):
    corrupt = corrupt_digest(c) if os.path.isfile(os.path.join(c, 'model.safetensors')) else ''
    for key, value in (
        ('{c}', c),
        ('{m}', m),
        ('{t}', t),
        ('{url}', url or ''),
        ('{commit}', commit),
        ('{COMMIT}', commit.upper()),
        ('{corrupt}', corrupt),
        ('{lfs}', lfs),
    ):
        text = text.replace(key, value)
    return text


@pytest.mark.parametrize('spec', list(CASES.values()), ids=list(CASES))
def test_bad_input(tmp_path, model, verdict, spec):
    c, m, commit = model
    t = str(tmp_path)
    with open(m) as f:
        lfs = sibling_of(json.load(f), 'model.safetensors')['lfs']['sha256']
    if spec.files:
        spec.files(c, m, t)
    server = None
    if spec.server == 'hub':
        server = fake_hub.FakeHub(os.path.join(t, 'hub'), token=TOKEN).start()
    elif spec.server:
        server = Misbehaving(SERVERS[spec.server])
    args = {'path': c}
    if server:
        args.update(repo_id=REPO, revision=commit, endpoint=server.url, token=TOKEN)
    else:
        args['manifest'] = m
    url = server.url if server else None
    for key, value in spec.args.items():
        args[key] = fill(value, c, m, t, url, commit) if isinstance(value, str) else value
    try:
        run = harness.run_module(MODULE, tmp_path, args)
    finally:
        if server:
            server.stop()
    if isinstance(spec.expect, Refused):
        parts = [fill(p, c, m, t, url, commit) for p in spec.expect.parts]
        outcome = harness.judge(run, expect_success=False, check=Refused(*parts), secrets=spec.secrets)
    elif callable(spec.expect):
        outcome = harness.judge(
            run,
            expect_success=True,
            check=lambda r: spec.expect(r, lambda text: fill(text, c, m, t, url, commit)),
            secrets=spec.secrets,
        )
    else:
        expected = fill(spec.expect, c, m, t, url, commit, lfs)
        outcome = harness.judge(run, expect_success=False, check=lambda r: r['msg'] == expected, secrets=spec.secrets)
    verdict(MODULE, outcome, '%s\n%s' % (run.result, run.stderr.decode('utf-8', 'replace')[-2000:]))


def test_concurrent_runs_share_one_cache(tmp_path, model, verdict):
    c, m, commit = model
    args = {'path': c, 'manifest': m, 'cache_dir': str(tmp_path / 'cache')}
    with ThreadPoolExecutor(max_workers=3) as pool:
        runs = list(
            pool.map(
                lambda i: harness.run_module(MODULE, tmp_path / ('run%d' % i), args),
                [(tmp_path / ('run%d' % i)).mkdir() or i for i in range(3)],
            )
        )
    for run in runs:
        verdict(MODULE, harness.judge(run, expect_success=True, check=lambda r: passes(files=4)(r, str)), run.result)
    with open(str(tmp_path / 'cache' / 'checkpoint-digests.json')) as f:
        assert len(json.load(f)['entries']) == 4
    assert os.listdir(str(tmp_path / 'cache')) == ['checkpoint-digests.json']


def test_an_immutable_cache_file_is_a_warning(tmp_path, model, verdict):
    c, m, commit = model
    args = {'path': c, 'manifest': m, 'cache_dir': str(tmp_path / 'cache')}
    harness.run_module(MODULE, tmp_path, args)
    cache = str(tmp_path / 'cache' / 'checkpoint-digests.json')
    os.utime(os.path.join(c, 'config.json'))
    if subprocess.run(['chattr', '+i', cache], stderr=subprocess.DEVNULL, check=False).returncode:
        pytest.skip('chattr +i is not possible here')
    try:
        run = harness.run_module(MODULE, tmp_path, args)
    finally:
        subprocess.run(['chattr', '-i', cache], check=False)
    check = warned(
        'digest cache not written: cannot replace %s: Operation not permitted; nothing was changed' % cache, files=4
    )
    verdict(
        MODULE,
        harness.judge(
            run,
            expect_success=True,
            check=lambda r: check(r, str),
            stray=[f for f in os.listdir(str(tmp_path / 'cache')) if f.endswith('.tmp')],
        ),
        run.result,
    )


# --- no part of a secret comes back ------------------------------------------------------------

# Any run of this many characters of a secret in the output counts as a leak (the module masks such runs).
PART = 8
# A token with the characters JSON escapes, which a Bearer header carries.
ODD_TOKEN = 'hf_zq7"adv\\token'
PASSWORD = 'pw-zq7-secret'
BASIC = base64.b64encode(('hub:%s' % PASSWORD).encode()).decode()


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


def manifest_naming(extra_name):
    """A Hub that answers the model's manifest with one more file, named extra_name."""

    def behaviour(server, conn, request):
        with open(server.manifest) as f:
            doc = json.load(f)
        doc['siblings'].append(
            {'rfilename': extra_name, 'size': 0, 'blobId': 'e69de29bb2d1d6434b8b29ae775ad8c2e48c5391'}
        )
        respond('200 OK', json.dumps(doc).encode())(server, conn, request)

    return behaviour


def challenge_and_echo(server, conn, request):
    """Ask for Basic credentials and quote what came: urllib answers with the endpoint's user:password."""
    line = next((header for header in request.split(b'\r\n') if header.lower().startswith(b'authorization:')), b'')
    respond('401 Unauthorized', b'you sent ' + (line or b'nothing'), [('WWW-Authenticate', 'Basic realm="hub"')])(
        server, conn, request
    )


CREDENTIALS = 'http://hub:%s@' % PASSWORD
SHOWN_FETCH = '{shown}/api/models/org/model/revision/{commit}?blobs=true'

SECRET_CASES = {
    # The Hub's error body cut at 200 bytes before the mask: 12 characters of the token came back.
    'token-cut-in-the-error-body': (
        respond('500 Internal Server Error', b'x' * 188 + TOKEN.encode() + b' tail'),
        {},
        FETCH
        + ' answered HTTP 500: the Hub did not give the model info (the Hub says: '
        + 'x' * 188
        + '******** tail)',
        (TOKEN,),
    ),
    # The manifest's sha quoted as JSON, cut at 120 characters before any mask.
    'token-cut-in-a-manifest-value': (
        respond('200 OK', json.dumps({'sha': 'x' * 100 + TOKEN, 'siblings': []}).encode()),
        {},
        FETCH + ' has sha "' + 'x' * 100 + '********", not the 40-hex commit of the revision it describes',
        (TOKEN,),
    ),
    # The redirect's Location was never masked; percent-encoded, Ansible's no_log does not see it.
    'odd-token-percent-encoded-in-a-redirect': (
        respond('302 Found', b'', [('Location', 'https://evil.example/?t=' + quote(ODD_TOKEN, safe=''))]),
        {'token': ODD_TOKEN},
        FETCH + ' answered HTTP 302: a redirect to https://evil.example/?t=********, which is not followed (the '
        'token would go along): was the repository renamed? Use its new name',
        (ODD_TOKEN,),
    ),
    'odd-token-json-escaped-in-the-error-body': (
        respond('500 Internal Server Error', json.dumps({'error': 'bad token ' + ODD_TOKEN}).encode()),
        {'token': ODD_TOKEN},
        FETCH
        + ' answered HTTP 500: the Hub did not give the model info (the Hub says: {"error": "bad token ********"})',
        (ODD_TOKEN,),
    ),
    # A file of the manifest named after part of the token: the problems quote the manifest's names.
    'token-part-as-a-file-name': (
        manifest_naming('shard-%s.bin' % TOKEN[:12]),
        {},
        HUB_PROBLEM + 'shard-********.bin: missing (not in the checkpoint)',
        (TOKEN,),
    ),
    # The endpoint's password was in every message that names the URL.
    'endpoint-password': (
        SERVERS['html'],
        {'endpoint': CREDENTIALS + '{hostport}'},
        SHOWN_FETCH + ' is not valid JSON: Expecting value: line 1 column 1 (char 0)',
        (PASSWORD,),
    ),
    'endpoint-basic-credentials-echoed': (
        challenge_and_echo,
        {'endpoint': CREDENTIALS + '{hostport}', 'token': None},
        SHOWN_FETCH + ' answered HTTP 401: the repository is private or gated and needs a token (token, or HF_TOKEN '
        'on the host) (the Hub says: you sent Authorization: Basic ********)',
        (PASSWORD, BASIC),
    ),
    # A raw / in the password: the fetch error named the URL as urllib read it.
    'endpoint-password-with-a-slash': (
        SERVERS['html'],
        {'endpoint': 'http://hub:pw/zq7-secret@{hostport}'},
        "endpoint 'http://hub:********@{hostport}' has more than one @, or one after a /, ? or #: percent-encode "
        'an @, /, ? or # in its user name or password (%40, %2F, %3F, %23)',
        ('pw/zq7-secret',),
    ),
}


@pytest.mark.parametrize('behaviour, args, expected, secrets', list(SECRET_CASES.values()), ids=list(SECRET_CASES))
def test_no_part_of_a_secret_comes_back(tmp_path, model, verdict, behaviour, args, expected, secrets):
    c, m, commit = model
    server = Misbehaving(behaviour)
    server.manifest = m
    hostport = server.url[len('http://') :]
    filled = {}
    for key, value in dict({'endpoint': server.url, 'token': TOKEN}, **args).items():
        filled[key] = value.replace('{hostport}', hostport) if isinstance(value, str) else value
    try:
        run = harness.run_module(
            MODULE, tmp_path, dict(path=c, repo_id=REPO, revision=commit, timeout=10, **filled), timeout=40
        )
    finally:
        server.stop()
    expected = fill(expected, c, m, str(tmp_path), server.url, commit)
    expected = expected.replace('{shown}', CREDENTIALS.replace(PASSWORD, '********') + hostport)
    expected = expected.replace('{hostport}', hostport)
    outcome = harness.judge(run, expect_success=False, check=lambda r: r['msg'] == expected, secrets=exposed(*secrets))
    verdict(MODULE, outcome, '%s\n%s' % (run.result, run.stderr.decode('utf-8', 'replace')[-2000:]))
