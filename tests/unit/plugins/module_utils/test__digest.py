# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Unit tests of _digest: the Hub's digests of a file, and the cache that spares a rerun the reading."""

import json
import os
import stat
import time

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._digest import (
    CACHE_NAME,
    DigestCache,
    DigestError,
    digest_of_bytes,
    hash_file,
)

# `git hash-object` and `sha256sum` of the same contents.
VECTORS = [
    (
        b'',
        'e69de29bb2d1d6434b8b29ae775ad8c2e48c5391',
        'e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855',
    ),
    (
        b'hello\n',
        'ce013625030ba8dba906f756967f9e9ca394464a',
        '5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03',
    ),
]


@pytest.mark.parametrize('data, git_sha1, sha256', VECTORS, ids=['empty', 'hello'])
@pytest.mark.parametrize('chunk', [1, 4, 1 << 20], ids=['chunk-1', 'chunk-4', 'chunk-1M'])
def test_hash_file_gives_git_and_sha256_digests(tmp_path, data, git_sha1, sha256, chunk):
    path = tmp_path / 'f'
    path.write_bytes(data)
    digests, info = hash_file(str(path), ['git-sha1', 'sha256'], chunk_bytes=chunk)
    assert digests == {'git-sha1': git_sha1, 'sha256': sha256}
    assert info.st_size == len(data)
    assert digest_of_bytes(data, 'git-sha1') == git_sha1
    assert digest_of_bytes(data, 'sha256') == sha256


@pytest.mark.parametrize(
    'make, message',
    [
        (os.mkfifo, '{p} is a FIFO, not a regular file'),
        (os.mkdir, '{p} is a directory, not a regular file'),
        (lambda p: None, 'cannot read {p}: No such file or directory'),
        (lambda p: os.symlink('/dev/null', p), '{p} is a character device, not a regular file'),
    ],
    ids=['fifo', 'directory', 'missing', 'device'],
)
def test_hash_file_refuses_without_blocking(tmp_path, make, message):
    path = str(tmp_path / 'f')
    make(path)
    with pytest.raises(DigestError) as caught:
        hash_file(path, ['sha256'])
    assert str(caught.value) == message.format(p=path)


def test_hash_file_refuses_a_file_that_grows_while_read(tmp_path, monkeypatch):
    path = tmp_path / 'f'
    path.write_bytes(b'abcdefgh')
    real_fstat = os.fstat

    def fstat_at_the_start(fd):
        """The size the file had when it was opened, before a download appended to it."""
        fields = list(real_fstat(fd)[:10])
        fields[stat.ST_SIZE] = 4
        return os.stat_result(fields)

    monkeypatch.setattr(os, 'fstat', fstat_at_the_start)
    with pytest.raises(DigestError) as caught:
        hash_file(str(path), ['sha256'])
    assert str(caught.value) == (
        '%s changed while it was read: 4 bytes at the start, 8 read (is a download still writing it?)' % path
    )


# ---------------------------------------------------------------- the cache


@pytest.fixture
def shard(tmp_path):
    path = tmp_path / 'ckpt' / 'model.safetensors'
    path.parent.mkdir()
    path.write_bytes(b'weights')
    return str(path)


def test_cache_answers_for_the_same_file_only(tmp_path, shard):
    cache = DigestCache(str(tmp_path / 'cache'))
    info = os.stat(shard)
    cache.put(shard, info, {'sha256': 'x'})
    assert cache.get(shard, os.stat(shard), 'sha256') == 'x'
    os.utime(shard, ns=(info.st_atime_ns, info.st_mtime_ns + 1))
    assert cache.get(shard, os.stat(shard), 'sha256') is None


def test_a_file_rewritten_in_place_with_its_mtime_set_back_is_a_miss(tmp_path, shard):
    cache = DigestCache(str(tmp_path / 'cache'))
    info = os.stat(shard)
    cache.put(shard, info, {'sha256': 'x'})
    time.sleep(0.01)  # a ctime the kernel can tell from the first
    with open(shard, 'r+b') as f:
        f.write(b'WEIGHTS')  # same size, same inode
    os.utime(shard, ns=(info.st_atime_ns, info.st_mtime_ns))
    after = os.stat(shard)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (info.st_size, info.st_mtime_ns, info.st_ino)
    assert cache.get(shard, after, 'sha256') is None


def test_cache_survives_a_save_and_load(tmp_path, shard):
    cache = DigestCache(str(tmp_path / 'cache'))
    cache.put(shard, os.stat(shard), {'sha256': 'x', 'safetensors_header_problem': ''})
    assert cache.save(os.path.dirname(shard)) is None
    cache_file = tmp_path / 'cache' / CACHE_NAME
    assert stat.S_IMODE(os.stat(str(cache_file)).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(str(tmp_path / 'cache')).st_mode) == 0o700
    again = DigestCache(str(tmp_path / 'cache'))
    again.load()
    assert (again.get(shard, os.stat(shard), 'sha256'), again.warnings) == ('x', [])
    assert again.get(shard, os.stat(shard), 'safetensors_header_problem') == ''
    assert sorted(os.listdir(str(tmp_path / 'cache'))) == [CACHE_NAME]


