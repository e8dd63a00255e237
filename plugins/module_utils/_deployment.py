# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""A host's deployment state: what passed the gate, the pointer to the last good one, the rollback count.

PRIVATE to the collection: this is not a public API; it may change without notice.

The deployments directory is root's alone (0700, owned by root, outside every directory the service user can
write). It holds one directory per deployment that passed its gate, named by the time it passed and its release
(20261201T120000Z-0123456789ab), with the unit and the environment file that served then and its record.json; the
symlink last-good to the newest good one; rollbacks.json, the count. Nothing here follows a link but last-good,
which only this code writes; every file is written beside its place and renamed into it, so a run killed at any
point leaves each file whole, old or new.
"""

import errno
import json
import os
import re
import shutil
import stat
from typing import Any, Callable, Optional

LAST_GOOD = 'last-good'
RECORD = 'record.json'
ROLLBACKS = 'rollbacks.json'
UNIT = 'unit'
ENVIRONMENT = 'environment'
# <UTC time it passed>-<release id>; a release id is 12 hex digits (the role's _vllm_kimi_release_id).
DEPLOYMENT_NAME = re.compile(r'^[0-9]{8}T[0-9]{6}Z-([0-9a-f]{12})$')
RELEASE_NAME = re.compile(r'^[0-9a-f]{12}$')
MAX_RECORD_BYTES = 1 << 20
TEMP_PREFIX = '.llmserve-deployment-'

Record = dict[str, Any]


class DeploymentError(Exception):
    """The deployment state cannot be read or changed; the message names the path and why."""


def check_private(path: str) -> None:
    """Refuse a deployments directory that is a link, not root's, or that others may write: whoever can rename in it
    could plant the unit the next rollback installs."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise DeploymentError('%s cannot be read: %s' % (path, exc.strerror)) from exc
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise DeploymentError('%s is not a directory (a link or a file there is not followed)' % path)
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise DeploymentError(
            '%s must be private to the user the role runs as (owner uid %d, mode %04o): found owner uid %d, mode %04o'
            % (path, os.geteuid(), 0o700, info.st_uid, stat.S_IMODE(info.st_mode))
        )


def ensure_private_directory(path: str, check_mode: bool) -> bool:
    """Create the deployments directory 0700 if it is missing; True where it was (or would be) created."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        if not check_mode:
            os.makedirs(path, mode=0o700)
            os.chmod(path, 0o700)
        return True
    check_private(path)
    return False


def _read_regular(path: str, limit: int) -> bytes:
    """The bytes of a regular file, not through a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DeploymentError('%s is a link, which is not followed' % path) from exc
        raise
    with os.fdopen(fd, 'rb') as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise DeploymentError('%s is not a regular file' % path)
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise DeploymentError('%s is larger than %d bytes: not a record' % (path, limit))
    return data


