# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Unit tests of _checkpoint_verify: each kind of problem named exactly, kv_cache_quant's rewrites, the cache."""

import json
import os
import random
import shutil
import struct

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint import _checkpoint_verify, _kv_cache_quant
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint_verify import (
    VerifyError,
    check_directory,
    ignored,
    verify,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._digest import DigestCache
from ansible_collections.llmserve.vllm.plugins.module_utils.hub._hub_manifest import parse_manifest
from ansible_collections.llmserve.vllm.tools import fake_hub

SHARD1 = 'model-00001-of-00002.safetensors'
SHARD2 = 'model-00002-of-00002.safetensors'
INDEX = 'model.safetensors.index.json'
HF_QUANT = """{
  "producer": {"name": "modelopt", "version": "0.29.0"},
  "quantization": {
    "quant_algo": "NVFP4",
    "kv_cache_quant_algo": "FP8",
    "exclude_modules": ["lm_head"]
  }
}
"""


def shard_bytes(tensors, seed):
    """A safetensors file {name: (dtype, shape, nbytes)} with pseudo-random data."""
    header, offset = {'__metadata__': {'format': 'pt'}}, 0
    for name, (dtype, shape, nbytes) in sorted(tensors.items()):
        header[name] = {'dtype': dtype, 'shape': shape, 'data_offsets': [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode('utf-8')
    return struct.pack('<Q', len(raw)) + raw + random.Random(seed).randbytes(offset)


def raw_shard(header, data_bytes):
    raw = json.dumps(header).encode('utf-8')
    return struct.pack('<Q', len(raw)) + raw + b'\0' * data_bytes


def make_checkpoint(directory):
    os.makedirs(str(directory), exist_ok=True)
    files = {
        'config.json': b'{"model_type": "llama", "num_hidden_layers": 2}\n',
        'tokenizer.json': b'{"version": "1.0"}\n',
        'hf_quant_config.json': HF_QUANT.encode('utf-8'),
        SHARD1: shard_bytes({'embed.weight': ('BF16', [64, 32], 4096), 'layers.0.weight': ('U8', [1024], 1024)}, 1),
        SHARD2: shard_bytes({'lm_head.weight': ('BF16', [64, 32], 4096)}, 2),
        INDEX: json.dumps(
            {
                'metadata': {'total_size': 9216},
                'weight_map': {'embed.weight': SHARD1, 'layers.0.weight': SHARD1, 'lm_head.weight': SHARD2},
            }
        ).encode('utf-8'),
    }
    for name, data in files.items():
        with open(os.path.join(str(directory), name), 'wb') as f:
            f.write(data)
    return str(directory)


def manifest_of(directory):
    """What the Hub would say of a directory's files (the fake Hub's computation)."""
    entries = fake_hub.describe_tree(directory)
    doc = {'sha': fake_hub.commit_of(entries), 'siblings': [fake_hub.sibling(e, True) for e in entries]}
    return parse_manifest(json.dumps(doc).encode('utf-8'), 'manifest')


@pytest.fixture
def checkpoint(tmp_path):
    path = make_checkpoint(tmp_path / 'ckpt')
    return path, manifest_of(path)


def problems(report):
    return [(p['file'], p['kind'], p['detail']) for p in report.problems]


def test_an_exact_copy_passes(checkpoint):
    path, manifest = checkpoint
    report = verify(path, manifest)
    assert (report.ok, report.problems, report.rewritten) == (True, [], [])
    assert (report.files, report.bytes) == (6, sum(f.size for f in manifest.files.values()))
    assert report.hashed_bytes == report.bytes
    assert len(report.fingerprint) == 64


def test_the_fingerprint_is_the_same_for_the_same_bytes_anywhere(checkpoint, tmp_path):
    path, manifest = checkpoint
    copy = str(tmp_path / 'elsewhere')
    shutil.copytree(path, copy)
    assert verify(copy, manifest, threads=3).fingerprint == verify(path, manifest).fingerprint


def test_the_fingerprint_differs_for_another_revision(checkpoint, tmp_path):
    path, manifest = checkpoint
    other = make_checkpoint(tmp_path / 'other')
    with open(os.path.join(other, 'tokenizer.json'), 'wb') as f:
        f.write(b'{"version": "1.1"}\n')
    assert verify(other, manifest_of(other)).fingerprint != verify(path, manifest).fingerprint


def flip_byte_in_the_middle(path):
    with open(path, 'r+b') as f:
        f.seek(os.path.getsize(path) // 2 + 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def truncate(path):
    with open(path, 'r+b') as f:
        f.truncate(os.path.getsize(path) - 1000)


def append(path):
    with open(path, 'ab') as f:
        f.write(b'\0' * 8)


def git_sha1_of(path):
    with open(path, 'rb') as f:
        data = f.read()
    return fake_hub.git_blob_id(data)


def sha256_of(path):
    return fake_hub.describe_file(path, os.path.basename(path))['sha256']


@pytest.mark.parametrize(
    'spoil, expected',
    [
        (
            lambda d: flip_byte_in_the_middle(os.path.join(d, SHARD1)),
            [(SHARD1, 'digest_mismatch', 'sha256 {now}, the manifest says {was}')],
        ),
        (
            lambda d: truncate(os.path.join(d, SHARD1)),
            [(SHARD1, 'truncated', '4326 bytes, the manifest says 5326 (1000 missing: an interrupted download?)')],
        ),
        (
            lambda d: append(os.path.join(d, SHARD2)),
            [(SHARD2, 'oversized', '4229 bytes, the manifest says 4221 (8 more)')],
        ),
        (
            lambda d: os.unlink(os.path.join(d, 'tokenizer.json')),
            [('tokenizer.json', 'missing', 'not in the checkpoint')],
        ),
        (
            lambda d: open(os.path.join(d, 'notes.txt'), 'w').close(),
            [('notes.txt', 'extra_file', 'in the checkpoint but not in the manifest of revision {rev}')],
        ),
        (
            lambda d: os.mkfifo(os.path.join(d, 'pipe')),
            [('pipe', 'extra_file', 'in the checkpoint (a FIFO) but not in the manifest of revision {rev}')],
        ),
        (
            lambda d: (os.unlink(os.path.join(d, 'tokenizer.json')), os.mkfifo(os.path.join(d, 'tokenizer.json'))),
            [('tokenizer.json', 'unreadable', 'a FIFO, not a regular file')],
        ),
        (
            lambda d: (
                os.unlink(os.path.join(d, 'tokenizer.json')),
                os.symlink('blobs/x', os.path.join(d, 'tokenizer.json')),
            ),
            [('tokenizer.json', 'missing', 'a broken symbolic link to blobs/x')],
        ),
        (
            lambda d: (os.unlink(os.path.join(d, 'config.json')), os.mkdir(os.path.join(d, 'config.json'))),
            [('config.json', 'unreadable', 'a directory, not a regular file')],
        ),
        (
            lambda d: (
                os.makedirs(os.path.join(d, 'sub', 'deeper')),
                open(os.path.join(d, 'sub', 'deeper', 'x.bin'), 'w').close(),
            ),
            [('sub/deeper/x.bin', 'extra_file', 'in the checkpoint but not in the manifest of revision {rev}')],
        ),
    ],
    ids=[
        'flipped-byte',
        'truncated',
        'oversized',
        'missing',
        'extra',
        'extra-fifo',
        'fifo-instead-of-file',
        'broken-link',
        'directory-instead-of-file',
        'extra-deep',
    ],
)
def test_each_fault_is_named(checkpoint, spoil, expected):
    path, manifest = checkpoint
    spoil(path)
    report = verify(path, manifest)
    now = sha256_of(os.path.join(path, SHARD1)) if os.path.isfile(os.path.join(path, SHARD1)) else None
    assert problems(report) == [
        (f, k, d.format(now=now, was=manifest.files[SHARD1].digest, rev=manifest.revision)) for f, k, d in expected
    ]
    assert report.fingerprint is None


def test_a_name_that_is_not_utf8_is_shown_escaped(checkpoint):
    path, manifest = checkpoint
    open(os.path.join(path.encode(), b'\xff\xfe.bin'), 'w').close()
    assert problems(verify(path, manifest)) == [
        ('\\xff\\xfe.bin', 'extra_file', 'in the checkpoint but not in the manifest of revision %s' % manifest.revision)
    ]


def test_a_config_with_other_bytes_is_a_git_digest_mismatch(checkpoint):
    path, manifest = checkpoint
    config = os.path.join(path, 'config.json')
    with open(config, 'wb') as f:
        f.write(b'{"model_type": "llama", "num_hidden_layers": 3}\n')
    assert problems(verify(path, manifest)) == [
        (
            'config.json',
            'digest_mismatch',
            'git-sha1 %s, the manifest says %s' % (git_sha1_of(config), manifest.files['config.json'].digest),
        )
    ]


@pytest.mark.parametrize(
    'data, detail',
    [
        (
            struct.pack('<Q', 10**9) + b'{}',
            '{p} has a header length of 1000000000 bytes, above the 100 MB safetensors '
            'limit: not a safetensors file or corrupt',
        ),
        (struct.pack('<Q', 2) + b'[]', '{p} has an invalid header: a JSON object was expected'),
        (
            shard_bytes({'w': ('BF16', [4], 8)}, 3) + b'\0' * 16,
            '{p} has 16 bytes after the tensor data its header describes; safetensors requires the data to end the file',
        ),
        (
            raw_shard(
                {
                    'a': {'dtype': 'U8', 'shape': [8], 'data_offsets': [0, 8]},
                    'b': {'dtype': 'U8', 'shape': [8], 'data_offsets': [0, 8]},
                },
                8,
            ),
            '{p}: its tensors take 16 bytes but their offsets span 8; safetensors requires them to follow one another',
        ),
    ],
    ids=['huge-header-length', 'array-header', 'trailing-bytes', 'overlapping-tensors'],
)
def test_a_shard_the_hub_has_but_safetensors_cannot_load_is_named(tmp_path, data, detail):
    path = make_checkpoint(tmp_path / 'ckpt')
    full = os.path.join(path, SHARD2)
    with open(full, 'wb') as f:
        f.write(data)
    assert problems(verify(path, manifest_of(path))) == [(SHARD2, 'bad_safetensors_header', detail.format(p=full))]


def write_index(path, weight_map):
    with open(os.path.join(path, INDEX), 'w') as f:
        json.dump({'weight_map': weight_map}, f)


@pytest.mark.parametrize(
    'weight_map, expected',
    [
        (
            {'a': SHARD1, 'b': 'model-00003-of-00003.safetensors'},
            [
                (
                    'model-00003-of-00003.safetensors',
                    'index_names_missing_shard',
                    'model.safetensors.index.json maps tensors to it, but it is not in the checkpoint',
                )
            ],
        ),
        (
            {'a': '/etc/hostname'},
            [
                (
                    INDEX,
                    'bad_safetensors_index',
                    'its weight_map names shard "/etc/hostname", which is not a relative path inside the checkpoint',
                )
            ],
        ),
        ({'a': 7}, [(INDEX, 'bad_safetensors_index', '{p} has no weight_map of tensor names to shard files')]),
    ],
    ids=['names-missing-shard', 'absolute-shard', 'not-a-name'],
)
def test_the_index_names_only_shards_that_are_there(tmp_path, weight_map, expected):
    path = make_checkpoint(tmp_path / 'ckpt')
    write_index(path, weight_map)
    full = os.path.join(path, INDEX)
    assert problems(verify(path, manifest_of(path))) == [(f, k, d.format(p=full)) for f, k, d in expected]


def test_a_missing_shard_is_named_once(checkpoint):
    path, manifest = checkpoint
    os.unlink(os.path.join(path, SHARD2))
    assert problems(verify(path, manifest)) == [(SHARD2, 'missing', 'not in the checkpoint')]


def test_an_index_that_is_no_json_is_named(tmp_path):
    path = make_checkpoint(tmp_path / 'ckpt')
    with open(os.path.join(path, INDEX), 'w') as f:
        f.write('{')
    assert problems(verify(path, manifest_of(path))) == [
        (
            INDEX,
            'bad_safetensors_index',
            '%s is not valid JSON: Expecting property name enclosed in double quotes: '
            'line 1 column 2 (char 1)' % os.path.join(path, INDEX),
        )
    ]


def test_ignored_files_are_neither_checked_nor_extra(checkpoint):
    path, manifest = checkpoint
    os.unlink(os.path.join(path, 'tokenizer.json'))
    os.makedirs(os.path.join(path, '.cache', 'huggingface', 'download'))
    open(os.path.join(path, '.cache', 'huggingface', 'download', 'x.lock'), 'w').close()
    open(os.path.join(path, 'README.md'), 'w').close()
    report = verify(path, manifest, patterns=['.cache/huggingface/**', 'tokenizer.*', '*.md'])
    assert (report.ok, report.files) == (True, 5)


@pytest.mark.parametrize(
    'name, patterns, result',
    [
        ('.cache/huggingface/download/a.lock', ['.cache/huggingface/**'], True),
        ('.cache/huggingface/', ['.cache/huggingface/**'], True),
        ('.cache/other', ['.cache/huggingface/**'], False),
        ('original/sub/w.bin', ['original/*'], True),
        ('README.md', ['*.md'], True),
        ('config.json', [], False),
    ],
    ids=['hf-download', 'hf-directory', 'other-cache', 'star-crosses-slash', 'suffix', 'none'],
)
def test_ignored(name, patterns, result):
    assert ignored(name, patterns) is result


@pytest.mark.parametrize(
    'make, message',
    [
        (lambda p: None, 'checkpoint directory {p} does not exist'),
        (lambda p: open(p, 'w').close(), 'checkpoint path {p} is a regular file, not a directory'),
        (os.mkfifo, 'checkpoint path {p} is a FIFO, not a directory'),
    ],
    ids=['missing', 'file', 'fifo'],
)
def test_check_directory(tmp_path, make, message):
    path = str(tmp_path / 'ckpt')
    make(path)
    with pytest.raises(VerifyError) as caught:
        check_directory(path)
    assert str(caught.value) == message.format(p=path)


def test_a_link_loop_ends(checkpoint):
    path, manifest = checkpoint
    os.symlink('.', os.path.join(path, 'loop'))
    assert verify(path, manifest).ok


def test_links_inside_the_checkpoint_pass(checkpoint):
    """A file and a directory reached through links that stay inside the checkpoint."""
    path, manifest = checkpoint
    os.rename(os.path.join(path, 'tokenizer.json'), os.path.join(path, 'tokenizer.real'))
    os.symlink('tokenizer.real', os.path.join(path, 'tokenizer.json'))
    os.symlink('.', os.path.join(path, 'here'))
    report = verify(path, manifest, patterns=['tokenizer.real', 'here/**'])
    assert (report.ok, report.problems) == (True, [])


def link_everything_to(real, linked):
    os.makedirs(str(linked))
    for name in os.listdir(str(real)):
        os.symlink(os.path.join(str(real), name), os.path.join(str(linked), name))


def test_links_out_of_the_checkpoint_are_problems_by_default(tmp_path):
    """Each link that leaves the checkpoint is named with where it leads, even when its content matches."""
    real = make_checkpoint(tmp_path / 'real')
    manifest = manifest_of(real)
    link_everything_to(real, tmp_path / 'linked')
    report = verify(str(tmp_path / 'linked'), manifest)
    assert not report.ok
    assert problems(report) == [
        (name, 'link_outside', 'a link that leads outside the checkpoint, to %s' % os.path.join(str(real), name))
        for name in sorted(os.listdir(str(real)))
    ]


def test_links_out_of_the_checkpoint_pass_when_allowed(tmp_path):
    """As a Hugging Face cache snapshot's links to its blobs."""
    real = make_checkpoint(tmp_path / 'real')
    manifest = manifest_of(real)
    link_everything_to(real, tmp_path / 'linked')
    report = verify(str(tmp_path / 'linked'), manifest, links_outside=True)
    assert (report.ok, report.problems) == (True, [])


def test_a_directory_link_out_of_the_checkpoint_is_not_walked(checkpoint, tmp_path):
    """A link to / would walk the whole host: the link is the problem, what it leads to is never listed."""
    path, manifest = checkpoint
    elsewhere = tmp_path / 'elsewhere'
    (elsewhere / 'deep').mkdir(parents=True)
    (elsewhere / 'deep' / 'secret.py').write_text('import os\n')
    os.symlink(str(elsewhere), os.path.join(path, 'code'))
    report = verify(path, manifest)
    assert problems(report) == [('code', 'link_outside', 'a link that leads outside the checkpoint, to %s' % elsewhere)]
    allowed = verify(path, manifest, links_outside=True)
    assert [(p['file'], p['kind']) for p in allowed.problems] == [('code/deep/secret.py', 'extra_file')]


def test_a_checkpoint_reached_through_a_link_is_judged_by_where_it_resolves(checkpoint, tmp_path):
    """The path itself may be a link (a "current" link to a revision): inside means inside what it resolves to."""
    path, manifest = checkpoint
    os.symlink(path, str(tmp_path / 'current'))
    os.symlink(os.path.join(path, 'tokenizer.json'), os.path.join(path, 'tokenizer.alias'))
    report = verify(str(tmp_path / 'current'), manifest, patterns=['tokenizer.alias'])
    assert (report.ok, report.problems) == (True, [])


# ---------------------------------------------------------------- kv_cache_quant's rewrites


def strip_kv_cache_quant(path):
    """What llmserve.vllm.kv_cache_quant state=absent writes: the stripped configs and its record."""
    files = _kv_cache_quant.read_checkpoint(path)
    plans, record, warnings = _kv_cache_quant.plan_strip(path, files, None)
    for plan in plans:
        with open(plan.file.full, 'w') as f:
            f.write(plan.new_text)
    with open(os.path.join(path, _kv_cache_quant.RECORD_NAME), 'w') as f:
        f.write(_kv_cache_quant.render_record(record))


def test_a_config_kv_cache_quant_rewrote_passes_and_is_reported(checkpoint):
    path, manifest = checkpoint
    untouched = verify(path, manifest).fingerprint
    strip_kv_cache_quant(path)
    report = verify(path, manifest)
    assert (report.ok, report.rewritten) == (True, ['hf_quant_config.json'])
    # The fingerprint covers the bytes that are served: a stripped node differs from an untouched one.
    assert report.fingerprint not in (None, untouched)


def test_a_rewritten_config_changed_afterwards_is_a_mismatch(checkpoint):
    path, manifest = checkpoint
    strip_kv_cache_quant(path)
    full = os.path.join(path, 'hf_quant_config.json')
    with open(full) as f:
        text = f.read()
    with open(full, 'w') as f:
        f.write(text.replace('NVFP4', 'NVFP8'))
    ((name, kind, detail),) = problems(verify(path, manifest))
    assert (name, kind) == ('hf_quant_config.json', 'digest_mismatch')
    assert detail.startswith('with the values .llmserve-kv-cache-quant.json recorded put back: 181 bytes, git-sha1 ')
    assert detail.endswith(
        '; the manifest says 181 bytes, %s (changed after kv_cache_quant rewrote it)'
        % manifest.files['hf_quant_config.json'].digest
    )


def test_a_rewritten_value_set_again_is_a_mismatch(checkpoint):
    path, manifest = checkpoint
    strip_kv_cache_quant(path)
    full = os.path.join(path, 'hf_quant_config.json')
    with open(full) as f:
        text = f.read()
    with open(full, 'w') as f:
        f.write(text.replace('"kv_cache_quant_algo": null', '"kv_cache_quant_algo": "FP8" '))
    assert problems(verify(path, manifest)) == [
        (
            'hf_quant_config.json',
            'digest_mismatch',
            'git-sha1 %s, the manifest says %s; .llmserve-kv-cache-quant.json lists it as rewritten, but '
            'quantization.kv_cache_quant_algo is "FP8", where its record says it set null'
            % (git_sha1_of(full), manifest.files['hf_quant_config.json'].digest),
        )
    ]


def test_a_broken_record_is_named_and_excuses_nothing(checkpoint):
    path, manifest = checkpoint
    strip_kv_cache_quant(path)
    record = os.path.join(path, _kv_cache_quant.RECORD_NAME)
    with open(record, 'w') as f:
        f.write('{')
    assert problems(verify(path, manifest)) == [
        (
            '.llmserve-kv-cache-quant.json',
            'unreadable',
            '.llmserve-kv-cache-quant.json in %s is not valid JSON: Expecting property name enclosed in double quotes: '
            'line 1 column 2 (char 1)' % path,
        ),
        ('hf_quant_config.json', 'truncated', '180 bytes, the manifest says 181 (1 missing: an interrupted download?)'),
    ]


def test_a_config_restored_by_hand_passes_beside_a_stale_record(checkpoint):
    path, manifest = checkpoint
    strip_kv_cache_quant(path)
    with open(os.path.join(path, 'hf_quant_config.json'), 'w') as f:
        f.write(HF_QUANT)
    report = verify(path, manifest)
    assert (report.ok, report.rewritten) == (True, [])


# ---------------------------------------------------------------- the cache


def test_a_rerun_reads_no_file(checkpoint, tmp_path):
    path, manifest = checkpoint
    first = DigestCache(str(tmp_path / 'cache'))
    first.load()
    verify(path, manifest, cache=first)
    first.save(path)
    cache = DigestCache(str(tmp_path / 'cache'))
    cache.load()
    report = verify(path, manifest, cache=cache)
    assert (report.ok, report.cache_hits, report.hashed_bytes) == (True, 6, 0)


def test_a_rerun_parses_neither_headers_nor_the_index(checkpoint, tmp_path, monkeypatch):
    path, manifest = checkpoint
    cache = DigestCache(str(tmp_path / 'cache'))
    verify(path, manifest, cache=cache)

    def unexpected(*args):
        raise AssertionError('read again: %s' % (args,))

    monkeypatch.setattr(_checkpoint_verify, 'read_json', unexpected)
    monkeypatch.setattr(_checkpoint_verify, 'read_header', unexpected)
    report = verify(path, manifest, cache=cache)
    assert (report.ok, report.hashed_bytes) == (True, 0)


def test_a_changed_file_is_read_again_and_caught(checkpoint, tmp_path):
    path, manifest = checkpoint
    cache = DigestCache(str(tmp_path / 'cache'))
    verify(path, manifest, cache=cache)
    flip_byte_in_the_middle(os.path.join(path, SHARD2))
    report = verify(path, manifest, cache=cache)
    assert [(p['file'], p['kind']) for p in report.problems] == [(SHARD2, 'digest_mismatch')]
    assert (report.cache_hits, report.hashed_bytes) == (5, os.path.getsize(os.path.join(path, SHARD2)))


def test_a_cached_header_verdict_is_reported_again(tmp_path):
    path = make_checkpoint(tmp_path / 'ckpt')
    with open(os.path.join(path, SHARD2), 'ab') as f:
        f.write(b'\0' * 8)
    manifest = manifest_of(path)
    cache = DigestCache(str(tmp_path / 'cache'))
    first = verify(path, manifest, cache=cache)
    again = verify(path, manifest, cache=cache)
    assert problems(again) == problems(first) != []
    assert again.hashed_bytes == 0


def test_threads_find_the_same(checkpoint):
    path, manifest = checkpoint
    truncate(os.path.join(path, SHARD1))
    os.unlink(os.path.join(path, 'config.json'))
    assert problems(verify(path, manifest, threads=1)) == problems(verify(path, manifest, threads=8))
