# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""A host's deployment state: what passed the gate, the pointer to the last good one, the rollback count.

PRIVATE to the collection: this is not a public API; it may change without notice.

The deployments directory is root's alone (0700, owned by root, outside every directory the service user can
write). It holds one directory per deployment that passed its gate, named by the time it passed and its release
(20261201T120000Z-0123456789ab), with the unit and the environment file that served then and its record.json; the
symlink last-good to the newest good one; rollbacks.json, the count. Nothing here follows a link but last-good,
which only this code writes: a deployment directory is opened with O_NOFOLLOW and its files through its descriptor.
Only regular files are read, opened without blocking (a FIFO would hang the read) and of at most MAX_FILE_BYTES.
A deployment directory is made whole under a temporary name and renamed into place, and the files a restore puts
back are all written beside their places before the first of them is renamed in, so that a run that fails leaves
every file as it was and a run killed at any point leaves each file whole, old or new, and the temporary files that
the next run removes.
"""

import contextlib
import errno
import json
import os
import re
import shutil
import stat
from collections.abc import Iterator
from typing import Any, Callable, Optional

from ansible_collections.llmserve.vllm.plugins.module_utils._file_transaction import (
    TEMP_PREFIX,
    FileTransactionError,
    Transaction,
    cause,
    file_kind,
    write_new,
)
from ansible_collections.llmserve.vllm.plugins.module_utils._json_text import decode_json, nests_deeper
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._systemd import (
    environment_value_problem,
    systemd_environment_value,
)

LAST_GOOD = 'last-good'
RECORD = 'record.json'
ROLLBACKS = 'rollbacks.json'
UNIT = 'unit'
ENVIRONMENT = 'environment'
LOCK = '.llmserve-deployment.lock'
# Names become paths, so they are matched in full (fullmatch): with match and $, a name ending in a newline passes.
# <UTC time it passed>-<release id>; a release id is 12 hex digits (the role's _vllm_kimi_release_id).
DEPLOYMENT_NAME = re.compile(r'[0-9]{8}T[0-9]{6}Z-([0-9a-f]{12})')
RELEASE_NAME = re.compile(r'[0-9a-f]{12}')
# The most any file here may hold, for the writer and the reader alike: a record written larger than the reader
# accepts would leave last-good unreadable, and with it every later rollback.
MAX_FILE_BYTES = 1 << 20
# How deep a record may nest objects and arrays, for the writer and the reader alike; far below the depth at which
# Python's json raises RecursionError.
MAX_RECORD_DEPTH = 32

Record = dict[str, Any]
# A variable's name in an environment file, as the role writes them.
ENVIRONMENT_NAME = re.compile(r'[A-Za-z_][A-Za-z0-9_]*')


class DeploymentError(Exception):
    """The deployment state cannot be read or changed; the message names the path and why."""


class MissingFile(DeploymentError):
    """A file to read is not there."""


def is_release(value: object) -> bool:
    """Whether value is a release id: 12 hexadecimal digits and nothing else."""
    return isinstance(value, str) and RELEASE_NAME.fullmatch(value) is not None


def check_private(path: str) -> None:
    """Refuse a deployments directory that is a link, not root's, or that others may write: whoever can rename in it
    could plant the unit the next rollback installs."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise DeploymentError('%s cannot be read: %s' % (path, cause(exc))) from exc
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise DeploymentError('%s is not a directory (a link or a file there is not followed)' % path)
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise DeploymentError(
            '%s must be private to the user the role runs as (owner uid %d, mode %04o): found owner uid %d, mode %04o'
            % (path, os.geteuid(), 0o700, info.st_uid, stat.S_IMODE(info.st_mode))
        )


def ensure_private_directory(path: str, check_mode: bool) -> bool:
    """Create the deployments directory 0700 if it is missing; True where it was (or would be) created."""
    if not os.path.lexists(path):
        if check_mode:
            return True
        try:
            os.makedirs(path, mode=0o700)
        except FileExistsError:
            pass  # a concurrent run created it first: it is checked as any other
        else:
            os.chmod(path, 0o700)
            return True
    check_private(path)
    return False


def _kind(path: str) -> str:
    """What path is, for a message: 'a link to ...', 'a FIFO', 'a directory'..."""
    try:
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            return 'a link to %r' % os.readlink(path)
    except OSError as exc:
        return 'unreadable (%s)' % cause(exc)
    return file_kind(info.st_mode)


