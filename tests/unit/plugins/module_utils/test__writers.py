# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""checkpoint/_writers.py: who but root could change a checkpoint, its parents up to / and their ACLs, on trees each
test makes (as root: other owners need chown) and on ACL bytes as the kernel stores them."""

import os
import pwd
import struct

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._writers import (
    ACL_XATTR,
    CheckpointWalkError,
    acl_write_grants,
    checkpoint_writers,
    directories_on_path,
)

NOBODY = pwd.getpwnam('nobody')
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
UNDEFINED = 0xFFFFFFFF
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason='makes files of another user (chown): needs root')


def acl(*entries, version=2):
    """The bytes of system.posix_acl_access: the version, then (tag, permissions, id) per entry, in the order of their
    tags and ids, as the kernel takes them."""
    return struct.pack('<I', version) + b''.join(struct.pack('<HHI', *entry) for entry in sorted(entries))


BASE = [(USER_OBJ, 6, UNDEFINED), (GROUP_OBJ, 4, UNDEFINED), (OTHER, 4, UNDEFINED)]


def names(kind, ident):
    return {('user', NOBODY.pw_uid): 'nobody', ('group', 50): 'models'}.get((kind, ident), '%s#%d' % (kind, ident))


@pytest.mark.parametrize(
    'entries, owner_gid, grants',
    [
        (BASE, 0, []),
        (BASE + [(USER, 6, 1000), (MASK, 6, UNDEFINED)], 0, [('user', 1000)]),
        # A mask without write holds the grant back only until root's next chmod g+w.
        (BASE + [(USER, 6, 1000), (MASK, 4, UNDEFINED)], 0, [('user', 1000)]),
        (BASE + [(GROUP, 7, 50), (MASK, 7, UNDEFINED)], 0, [('group', 50)]),
        (BASE + [(USER, 4, 1000), (MASK, 4, UNDEFINED)], 0, []),
        # Root's own user and group may write, as the mode check lets group root write.
        (BASE + [(USER, 6, 0), (GROUP, 6, 0), (MASK, 6, UNDEFINED)], 0, []),
        ([(USER_OBJ, 6, UNDEFINED), (GROUP_OBJ, 6, UNDEFINED), (OTHER, 4, UNDEFINED)], 50, [('group', 50)]),
        ([(USER_OBJ, 6, UNDEFINED), (GROUP_OBJ, 6, UNDEFINED), (OTHER, 4, UNDEFINED)], 0, []),
    ],
    ids=[
        'mode only',
        'named user',
        'named user masked',
        'named group',
        'read only',
        'root',
        'owning group',
        'group root',
    ],
)
def test_an_acl_names_each_user_and_group_it_lets_write(entries, owner_gid, grants):
    assert acl_write_grants(acl(*entries), owner_gid) == grants


@pytest.mark.parametrize(
    'raw, message',
    [
        (b'\x02\x00', 'an ACL of 2 bytes is no list of entries'),
        (acl(*BASE) + b'\x00', 'an ACL of 29 bytes is no list of entries'),
        (acl(*BASE, version=1), 'ACL version 1, not 2'),
    ],
    ids=['short', 'torn entry', 'version'],
)
def test_bytes_that_are_no_acl_are_refused(raw, message):
    with pytest.raises(ValueError) as caught:
        acl_write_grants(raw, 0)
    assert str(caught.value) == message


@pytest.fixture
def tree(tmp_path):
    """/…/disk/kimi, root's alone, 0755 and 0644, with a link /…/current to it."""
    top = tmp_path / 'disk' / 'kimi'
    top.mkdir(parents=True)
    for directory in (tmp_path / 'disk', top):
        os.chmod(str(directory), 0o755)
    (top / 'modeling_kimi.py').write_text('')
    os.chmod(str(top / 'modeling_kimi.py'), 0o644)
    os.symlink('disk/kimi', str(tmp_path / 'current'))
    return tmp_path


def test_the_directories_on_the_way_are_each_parent_and_each_links_own(tree):
    # /tmp/…/current -> disk/kimi: the kernel reads names in each parent of current, then in tree and in tree/disk.
    held, top = directories_on_path(str(tree / 'current'))
    parents = []
    path = str(tree)
    while path != '/':
        parents.insert(0, path)
        path = os.path.dirname(path)
    assert held == ['/'] + parents + [str(tree / 'disk')]
    assert top == str(tree / 'disk' / 'kimi')


def test_a_loop_of_links_is_refused(tmp_path):
    os.symlink('b', str(tmp_path / 'a'))
    os.symlink('a', str(tmp_path / 'b'))
    with pytest.raises(CheckpointWalkError) as caught:
        directories_on_path(str(tmp_path / 'a'))
    assert str(caught.value) == '%s: more than 40 links on the way' % (tmp_path / 'a')


@needs_root
def test_a_tree_only_root_can_change_has_no_writers(tree):
    assert checkpoint_writers(str(tree / 'current'), names) == []


@needs_root
@pytest.mark.parametrize(
    'change, reason',
    [
        (lambda t: os.chown(str(t / 'disk'), NOBODY.pw_uid, 0), '{t}/disk is owned by nobody'),
        (lambda t: os.chmod(str(t / 'disk'), 0o777), '{t}/disk is writable by every user'),
        (lambda t: os.chown(str(t), NOBODY.pw_uid, 0), '{t} is owned by nobody'),
        (lambda t: os.chown(str(t / 'disk' / 'kimi'), NOBODY.pw_uid, 0), '{t}/current is owned by nobody'),
        (
            lambda t: os.setxattr(str(t / 'disk' / 'kimi' / 'modeling_kimi.py'), ACL_XATTR, acl(
                *BASE, (USER, 6, NOBODY.pw_uid), (MASK, 6, UNDEFINED))),
            '{t}/current/modeling_kimi.py is writable by user nobody through its ACL',
        ),
        (
            lambda t: os.setxattr(str(t / 'disk'), ACL_XATTR, acl(*BASE, (GROUP, 7, 50), (MASK, 5, UNDEFINED))),
            '{t}/disk is writable by group models through its ACL',
        ),
    ],
    ids=['link target parent owned', 'link target parent 777', 'parent owned', 'top owned', 'acl user', 'acl group'],
)  # fmt: skip
def test_each_way_another_user_could_change_the_checkpoint_is_named(tree, change, reason):
    change(tree)
    assert checkpoint_writers(str(tree / 'current'), names) == [reason.format(t=tree)]


@needs_root
def test_a_sticky_parent_lets_others_add_names_but_rename_none_of_roots(tree):
    os.chmod(str(tree / 'disk'), 0o1777)
    assert checkpoint_writers(str(tree / 'current'), names) == []
    os.chown(str(tree / 'disk'), NOBODY.pw_uid, 0)
    assert checkpoint_writers(str(tree / 'current'), names) == ['%s/disk is owned by nobody' % tree]
