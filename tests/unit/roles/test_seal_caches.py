# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""llmserve-seal-caches, root's copy of a run's caches into the store the next start is seeded from, run for real as
root over a tree another user (nobody) owns and has planted links, FIFOs and other owners' files in."""

import grp
import json
import os
import pwd
import socket
import stat
import subprocess

import pytest

PROGRAM = os.path.join(
    os.path.dirname(__file__), '..', '..', '..', 'roles', 'vllm_kimi', 'files', 'llmserve-seal-caches'
)
# The system's interpreter, as the role runs it.
PYTHON = '/usr/bin/python3'

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="copies another user's files as root: needs root")

SERVICE = pwd.getpwnam('nobody')
GROUP = grp.getgrgid(SERVICE.pw_gid).gr_name
SECRET = b'root only\n'


def seal(run_home, store, name='0123456789ab-ba9876543210', *more):
    proc = subprocess.run(
        [PYTHON, '-I', PROGRAM, str(run_home), str(store), name, '--user=nobody', '--group=' + GROUP] + list(more),
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    return proc.returncode, (json.loads(proc.stdout) if proc.returncode == 0 else proc.stderr)


def services(path, data=b'', mode=0o600):
    """A file of the service user's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.chmod(str(path), mode)
    os.chown(str(path), SERVICE.pw_uid, SERVICE.pw_gid)


def owned_tree(top):
    for dirpath, dirnames, filenames in os.walk(str(top)):
        for name in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
            os.lchown(name, SERVICE.pw_uid, SERVICE.pw_gid)


@pytest.fixture
def layout(tmp_path):
    run_home, store = tmp_path / 'run' / 'home', tmp_path / 'store'
    services(run_home / '.cache' / 'vllm' / 'modelinfos' / 'kimi.json', b'{"model": 1}')
    services(run_home / '.triton' / 'cache' / 'ab' / 'launcher.so', b'\x7fELF', mode=0o700)
    owned_tree(run_home)
    store.mkdir(mode=0o755)
    secret = tmp_path / 'secret'
    secret.write_bytes(SECRET)
    os.chmod(str(secret), 0o600)
    return run_home, store, secret


def listing(top):
    """relative path -> (owner, group, mode, bytes) of every entry under top."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(str(top)):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            info = os.lstat(path)
            data = None
            if stat.S_ISREG(info.st_mode):
                with open(path, 'rb') as handle:
                    data = handle.read()
            found[os.path.relpath(path, str(top))] = (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode), data)
    return found


def test_the_service_users_files_are_copied_roots_and_read_only(layout):
    run_home, store, _secret = layout
    rc, result = seal(run_home, store)
    assert rc == 0, result
    sealed = store / '0123456789ab-ba9876543210'
    assert result == {
        'sealed': True,
        'store': str(sealed),
        'files': 2,
        'bytes': 16,
        'skipped': [],
        'pruned': [],
    }
    gid = SERVICE.pw_gid
    assert listing(sealed) == {
        '.cache': (0, gid, 0o750, None),
        '.cache/vllm': (0, gid, 0o750, None),
        '.cache/vllm/modelinfos': (0, gid, 0o750, None),
        '.cache/vllm/modelinfos/kimi.json': (0, gid, 0o640, b'{"model": 1}'),
        '.triton': (0, gid, 0o750, None),
        '.triton/cache': (0, gid, 0o750, None),
        '.triton/cache/ab': (0, gid, 0o750, None),
        # What the service made executable stays so, for its group alone.
        '.triton/cache/ab/launcher.so': (0, gid, 0o750, b'\x7fELF'),
    }
    assert stat.S_IMODE(os.lstat(str(sealed)).st_mode) == 0o750 and os.lstat(str(sealed)).st_uid == 0


