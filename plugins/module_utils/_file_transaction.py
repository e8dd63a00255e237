# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The collection's one way to write a file: whole or not at all, several files all or nothing, under a lock.

This is PRIVATE to the collection. It can change at any time, without notice.

A DirectoryLock serialises the runs that change one directory. write_new
creates a file that was not there, synced before it is closed. A Transaction
stages every new file, every backup and a copy of every file it replaces under
a temporary name beside it first (a full disk or a directory that cannot be
written fails there, before anything changes), then renames them into place in
order; when a rename fails, the renames already done are undone and every
temporary file is removed. Each file is always either wholly old or wholly new,
also for a run killed with SIGKILL; what such a run leaves behind is only
temporary files, which remove_stale() clears under the lock.
"""

import binascii
import contextlib
import errno
import fcntl
import os
import shutil
import stat
import time
from collections.abc import Iterator
from typing import Callable, Optional

TEMP_PREFIX = '.llmserve-tmp-'
LOCK_POLL_SECONDS = 0.1
# The lock file cannot be created where nothing can be written; nobody changes such a directory.
UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)

FILE_KINDS = (
    (stat.S_ISREG, 'a regular file'),
    (stat.S_ISDIR, 'a directory'),
    (stat.S_ISFIFO, 'a FIFO'),
    (stat.S_ISCHR, 'a character device'),
    (stat.S_ISBLK, 'a block device'),
    (stat.S_ISSOCK, 'a socket'),
)


# A step of a transaction: (action, dest, where, staged, undo); see Transaction.
Step = tuple[str, str, str, Optional[str], Optional[str]]


class FileTransactionError(Exception):
    """A file cannot be locked, staged or replaced; the message names it and the cause."""


def file_kind(mode: int) -> str:
    """'a regular file', 'a FIFO', 'a directory', ...: what a mode says a path is, for a message."""
    return next((kind for test, kind in FILE_KINDS if test(mode)), 'an unknown kind of file')


def cause(exc: OSError) -> str:
    return exc.strerror or str(exc)


class DirectoryLock:
    """An exclusive flock on ``directory/name``, created for the run and removed when released.

    ``holder`` names the program in the message of a lock that stays taken for
    ``timeout`` seconds. Where the lock file cannot be created (a read-only
    directory) nothing is locked: nothing can change there.
    """

    def __init__(
        self,
        directory: str,
        name: str,
        timeout: float,
        holder: str,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.path = os.path.join(directory, name)
        self.timeout = timeout
        self.holder = holder
        self._clock = clock
        self._sleep = sleep
        self._fd: Optional[int] = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> 'DirectoryLock':
        deadline = self._clock() + self.timeout
        while self._fd is None:
            fd = self._open()
            if fd is None:
                return self
            try:
                self._fd = self._lock(fd, deadline)
            except BaseException:
                os.close(fd)
                raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._fd is not None:
            # Removed while held: a run that opened this file meanwhile sees it is gone and retries.
            try:
                os.unlink(self.path)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None

    def _open(self) -> Optional[int]:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno in UNWRITABLE:
                return None
            if exc.errno in (errno.ELOOP, errno.EISDIR):
                kind = 'a symbolic link' if exc.errno == errno.ELOOP else 'a directory'
                raise FileTransactionError('cannot lock %s: not a regular file (%s)' % (self.path, kind)) from exc
            raise FileTransactionError('cannot lock %s: %s' % (self.path, cause(exc))) from exc
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise FileTransactionError('cannot lock %s: not a regular file (%s)' % (self.path, file_kind(mode)))
        return fd

    def _lock(self, fd: int, deadline: float) -> Optional[int]:
        """fd once it holds the lock on the file that is still at self.path, else None (open again)."""
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise FileTransactionError('cannot lock %s: %s' % (self.path, cause(exc))) from exc
            if self._clock() >= deadline:
                raise FileTransactionError(
                    'cannot lock %s: another run of %s has held it for more than %s s'
                    % (self.path, self.holder, self.timeout)
                )
            self._sleep(LOCK_POLL_SECONDS)
        held = os.fstat(fd)
        try:
            current = os.lstat(self.path)
        except OSError:
            current = None
        if current is not None and (current.st_dev, current.st_ino) == (held.st_dev, held.st_ino):
            return fd
        os.close(fd)
        return None


def write_new(name: str, data: bytes, mode: int, dir_fd: Optional[int] = None) -> None:
    """Create the file ``name`` (relative to ``dir_fd`` where given) with ``data`` and ``mode``, synced, or raise
    OSError and leave nothing. An existing file or link there is an error, so a name chosen at random cannot be
    raced."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fchmod(fd, mode)
        # A full disk or a quota shows on some file systems (NFS) only here.
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
        raise
    os.close(fd)


