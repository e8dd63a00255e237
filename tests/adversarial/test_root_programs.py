# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The role's programs that root runs over another user's files, against what that user can plant: links swapped in
between a listing and an opening, FIFOs, sockets and devices, hard links to root's files outside the tree, trees
1,100 directories deep; and the fetch's program on paths it cannot work from.

llmserve-own-tree and llmserve-seal-caches run as the role runs them (the system's python3 -I, as root) under a
watcher that loads the program and wraps two calls: os.stat, which swaps an entry for a link right after the program
listed it (deterministically, where a real race would win now and then), and os.open, which records what every
descriptor the program got is. Each case must end, by its deadline, in a clean refusal or a success that names what
it left out, with nothing opened that is not a directory or a regular file of the tree, and what lies outside as it
was. llmserve-fetch-model runs with a stub of huggingface_hub that describes an empty revision, so that only its own
handling of the path is tried.
"""

import collections
import contextlib
import grp
import json
import os
import pwd
import socket
import stat
import subprocess
import sys

import pytest

from ansible_collections.llmserve.vllm.tests.adversarial import harness

FILES = os.path.join(os.path.dirname(__file__), '..', '..', 'roles', 'vllm_kimi', 'files')
# The system's interpreter, as the role runs root's programs.
PYTHON = '/usr/bin/python3'
SERVICE = pwd.getpwnam('nobody')
GROUP = grp.getgrgid(SERVICE.pw_gid).gr_name
DEEP = 1100
DEADLINE = 60

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="root's programs over another user's files: needs root")

# argv: PROGRAM RECORD SWAPS ARGS...: SWAPS is {name: target}, each entry of that name replaced by a link to target
# right after the program's first lstat of it through a directory's descriptor; RECORD gets [path, kind] of each
# descriptor the program opened.
WATCHER = r"""
import importlib.machinery, importlib.util, json, os, stat, sys
program, record, swaps = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
real_stat, real_open = os.stat, os.open
KINDS = ((stat.S_ISDIR, 'directory'), (stat.S_ISREG, 'regular file'), (stat.S_ISFIFO, 'FIFO'),
         (stat.S_ISCHR, 'character device'), (stat.S_ISBLK, 'block device'), (stat.S_ISSOCK, 'socket'))
opened = []

def watched_stat(path, *args, dir_fd=None, follow_symlinks=True):
    info = real_stat(path, *args, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
    target = swaps.pop(path, None) if dir_fd is not None else None
    if target is not None:
        os.rename(path, path + '.away', src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.symlink(target, path, dir_fd=dir_fd)
    return info

def watched_open(path, flags, *args, **kwargs):
    fd = real_open(path, flags, *args, **kwargs)
    mode = os.fstat(fd).st_mode
    try:
        path = os.readlink('/proc/self/fd/%d' % fd)
    except OSError:
        path = '(a path too long to read back)'
    opened.append([path, next((kind for test, kind in KINDS if test(mode)), '?')])
    return fd

os.stat, os.open = watched_stat, watched_open
loader = importlib.machinery.SourceFileLoader('program', program)
module = importlib.util.module_from_spec(importlib.util.spec_from_loader('program', loader))
loader.exec_module(module)
try:
    code = module.main(sys.argv[4:])
finally:
    with open(record, 'w') as handle:
        json.dump(opened, handle)
sys.exit(code)
"""

# Describes every revision as one without files, and downloads nothing.
STUB_HUB = {
    '__init__.py': (
        'import types\n'
        'constants = types.SimpleNamespace()\n'
        'file_download = types.SimpleNamespace()\n'
        'class HfApi:\n'
        '    def model_info(self, repo, revision=None, files_metadata=False):\n'
        "        return types.SimpleNamespace(sha='0' * 40, siblings=[])\n"
        'def snapshot_download(repo, revision=None, local_dir=None):\n'
        '    return local_dir\n'
    ),
    'utils.py': 'class HfHubHTTPError(Exception):\n    pass\n',
}

Run = collections.namedtuple('Run', 'rc stdout stderr hung forbidden')


def watched(program, tmp_path, args, swaps=None, outside=None):
    """PROGRAM run as root runs it, under the watcher; forbidden: what it opened that is neither a directory nor a
    regular file, or lies under OUTSIDE."""
    record = tmp_path / 'opened.json'
    argv = [PYTHON, '-I', '-c', WATCHER, os.path.join(FILES, program), str(record), json.dumps(swaps or {})]
    try:
        proc = subprocess.run(argv + args, capture_output=True, text=True, timeout=DEADLINE, check=False)
    except subprocess.TimeoutExpired:
        return Run(None, '', '', True, [])
    opened = json.loads(record.read_text()) if record.exists() else []
    forbidden = [
        (path, kind)
        for path, kind in opened
        if kind not in ('directory', 'regular file') or (outside and path.startswith(str(outside) + '/'))
    ]
    return Run(proc.returncode, proc.stdout, proc.stderr, False, forbidden)


def judge(run, expect_rc, says=(), kept=True):
    """The one outcome: a refusal (EXPECT_RC not 0) or a success that says each of SAYS (on stdout or stderr),
    opened nothing forbidden and KEPT what lies outside as it was."""
    if run.hung:
        return harness.HANG
    if 'Traceback (most recent call last)' in run.stderr:
        return harness.TRACEBACK
    right = not run.forbidden and kept and all(part in run.stdout + run.stderr for part in says)
    if expect_rc == 0:
        if run.rc != 0:
            return harness.WRONG_ERROR
        return harness.CORRECT_SUCCESS if right else harness.WRONG_SUCCESS
    if run.rc == 0:
        return harness.WRONG_SUCCESS
    return harness.CLEAN_ERROR if right and run.rc == expect_rc else harness.WRONG_ERROR


def owner_and_mode(path):
    info = os.lstat(str(path))
    return info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)


def services(path, mode):
    os.chown(str(path), SERVICE.pw_uid, SERVICE.pw_gid)
    os.chmod(str(path), mode)


def deep_tree(top, levels=DEEP):
    """LEVELS directories, each in the one before, below top (through descriptors: the path is too long to name)."""
    fd = os.open(str(top), os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _level in range(levels):
            os.mkdir('a', dir_fd=fd)
            below = os.open('a', os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = below
    finally:
        os.close(fd)


@pytest.fixture
def outside(tmp_path):
    """Root's things outside any tree: a FIFO, a directory with a file anyone may write, and such a file."""
    place = tmp_path / 'outside'
    (place / 'canary').mkdir(parents=True)
    os.mkfifo(str(place / 'fifo'))
    for path in (place / 'canary' / 'file', place / 'secret'):
        path.write_text('root only\n')
        os.chmod(str(path), 0o666)
    return place


# --- llmserve-own-tree ---------------------------------------------------------------------------------------


@pytest.fixture
def revision(tmp_path):
    """A revision the fetch's user wrote: file, sub/file, sub/deeper/file, everything writable by everyone."""
    top = tmp_path / 'revision'
    (top / 'sub' / 'deeper').mkdir(parents=True)
    for directory in (top, top / 'sub', top / 'sub' / 'deeper'):
        services(directory, 0o777)
    for path in (top / 'file', top / 'sub' / 'file', top / 'sub' / 'deeper' / 'file'):
        path.write_text('weights\n')
        services(path, 0o666)
    return top


def plant_fifo(top, outside):
    os.mkfifo(str(top / 'sub' / 'planted'))
    services(top / 'sub' / 'planted', 0o666)


def plant_device(top, outside):
    # What /dev/null is: a device anyone may open.
    os.mknod(str(top / 'sub' / 'planted'), 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    services(top / 'sub' / 'planted', 0o666)


def plant_socket(top, outside):
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(str(top / 'sub' / 'planted'))
    listening.close()
    services(top / 'sub' / 'planted', 0o777)


def plant_hard_link(top, outside):
    os.link(str(outside / 'secret'), str(top / 'sub' / 'planted'))


def plant_deep_tree(top, outside):
    deep_tree(top / 'sub' / 'deeper')


@contextlib.contextmanager
def immutable(top):
    """sub/file made immutable (chattr +i), as a read-only file system would refuse the seal; made mutable again."""
    path = str(top / 'sub' / 'file')
    if subprocess.run(['chattr', '+i', path], capture_output=True, check=False).returncode != 0:
        pytest.skip('chattr +i is refused on this file system')
    try:
        yield
    finally:
        subprocess.run(['chattr', '-i', path], check=True)


SEAL = ['seal', '{top}', '--group', GROUP]
OPEN = ['open', '{top}', '--user', 'nobody']
SWAPPED = 'left as it is: {top}/sub changed since it was listed (swapped or removed)'


@pytest.mark.parametrize(
    'args, plant, swaps, expect_rc, says',
    [
        (SEAL, None, {'sub': 'fifo'}, 0, [SWAPPED]),
        (OPEN, None, {'sub': 'fifo'}, 0, [SWAPPED]),
        (SEAL, None, {'sub': 'canary'}, 0, [SWAPPED]),
        (OPEN, None, {'sub': 'canary'}, 0, [SWAPPED]),
        (SEAL, None, {'file': 'secret'}, 0, ['left as it is: {top}/file changed since it was listed']),
        (SEAL, plant_fifo, None, 1, ['left as it is: {top}/sub/planted is a FIFO', '{top} is not sealed']),
        (SEAL, plant_device, None, 1, ['left as it is: {top}/sub/planted is a character device']),
        (SEAL, plant_socket, None, 1, ['left as it is: {top}/sub/planted is a socket']),
        (SEAL, plant_hard_link, None, 1, ['left as it is: {top}/sub/planted has 2 hard links', '{top} is not sealed']),
        (SEAL, plant_deep_tree, None, 1, ['directories deep', '{top} is not sealed']),
        (OPEN, plant_deep_tree, None, 1, ['lies more than 256 directories deep', '{top} is not opened']),
        (SEAL, immutable, None, 1, ['llmserve-own-tree: {top}/sub/file: Operation not permitted']),
    ],
    ids=[
        'seal: a directory swapped for a link to a FIFO outside between its listing and its opening',
        'open: a directory swapped for a link to a FIFO outside between its listing and its opening',
        "seal: a directory swapped for a link to root's directory outside",
        "open: a directory swapped for a link to root's directory outside",
        "seal: a file swapped for a link to root's file outside",
        'seal: a FIFO in the tree, which anyone may write',
        'seal: a device in the tree',
        'seal: a socket in the tree',
        "seal: a hard link to root's file outside, which anyone may write",
        'seal: a tree 1,100 directories deep',
        'open: a tree 1,100 directories deep',
        'seal: an immutable file',
    ],
)
def test_own_tree(verdict, tmp_path, outside, revision, args, plant, swaps, expect_rc, says):
    with contextlib.ExitStack() as planted:
        if plant is immutable:
            planted.enter_context(immutable(revision))
        elif plant:
            plant(revision, outside)
        before = {path: owner_and_mode(path) for path in (outside / 'canary', outside / 'canary' / 'file')}
        before[outside / 'secret'] = owner_and_mode(outside / 'secret')
        swaps = {name: str(outside / target) for name, target in (swaps or {}).items()}
        run = watched('llmserve-own-tree', tmp_path, [arg.format(top=revision) for arg in args], swaps, outside)
    kept = {path: owner_and_mode(path) for path in before} == before
    outcome = judge(run, expect_rc, [part.format(top=revision) for part in says], kept)
    verdict('llmserve-own-tree', outcome, '%s %s kept=%s' % (run.stderr[-2000:], run.forbidden, kept))


# --- llmserve-seal-caches ------------------------------------------------------------------------------------


@pytest.fixture
def run_home(tmp_path):
    """The service's per-run HOME: .cache/vllm/kimi.json and .cache/vllm/sub/more.json, the service user's."""
    home = tmp_path / 'run' / 'home'
    (home / '.cache' / 'vllm' / 'sub').mkdir(parents=True)
    for path in (home / '.cache' / 'vllm' / 'kimi.json', home / '.cache' / 'vllm' / 'sub' / 'more.json'):
        path.write_text('{}')
    for dirpath, dirnames, filenames in os.walk(str(home)):
        for name in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
            os.lchown(name, SERVICE.pw_uid, SERVICE.pw_gid)
    (tmp_path / 'store').mkdir(mode=0o755)
    return home


def services_directory(outside):
    """A directory of the service user's outside the caches, with a file of its own that must not be sealed."""
    (outside / 'elsewhere').mkdir()
    (outside / 'elsewhere' / 'stolen.json').write_text('{}')
    for path in (outside / 'elsewhere', outside / 'elsewhere' / 'stolen.json'):
        os.chown(str(path), SERVICE.pw_uid, SERVICE.pw_gid)
    return 'elsewhere'


def plant_deep_cache(home):
    deep_tree(home / '.cache' / 'vllm' / 'sub')


def plant_long_names(home):
    """20 directories of 250-character names below .cache/vllm/sub, the last with a file: a path of some 5,000
    bytes, which the store's copy cannot name (PATH_MAX 4096)."""
    fd = os.open(str(home / '.cache' / 'vllm' / 'sub'), os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _level in range(20):
            os.mkdir('d' * 250, dir_fd=fd)
            below = os.open('d' * 250, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = below
        written = os.open('deep.json', os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd)
        os.fchown(written, SERVICE.pw_uid, SERVICE.pw_gid)
        os.close(written)
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    'swap, plant, says',
    [
        ({'vllm': 'fifo'}, None, ['.cache/vllm changed since it was listed']),
        ({'vllm': services_directory}, None, ['.cache/vllm changed since it was listed']),
        ({'kimi.json': 'fifo'}, None, ['.cache/vllm/kimi.json changed while it was read']),
        (None, plant_deep_cache, ['.cache/vllm/sub/a/a/a/', '/a lies more than 256 directories deep']),
        (None, plant_long_names, ['/deep.json lies too deep to copy (its path in the store is too long)']),
    ],
    ids=[
        'a cache directory swapped for a link to a FIFO outside between its listing and its opening',
        "a cache directory swapped for a link to the service user's directory outside",
        'a cache file swapped for a link to a FIFO outside',
        'a cache tree 1,100 directories deep',
        'a cache tree whose names make a path longer than the store can name',
    ],
)
def test_seal_caches(verdict, tmp_path, outside, run_home, swap, plant, says):
    if plant:
        plant(run_home)
    swaps = {
        name: str(outside / (target(outside) if callable(target) else target)) for name, target in (swap or {}).items()
    }
    args = [str(run_home), str(tmp_path / 'store'), 'release-1', '--user=nobody', '--group=' + GROUP]
    run = watched('llmserve-seal-caches', tmp_path, args, swaps, outside)
    sealed = []
    for dirpath, _dirnames, filenames in os.walk(str(tmp_path / 'store')):
        sealed += [os.path.relpath(os.path.join(dirpath, name), str(tmp_path / 'store')) for name in filenames]
    kept = not any(name.endswith('stolen.json') for name in sealed) and '"sealed": true' in run.stdout
    outcome = judge(run, 0, says, kept)
    verdict(
        'llmserve-seal-caches', outcome, '%s %s %s %s' % (run.stdout[-2000:], run.stderr[-2000:], run.forbidden, sealed)
    )


# --- llmserve-fetch-model ------------------------------------------------------------------------------------


def under_a_file(tmp_path):
    (tmp_path / 'file').write_text('')
    return str(tmp_path / 'file' / 'model')


@pytest.mark.parametrize(
    'directory, expect_rc, says',
    [
        ('model', 1, ["DIR must be an absolute path, not 'model'"]),
        ('', 1, ["DIR must be an absolute path, not ''"]),
        ('./model', 1, ["DIR must be an absolute path, not './model'"]),
        (under_a_file, 1, ['Cannot make the directory {tmp}/file/model: Not a directory']),
        ('{tmp}/a/b/model', 0, ['"revision": "' + '0' * 40 + '"']),
    ],
    ids=['a relative path', 'an empty path', 'a path from the current directory', 'a path under a file', 'a new path'],
)
def test_fetch_model(verdict, tmp_path, directory, expect_rc, says):
    stub = tmp_path / 'stub' / 'huggingface_hub'
    stub.mkdir(parents=True)
    for name, text in STUB_HUB.items():
        (stub / name).write_text(text)
    directory = directory(tmp_path) if callable(directory) else directory.format(tmp=tmp_path)
    work = tmp_path / 'work'
    work.mkdir()
    env = dict(os.environ, PYTHONPATH=str(stub.parent))
    try:
        proc = subprocess.run(
            [sys.executable, os.path.join(FILES, 'llmserve-fetch-model'), 'llmserve/tiny-kimi', 'main', directory],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
            cwd=str(work),
            env=env,
        )
        run = Run(proc.returncode, proc.stdout, proc.stderr, False, [])
    except subprocess.TimeoutExpired:
        run = Run(None, '', '', True, [])
    outcome = judge(run, expect_rc, [part.format(tmp=tmp_path) for part in says])
    verdict('llmserve-fetch-model', outcome, run.stderr[-2000:])