def _read_regular(name: str, where: str, dir_fd: Optional[int] = None) -> bytes:
    """The bytes of the regular file name (where, in messages), of at most MAX_FILE_BYTES.

    A link is not followed, and nothing but a regular file is opened: a FIFO would block the open, a device could
    act on it. The open does not block either, and the file opened must be the one looked at.
    """
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError as exc:
        raise MissingFile('%s is missing' % where) from exc
    except OSError as exc:
        raise DeploymentError('%s cannot be read: %s' % (where, cause(exc))) from exc
    if stat.S_ISLNK(info.st_mode):
        raise DeploymentError('%s is a link, which is not followed' % where)
    if not stat.S_ISREG(info.st_mode):
        raise DeploymentError('%s is %s, not a regular file: it is not read' % (where, file_kind(info.st_mode)))
    chunks: list[bytes] = []
    size = 0
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            opened = os.fstat(fd)
            if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
                raise DeploymentError('%s was replaced while it was read' % where)
            while size <= MAX_FILE_BYTES:
                chunk = os.read(fd, MAX_FILE_BYTES + 1 - size)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        finally:
            os.close(fd)
    except OSError as exc:
        raise DeploymentError('%s cannot be read: %s' % (where, cause(exc))) from exc
    if size > MAX_FILE_BYTES:
        raise DeploymentError(
            '%s is larger than %d bytes, the most a deployment file may hold' % (where, MAX_FILE_BYTES)
        )
    return b''.join(chunks)


def _read_optional(path: str) -> Optional[bytes]:
    """_read_regular's bytes of path, None where it is missing."""
    try:
        return _read_regular(path, path)
    except MissingFile:
        return None


def _record_of(data: bytes, where: str) -> Record:
    found = decode_json(data, where, DeploymentError, MAX_RECORD_DEPTH)
    if not isinstance(found, dict):
        raise DeploymentError('%s does not hold a JSON object' % where)
    return found


def encode_record(content: Record) -> bytes:
    """The record.json of content, refused (DeploymentError) where its own reader would refuse it: a record that
    could not be read back would end every rollback once last-good pointed to it."""
    if nests_deeper(content, MAX_RECORD_DEPTH):
        raise DeploymentError(
            'the record nests arrays and objects more than %d levels deep, more than a record may: nothing was recorded'
            % MAX_RECORD_DEPTH
        )
    try:
        data = (json.dumps(content, indent=2, sort_keys=True) + '\n').encode('ascii')
    except (TypeError, ValueError) as exc:
        raise DeploymentError('the record cannot be written as JSON: %s; nothing was recorded' % exc) from exc
    if len(data) > MAX_FILE_BYTES:
        raise DeploymentError(
            'the record is %d bytes as JSON, more than the %d bytes a record may hold: nothing was recorded'
            % (len(data), MAX_FILE_BYTES)
        )
    # The reader's own check: whatever it would refuse is never written.
    _record_of(data, 'the record')
    return data


@contextlib.contextmanager
def _deployment_directory(path: str, name: str) -> Iterator[int]:
    """A descriptor of the deployment directory name under path, opened without following a link."""
    where = os.path.join(path, name)
    try:
        fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise DeploymentError('%s is missing' % where) from exc
    except OSError as exc:
        if exc.errno != errno.ENOTDIR:
            raise DeploymentError('%s cannot be read: %s' % (where, cause(exc))) from exc
        if os.path.islink(where):
            raise DeploymentError(
                '%s is a link, which is not followed (%s; no link under %s is followed but %s)'
                % (where, _kind(where), path, LAST_GOOD)
            ) from exc
        raise DeploymentError('%s is %s, not a deployment directory' % (where, _kind(where))) from exc
    try:
        yield fd
    finally:
        os.close(fd)


def read_record(path: str, name: str) -> Record:
    """The record.json of the deployment name under path."""
    with _deployment_directory(path, name) as fd:
        where = os.path.join(path, name, RECORD)
        return _record_of(_read_regular(RECORD, where, fd), where)


def last_good(path: str) -> tuple[Optional[str], Record]:
    """(name, record) of the last good deployment, (None, {}) before any passed its gate."""
    pointer = os.path.join(path, LAST_GOOD)
    try:
        target = os.readlink(pointer)
    except FileNotFoundError:
        return None, {}
    except OSError as exc:
        raise DeploymentError('%s is not the link to the last good deployment: %s' % (pointer, cause(exc))) from exc
    if not DEPLOYMENT_NAME.fullmatch(target):
        raise DeploymentError('%s points to %r, which is no deployment of this directory' % (pointer, target))
    return target, read_record(path, target)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def rollbacks(path: str) -> dict[str, int]:
    """The rollback count: {'total': rollbacks so far, 'last': Unix time of the last one, 0 for none}."""
    where = os.path.join(path, ROLLBACKS)
    data = _read_optional(where)
    if data is None:
        return {'total': 0, 'last': 0}
    counted = decode_json(data, where, DeploymentError, MAX_RECORD_DEPTH)
    if not isinstance(counted, dict) or not all(_is_count(counted.get(k)) for k in ('total', 'last')):
        raise DeploymentError('%s is not a rollback count ({"total": N, "last": T})' % where)
    return {'total': counted['total'], 'last': counted['last']}


