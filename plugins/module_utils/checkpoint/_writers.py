# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Who but root could change a checkpoint: its entries, every directory above it, and their POSIX ACLs.

PRIVATE to the collection: the checkpoint_sealed module and the checkpoint_writers filter use it.

Whoever may write a directory may rename what is in it, so a checkpoint only root can change needs every directory
that holds a name on its path (each parent up to /, and those of every link met on the way) to be root's alone, as
well as everything in it. An ACL grants write beside the mode bits, and `ls -l` shows only its mask.
"""

import errno
import os
import stat
import struct
from collections.abc import Iterator
from typing import Callable, Optional

# linux/posix_acl_xattr.h: a version word, then (tag, permissions, id) per entry, little-endian.
ACL_XATTR = 'system.posix_acl_access'
ACL_VERSION = 2
ACL_HEADER = struct.Struct('<I')
ACL_ENTRY = struct.Struct('<HHI')
ACL_USER = 0x02
ACL_GROUP_OBJ = 0x04
ACL_GROUP = 0x08
ACL_WRITE = 0x02
# The kernel's own bound on links followed while it resolves one path (MAXSYMLINKS).
MAX_LINKS = 40

# An ACL's write grant: ('user' | 'group', id).
Grant = tuple[str, int]
# names(kind, id): the name of a user ('user') or group ('group'), or 'uid N' / 'gid N' where it has none.
Names = Callable[[str, int], str]


class CheckpointWalkError(Exception):
    """The path cannot be resolved as the kernel would (a loop of links, a name that is no directory)."""


def acl_write_grants(raw: bytes, owner_gid: int) -> list[Grant]:
    """The users and groups other than root's an ACL (the bytes of system.posix_acl_access) grants write to, masked or
    not: a mask that holds write back today is root's chmod g+w away from granting it."""
    if len(raw) < ACL_HEADER.size or (len(raw) - ACL_HEADER.size) % ACL_ENTRY.size:
        raise ValueError('an ACL of %d bytes is no list of entries' % len(raw))
    (version,) = ACL_HEADER.unpack_from(raw)
    if version != ACL_VERSION:
        raise ValueError('ACL version %d, not %d' % (version, ACL_VERSION))
    grants = []
    for offset in range(ACL_HEADER.size, len(raw), ACL_ENTRY.size):
        tag, permissions, ident = ACL_ENTRY.unpack_from(raw, offset)
        if not permissions & ACL_WRITE:
            continue
        if tag == ACL_USER and ident != 0:
            grants.append(('user', ident))
        elif tag == ACL_GROUP and ident != 0:
            grants.append(('group', ident))
        elif tag == ACL_GROUP_OBJ and owner_gid != 0:
            grants.append(('group', owner_gid))
    return grants


def read_acl(path: str) -> Optional[bytes]:
    """The access ACL of path (not followed if a link), or None where it has none or its file system keeps none."""
    try:
        return os.getxattr(path, ACL_XATTR, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
            return None
        raise


def mode_reason(path: str, is_link: bool, uid: int, gid: int, group_writes: bool, others_write: bool,
                names: Names) -> Optional[str]:  # fmt: skip
    """Why a user other than root could change the entry at path by its owner and mode bits, or None: the owner
    first, then write for every user, then a group's but root's. A link's own owner and mode say nothing of what it
    leads to, which may be anywhere."""
    if is_link:
        return '%s is a symbolic link' % path
    if uid != 0:
        return '%s is owned by %s' % (path, names('user', uid))
    if others_write:
        return '%s is writable by every user' % path
    if group_writes and gid != 0:
        return '%s is writable by group %s' % (path, names('group', gid))
    return None


def entry_reason(path: str, info: os.stat_result, names: Names) -> Optional[str]:
    """mode_reason for the entry at path as lstat gives it, then its ACL's write grants."""
    mode = info.st_mode
    reason = mode_reason(
        path, stat.S_ISLNK(mode), info.st_uid, info.st_gid, bool(mode & stat.S_IWGRP), bool(mode & stat.S_IWOTH), names
    )
    if reason:
        return reason
    raw = read_acl(path)
    try:
        grants = acl_write_grants(raw, info.st_gid) if raw else []
    except ValueError as exc:
        raise ValueError('the ACL of %s cannot be read: %s' % (path, exc)) from None
    for kind, ident in grants:
        return '%s is writable by %s %s through its ACL' % (path, kind, names(kind, ident))
    return None


def directories_on_path(path: str) -> tuple[list[str], str]:
    """Every directory that holds a name the kernel reads to resolve path, in the order it reads them (each parent up
    to /, and those of every link it follows), and the directory path resolves to."""
    held: list[str] = []
    current = '/'
    pending = [part for part in os.path.abspath(path).split('/') if part]
    links = 0
    while pending:
        name = pending.pop(0)
        if name == '.':
            continue
        if name == '..':
            current = os.path.dirname(current)
            continue
        if current not in held:
            held.append(current)
        candidate = os.path.join(current, name)
        info = os.lstat(candidate)
        if stat.S_ISLNK(info.st_mode):
            links += 1
            if links > MAX_LINKS:
                raise CheckpointWalkError('%s: more than %d links on the way' % (path, MAX_LINKS))
            target = os.readlink(candidate)
            if target.startswith('/'):
                current = '/'
            pending = [part for part in target.split('/') if part] + pending
            continue
        if pending and not stat.S_ISDIR(info.st_mode):
            raise CheckpointWalkError('%s: %s is not a directory' % (path, candidate))
        current = candidate
    return held, current


def parent_reason(directory: str, info: os.stat_result, names: Names) -> Optional[str]:
    """entry_reason for a directory above the checkpoint, where a sticky bit (/tmp) lets other users add names but
    rename or remove none of root's, which is all the next name on the path is."""
    if stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX and info.st_uid == 0:
        return entry_reason(directory, _without_write_for_others(info), names)
    return entry_reason(directory, info, names)


def _without_write_for_others(info: os.stat_result) -> os.stat_result:
    fields = list(info)
    fields[stat.ST_MODE] = info.st_mode & ~(stat.S_IWOTH | stat.S_IWGRP)
    return os.stat_result(fields)


def tree_entries(top: str, shown: str) -> Iterator[tuple[str, str, os.stat_result]]:
    """(path on disk, path as the caller named it, lstat) of top and of everything under it, following no link."""
    yield top, shown, os.stat(top)
    for folder, directories, files, _folder_fd in os.fwalk(top, follow_symlinks=False):
        for name in sorted(directories + files):
            real = os.path.join(folder, name)
            try:
                info = os.lstat(real)
            except FileNotFoundError:
                continue  # removed since the listing
            yield real, shown + real[len(top) :], info


def checkpoint_writers(path: str, names: Names) -> list[str]:
    """Why users other than root could change the checkpoint at path, one text per entry: the directories above it
    first (each as the kernel resolves it), then the checkpoint and what is in it, named under path as given."""
    held, top = directories_on_path(path)
    reasons = []
    for directory in held:
        reason = parent_reason(directory, os.lstat(directory), names)
        if reason:
            reasons.append(reason)
    for real, shown, info in tree_entries(top, path.rstrip('/') or '/'):
        reason = entry_reason(real, info, names)
        if reason:
            reasons.append(shown + reason[len(real) :])
    return reasons