def temp_name(directory: str) -> str:
    return os.path.join(directory, TEMP_PREFIX + binascii.hexlify(os.urandom(8)).decode('ascii'))


def remove_stale(directory: str) -> list[str]:
    """Remove the temporary files a killed run left in ``directory``; call it only under the lock.

    Returns the paths removed. What cannot be removed stays: the run's own writes will say why.
    """
    removed: list[str] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return removed
    for name in names:
        full = os.path.join(directory, name)
        try:
            if name.startswith(TEMP_PREFIX) and not stat.S_ISDIR(os.lstat(full).st_mode):
                os.unlink(full)
                removed.append(full)
        except OSError:
            pass
    return removed


class Transaction:
    """Create, replace and remove files, each in its own directory, all or nothing.

    ``replace``, ``backup`` and ``remove`` stage at once; when they cannot, they remove
    everything staged so far and raise FileTransactionError. ``commit`` applies the
    steps in the order they were added; when one fails it undoes the steps done,
    removes every temporary file and raises FileTransactionError. ``abort`` removes
    every temporary file of a transaction that is not committed.
    """

    def __init__(self) -> None:
        self._temps: list[str] = []
        # (action, dest, where, staged, undo): 'replace' and 'create' rename staged to dest
        # (undo: a copy of the original, None for a new file); 'remove' renames dest to undo.
        self._steps: list[Step] = []

    def replace(
        self,
        dest: str,
        where: str,
        data: Optional[bytes] = None,
        link: Optional[str] = None,
        first: bool = False,
        mode: Optional[int] = None,
    ) -> None:
        """Stage ``data`` (bytes) or a symbolic link to ``link`` for ``dest``, named ``where`` in messages.

        The new file gets the owner, mode and extended attributes of the one it replaces; ``mode``, where given, is
        its mode whatever the original's (a file of secrets stays private even where it was missing or loosened).
        ``first``: commit it before the steps added so far.
        """
        with self._staging():
            original = _lstat(dest, where)
            if original is not None and not (stat.S_ISREG(original.st_mode) or stat.S_ISLNK(original.st_mode)):
                raise FileTransactionError('cannot write %s: it is %s' % (where, file_kind(original.st_mode)))
            staged = self._stage('write', where, os.path.dirname(dest), data=data, link=link)
            if link is None:
                _take_attributes(staged, dest, original, where, mode=mode)
            undo = self._copy('write', where, dest, original) if original is not None else None
            self._steps.insert(0 if first else len(self._steps), ('replace', dest, where, staged, undo))

    def backup(self, source: str, where: str, backup_path: str) -> None:
        """A copy of ``source`` (of its content, for a symbolic link) at the new name ``backup_path``."""
        with self._staging():
            staged = self._copy('back up', where, source, _stat(source, where))
            self._steps.append(('create', backup_path, backup_path, staged, None))

    def remove(self, dest: str, where: str) -> None:
        """Remove ``dest``: renamed onto a temporary name at commit, so that it can be put back."""
        with self._staging():
            undo = self._stage('write', where, os.path.dirname(dest), data=b'')
            self._steps.append(('remove', dest, where, None, undo))

    def commit(self) -> None:
        done: list[Step] = []
        try:
            for step in self._steps:
                action, dest, where, staged, undo = step
                try:
                    if action == 'remove' and undo is not None:
                        os.rename(dest, undo)
                    elif staged is not None:
                        os.rename(staged, dest)
                except OSError as exc:
                    raise FileTransactionError(
                        'cannot %s %s: %s%s' % (action, where, cause(exc), self._undo(done))
                    ) from exc
                done.append(step)
        finally:
            self.abort()

    def abort(self) -> None:
        for temp in self._temps:
            try:
                os.unlink(temp)
            except OSError:
                pass
        self._temps = []

    @contextlib.contextmanager
    def _staging(self) -> Iterator[None]:
        try:
            yield
        except FileTransactionError:
            self.abort()
            raise

    def _undo(self, done: list[Step]) -> str:
        """Undo the steps done, last first; returns the end of the failure's message."""
        failures = []
        for _action, dest, where, _staged, undo in reversed(done):
            try:
                if undo is None:
                    os.unlink(dest)
                else:
                    os.rename(undo, dest)
            except OSError as exc:
                kept = ''
                if undo is not None:
                    # Kept, so that a person can put it back.
                    self._temps.remove(undo)
                    kept = ' (the original is %s)' % undo
                failures.append('putting back %s failed: %s%s' % (where, cause(exc), kept))
        if failures:
            return '; ' + '; '.join(failures)
        return '; nothing was changed'

    def _stage(
        self, action: str, where: str, directory: str, data: Optional[bytes] = None, link: Optional[str] = None
    ) -> str:
        """A new temporary file holding ``data`` (or a symbolic link to ``link``) in ``directory``."""
        staged = temp_name(directory)
        try:
            if link is not None:
                # os.symlink refuses an existing name, so the random name cannot be raced.
                os.symlink(link, staged)
                self._temps.append(staged)
                return staged
            write_new(staged, data or b'', 0o600)
            self._temps.append(staged)
        except OSError as exc:
            raise FileTransactionError(
                'cannot %s %s: %s (a temporary file in %s)' % (action, where, cause(exc), directory)
            ) from exc
        return staged

    def _copy(self, action: str, where: str, source: str, source_stat: os.stat_result) -> str:
        """A temporary copy of ``source`` as it is: a symbolic link stays a link; a file keeps its attributes."""
        directory = os.path.dirname(source)
        if stat.S_ISLNK(source_stat.st_mode):
            return self._stage(action, where, directory, link=os.readlink(source))
        try:
            with open(source, 'rb') as handle:
                data = handle.read()
        except OSError as exc:
            raise FileTransactionError('cannot read %s: %s' % (where, cause(exc))) from exc
        copy = self._stage(action, where, directory, data=data)
        _take_attributes(copy, source, source_stat, where, keep_times=True)
        return copy