def _write_atomically(path: str, data: bytes, mode: int) -> None:
    """Write data to path whole: beside it first, synced, then renamed over it."""
    directory = os.path.dirname(path)
    temp = os.path.join(directory, TEMP_PREFIX + os.path.basename(path))
    try:
        os.unlink(temp)
    except FileNotFoundError:
        pass
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, 'wb') as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp, mode)
        os.rename(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise


def read_record(directory: str) -> Record:
    """The record.json of one deployment directory."""
    path = os.path.join(directory, RECORD)
    try:
        record = json.loads(_read_regular(path, MAX_RECORD_BYTES).decode('utf-8'))
    except (ValueError, UnicodeDecodeError) as exc:
        raise DeploymentError('%s is not a JSON record: %s' % (path, exc)) from exc
    if not isinstance(record, dict):
        raise DeploymentError('%s does not hold a JSON object' % path)
    return record


def last_good(path: str) -> tuple[Optional[str], Record]:
    """(name, record) of the last good deployment, (None, {}) before any passed its gate."""
    pointer = os.path.join(path, LAST_GOOD)
    try:
        target = os.readlink(pointer)
    except FileNotFoundError:
        return None, {}
    except OSError as exc:
        raise DeploymentError('%s is not the link to the last good deployment: %s' % (pointer, exc.strerror)) from exc
    if not DEPLOYMENT_NAME.match(target):
        raise DeploymentError('%s points to %r, which is no deployment of this directory' % (pointer, target))
    return target, read_record(os.path.join(path, target))


def rollbacks(path: str) -> dict[str, int]:
    """The rollback count: {'total': rollbacks so far, 'last': Unix time of the last one, 0 for none}."""
    file_path = os.path.join(path, ROLLBACKS)
    try:
        counted = json.loads(_read_regular(file_path, MAX_RECORD_BYTES).decode('utf-8'))
    except FileNotFoundError:
        return {'total': 0, 'last': 0}
    except (ValueError, UnicodeDecodeError) as exc:
        raise DeploymentError('%s is not a rollback count: %s' % (file_path, exc)) from exc
    if not isinstance(counted, dict) or not all(isinstance(counted.get(k), int) for k in ('total', 'last')):
        raise DeploymentError('%s is not a rollback count ({"total": N, "last": T})' % file_path)
    return {'total': counted['total'], 'last': counted['last']}


def deployment_name(recorded_at: str, release: str) -> str:
    """The name of a deployment that passed at recorded_at (20261201T120000Z) on release (12 hex digits)."""
    name = '%s-%s' % (recorded_at, release)
    if not DEPLOYMENT_NAME.match(name):
        raise DeploymentError(
            'a deployment is named <UTC time as 20261201T120000Z>-<12 hex digits of its release>: got %r' % name
        )
    return name


def deployments(path: str) -> list[str]:
    """The deployment directories, oldest first (their names sort by time); none where path is not there yet."""
    if not os.path.isdir(path):
        return []
    return sorted(
        entry.name
        for entry in os.scandir(path)
        if DEPLOYMENT_NAME.match(entry.name) and entry.is_dir(follow_symlinks=False)
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
            if RELEASE_NAME.match(entry.name) and entry.is_dir(follow_symlinks=False) and entry.name not in used
        )
    return doomed


def _release_of(name: str) -> str:
    match = DEPLOYMENT_NAME.match(name)
    if match is None:
        raise DeploymentError('%r is no deployment name (<UTC time>-<12 hex digits of its release>)' % name)
    return match.group(1)


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
    prune. Returns what was done: deployment, record, pruned."""
    content = dict(content, deployment=name)
    snapshot = os.path.join(path, name)
    pruned = prune_plan(path, releases_dir, keep, name)
    if check_mode:
        return {'deployment': name, 'record': content, 'pruned': pruned}
    unit, environment = (_read_regular(source, MAX_RECORD_BYTES) for source in (unit_file, environment_file))
    if not os.path.isdir(snapshot):
        os.mkdir(snapshot, 0o700)
    check_private(snapshot)
    _write_atomically(os.path.join(snapshot, UNIT), unit, 0o600)
    _write_atomically(os.path.join(snapshot, ENVIRONMENT), environment, 0o600)
    _write_atomically(
        os.path.join(snapshot, RECORD), (json.dumps(content, indent=2, sort_keys=True) + '\n').encode(), 0o600
    )
    point_last_good(path, name)
    for doomed in pruned:
        shutil.rmtree(doomed)
    return {'deployment': name, 'record': content, 'pruned': pruned}


def point_last_good(path: str, name: str) -> None:
    """Switch last-good to name in one rename: a reader sees the old pointer or the new one, never none."""
    temp = os.path.join(path, TEMP_PREFIX + LAST_GOOD)
    try:
        os.unlink(temp)
    except FileNotFoundError:
        pass
    os.symlink(name, temp)
    os.rename(temp, os.path.join(path, LAST_GOOD))


def restore(
    path: str, unit_file: str, environment_file: str, now: Callable[[], float], check_mode: bool
) -> dict[str, Any]:
    """Put back the last good deployment's unit and environment file and count the rollback. Returns deployment,
    record, rolled_back, rollbacks, unit_before/unit_after (for a diff)."""
    name, good = last_good(path)
    if name is None:
        raise DeploymentError(
            '%s has no good deployment to roll back to (%s is missing: a first deploy)' % (path, LAST_GOOD)
        )
    snapshot = os.path.join(path, name)
    unit, environment = (_read_regular(os.path.join(snapshot, n), MAX_RECORD_BYTES) for n in (UNIT, ENVIRONMENT))
    unit_before = _current(unit_file)
    counted = rollbacks(path)
    counted = {'total': counted['total'] + 1, 'last': int(now())}
    if not check_mode:
        _write_atomically(unit_file, unit, 0o644)
        _write_atomically(environment_file, environment, 0o600)
        _write_atomically(os.path.join(path, ROLLBACKS), (json.dumps(counted, sort_keys=True) + '\n').encode(), 0o600)
    return {
        'deployment': name,
        'record': good,
        'rolled_back': True,
        'rollbacks': counted,
        'unit_before': (unit_before or b'').decode('utf-8', 'replace'),
        'unit_after': unit.decode('utf-8', 'replace'),
    }


def _current(path: str) -> Optional[bytes]:
    try:
        return _read_regular(path, MAX_RECORD_BYTES)
    except FileNotFoundError:
        return None