def test_links_special_files_and_other_owners_files_are_left_out_and_named(layout, tmp_path):
    run_home, store, secret = layout
    vllm = run_home / '.cache' / 'vllm'
    os.symlink(str(secret), str(vllm / 'link.json'))
    os.symlink(str(tmp_path), str(vllm / 'linked-dir'))
    os.mkfifo(str(vllm / 'fifo'))
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(str(vllm / 'socket'))
    (vllm / 'roots.json').write_bytes(SECRET)
    services(vllm / 'linked.json', b'x')
    os.link(str(vllm / 'linked.json'), str(vllm / 'second-name.json'))
    owned_tree(run_home)
    os.chown(str(vllm / 'roots.json'), 0, 0)
    try:
        rc, result = seal(run_home, store)
    finally:
        listening.close()
    assert rc == 0, result
    assert sorted(result['skipped']) == [
        '.cache/vllm/fifo is a FIFO',
        '.cache/vllm/link.json is a symbolic link',
        '.cache/vllm/linked-dir is a symbolic link',
        '.cache/vllm/linked.json has 2 hard links',
        '.cache/vllm/roots.json is owned by uid 0, not the service user',
        '.cache/vllm/second-name.json has 2 hard links',
        '.cache/vllm/socket is a socket',
    ]
    sealed = listing(store / '0123456789ab-ba9876543210')
    assert sorted(p for p in sealed if p.startswith('.cache/vllm/') and '/' not in p[len('.cache/vllm/') :]) == [
        '.cache/vllm/modelinfos'
    ]
    assert all(entry[3] != SECRET for entry in sealed.values())


@pytest.mark.parametrize('swap', ['link', 'roots'], ids=['a link', "root's directory"])
def test_a_run_home_that_is_not_the_service_users_directory_is_refused(layout, tmp_path, swap):
    run_home, store, _secret = layout
    if swap == 'link':
        os.rename(str(run_home), str(tmp_path / 'moved'))
        os.symlink(str(tmp_path / 'moved'), str(run_home))
        cause = 'a symbolic link'
    else:
        os.chown(str(run_home), 0, 0)
        cause = 'uid 0'
    rc, message = seal(run_home, store)
    assert rc == 1
    assert message == 'llmserve-seal-caches: %s is not a directory of the service user (%s); nothing was sealed\n' % (
        run_home,
        cause,
    )
    assert os.listdir(str(store)) == []


def test_a_store_that_exists_is_never_written_again(layout):
    run_home, store, _secret = layout
    assert seal(run_home, store)[0] == 0
    before = listing(store)
    services(run_home / '.cache' / 'vllm' / 'later.py', b'import os')
    rc, result = seal(run_home, store)
    assert rc == 0 and result['sealed'] is False and result['files'] == 0, result
    assert listing(store) == before


def test_caches_over_the_bound_seal_nothing_leave_nothing_and_say_so(layout):
    # No failure: the gated run serves, and a failed seal would roll a good change back.
    run_home, store, _secret = layout
    rc, result = seal(run_home, store, '0123456789ab-ba9876543210', '--max-bytes=15')
    assert (rc, result['sealed'], result['files']) == (0, False, 0), result
    assert result['not_sealed'] == (
        'the caches hold more than 15 bytes (--max-bytes): nothing was sealed, and the next start of this release '
        'builds them again'
    )
    assert os.listdir(str(store)) == []


def test_stores_beyond_the_newest_kept_are_pruned(layout):
    run_home, store, _secret = layout
    for age, name in enumerate(['000000000003-x', '000000000002-x', '000000000001-x']):
        (store / name).mkdir()
        os.utime(str(store / name), (1e9 - age * 100, 1e9 - age * 100))
    (store / '.sealing-killed').mkdir()
    rc, result = seal(run_home, store, '0123456789ab-ba9876543210', '--keep=2')
    assert rc == 0, result
    assert sorted(result['pruned']) == sorted(
        str(store / name) for name in ('.sealing-killed', '000000000001-x', '000000000002-x')
    )
    assert sorted(os.listdir(str(store))) == ['000000000003-x', '0123456789ab-ba9876543210']


@pytest.mark.parametrize('spoil', ['link', 'group-writable'])
def test_a_store_root_does_not_own_alone_is_refused(layout, tmp_path, spoil):
    run_home, store, _secret = layout
    if spoil == 'link':
        os.rename(str(store), str(tmp_path / 'elsewhere'))
        os.symlink(str(tmp_path / 'elsewhere'), str(store))
    else:
        os.chmod(str(store), 0o775)
    rc, message = seal(run_home, store)
    assert rc == 1
    assert 'must be a directory of root that no one else may write (not a link)' in message