def _lstat(path: str, where: str) -> Optional[os.stat_result]:
    """lstat of ``path``, None when there is nothing."""
    try:
        return os.lstat(path)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return None
        raise FileTransactionError('cannot read %s: %s' % (where, cause(exc))) from exc


def _stat(path: str, where: str) -> os.stat_result:
    try:
        return os.stat(path)
    except OSError as exc:
        raise FileTransactionError('cannot read %s: %s' % (where, cause(exc))) from exc


def _take_attributes(
    staged: str,
    dest: str,
    original: Optional[os.stat_result],
    where: str,
    keep_times: bool = False,
    mode: Optional[int] = None,
) -> None:
    """Give ``staged`` the owner, mode and extended attributes (SELinux context) of ``dest``, as atomic_move does;
    ``mode``, where given, replaces the mode.

    A new file (``original`` None) gets ``mode``, else the mode the umask allows, as atomic_move gives it.
    """
    try:
        if original is None:
            if mode is None:
                umask = os.umask(0)
                os.umask(umask)
                mode = 0o666 & ~umask
            os.chmod(staged, mode)
            return
        target = os.stat(dest)
        try:
            os.chown(staged, target.st_uid, target.st_gid)
        except OSError as exc:
            # Only root may give a file away; as atomic_move, keep our own then.
            if exc.errno != errno.EPERM:
                raise
        shutil.copystat(dest, staged)
        if mode is not None:
            os.chmod(staged, mode)
        if not keep_times:
            now = time.time()
            os.utime(staged, (now, now))
    except OSError as exc:
        raise FileTransactionError('cannot copy the attributes of %s: %s' % (where, cause(exc))) from exc
