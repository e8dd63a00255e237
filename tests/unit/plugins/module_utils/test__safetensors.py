# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Unit tests of _safetensors: sizes from headers, the index fallback, broken and missing shards."""

import json
import os
import struct

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import CheckpointError
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._safetensors import (
    complete_numbered_set,
    entry_problem,
    read_header,
    scan,
)


def header_bytes(tensors):
    """A header {name: (dtype, shape, nbytes)} laid out back to back."""
    header, offset = {'__metadata__': {'format': 'pt'}}, 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {'dtype': dtype, 'shape': shape, 'data_offsets': [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode('utf-8')
    return struct.pack('<Q', len(raw)) + raw, offset


def write_shard(path, tensors, data=None):
    head, size = header_bytes(tensors)
    with open(str(path), 'wb') as f:
        f.write(head)
        if data is None:
            f.truncate(len(head) + size)  # sparse: no tensor data written
        else:
            f.write(data)
    return len(head) + size


SHARD1 = {
    'model.embed_tokens.weight': ('BF16', [512, 256], 262144),
    'model.layers.0.mlp.experts.0.up_proj.weight': ('U8', [128, 128], 16384),
    'model.layers.0.mlp.experts.0.up_proj.weight_scale': ('F8_E4M3', [128, 16], 2048),
    'model.layers.0.mlp.experts.0.up_proj.weight_scale_2': ('F32', [], 4),
}
SHARD2 = {'lm_head.weight': ('BF16', [512, 256], 262144)}


def test_read_header_sizes_without_reading_data(tmp_path):
    size = write_shard(tmp_path / 'a.safetensors', SHARD1)
    shard = read_header(str(tmp_path / 'a.safetensors'))
    assert shard.tensors == dict((k, v[2]) for k, v in SHARD1.items())
    assert (shard.data_bytes, shard.file_bytes) == (262144 + 16384 + 2048 + 4, size)


@pytest.mark.parametrize(
    'content, message',
    [
        (b'\x10\x00\x00', '{p} is truncated: 3 bytes, shorter than the 8-byte header length'),
        (
            struct.pack('<Q', 4096) + b'{"a":',
            '{p} is truncated: its header length 4096 reaches beyond the end of the file (13 bytes)',
        ),
        (
            struct.pack('<Q', 2**40),
            '{p} has a header length of 1099511627776 bytes, above the 100 MB safetensors limit: '
            'not a safetensors file or corrupt',
        ),
        (
            struct.pack('<Q', 5) + b'{"a":',
            '{p} has an invalid header (not JSON): Expecting value: line 1 column 6 (char 5)',
        ),
        (struct.pack('<Q', 2) + b'[]', '{p} has an invalid header: a JSON object was expected'),
        (struct.pack('<Q', 14) + b'{"t": {"x":1}}', '{p} has an invalid header entry for tensor "t": {"x": 1}'),
        (struct.pack('<Q', 20000) + b'[' * 10000 + b']' * 10000, '{p} has an invalid header (nested too deeply)'),
    ],
)
def test_read_header_bad_files(tmp_path, content, message):
    p = tmp_path / 'bad.safetensors'
    p.write_bytes(content)
    with pytest.raises(CheckpointError) as exc:
        read_header(str(p))
    assert str(exc.value) == message.replace('{p}', str(p))


def entry(dtype='BF16', shape=(4, 2), offsets=(0, 16)):
    return {'dtype': dtype, 'shape': list(shape), 'data_offsets': list(offsets)}


@pytest.mark.parametrize(
    'info, problem',
    [
        (entry(offsets=(-16, 0)), 'data_offsets [-16, 0] are not two integers 0 <= begin <= end < 2**64'),
        (entry(offsets=(16, 0)), 'data_offsets [16, 0] are not two integers 0 <= begin <= end < 2**64'),
        (entry(offsets=(False, True)), 'data_offsets [false, true] are not two integers 0 <= begin <= end < 2**64'),
        (entry(offsets=(0, 16.0)), 'data_offsets [0, 16.0] are not two integers 0 <= begin <= end < 2**64'),
        (
            entry(offsets=(0, 2**64)),
            'data_offsets [0, 18446744073709551616] are not two integers 0 <= begin <= end < 2**64',
        ),
        (entry(offsets=(0,)), 'data_offsets [0] are not two integers 0 <= begin <= end < 2**64'),
        (dict(entry(), data_offsets='0-16'), 'data_offsets "0-16" are not two integers 0 <= begin <= end < 2**64'),
        (entry(dtype='X99'), 'dtype "X99" is not a safetensors dtype'),
        (entry(dtype=['BF16']), 'dtype ["BF16"] is not a safetensors dtype'),
        (entry(shape=(-4, -2)), 'shape [-4, -2] is not a list of non-negative integers'),
        (entry(shape=(4, 2.0)), 'shape [4, 2.0] is not a list of non-negative integers'),
        (entry(shape=(4, True)), 'shape [4, true] is not a list of non-negative integers'),
        (dict(entry(), shape={'a': 1}), 'shape {"a": 1} is not a list of non-negative integers'),
        (entry(shape=(4, 4)), 'shape [4, 4] of BF16 takes 32 bytes, data_offsets [0, 16] hold 16'),
        (entry(dtype='F4', shape=(3,), offsets=(0, 2)), 'shape [3] of F4 takes 12 bits, data_offsets [0, 2] hold 2'),
        ({'dtype': 'BF16', 'shape': [1]}, '{"dtype": "BF16", "shape": [1]}'),
        ('x' * 300, '"' + 'x' * 199),
        (entry(), None),
        (entry(dtype='F4', shape=(4,), offsets=(0, 2)), None),
        (entry(dtype='F6_E2M3', shape=(4,), offsets=(0, 3)), None),
        (entry(shape=(), offsets=(0, 2)), None),
        (entry(shape=(0, 5), offsets=(7, 7)), None),
    ],
)
def test_entry_problem(info, problem):
    assert entry_problem(info) == problem


@pytest.mark.parametrize(
    'info',
    [
        entry(offsets=(-16, 0)),
        entry(offsets=(16, 0)),
        entry(offsets=(False, True)),
        entry(dtype='X99'),
        entry(shape=(-4, -2)),
        entry(shape=(4, 4)),
        entry(shape=(4, 2.0)),
        entry(offsets=(0, float('inf'))),
        {'shape': [4, 2], 'data_offsets': [0, 16]},
        'x',
        None,
    ],
)
def test_read_header_refuses_an_entry_safetensors_would_refuse(tmp_path, info):
    p = tmp_path / 'bad.safetensors'
    raw = json.dumps({'__metadata__': {'format': 'pt'}, 't': info}).encode('utf-8')
    p.write_bytes(struct.pack('<Q', len(raw)) + raw + b'\0' * 64)
    with pytest.raises(CheckpointError) as exc:
        read_header(str(p))
    assert str(exc.value) == '%s has an invalid header entry for tensor "t": %s' % (p, entry_problem(info))


def test_read_header_refuses_what_is_not_a_regular_file(tmp_path):
    os.mkfifo(str(tmp_path / 'fifo.safetensors'))  # open() would block for ever on it
    with pytest.raises(CheckpointError) as exc:
        read_header(str(tmp_path / 'fifo.safetensors'))
    assert str(exc.value) == '%s is not a regular file' % (tmp_path / 'fifo.safetensors')


def test_read_header_truncated_data(tmp_path):
    p = tmp_path / 'half.safetensors'
    head, size = header_bytes(SHARD1)
    p.write_bytes(head + b'\0' * 1000)
    with pytest.raises(CheckpointError) as exc:
        read_header(str(p))
    assert str(exc.value) == (
        '%s is truncated: %d bytes on disk, its header describes %d (an unfinished download?)'
        % (p, len(head) + 1000, len(head) + size)
    )


def write_index(path, total=None, shards=('model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors')):
    weight_map = dict((k, shards[0]) for k in SHARD1)
    weight_map.update((k, shards[1]) for k in SHARD2)
    index = {'weight_map': weight_map}
    if total is not None:
        index['metadata'] = {'total_size': total}
    (path / 'model.safetensors.index.json').write_text(json.dumps(index))


TOTAL = 262144 + 16384 + 2048 + 4 + 262144


def test_scan_sums_headers_not_the_stale_index(tmp_path):
    write_index(tmp_path, total=1)
    write_shard(tmp_path / 'model-00001-of-00002.safetensors', SHARD1)
    write_shard(tmp_path / 'model-00002-of-00002.safetensors', SHARD2)
    ckpt = scan(str(tmp_path))
    assert (ckpt.source, ckpt.total_bytes, ckpt.problems, ckpt.missing) == ('headers', TOTAL, [], [])
    assert ckpt.tensors['lm_head.weight'] == 262144


def test_scan_index_only_plans_before_the_download(tmp_path):
    write_index(tmp_path, total=540 * 10**9)
    ckpt = scan(str(tmp_path))
    assert (ckpt.source, ckpt.total_bytes, ckpt.problems) == ('index', 540 * 10**9, [])
    assert ckpt.missing == ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
    assert set(ckpt.tensors.values()) == {None}


def test_scan_reports_missing_and_truncated_shards(tmp_path):
    write_index(tmp_path, total=TOTAL)
    p1 = tmp_path / 'model-00001-of-00002.safetensors'
    head, size = header_bytes(SHARD1)
    p1.write_bytes(head)
    (tmp_path / 'model-00003-of-00003.safetensors').write_bytes(b'')  # not named: ignored
    ckpt = scan(str(tmp_path))
    assert ckpt.problems == [
        '%s is truncated: %d bytes on disk, its header describes %d (an unfinished download?)'
        % (p1, len(head), len(head) + size),
        '%s is named in model.safetensors.index.json but missing' % (tmp_path / 'model-00002-of-00002.safetensors'),
    ]
    assert ckpt.total_bytes == TOTAL


@pytest.mark.parametrize(
    'index, message',
    [
        ({'weight_map': {}}, '{p} has no weight_map: not a safetensors index'),
        (
            {'metadata': {'total_size': 'x'}, 'weight_map': {'a': 'b.safetensors'}},
            '{p} has a metadata.total_size that is not a byte count (an integer from 0 to 2**63 - 1): "x"',
        ),
        ({'weight_map': {'a': 'b.safetensors'}}, '{p} names 1 shards, none present, and has no metadata.total_size'),
        ({'weight_map': {'a': 5}}, '{p} maps tensor "a" to 5, where a shard file name was expected'),
        (
            {'weight_map': {'a': 'b.safetensors', 'c': ['d']}},
            '{p} maps tensor "c" to ["d"], where a shard file name was expected',
        ),
        (
            {'metadata': {'total_size': float('inf')}, 'weight_map': {'a': 'b.safetensors'}},
            '{p} has a metadata.total_size that is not a byte count (an integer from 0 to 2**63 - 1): Infinity',
        ),
        (
            {'metadata': {'total_size': -1}, 'weight_map': {'a': 'b.safetensors'}},
            '{p} has a metadata.total_size that is not a byte count (an integer from 0 to 2**63 - 1): -1',
        ),
        (
            {'metadata': {'total_size': True}, 'weight_map': {'a': 'b.safetensors'}},
            '{p} has a metadata.total_size that is not a byte count (an integer from 0 to 2**63 - 1): true',
        ),
        (
            {'metadata': {'total_size': 1.5}, 'weight_map': {'a': 'b.safetensors'}},
            '{p} has a metadata.total_size that is not a byte count (an integer from 0 to 2**63 - 1): 1.5',
        ),
        (
            {'metadata': {'total_size': 2**63}, 'weight_map': {'a': 'b.safetensors'}},
            '{p} has a metadata.total_size that is not a byte count (an integer from 0 to 2**63 - 1): 9223372036854775808',
        ),
    ],
)
def test_scan_bad_index(tmp_path, index, message):
    p = tmp_path / 'model.safetensors.index.json'
    p.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as exc:
        scan(str(tmp_path))
    assert str(exc.value) == message.replace('{p}', str(p))


def test_scan_index_total_size_written_as_a_float(tmp_path):
    (tmp_path / 'model.safetensors.index.json').write_text(
        json.dumps({'metadata': {'total_size': 5.4e11}, 'weight_map': {'a': 'b.safetensors'}})
    )
    assert scan(str(tmp_path)).total_bytes == 540000000000


def test_scan_reports_a_shard_that_is_not_a_regular_file(tmp_path):
    write_index(tmp_path, total=TOTAL)
    write_shard(tmp_path / 'model-00001-of-00002.safetensors', SHARD1)
    os.mkfifo(str(tmp_path / 'model-00002-of-00002.safetensors'))
    ckpt = scan(str(tmp_path))
    assert ckpt.problems == ['%s is not a regular file' % (tmp_path / 'model-00002-of-00002.safetensors')]
    assert ckpt.total_bytes == TOTAL


def test_scan_invalid_index_json(tmp_path):
    p = tmp_path / 'model.safetensors.index.json'
    p.write_text('{"weight_map": ')
    with pytest.raises(CheckpointError) as exc:
        scan(str(tmp_path))
    assert str(exc.value) == '%s is not valid JSON: Expecting value: line 1 column 16 (char 15)' % p


def test_scan_single_file_and_empty_dir(tmp_path):
    with pytest.raises(CheckpointError) as exc:
        scan(str(tmp_path))
    assert str(exc.value) == '%s holds neither model.safetensors.index.json nor any *.safetensors file' % tmp_path
    write_shard(tmp_path / 'model.safetensors', SHARD2)
    assert scan(str(tmp_path)).total_bytes == 262144


@pytest.mark.parametrize(
    'files, expected',
    [
        (
            ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors', 'config.json'],
            ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors'],
        ),
        (['model-00001-of-00002.safetensors'], None),
        (['model-00001-of-00001.safetensors', 'other-00001-of-00001.safetensors'], None),
        (['model.safetensors'], None),
    ],
)
def test_complete_numbered_set(tmp_path, files, expected):
    for f in files:
        (tmp_path / f).write_bytes(b'')
    assert complete_numbered_set(str(tmp_path)) == expected


def test_scan_complete_set_still_reports_a_truncated_shard(tmp_path):
    write_index(tmp_path, total=TOTAL)
    write_shard(tmp_path / 'model-00001-of-00002.safetensors', SHARD1)
    p2 = tmp_path / 'model-00002-of-00002.safetensors'
    head, size = header_bytes(SHARD2)
    p2.write_bytes(head + b'\0' * 10)
    ckpt = scan(str(tmp_path))
    assert ckpt.problems == [
        '%s is truncated: %d bytes on disk, its header describes %d (an unfinished download?)'
        % (p2, len(head) + 10, len(head) + size)
    ]
    assert ckpt.total_bytes == TOTAL


def test_a_tensor_name_in_a_message_is_quoted_and_cut_short(tmp_path):
    # A header may hold a name of megabytes, with line breaks: the message quotes a bounded, escaped part of it.
    name = 'w\n' + 'x' * 1_000_000
    p = tmp_path / 'bad.safetensors'
    raw = json.dumps({name: {'dtype': 'F32', 'shape': [1], 'data_offsets': [0, 8]}}).encode('utf-8')
    p.write_bytes(struct.pack('<Q', len(raw)) + raw + b'\0' * 8)
    with pytest.raises(CheckpointError) as exc:
        read_header(str(p))
    message = str(exc.value)
    assert '"w\\nxxx' in message and '\n' not in message
    assert len(message) < len(str(p)) + 500
