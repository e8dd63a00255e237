# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""File digests as the Hub states them, and a cache of what a run already read.

PRIVATE to the collection: this is not a public API; it may change without notice.

``sha256`` is the SHA-256 of the content (Git LFS files); ``git-sha1`` is git's blob id,
``sha1(b"blob <size>\\0" + content)`` (the other files). Files are read in 8 MiB chunks:
hashlib and the reads release the GIL for blocks that large, so threads hash files
in parallel.
"""

import hashlib
import json
import os
import stat
from collections.abc import Iterable, Mapping
from typing import Any, Optional, Union, overload

from ansible_collections.llmserve.vllm.plugins.module_utils._file_transaction import FileTransactionError, Transaction

SHA256 = 'sha256'
GIT_SHA1 = 'git-sha1'
CHUNK_BYTES = 8 << 20
CACHE_NAME = 'checkpoint-digests.json'
CACHE_FORMAT = 1
SPECIAL_FILES = (stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK)


class DigestError(Exception):
    """A file could not be read to the end; the message names it and the cause."""


def describe_mode(mode: int) -> str:
    """What kind of file ``mode`` (st_mode) is, for messages."""
    for test, name in (
        (stat.S_ISREG, 'a regular file'),
        (stat.S_ISDIR, 'a directory'),
        (stat.S_ISLNK, 'a symbolic link'),
        (stat.S_ISFIFO, 'a FIFO'),
        (stat.S_ISSOCK, 'a socket'),
        (stat.S_ISCHR, 'a character device'),
        (stat.S_ISBLK, 'a block device'),
    ):
        if test(mode):
            return name
    return 'a file of unknown type'


def _hasher(algorithm: str, size: int) -> 'hashlib._Hash':
    if algorithm == SHA256:
        return hashlib.sha256()
    return hashlib.sha1(b'blob %d\0' % size)


def digest_of_bytes(data: bytes, algorithm: str) -> str:
    hasher = _hasher(algorithm, len(data))
    hasher.update(data)
    return hasher.hexdigest()


def hash_file(
    path: str, algorithms: Iterable[str], chunk_bytes: int = CHUNK_BYTES
) -> tuple[dict[str, str], os.stat_result]:
    """({algorithm: hex digest}, os.stat_result) of the regular file at ``path``.

    A FIFO or device is refused without waiting on it (the open does not block and
    fstat judges what was opened). A file whose size changes while it is read (a
    download still writing) is an error, not a digest of half a file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, 'O_CLOEXEC', 0))
    except OSError as exc:
        raise DigestError('cannot read %s: %s' % (path, exc.strerror or exc)) from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise DigestError('%s is %s, not a regular file' % (path, describe_mode(info.st_mode)))
        with os.fdopen(fd, 'rb', buffering=0) as handle:
            if hasattr(os, 'posix_fadvise'):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            hashers = dict((algorithm, _hasher(algorithm, info.st_size)) for algorithm in algorithms)
            buf = bytearray(chunk_bytes)
            view = memoryview(buf)
            total = 0
            while True:
                n = handle.readinto(buf)
                if not n:
                    break
                total += n
                for hasher in hashers.values():
                    hasher.update(view[:n])
    except OSError as exc:
        raise DigestError('cannot read %s: %s' % (path, exc.strerror or exc)) from exc
    if total != info.st_size:
        raise DigestError(
            '%s changed while it was read: %d bytes at the start, %d read (is a download still writing it?)'
            % (path, info.st_size, total)
        )
    return dict((algorithm, hasher.hexdigest()) for algorithm, hasher in hashers.items()), info


def identity(info: os.stat_result) -> list[int]:
    """What says a file is unchanged since it was read: size, mtime and ctime in ns, inode and device.

    The ctime because anyone who may write a file can also set its mtime back (utime); only the kernel sets the
    ctime, to the time of every write and every utime.
    """
    return [info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, info.st_dev]