def deployment_name(recorded_at: str, release: str) -> str:
    """The name of a deployment that passed at recorded_at (20261201T120000Z) on release (12 hex digits)."""
    name = '%s-%s' % (recorded_at, release)
    if not DEPLOYMENT_NAME.fullmatch(name):
        raise DeploymentError(
            'a deployment is named <UTC time as 20261201T120000Z>-<12 hex digits of its release>: got %r' % name
        )
    return name


def deployments(path: str) -> list[str]:
    """The deployment directories, oldest first (their names sort by time); none where path is not there yet.
    A link named as a deployment is no deployment: it is neither followed nor pruned."""
    if not os.path.isdir(path):
        return []
    return sorted(
        entry.name
        for entry in os.scandir(path)
        if DEPLOYMENT_NAME.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)
    )


def prune_plan(path: str, releases_dir: Optional[str], keep: int, adding: str) -> list[str]:
    """The paths a prune removes once deployment adding is recorded: deployments beyond the newest keep, and the
    releases no kept deployment uses (adding's is among them)."""
    names = sorted(set(deployments(path)) | {adding})
    kept = set(names[-max(keep, 1) :]) | {adding}
    doomed = [os.path.join(path, name) for name in names if name not in kept]
    if releases_dir and os.path.isdir(releases_dir):
        used = set(_release_of(name) for name in kept)
        doomed += sorted(
            os.path.join(releases_dir, entry.name)
            for entry in os.scandir(releases_dir)
            if RELEASE_NAME.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False) and entry.name not in used
        )
    return doomed


def _release_of(name: str) -> str:
    match = DEPLOYMENT_NAME.fullmatch(name)
    if match is None:
        raise DeploymentError('%r is no deployment name (<UTC time>-<12 hex digits of its release>)' % name)
    return match.group(1)


def remove_stale(path: str) -> list[str]:
    """Remove what a killed run left in the deployments directory (its temporary names); call it under the lock.
    Returns the paths removed; what cannot be removed stays, and the run's own writes say why."""
    removed = []
    with os.scandir(path) as found:
        entries = sorted(found, key=lambda entry: entry.name)
    for entry in entries:
        if entry.name.startswith(TEMP_PREFIX):
            try:
                _remove(entry.path)
            except OSError:
                continue
            removed.append(entry.path)
    return removed


