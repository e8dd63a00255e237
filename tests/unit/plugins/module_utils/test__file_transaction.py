# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Unit tests of _file_transaction: the directory lock and all-or-nothing file changes."""

import errno
import fcntl
import os
import stat

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils import _file_transaction as ft

LOCK = '.test.lock'


def listing(directory):
    """name -> bytes, or ('link', target) for a symbolic link."""
    found = {}
    for name in sorted(os.listdir(str(directory))):
        full = os.path.join(str(directory), name)
        if os.path.islink(full):
            found[name] = ('link', os.readlink(full))
        elif os.path.isfile(full):
            with open(full, 'rb') as handle:
                found[name] = handle.read()
        else:
            found[name] = 'directory'
    return found


class FakeClock:
    """A clock that moves only when the lock sleeps; on_sleep runs at each sleep."""

    def __init__(self, on_sleep=None):
        self.now = 0.0
        self.sleeps = 0
        self.on_sleep = on_sleep

    def clock(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps += 1
        self.now += seconds
        if self.on_sleep:
            self.on_sleep()


def hold(path):
    """Another run's lock: the open file holds it until the test closes it."""
    handle = open(str(path), 'w')  # noqa: SIM115
    fcntl.flock(handle, fcntl.LOCK_EX)
    return handle


def test_lock_is_taken_and_its_file_removed(tmp_path):
    with ft.DirectoryLock(str(tmp_path), LOCK, 5, 'prog') as lock:
        assert lock.held
        assert os.path.isfile(str(tmp_path / LOCK))
        # Another process (another open file) cannot take it meanwhile.
        with open(str(tmp_path / LOCK)) as other:
            with pytest.raises(OSError) as caught:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            assert caught.value.errno in (errno.EAGAIN, errno.EACCES)
    assert not lock.held
    assert listing(tmp_path) == {}


def test_lock_held_elsewhere_times_out(tmp_path):
    holder = hold(tmp_path / LOCK)
    fake = FakeClock()
    with (
        pytest.raises(ft.FileTransactionError) as caught,
        ft.DirectoryLock(str(tmp_path), LOCK, 2, 'prog', clock=fake.clock, sleep=fake.sleep),
    ):
        pass
    assert str(caught.value) == 'cannot lock %s: another run of prog has held it for more than 2 s' % (tmp_path / LOCK)
    assert fake.sleeps == 20
    # The holder's file stays where it was.
    assert os.path.samefile(str(tmp_path / LOCK), '/proc/self/fd/%d' % holder.fileno())
    holder.close()


def test_lock_released_by_a_holder_that_removes_it_is_taken_on_the_new_file(tmp_path):
    holder = hold(tmp_path / LOCK)

    def release():
        # What a finishing run does: remove the file while holding it, then close it.
        if not holder.closed:
            os.unlink(str(tmp_path / LOCK))
            holder.close()

    fake = FakeClock(on_sleep=release)
    with ft.DirectoryLock(str(tmp_path), LOCK, 5, 'prog', clock=fake.clock, sleep=fake.sleep) as lock:
        # Held on the file now at the path, not on the removed one it had opened first.
        assert os.path.samefile(str(tmp_path / LOCK), '/proc/self/fd/%d' % lock._fd)
    assert fake.sleeps == 1
    assert listing(tmp_path) == {}


def make_directory(path):
    os.mkdir(path)


def make_link(path):
    os.symlink('/tmp', path)


@pytest.mark.parametrize(
    'make, kind',
    [
        (make_directory, 'a directory'),
        (make_link, 'a symbolic link'),
        (os.mkfifo, 'a FIFO'),
    ],
    ids=['directory', 'symlink', 'fifo'],
)
def test_lock_file_of_another_kind_is_refused_and_left(tmp_path, make, kind):
    make(str(tmp_path / LOCK))
    before = listing(tmp_path)
    with pytest.raises(ft.FileTransactionError) as caught, ft.DirectoryLock(str(tmp_path), LOCK, 5, 'prog'):
        pass
    assert str(caught.value) == 'cannot lock %s: not a regular file (%s)' % (tmp_path / LOCK, kind)
    assert listing(tmp_path) == before


def test_no_lock_where_nothing_can_be_written(tmp_path, monkeypatch):
    real_open = os.open

    def read_only(path, flags, *args):
        if flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, 'open', read_only)
    with ft.DirectoryLock(str(tmp_path), LOCK, 5, 'prog') as lock:
        assert not lock.held


