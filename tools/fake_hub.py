# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A small Hugging Face Hub: what huggingface_hub needs to download a model, and the model info.

No test may reach the real Hub, so this one serves model repositories from a directory:

    ROOT/<namespace>/<name>/<commit>/<files...>     a revision (commit: 40 lowercase hex digits)
    ROOT/<namespace>/<name>/<branch> -> <commit>      a branch or tag: a symbolic link to a revision

publish() (or --publish) copies a model directory in, under a commit computed from its files, and
points the branch main at it. Sizes, SHA-256 and git blob ids are computed from the files.

Routes, as huggingface_hub 2.x calls them (snapshot_download, hf_hub_download, model_info):

    GET  /api/models/NS/NAME[/revision/REV][?blobs=true]       model info: sha, siblings (with blobs:
                                                                size, blobId, lfs {sha256, size, pointerSize})
    GET  /api/models/NS/NAME/tree/REV[/PATH][?recursive=true]  the tree listing snapshot_download reads
    HEAD /NS/NAME/resolve/REV/PATH, GET the same               the file: ETag, X-Repo-Commit, Content-Length,
                                                                X-Linked-Etag and X-Linked-Size (LFS); Range

Weights (*.safetensors, *.bin, ...) and any file of 10 MiB or more are LFS files: as on the Hub,
their blobId is the git blob of their LFS pointer and their content is checked by lfs.sha256.
Errors carry the Hub's X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound).

Faults: drop_once (file names) ends the first GET of each such file halfway by closing the
connection, as a flaky network does (huggingface_hub resumes with a Range request); token makes
every request need it as a bearer token (401 otherwise).

    python tools/fake_hub.py --root DIR --port N [--host ADDR] [--token T] [--drop-once FILE]...
                             [--publish NS/NAME=MODEL_DIR]...

Only the Python standard library is used, so any python3 runs it.
"""

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = ('.safetensors', '.bin', '.pt', '.pth', '.ckpt', '.h5', '.msgpack', '.onnx', '.gguf', '.model')
LFS_MIN_BYTES = 10 << 20
COMMIT = re.compile(r'^[0-9a-f]{40}$')
CHUNK = 1 << 16
LFS_POINTER = 'version https://git-lfs.github.com/spec/v1\noid sha256:%s\nsize %d\n'
DATE = '2026-01-01T00:00:00.000Z'


def git_blob_id(data):
    return hashlib.sha1(b'blob %d\0' % len(data) + data).hexdigest()


def describe_file(path, name):
    """The Hub's facts about one file: size, blobId and, for an LFS file, sha256 and pointerSize."""
    with open(path, 'rb') as f:
        data = f.read()
    entry = {'path': name, 'size': len(data)}
    if name.endswith(LFS_SUFFIXES) or len(data) >= LFS_MIN_BYTES:
        sha256 = hashlib.sha256(data).hexdigest()
        pointer = (LFS_POINTER % (sha256, len(data))).encode('ascii')
        entry.update(blob_id=git_blob_id(pointer), sha256=sha256, pointer_size=len(pointer))
    else:
        entry.update(blob_id=git_blob_id(data), sha256=None, pointer_size=None)
    return entry


def describe_tree(directory):
    """Every file under ``directory`` (names '/'-separated, sorted) with describe_file's facts."""
    entries = []
    for top, dirs, files in os.walk(directory):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(top, name)
            entries.append(describe_file(full, os.path.relpath(full, directory).replace(os.sep, '/')))
    return sorted(entries, key=lambda e: e['path'])


def commit_of(entries):
    """A commit id for a set of files: the same files always give the same commit."""
    listing = ''.join('%s\0%s\n' % (e['path'], e['sha256'] or e['blob_id']) for e in entries)
    return hashlib.sha1(listing.encode('utf-8')).hexdigest()


def publish(root, repo_id, source, branch='main', commit=None):
    """Copy the model directory ``source`` into the hub at ``root`` as a revision of ``repo_id``; its commit.

    A given ``commit`` names the revision whatever its files (an inventory can pin it before the
    files exist); its files are replaced by ``source``'s each time.
    """
    repo_dir = os.path.join(root, *repo_id.split('/'))
    if commit:
        stale = os.path.join(repo_dir, commit)
        if os.path.isdir(stale):
            shutil.rmtree(stale)
    commit = commit or commit_of(describe_tree(source))
    target = os.path.join(repo_dir, commit)
    if not os.path.isdir(target):
        if os.path.isdir(target + '.tmp'):
            shutil.rmtree(target + '.tmp')
        shutil.copytree(source, target + '.tmp')
        os.rename(target + '.tmp', target)
    if branch:
        link = os.path.join(repo_dir, branch)
        os.symlink(commit, link + '.tmp')
        os.rename(link + '.tmp', link)
    return commit