def _remove(path: str) -> None:
    """Remove path: a directory with what it holds, anything else (a link too) itself."""
    if stat.S_ISDIR(os.lstat(path).st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def record(
    path: str,
    name: str,
    content: Record,
    unit_file: str,
    environment_file: str,
    releases_dir: Optional[str],
    keep: int,
    check_mode: bool,
) -> dict[str, Any]:
    """Snapshot the unit and the environment file that passed the gate with the record, point last-good at them, and
    prune. Returns what was done: deployment, record, pruned, and warnings (what could not be pruned).

    Everything that can be refused is refused before anything is written; a write that fails removes what it made.
    """
    content = dict(content, deployment=name)
    data = encode_record(content)
    snapshot = os.path.join(path, name)
    if os.path.lexists(snapshot):
        raise DeploymentError(
            '%s is already there: a deployment of release %s was recorded in this same second; nothing was recorded'
            % (snapshot, _release_of(name))
        )
    unit, environment = (_read_regular(source, source) for source in (unit_file, environment_file))
    pruned = prune_plan(path, releases_dir, keep, name)
    if check_mode:
        return {'deployment': name, 'record': content, 'pruned': pruned, 'warnings': []}
    try:
        _create_snapshot(path, name, ((UNIT, unit), (ENVIRONMENT, environment), (RECORD, data)))
        try:
            point_last_good(path, name)
        except BaseException:
            _discard_snapshot(path, name)
            raise
    except OSError as exc:
        raise DeploymentError('cannot record %s: %s; nothing was recorded' % (snapshot, cause(exc))) from exc
    except FileTransactionError as exc:
        raise DeploymentError('cannot record %s: %s' % (snapshot, exc)) from exc
    removed, warnings = [], []
    for doomed in pruned:
        try:
            shutil.rmtree(doomed)
        except OSError as exc:
            # The deployment is recorded and last-good points to it: what is left is only kept longer.
            warnings.append('%s was not pruned: %s' % (doomed, cause(exc)))
        else:
            removed.append(doomed)
    return {'deployment': name, 'record': content, 'pruned': removed, 'warnings': warnings}


def _create_snapshot(path: str, name: str, files: tuple[tuple[str, bytes], ...]) -> None:
    """The deployment directory name under path with files ((name, bytes)...), made whole under a temporary name
    and renamed into place: none is ever seen half written."""
    staging = os.path.join(path, TEMP_PREFIX + name)
    if os.path.lexists(staging):  # left by a killed run
        _remove(staging)
    os.mkdir(staging, 0o700)
    try:
        fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            for file_name, data in files:
                write_new(file_name, data, 0o600, fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(staging, os.path.join(path, name))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _discard_snapshot(path: str, name: str) -> None:
    """Take back a deployment directory that last-good never pointed to: renamed away first, so that it is gone
    whole even where the removal stops half way (the next run removes the rest)."""
    staging = os.path.join(path, TEMP_PREFIX + name)
    try:
        os.rename(os.path.join(path, name), staging)
    except OSError:
        return
    shutil.rmtree(staging, ignore_errors=True)


def point_last_good(path: str, name: str) -> None:
    """Switch last-good to name in one rename: a reader sees the old pointer or the new one, never none."""
    pointer = os.path.join(path, LAST_GOOD)
    transaction = Transaction()
    transaction.replace(pointer, pointer, link=name)
    transaction.commit()


def secrets_problem(secrets: dict[str, Any]) -> Optional[str]:
    """Why these secrets cannot go into an environment file, naming the variable but never its value; or None."""
    for name, value in sorted(secrets.items()):
        if not ENVIRONMENT_NAME.fullmatch(name):
            return 'environment_secrets: %r is not the name of an environment variable' % (name,)
        if not isinstance(value, str):
            return 'environment_secrets: the value of %s must be a text, got %s' % (name, type(value).__name__)
        if environment_value_problem(value):
            return (
                'environment_secrets: the value of %s holds a line break or a NUL, which an environment file cannot carry'
                % (name)
            )
    return None


def with_secrets(environment: bytes, secrets: dict[str, str]) -> bytes:
    """The environment file with each of the secrets set to its value (quoted as systemd reads it; an empty value
    removes the variable), in the place its first line had, else at the end. Checked by secrets_problem first."""
    lines = environment.decode('utf-8').split('\n')
    ends_with_newline = lines[-1] == ''
    if ends_with_newline:
        lines.pop()
    kept = []
    seen = set()
    for line in lines:
        name = line.split('=', 1)[0].strip() if '=' in line and not line.lstrip().startswith('#') else None
        if name not in secrets:
            kept.append(line)
        elif name not in seen:
            seen.add(name)
            if secrets[name]:
                kept.append('%s=%s' % (name, systemd_environment_value(secrets[name])))
    kept.extend('%s=%s' % (n, systemd_environment_value(v)) for n, v in sorted(secrets.items()) if v and n not in seen)
    return ('\n'.join(kept) + ('\n' if ends_with_newline or not lines else '')).encode('utf-8')


def restore(
    path: str,
    unit_file: str,
    environment_file: str,
    now: Callable[[], float],
    check_mode: bool,
    secrets: Optional[dict[str, str]] = None,
) -> dict[str, Any]:
    """Put back the last good deployment's unit and environment file and count the rollback, all or nothing; the
    secrets are set to their values of now, never to those the last good deployment had (a key rotated since must
    not come back). Returns deployment, record, rolled_back, rollbacks, unit_before/unit_after (for a diff)."""
    name, good = last_good(path)
    if name is None:
        raise DeploymentError(
            '%s has no good deployment to roll back to (%s is missing: a first deploy)' % (path, LAST_GOOD)
        )
    with _deployment_directory(path, name) as fd:
        unit, environment = (_read_regular(n, os.path.join(path, name, n), fd) for n in (UNIT, ENVIRONMENT))
    if secrets:
        try:
            environment = with_secrets(environment, secrets)
        except UnicodeDecodeError:
            raise DeploymentError(
                '%s is not UTF-8 text: its secrets cannot be set' % os.path.join(path, name, ENVIRONMENT)
            ) from None
    unit_before = _read_optional(unit_file)
    counted = rollbacks(path)
    counted = {'total': counted['total'] + 1, 'last': int(now())}
    if not check_mode:
        # All or nothing: every file is staged beside its place, and each one it replaces copied aside, before the
        # first is renamed in. The environment file holds secrets: private, whatever mode it had.
        transaction = Transaction()
        for dest, data, mode in (
            (unit_file, unit, 0o644),
            (environment_file, environment, 0o600),
            (os.path.join(path, ROLLBACKS), (json.dumps(counted, sort_keys=True) + '\n').encode('ascii'), 0o600),
        ):
            transaction.replace(dest, dest, data=data, mode=mode)
        transaction.commit()
    return {
        'deployment': name,
        'record': good,
        'rolled_back': True,
        'rollbacks': counted,
        'unit_before': (unit_before or b'').decode('utf-8', 'replace'),
        'unit_after': unit.decode('utf-8', 'replace'),
    }