def test_remove_stale_removes_only_temporary_files(tmp_path):
    (tmp_path / '.llmserve-tmp-abc').write_text('half')
    os.symlink('x', str(tmp_path / '.llmserve-tmp-link'))
    (tmp_path / '.llmserve-tmp-dir').mkdir()
    (tmp_path / 'config.json').write_text('{}')
    assert ft.remove_stale(str(tmp_path)) == [str(tmp_path / '.llmserve-tmp-abc'), str(tmp_path / '.llmserve-tmp-link')]
    assert sorted(os.listdir(str(tmp_path))) == ['.llmserve-tmp-dir', 'config.json']


def test_commit_replaces_creates_removes_and_keeps_attributes(tmp_path):
    (tmp_path / 'a').write_bytes(b'old a')
    os.chmod(str(tmp_path / 'a'), 0o640)
    (tmp_path / 'gone').write_bytes(b'x')
    transaction = ft.Transaction()
    transaction.backup(str(tmp_path / 'a'), 'a', str(tmp_path / 'a.bak'))
    transaction.replace(str(tmp_path / 'a'), 'a', data=b'new a')
    transaction.replace(str(tmp_path / 'b'), 'b', data=b'new b')
    transaction.replace(str(tmp_path / 'l'), 'l', link='a')
    transaction.remove(str(tmp_path / 'gone'), 'gone')
    transaction.commit()
    assert listing(tmp_path) == {'a': b'new a', 'a.bak': b'old a', 'b': b'new b', 'l': ('link', 'a')}
    assert stat.S_IMODE(os.stat(str(tmp_path / 'a')).st_mode) == 0o640
    assert stat.S_IMODE(os.stat(str(tmp_path / 'a.bak')).st_mode) == 0o640
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(str(tmp_path / 'b')).st_mode) == 0o666 & ~umask


def test_replacing_a_link_leaves_its_target(tmp_path):
    (tmp_path / 'blob').write_bytes(b'blob')
    os.symlink('blob', str(tmp_path / 'config'))
    transaction = ft.Transaction()
    transaction.replace(str(tmp_path / 'config'), 'config', data=b'edited')
    transaction.commit()
    assert listing(tmp_path) == {'blob': b'blob', 'config': b'edited'}


def test_a_failed_step_undoes_the_steps_before_it(tmp_path):
    (tmp_path / 'a').write_bytes(b'old a')
    os.symlink('a', str(tmp_path / 'l'))
    (tmp_path / 'c').write_bytes(b'old c')
    transaction = ft.Transaction()
    transaction.backup(str(tmp_path / 'a'), 'a', str(tmp_path / 'a.bak'))
    transaction.replace(str(tmp_path / 'new'), 'new', data=b'new')
    transaction.replace(str(tmp_path / 'a'), 'a', data=b'new a')
    transaction.replace(str(tmp_path / 'l'), 'l', data=b'new l')
    transaction.remove(str(tmp_path / 'c'), 'c')
    transaction.replace(str(tmp_path / 'd'), 'the file d', data=b'new d')
    # Between staging and commit, d becomes a directory that holds a file: the last rename fails.
    (tmp_path / 'd').mkdir()
    (tmp_path / 'd' / 'x').write_text('x')
    before = dict((name, value) for name, value in listing(tmp_path).items() if not name.startswith(ft.TEMP_PREFIX))
    with pytest.raises(ft.FileTransactionError) as caught:
        transaction.commit()
    assert str(caught.value) == 'cannot replace the file d: Is a directory; nothing was changed'
    assert listing(tmp_path) == before


def test_an_undo_that_fails_keeps_the_original_and_says_where(tmp_path, monkeypatch):
    (tmp_path / 'a').write_bytes(b'old a')
    transaction = ft.Transaction()
    transaction.replace(str(tmp_path / 'a'), 'a', data=b'new a')
    transaction.replace(str(tmp_path / 'd'), 'd', data=b'new d')
    (tmp_path / 'd').mkdir()
    (tmp_path / 'd' / 'x').write_text('x')
    real_rename = os.rename
    renames = []

    def rename(source, dest):
        renames.append(dest)
        if len(renames) == 3:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_rename(source, dest)

    monkeypatch.setattr(os, 'rename', rename)
    with pytest.raises(ft.FileTransactionError) as caught:
        transaction.commit()
    kept = [name for name in os.listdir(str(tmp_path)) if name.startswith(ft.TEMP_PREFIX)]
    assert str(caught.value) == (
        'cannot replace d: Is a directory; putting back a failed: Input/output error '
        '(the original is %s)' % (tmp_path / kept[0])
    )
    assert (tmp_path / kept[0]).read_bytes() == b'old a'