class DigestCache:
    """Facts learnt from reading a file ({name: value}: digests, header verdicts), kept per path and identity.

    The cache is a JSON file in ``directory``, readable and writable by its owner only. A
    file that another user owns or could have written is not trusted (anyone able to write
    it could make a corrupt checkpoint pass); it is ignored with a warning and rewritten.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, CACHE_NAME) if directory else None
        self.entries: dict[str, dict[str, Any]] = {}
        self.seen: set[str] = set()
        self.changed = False
        self.warnings: list[str] = []

    def load(self) -> None:
        if self.path is None:
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, 'O_NOFOLLOW', 0))
        except OSError as exc:
            if os.path.lexists(self.path):
                self.warnings.append('digest cache %s not used: %s' % (self.path, exc.strerror or exc))
                self.changed = True
            return
        with os.fdopen(fd, 'rb') as handle:
            info = os.fstat(fd)
            problem = self._trust_problem(info)
            if problem is None:
                try:
                    doc = json.loads(handle.read().decode('utf-8'))
                    if (
                        not isinstance(doc, dict)
                        or doc.get('format') != CACHE_FORMAT
                        or not isinstance(doc.get('entries'), dict)
                    ):
                        raise ValueError('not a format %d digest cache' % CACHE_FORMAT)
                    self.entries = dict(
                        (path, entry)
                        for path, entry in doc['entries'].items()
                        if isinstance(entry, dict) and isinstance(entry.get('identity'), list)
                    )
                except (ValueError, RecursionError) as exc:
                    problem = 'unreadable (%s); it is rebuilt' % exc
        if problem is not None:
            self.warnings.append('digest cache %s not used: %s' % (self.path, problem))
            self.changed = True

    @staticmethod
    def _trust_problem(info: os.stat_result) -> Optional[str]:
        if not stat.S_ISREG(info.st_mode):
            return 'it is %s' % describe_mode(info.st_mode)
        if info.st_uid != os.geteuid():
            return 'it belongs to uid %d, not to this user' % info.st_uid
        if info.st_mode & 0o022:
            return 'others may write it (mode %04o)' % stat.S_IMODE(info.st_mode)
        return None

    @overload
    def get(self, path: str, info: os.stat_result, name: str, kind: type[str] = ...) -> Optional[str]:
        """A string, or None."""

    @overload
    def get(self, path: str, info: os.stat_result, name: str, kind: type[list[Any]]) -> Optional[list[str]]:
        """A list of strings, or None."""

    def get(
        self, path: str, info: os.stat_result, name: str, kind: Union[type[str], type[list[Any]]] = str
    ) -> Union[str, list[str], None]:
        """The cached value ``name`` for the file at ``path`` as ``info`` describes it, or None.

        ``kind``: str (digests, verdicts) or list (of strings); a value of another type was not written here.
        """
        self.seen.add(path)
        entry = self.entries.get(path)
        if entry is None or entry.get('identity') != identity(info):
            return None
        value = entry.get(name)
        if kind is list:
            return value if isinstance(value, list) and all(isinstance(item, str) for item in value) else None
        return value if isinstance(value, str) else None

    def put(self, path: str, info: os.stat_result, values: Mapping[str, Union[str, list[str]]]) -> None:
        """Remember ``values`` for the file at ``path``; an entry for other bytes is dropped."""
        self.seen.add(path)
        key = identity(info)
        entry = self.entries.get(path)
        if entry is None or entry.get('identity') != key:
            entry = self.entries[path] = {'identity': key}
        if any(entry.get(name) != value for name, value in values.items()):
            entry.update(values)
            self.changed = True

    def save(self, root: str) -> Optional[str]:
        """Write the cache atomically; entries under ``root`` that this run did not see are dropped.

        Returns a warning when it cannot be written (the check itself stands).
        """
        if self.path is None:
            return None
        prefix = root.rstrip('/') + '/'
        entries = dict(
            (path, entry) for path, entry in self.entries.items() if path in self.seen or not path.startswith(prefix)
        )
        if not self.changed and len(entries) == len(self.entries):
            return None
        try:
            if not os.path.isdir(self.directory):
                if os.path.lexists(self.directory):
                    return 'digest cache %s not written: %s is %s, not a directory' % (
                        self.path,
                        self.directory,
                        describe_mode(os.lstat(self.directory).st_mode),
                    )
                os.makedirs(self.directory, 0o700)
            # A cache that is a FIFO, a socket or a device was not used (load said so): it goes, never opened.
            if os.path.lexists(self.path) and stat.S_IFMT(os.lstat(self.path).st_mode) in SPECIAL_FILES:
                os.unlink(self.path)
            transaction = Transaction()
            content = json.dumps({'format': CACHE_FORMAT, 'entries': entries}, sort_keys=True).encode('utf-8')
            transaction.replace(self.path, self.path, data=content, mode=0o600)
            transaction.commit()
        except OSError as exc:
            return 'digest cache %s not written: %s' % (self.path, exc.strerror or exc)
        except FileTransactionError as exc:
            return 'digest cache not written: %s' % exc
        return None