def test_cache_values_of_other_types_are_misses(tmp_path, shard):
    cache = DigestCache(str(tmp_path / 'cache'))
    cache.put(shard, os.stat(shard), {'sha256': 5, 'git-sha1': [7], 'index_shards': ['a.safetensors']})
    info = os.stat(shard)
    assert [
        cache.get(shard, info, 'sha256'),
        cache.get(shard, info, 'git-sha1', list),
        cache.get(shard, info, 'index_shards'),
        cache.get(shard, info, 'index_shards', list),
    ] == [None, None, None, ['a.safetensors']]


def test_cache_is_not_rewritten_when_nothing_changed(tmp_path, shard):
    cache = DigestCache(str(tmp_path / 'cache'))
    cache.put(shard, os.stat(shard), {'sha256': 'x'})
    cache.save(os.path.dirname(shard))
    cache_file = str(tmp_path / 'cache' / CACHE_NAME)
    before = os.stat(cache_file)
    again = DigestCache(str(tmp_path / 'cache'))
    again.load()
    again.put(shard, os.stat(shard), {'sha256': again.get(shard, os.stat(shard), 'sha256')})
    again.save(os.path.dirname(shard))
    assert os.stat(cache_file).st_ino == before.st_ino


def test_cache_forgets_files_gone_from_the_checkpoint_only(tmp_path, shard):
    cache = DigestCache(str(tmp_path / 'cache'))
    root = os.path.dirname(shard)
    info = os.stat(shard)
    cache.put(shard, info, {'sha256': 'x'})
    cache.put(root + '/gone.safetensors', info, {'sha256': 'y'})
    cache.put('/elsewhere/model.safetensors', info, {'sha256': 'z'})
    cache.save(root)
    again = DigestCache(str(tmp_path / 'cache'))
    again.load()
    again.get(shard, info, 'sha256')
    again.save(root)
    with open(str(tmp_path / 'cache' / CACHE_NAME)) as f:
        assert sorted(json.load(f)['entries']) == ['/elsewhere/model.safetensors', shard]


@pytest.mark.parametrize(
    'spoil, warning',
    [
        (
            lambda p: p.write_text('{'),
            'digest cache {p} not used: unreadable (Expecting property name enclosed in double '
            'quotes: line 1 column 2 (char 1)); it is rebuilt',
        ),
        (
            lambda p: p.write_text('{"format": 9, "entries": {}}'),
            'digest cache {p} not used: unreadable (not a format 1 digest cache); it is rebuilt',
        ),
        (lambda p: os.chmod(str(p), 0o666), 'digest cache {p} not used: others may write it (mode 0666)'),
        (
            lambda p: (p.unlink(), p.symlink_to('/etc/hostname')),
            'digest cache {p} not used: Too many levels of symbolic links',
        ),
        (lambda p: (p.unlink(), os.mkfifo(str(p))), 'digest cache {p} not used: it is a FIFO'),
    ],
    ids=['not-json', 'other-format', 'world-writable', 'symlink', 'fifo'],
)
def test_cache_distrusts_what_it_cannot_vouch_for(tmp_path, shard, spoil, warning):
    cache = DigestCache(str(tmp_path / 'cache'))
    cache.put(shard, os.stat(shard), {'sha256': 'x'})
    cache.save(os.path.dirname(shard))
    cache_file = tmp_path / 'cache' / CACHE_NAME
    spoil(cache_file)
    again = DigestCache(str(tmp_path / 'cache'))
    again.load()
    assert again.warnings == [warning.format(p=cache_file)]
    assert again.get(shard, os.stat(shard), 'sha256') is None
    assert again.save(os.path.dirname(shard)) is None
    assert stat.S_ISREG(os.lstat(str(cache_file)).st_mode)


def test_cache_of_another_user_is_not_used(tmp_path, shard, monkeypatch):
    cache = DigestCache(str(tmp_path / 'cache'))
    cache.put(shard, os.stat(shard), {'sha256': 'x'})
    cache.save(os.path.dirname(shard))
    monkeypatch.setattr(os, 'geteuid', lambda: 4242)
    again = DigestCache(str(tmp_path / 'cache'))
    again.load()
    assert again.warnings == [
        'digest cache %s not used: it belongs to uid %d, not to this user'
        % (tmp_path / 'cache' / CACHE_NAME, os.getuid())
    ]


def test_cache_dir_that_is_a_file_is_named(tmp_path, shard):
    blocker = tmp_path / 'file'
    blocker.write_text('')
    cache = DigestCache(str(blocker))
    cache.put(shard, os.stat(shard), {'sha256': 'x'})
    assert cache.save(os.path.dirname(shard)) == (
        'digest cache %s/%s not written: %s is a regular file, not a directory' % (blocker, CACHE_NAME, blocker)
    )


def test_cache_that_cannot_be_written_is_a_warning(tmp_path, shard):
    blocker = tmp_path / 'file'
    blocker.write_text('')
    cache = DigestCache(str(blocker / 'cache'))
    cache.put(shard, os.stat(shard), {'sha256': 'x'})
    assert cache.save(os.path.dirname(shard)) == 'digest cache %s not written: Not a directory' % (
        blocker / 'cache' / CACHE_NAME
    )