def test_staging_that_fails_leaves_nothing(tmp_path, monkeypatch):
    (tmp_path / 'a').write_bytes(b'old a')
    transaction = ft.Transaction()
    transaction.replace(str(tmp_path / 'a'), 'a', data=b'new a')

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, 'fsync', full)
    with pytest.raises(ft.FileTransactionError) as caught:
        transaction.backup(str(tmp_path / 'a'), 'a', str(tmp_path / 'a.bak'))
    assert str(caught.value) == 'cannot back up a: No space left on device (a temporary file in %s)' % tmp_path
    assert listing(tmp_path) == {'a': b'old a'}


def test_staging_in_a_missing_directory(tmp_path):
    with pytest.raises(ft.FileTransactionError) as caught:
        ft.Transaction().replace(str(tmp_path / 'missing' / 'a'), 'a', data=b'x')
    assert str(caught.value) == 'cannot write a: No such file or directory (a temporary file in %s)' % (
        tmp_path / 'missing'
    )


def test_abort_removes_what_was_staged(tmp_path):
    (tmp_path / 'a').write_bytes(b'old a')
    transaction = ft.Transaction()
    transaction.replace(str(tmp_path / 'a'), 'a', data=b'new a')
    transaction.remove(str(tmp_path / 'a'), 'a')
    assert len(os.listdir(str(tmp_path))) == 4
    transaction.abort()
    assert listing(tmp_path) == {'a': b'old a'}


def test_a_step_added_first_is_committed_first(tmp_path, monkeypatch):
    transaction = ft.Transaction()
    transaction.replace(str(tmp_path / 'config'), 'config', data=b'c')
    transaction.replace(str(tmp_path / 'record'), 'record', data=b'r', first=True)
    real_rename = os.rename
    order = []

    def rename(source, dest):
        order.append(os.path.basename(dest))
        return real_rename(source, dest)

    monkeypatch.setattr(os, 'rename', rename)
    transaction.commit()
    assert order == ['record', 'config']


@pytest.mark.parametrize('existing', [None, 0o644], ids=['new', 'loosened'])
def test_a_mode_given_is_the_files_whatever_it_had(tmp_path, existing):
    secrets = tmp_path / 'env'
    if existing is not None:
        secrets.write_text('OLD=1\n')
        os.chmod(str(secrets), existing)
    transaction = ft.Transaction()
    transaction.replace(str(secrets), 'env', data=b'KEY=2\n', mode=0o600)
    transaction.commit()
    assert secrets.read_bytes() == b'KEY=2\n'
    assert stat.S_IMODE(os.stat(str(secrets)).st_mode) == 0o600


@pytest.mark.parametrize('make, kind', [(os.mkfifo, 'a FIFO'), (os.mkdir, 'a directory')], ids=['fifo', 'directory'])
def test_replacing_what_is_not_a_file_is_refused_without_opening_it(tmp_path, make, kind):
    """A FIFO would block the copy kept for the undo; a file cannot be renamed over a directory."""
    dest = tmp_path / 'dest'
    make(str(dest))
    transaction = ft.Transaction()
    with pytest.raises(ft.FileTransactionError) as caught:
        transaction.replace(str(dest), 'dest', data=b'x')
    assert str(caught.value) == 'cannot write dest: it is %s' % kind
    assert sorted(os.listdir(str(tmp_path))) == ['dest']


def test_write_new_that_fails_leaves_nothing(tmp_path, monkeypatch):
    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, 'fsync', disk_full)
    with pytest.raises(OSError):
        ft.write_new(str(tmp_path / 'new'), b'data', 0o600)
    assert os.listdir(str(tmp_path)) == []


def test_write_new_never_writes_through_what_is_there(tmp_path):
    (tmp_path / 'target').write_text('kept')
    os.symlink('target', str(tmp_path / 'new'))
    with pytest.raises(OSError) as caught:
        ft.write_new(str(tmp_path / 'new'), b'data', 0o600)
    assert caught.value.errno == errno.EEXIST
    assert (tmp_path / 'target').read_text() == 'kept'