def sibling(entry, blobs):
    """One file of the model info."""
    if not blobs:
        return {'rfilename': entry['path']}
    found = {'rfilename': entry['path'], 'size': entry['size'], 'blobId': entry['blob_id']}
    if entry['sha256']:
        found['lfs'] = {'sha256': entry['sha256'], 'size': entry['size'], 'pointerSize': entry['pointer_size']}
    return found


def tree_entry(entry):
    """One file of the tree listing."""
    found = {'type': 'file', 'oid': entry['blob_id'], 'size': entry['size'], 'path': entry['path']}
    if entry['sha256']:
        found['lfs'] = {'oid': entry['sha256'], 'size': entry['size'], 'pointerSize': entry['pointer_size']}
    return found


class HubError(Exception):
    def __init__(self, status, code, message, commit=None):
        Exception.__init__(self, message)
        self.status = status
        self.code = code
        self.message = message
        self.commit = commit


class Handler(BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'
    server_version = 'FakeHub/1.0'

    def send_response(self, code, message=None):
        self.server.record_answer(self.command, self.path, code)
        BaseHTTPRequestHandler.send_response(self, code, message)

    def log_message(self, fmt, *args):
        if self.server.verbose:
            BaseHTTPRequestHandler.log_message(self, fmt, *args)

    def do_GET(self):
        self.answer(head=False)

    def do_HEAD(self):
        self.answer(head=True)

    def answer(self, head):
        hub = self.server
        hub.record(self.command, self.path, self.headers.get('Range'))
        try:
            if hub.token and self.headers.get('Authorization') != 'Bearer %s' % hub.token:
                raise HubError(401, None, 'Invalid credentials in Authorization header')
            split = urlsplit(self.path)
            parts = [unquote(p) for p in split.path.split('/')[1:]]
            query = dict((k, v[-1]) for k, v in parse_qs(split.query).items())
            if parts[:2] == ['api', 'models'] and len(parts) >= 4:
                self.api(parts[2:4], parts[4:], query, head)
            elif len(parts) >= 5 and parts[2] == 'resolve':
                self.resolve(parts[0:2], parts[3], '/'.join(parts[4:]), head)
            else:
                raise HubError(404, None, "Sorry, we can't find the page you are looking for.")
        except HubError as exc:
            self.error(exc, head)

    def api(self, repo, rest, query, head):
        if not rest:
            rest = ['revision', 'main']
        if rest[0] == 'revision' and len(rest) == 2:
            commit, entries = self.server.revision(repo, rest[1])
            blobs = query.get('blobs', '').lower() == 'true'
            info = {
                '_id': commit[:24],
                'id': '/'.join(repo),
                'modelId': '/'.join(repo),
                'sha': commit,
                'private': False,
                'disabled': False,
                'gated': False,
                'tags': [],
                'downloads': 0,
                'likes': 0,
                'lastModified': DATE,
                'createdAt': DATE,
                'siblings': [sibling(e, blobs) for e in entries],
            }
            return self.send_json(info, head, commit)
        if rest[0] == 'tree' and len(rest) >= 2:
            commit, entries = self.server.revision(repo, rest[1])
            prefix = '/'.join(rest[2:]).strip('/')
            recursive = query.get('recursive', '').lower() == 'true'
            return self.send_json(self.tree(entries, prefix, recursive, commit), head, commit)
        raise HubError(404, None, "Sorry, we can't find the page you are looking for.")

    @staticmethod
    def tree(entries, prefix, recursive, commit):
        base = prefix + '/' if prefix else ''
        inside = [e for e in entries if e['path'].startswith(base)]
        if prefix and not inside:
            raise HubError(404, 'EntryNotFound', '%s does not exist on "%s"' % (prefix, commit), commit)
        listing, folders = [], set()
        for entry in inside:
            parts = entry['path'][len(base) :].split('/')
            for depth in range(1, len(parts) if recursive else min(2, len(parts))):
                folders.add(base + '/'.join(parts[:depth]))
            if recursive or len(parts) == 1:
                listing.append(tree_entry(entry))
        for folder in folders:
            listing.append(
                {
                    'type': 'directory',
                    'oid': hashlib.sha1(folder.encode('utf-8')).hexdigest(),
                    'size': 0,
                    'path': folder,
                }
            )
        return sorted(listing, key=lambda e: e['path'])

    def resolve(self, repo, revision, name, head):
        commit, entries = self.server.revision(repo, revision)
        entry = next((e for e in entries if e['path'] == name), None)
        if entry is None:
            raise HubError(404, 'EntryNotFound', '%s does not exist on "%s"' % (name, revision), commit)
        full = os.path.join(self.server.root, repo[0], repo[1], commit, *name.split('/'))
        size = entry['size']
        begin, end = 0, size
        status = 200
        asked = self.headers.get('Range')
        if asked:
            match = re.match(r'^bytes=(\d+)-(\d*)$', asked.strip())
            if not match or int(match.group(1)) >= max(size, 1):
                self.send_response(416)
                self.send_header('Content-Range', 'bytes */%d' % size)
                self.send_header('Content-Length', '0')
                self.end_headers()
                return
            begin = int(match.group(1))
            end = min(size, int(match.group(2)) + 1) if match.group(2) else size
            status = 206
        self.send_response(status)
        self.send_header('Content-Type', 'application/octet-stream')
        self.send_header('Content-Length', str(end - begin))
        self.send_header('Accept-Ranges', 'bytes')
        self.send_header('X-Repo-Commit', commit)
        if status == 206:
            self.send_header('Content-Range', 'bytes %d-%d/%d' % (begin, end - 1, size))
        if entry['sha256']:
            self.send_header('ETag', '"%s"' % entry['sha256'])
            self.send_header('X-Linked-Etag', '"%s"' % entry['sha256'])
            self.send_header('X-Linked-Size', str(size))
        else:
            self.send_header('ETag', '"%s"' % entry['blob_id'])
        self.end_headers()
        if head:
            return
        stop = end
        if self.server.take_drop(name):
            stop = begin + (end - begin) // 2
        rate = self.server.slow.get(commit)
        began = time.monotonic()
        with open(full, 'rb') as f:
            f.seek(begin)
            left = stop - begin
            while left > 0:
                # A slow revision goes out in tenths of its rate, each at its time.
                chunk = f.read(min(CHUNK, left, max(1, rate // 10)) if rate else min(CHUNK, left))
                if not chunk:
                    break
                self.wfile.write(chunk)
                left -= len(chunk)
                if rate:
                    time.sleep(max(0.0, began + (stop - begin - left) / rate - time.monotonic()))
        if stop != end:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True

    def send_json(self, doc, head, commit=None):
        body = json.dumps(doc).encode('utf-8')
        self.send_response(200)
        self.send_header('Content-Type', 'application/json; charset=utf-8')
        self.send_header('Content-Length', str(len(body)))
        if commit:
            self.send_header('X-Repo-Commit', commit)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def error(self, exc, head):
        body = json.dumps({'error': exc.message}).encode('utf-8')
        self.send_response(exc.status)
        self.send_header('Content-Type', 'application/json; charset=utf-8')
        self.send_header('Content-Length', str(len(body)))
        self.send_header('X-Error-Message', exc.message)
        if exc.code:
            self.send_header('X-Error-Code', exc.code)
        if exc.commit:
            self.send_header('X-Repo-Commit', exc.commit)
        self.end_headers()
        if not head:
            self.wfile.write(body)


class FakeHub(ThreadingHTTPServer):
    """The hub over ``root``; start() serves it from a thread, url is where.

    requests: (method, path, Range header) of each request; answers: (method, path, status).
    """

    daemon_threads = True

    def __init__(self, root, host='127.0.0.1', port=0, token=None, drop_once=(), verbose=False, slow=None):
        ThreadingHTTPServer.__init__(self, (host, port), Handler)
        self.root = os.path.abspath(root)
        self.token = token
        self.drop_once = set(drop_once)
        self.slow = dict(slow or {})
        self.verbose = verbose
        self.requests = []
        self.answers = []
        self._lock = threading.Lock()
        self._described = {}
        self._thread = None

    @property
    def url(self):
        host, port = self.server_address[:2]
        return 'http://%s:%d' % ('127.0.0.1' if host in ('0.0.0.0', '') else host, port)

    def record(self, method, path, asked_range):
        with self._lock:
            self.requests.append((method, path, asked_range))

    def record_answer(self, method, path, status):
        with self._lock:
            self.answers.append((method, path, status))

    def take_drop(self, name):
        """Whether this GET of ``name`` is the one to cut short (once per file)."""
        with self._lock:
            if name in self.drop_once:
                self.drop_once.discard(name)
                return True
        return False

    def revision(self, repo, revision):
        """(commit, file entries) of a revision; HubError when the repository or revision is unknown."""
        if any(part in ('', '.', '..') or '/' in part for part in repo):
            raise HubError(404, 'RepoNotFound', 'Repository not found')
        repo_dir = os.path.join(self.root, repo[0], repo[1])
        if not os.path.isdir(repo_dir):
            raise HubError(404, 'RepoNotFound', 'Repository not found')
        commit = None
        if '/' not in revision and revision not in ('', '.', '..'):
            candidate = os.path.join(repo_dir, revision)
            if os.path.islink(candidate):
                commit = os.path.basename(os.readlink(candidate))
            elif COMMIT.match(revision) and os.path.isdir(candidate):
                commit = revision
        if commit is None or not os.path.isdir(os.path.join(repo_dir, commit)):
            raise HubError(404, 'RevisionNotFound', 'Invalid rev id: %s' % revision)
        with self._lock:
            entries = self._described.get((repo_dir, commit))
        if entries is None:
            entries = describe_tree(os.path.join(repo_dir, commit))
            with self._lock:
                self._described[(repo_dir, commit)] = entries
        return commit, entries

    def start(self):
        self._thread = threading.Thread(target=self.serve_forever, kwargs={'poll_interval': 0.1})
        self._thread.daemon = True
        self._thread.start()
        return self

    def stop(self):
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join()


def publish_argument(parser, option, item):
    repo_id, sep, source = item.partition('=')
    source, _, commit = source.partition('@')
    if not sep or repo_id.count('/') != 1 or (commit and not COMMIT.match(commit)):
        parser.error('%s wants NS/NAME=DIR[@COMMIT of 40 hex digits], got %s' % (option, item))
    return repo_id, source, commit


def publish_when_ready(root, revisions, poll_seconds=1.0):
    """Publishes each (repo, DIR, commit) once DIR exists: a model still being made appears whole, by a rename."""
    waiting = list(revisions)
    while waiting:
        for revision in list(waiting):
            repo_id, source, commit = revision
            if os.path.isdir(source):
                publish(root, repo_id, source, branch=None, commit=commit)
                print('published %s at %s (when ready)' % (repo_id, commit), flush=True)
                waiting.remove(revision)
        time.sleep(poll_seconds)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n', 1)[0])
    parser.add_argument('--root', required=True, help='the directory of repositories (created if missing)')
    parser.add_argument('--port', type=int, default=0, help='0 picks a free port (printed)')
    parser.add_argument('--host', default='127.0.0.1')
    parser.add_argument('--token', help='the bearer token every request must carry')
    parser.add_argument(
        '--drop-once',
        action='append',
        default=[],
        metavar='FILE',
        help='end the first GET of this file halfway by closing the connection',
    )
    parser.add_argument(
        '--publish',
        action='append',
        default=[],
        metavar='NS/NAME=DIR[@COMMIT]',
        help='copy a model directory in as a revision of NS/NAME (under COMMIT if given), branch main',
    )
    parser.add_argument(
        '--publish-when-ready',
        action='append',
        default=[],
        metavar='NS/NAME=DIR@COMMIT',
        help='publish DIR as that commit of NS/NAME once DIR exists (it is being made), leaving branch main as it is',
    )
    parser.add_argument(
        '--slow',
        action='append',
        default=[],
        metavar='COMMIT=BYTES_PER_SECOND',
        help='serve each file of this commit at this rate (each GET): a long download in miniature',
    )
    parser.add_argument('--quiet', action='store_true', help='no access log on stderr')
    args = parser.parse_args(argv)
    slow = {}
    for item in args.slow:
        commit, sep, rate = item.partition('=')
        if not sep or not COMMIT.match(commit) or not rate.isdigit() or int(rate) < 1:
            parser.error('--slow wants COMMIT (40 hex digits)=BYTES_PER_SECOND (at least 1), got %s' % item)
        slow[commit] = int(rate)
    os.makedirs(args.root, exist_ok=True)
    for item in args.publish:
        repo_id, source, commit = publish_argument(parser, '--publish', item)
        print(
            'published %s at %s (branch main)' % (repo_id, publish(args.root, repo_id, source, commit=commit or None)),
            flush=True,
        )
    later = [publish_argument(parser, '--publish-when-ready', item) for item in args.publish_when_ready]
    if any(not commit for _, _, commit in later):
        parser.error('--publish-when-ready wants NS/NAME=DIR@COMMIT: the commit is pinned before DIR exists')
    if later:
        threading.Thread(target=publish_when_ready, args=(args.root, later), daemon=True).start()
    hub = FakeHub(args.root, args.host, args.port, args.token, args.drop_once, verbose=not args.quiet, slow=slow)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    print('fake hub serving %s at %s' % (hub.root, hub.url), flush=True)
    try:
        hub.serve_forever()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        hub.server_close()


if __name__ == '__main__':
    main()
